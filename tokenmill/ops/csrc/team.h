// The threads of one parallel region running the ops of a step in turn, a barrier between
// dependent ops (the C++ decode stack). A parallel region per op (at::parallel_for) costs each op a
// fork and a join; with ~5 ops a layer and dozens of layers those add up to a large share of a
// small decode step, so one region with a barrier between ops pays them once (docs/design.md
// "One parallel region per step").
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tokenmill {

class Team {
 public:
  // f(team, t) on each thread t in [0, team.size()) of one OpenMP region (at::get_num_threads()
  // asked for; the runtime may give fewer, one in a nested region). f must not throw.
  template <typename F>
  static void run(F&& f) {
    Team team;
#ifdef _OPENMP
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp single
      team.size_ = omp_get_num_threads();  // (the end of `single` waits for every thread)
      f(team, static_cast<int64_t>(omp_get_thread_num()));
    }
#else
    f(team, 0);
#endif
  }

  int64_t size() const { return size_; }

  // Returns once every thread of the team has called it. Spins: the waits are the few microseconds
  // one thread's share of an op runs longer than another's, too short to sleep and wake for.
  void sync() {
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

 private:
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  int64_t size_ = 1;
};

}  // namespace tokenmill

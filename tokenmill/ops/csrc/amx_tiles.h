// What every AMX kernel shares: the tile state's grant, the switch, the tile configuration.
//
// Linux grants a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. The switch (set_enabled) is
// per extension library: each keeps its own copy, and tokenmill/ops/build.py sets them all alike.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__)
#define TM_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace tokenmill::tile {

// Asked once per process (the grant is the process's); true once granted.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}

inline std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{permitted()};
  return on;
}

// Whether the AMX kernels run: granted, unless switched off (to measure the AVX-512 kernels against them).
inline bool enabled() { return enabled_flag().load(std::memory_order_relaxed); }

inline bool set_enabled(bool on) {
  enabled_flag().store(on && permitted(), std::memory_order_relaxed);
  return enabled();
}

// A tile configuration (palette 1): per tile register, its rows and bytes per row. Loaded into the
// calling thread's tile state by each kernel call: other code on the thread (oneDNN's, or another of
// our kernels) may have loaded another.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  Config& tile(int t, int64_t num_rows, int64_t bytes_per_row) {
    rows[t] = static_cast<uint8_t>(num_rows);
    colsb[t] = static_cast<uint16_t>(bytes_per_row);
    return *this;
  }
  void load() const { _tile_loadconfig(this); }
};

}  // namespace tokenmill::tile

#endif  // TM_AMX

#include <cstdint>

namespace tokenmill::tile {

// This library's AMX kernels on (where the tile state is granted) or off; returns whether they run.
// False in builds without AMX. ops/build.py calls it in every library through its set_amx binding.
inline bool switch_to(bool on) {
#ifdef TM_AMX
  return set_enabled(on);
#else
  (void)on;
  return false;
#endif
}

// Whether this library's AMX kernels run.
inline bool on() {
#ifdef TM_AMX
  return enabled();
#else
  return false;
#endif
}

}  // namespace tokenmill::tile

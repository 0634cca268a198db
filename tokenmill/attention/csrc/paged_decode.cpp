// Paged decode attention for CPUs: each (sequence, kv head) pair reads its KV blocks in place,
// once per step, with an online softmax; no gathered copy of the cache is ever made.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), kf(block_size * head_dim),
        vf(block_size * head_dim), scores(block_size), row_max(group), row_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq_len = seq_lens[seq];
      const T* q_group = q + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(q_group[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
      for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t block = block_tables[seq * max_blocks + j];
        const int64_t num_tokens = std::min(block_size, seq_len - j * block_size);
        const T* k_block = k_cache + block * block_stride + kv_head * head_dim;
        const T* v_block = v_cache + block * block_stride + kv_head * head_dim;
        // Load the block's keys and values once for all query heads of the group.
        for (int64_t t = 0; t < num_tokens; ++t) {
          for (int64_t d = 0; d < head_dim; ++d) {
            kf[t * head_dim + d] = to_float(k_block[t * token_stride + d]);
            vf[t * head_dim + d] = to_float(v_block[t * token_stride + d]);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < num_tokens; ++t) {
            const float* kt = kf.data() + t * head_dim;
            float s = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kt[d];
            scores[t] = s;
            block_max = std::max(block_max, s);
          }
          const float new_max = std::max(row_max[g], block_max);
          const float correction = std::exp(row_max[g] - new_max);
          float* ag = acc.data() + g * head_dim;
          row_sum[g] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
          for (int64_t t = 0; t < num_tokens; ++t) {
            const float p = std::exp(scores[t] - new_max);
            row_sum[g] += p;
            const float* vt = vf.data() + t * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vt[d];
          }
          row_max[g] = new_max;
        }
      }
      T* out_group = out + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / row_sum[g];
        for (int64_t d = 0; d < head_dim; ++d) out_group[g * head_dim + d] = T(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32. Returns like q.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "q and kv_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t cache_half = kv_cache.size(1) * block_size * num_kv_heads * head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    decode<scalar_t>(q.data_ptr<scalar_t>(), cache, cache + cache_half, tables.data_ptr<int32_t>(),
                     lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads,
                     head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
}

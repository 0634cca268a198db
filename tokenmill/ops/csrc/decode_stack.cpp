// Every decoder layer of a CPU decode step in one call from Python: one new token per sequence, or a
// verification step's few (up to kMaxQueryLen per sequence, after its cached context, causal).
//
// A small model at batch 1 spends ~15 PyTorch calls per layer; issued from Python they cost as much
// as the weight streaming they wrap. Here the same kernels (packed GEMM or float32 at::linear,
// add+RMSNorm, rotary, paged decode attention, SiLU-and-mul) run back to back from C++, on the same
// weights and cache.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <tuple>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_ops.h"
#include "packed_gemm.h"
#include "paged_decode.h"

#if defined(TM_AVX512) && defined(TM_ATTN_AVX512)
#define TM_DECODE_TEAM 1  // every op of a step in one parallel region (forward_team)
#include "team.h"
#endif

namespace tokenmill {

// Either packed (packed [P, K, 16] int8 or bf16, scale [P * 16], bias [P * 16], out_features; or grouped:
// packed [P, K, 8] or [P, K, 16] uint8 with its group params as scale; see packed_gemm.h) or dense float32
// (weight [N, K], an empty tensor, bias [N] or empty, N).
using PackedLinear = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>;

inline at::Tensor linear(const PackedLinear& w, const at::Tensor& x) {
  const at::Tensor& weight = std::get<0>(w);
  if (weight.dim() == 2) {  // float32 weights: the same op as the layer-by-layer path (nn.Linear)
    const at::Tensor& bias = std::get<2>(w);
    return bias.numel() ? at::linear(x, weight, bias) : at::linear(x, weight);
  }
  return gemm::packed_linear(x, weight, std::get<1>(w), std::get<2>(w), std::get<3>(w), false);
}

// silu(gate) * up of a [gate | up] projection: in the packed GEMM's epilogue where the halves are
// whole panels (gemm::packed_linear), else after it (ops::silu_and_mul).
inline at::Tensor linear_silu_mul(const PackedLinear& w, const at::Tensor& x) {
  const at::Tensor& weight = std::get<0>(w);
  const int64_t N = std::get<3>(w);
  if (weight.dim() == 3 && gemm::halves_of_whole_panels(weight.size(0), N))
    return gemm::packed_linear(x, weight, std::get<1>(w), std::get<2>(w), N, true);
  return ops::silu_and_mul(linear(w, x));
}

// A verification step's query: 1 + k tokens per sequence, k up to 8 draft tokens.
constexpr int64_t kMaxQueryLen = 9;

// Token rows of one adapter whose LoRA updates are computed together, sharing each load of its weights.
constexpr int kLoRARows = 4;

// One adapted linear layer's LoRA adapters, stacked by slot (models/layers/lora.py): a [slots, R, in] and
// bt [slots, R, out] bf16 (half the bytes a step streams), read in place; `sizes`: the output columns of
// each piece (q, k, v; gate, up; or the one). An adapter of rank r has piece p's A rows and B^T rows at
// [p * r, (p + 1) * r) of its slot, and piece p's B^T is zero outside its own columns.
struct LoRASlots {
  at::Tensor a, bt;  // kept alive: a_p and bt_p point into them
  std::vector<int64_t> sizes;
  const uint16_t* a_p = nullptr;
  const uint16_t* bt_p = nullptr;
  int64_t rows = 0, in = 0, out = 0;  // R, in, out

  bool defined() const { return a_p != nullptr; }

  static float to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }

#ifdef __AVX512F__
  static __m512 load16(const uint16_t* p, __mmask16 k) {  // 16 bf16 as float32
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __mmask16 tail(int64_t i, int64_t n) {
    return i + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
  }
#endif

  // y_r += (x_r A^T) B^T for R token rows of the adapter in `slot`, of rank `rank`: each piece's rank
  // dot products with the rows, then their sums into that piece's own columns only. The R rows share
  // every load of A and B^T (R <= kLoRARows). t: R * 3 * rank floats.
  template <int R>
  void add_rows(int64_t slot, int64_t rank, const float* const* x, float* const* y, float* t) const {
    const uint16_t* a = a_p + slot * rows * in;
    const uint16_t* bt = bt_p + slot * rows * out;
    const int64_t width = static_cast<int64_t>(sizes.size()) * rank;
    int64_t col = 0;
    for (size_t p = 0; p < sizes.size(); ++p) {
      const int64_t j0 = static_cast<int64_t>(p) * rank, j1 = j0 + rank, n = sizes[p];
      for (int64_t j = j0; j < j1; ++j) shrink<R>(a + j * in, x, t + j, width);
      expand<R>(bt + j0 * out + col, rank, t + j0, width, y, col, n);
      col += n;
    }
  }

  // t[r * width] = x_r . a_j for the R rows.
  template <int R>
  void shrink(const uint16_t* aj, const float* const* x, float* t, int64_t width) const {
    int64_t i = 0;
    float sums[kLoRARows] = {};
#ifdef __AVX512F__
    __m512 acc[kLoRARows];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (; i < in; i += 16) {
      const __mmask16 k = tail(i, in);
      const __m512 av = load16(aj + i, k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(k, x[r] + i), acc[r]);
    }
    for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
#endif
    for (; i < in; ++i)
      for (int r = 0; r < R; ++r) sums[r] += to_float(aj[i]) * x[r][i];
    for (int r = 0; r < R; ++r) t[r * width] = sums[r];
  }

  // y_r[col, col + n) += sum_j t_r[j] * B^T[j, col + ...] over the rank's rows of B^T.
  template <int R>
  void expand(const uint16_t* b, int64_t rank, const float* t, int64_t width, float* const* y, int64_t col,
              int64_t n) const {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < n; i += 16) {  // the R rows' sums stay in registers over the rank
      const __mmask16 k = tail(i, n);
      __m512 acc[kLoRARows];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_maskz_loadu_ps(k, y[r] + col + i);
      for (int64_t j = 0; j < rank; ++j) {
        const __m512 bv = load16(b + j * out + i, k);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(t[r * width + j]), bv, acc[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y[r] + col + i, k, acc[r]);
    }
#endif
    for (int64_t j = 0; j < rank && i < n; ++j)
      for (int r = 0; r < R; ++r) {
        const float tj = t[r * width + j];
        float* yr = y[r] + col;
#pragma omp simd
        for (int64_t c = i; c < n; ++c) yr[c] += tj * to_float(b[j * out + c]);
      }
  }
};

// Which adapter each token row of a step runs: slot (-1: the base model) and rank, from the runs
// (slot, start, end, rank) the runner passes ([num_runs, 4] int64).
struct LoRARows {
  std::vector<int64_t> slot, rank;
  int64_t max_width = 0;  // the widest pieces * rank of any row: its scratch size

  bool any() const { return max_width > 0; }

  static LoRARows of(const at::Tensor& runs, int64_t num_rows, int64_t num_slots, int64_t max_rank) {
    LoRARows rows{std::vector<int64_t>(num_rows, -1), std::vector<int64_t>(num_rows, 0)};
    if (!runs.defined()) return rows;
    const int64_t* r = runs.data_ptr<int64_t>();
    for (int64_t i = 0; i < runs.size(0); ++i, r += 4) {
      TORCH_CHECK(r[0] >= 0 && r[0] < num_slots && r[1] >= 0 && r[1] <= r[2] && r[2] <= num_rows && r[3] >= 1 &&
                      r[3] <= max_rank,
                  "lora runs: a run out of range");
      for (int64_t m = r[1]; m < r[2]; ++m) rows.slot[m] = r[0], rows.rank[m] = r[3];
      rows.max_width = std::max(rows.max_width, 3 * r[3]);
    }
    return rows;
  }

  // y[m] += row m's update, for rows [m0, m1) that run an adapter, up to kLoRARows rows of one adapter
  // at a time; x, y: row-major, strides ldx, ldy; t: scratch of kLoRARows * max_width floats.
  void add(const LoRASlots& w, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t m0, int64_t m1,
           float* t) const {
    for (int64_t m = m0; m < m1;) {
      if (slot[m] < 0) {
        ++m;
        continue;
      }
      int64_t n = 1;
      while (n < kLoRARows && m + n < m1 && slot[m + n] == slot[m]) ++n;
      n = n >= 4 ? 4 : n >= 2 ? 2 : 1;  // the kernels' row counts
      const float* xs[kLoRARows];
      float* ys[kLoRARows];
      for (int64_t r = 0; r < n; ++r) xs[r] = x + (m + r) * ldx, ys[r] = y + (m + r) * ldy;
      if (n == 4)
        w.add_rows<4>(slot[m], rank[m], xs, ys, t);
      else if (n == 2)
        w.add_rows<2>(slot[m], rank[m], xs, ys, t);
      else
        w.add_rows<1>(slot[m], rank[m], xs, ys, t);
      m += n;
    }
  }

  // The same over every row of a contiguous [B, in] x into a contiguous [B, out] y, rows split over threads.
  void add_all(const LoRASlots& w, const at::Tensor& x, at::Tensor& y) const {
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(slot.size()), 1, [&](int64_t m0, int64_t m1) {
      std::vector<float> t(kLoRARows * max_width);
      add(w, xp, x.stride(0), yp, y.stride(0), m0, m1, t.data());
    });
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden]
  PackedLinear qkv, o, gate_up, down;
  at::Tensor kv_cache;  // [2, num_blocks, block_size, Hkv, D] float32 or bf16
  LoRASlots lora[4];    // qkv, o, gate_up, down (undefined: no adapters served)
};

class DecodeStack {
 public:
  // embedding: [vocab, hidden] float32; cos, sin: [max_position, D / 2] float32 (the rotary tables)
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor final_norm, at::Tensor embedding, at::Tensor cos, at::Tensor sin)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        final_norm_(std::move(final_norm)),
        embedding_(std::move(embedding)),
        cos_(std::move(cos)),
        sin_(std::move(sin)) {
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.scalar_type() == at::kFloat, "embedding: [vocab, hidden] float32");
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == head_dim / 2 && cos_.sizes() == sin_.sizes() &&
                    cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                "cos, sin: [max_position, head_dim / 2] float32");
    check_norm(final_norm_, "final_norm");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, PackedLinear qkv, PackedLinear o,
                 PackedLinear gate_up, PackedLinear down, at::Tensor kv_cache) {
    TORCH_CHECK((kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                 attn::avx512_supports(kv_cache)) &&
                    kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(3) == num_kv_heads_ &&
                    attn::cache_head_dim(kv_cache) == head_dim_,
                "kv_cache: contiguous [2, num_blocks, block_size, Hkv, D] float32 or bf16 (or int8 where "
                "paged_attention serves it)");
    TORCH_CHECK(std::get<3>(qkv) == (num_heads_ + 2 * num_kv_heads_) * head_dim_, "qkv width");
    check_norm(input_norm, "input_norm");
    check_norm(post_attention_norm, "post_attention_norm");
    Layer layer{std::move(input_norm), std::move(post_attention_norm),
                std::move(qkv),        std::move(o),
                std::move(gate_up),    std::move(down),
                std::move(kv_cache)};
#ifdef TM_DECODE_TEAM
    const bool serves = team_serves(layer);
    if (serves) {  // forward_team trusts these shapes inside its region: check them before keeping the layer
      const int64_t hidden = embedding_.size(1);
      const auto check = [](const PackedLinear& w, int64_t K, bool silu_mul) {
        gemm::check_packed(std::get<0>(w), std::get<1>(w), std::get<2>(w), K, std::get<3>(w), silu_mul);
      };
      check(layer.qkv, hidden, false);
      check(layer.o, num_heads_ * head_dim_, false);
      check(layer.gate_up, hidden, true);
      check(layer.down, std::get<3>(layer.gate_up) / 2, false);
    }
    team_serves_ = team_serves_ && serves;
    for (const PackedLinear* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      bf16_rows_ = bf16_rows_ || std::get<0>(*w).scalar_type() == at::kBFloat16;
#endif
    layers_.push_back(std::move(layer));
  }

  // input_ids, positions, slot_mapping: [T] int64, the step's T query tokens; block_tables:
  // [S, max_blocks] int32; seq_lens: [S] int32 (context length including the step's tokens);
  // query_start: [S + 1] int32, sequence i's tokens [query_start[i], query_start[i + 1]), 1 to
  // kMaxQueryLen of them, the last of its context. Returns the final normed hidden states, [T, hidden].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start) const {
    return run(input_ids, positions, slot_mapping, block_tables, seq_lens, query_start, at::Tensor());
  }

  // forward, with LoRA adapters on some rows: lora_runs [num_runs, 4] int64 (slot, start, end, rank), the
  // slots those of set_lora.
  at::Tensor forward_lora(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                          const at::Tensor& lora_runs) const {
    TORCH_CHECK(lora_runs.scalar_type() == at::kLong && lora_runs.dim() == 2 && lora_runs.size(1) == 4 &&
                    lora_runs.is_contiguous(),
                "lora_runs: contiguous [num_runs, 4] int64");
    TORCH_CHECK(!layers_.empty() && lora_slots_ > 0, "forward_lora: set_lora was not called for every layer");
    for (const Layer& layer : layers_)
      TORCH_CHECK(layer.lora[0].defined(), "forward_lora: set_lora was not called for every layer");
    return run(input_ids, positions, slot_mapping, block_tables, seq_lens, query_start, lora_runs);
  }

  // The LoRA slots of layer `index`: (a, bt, pieces) of qkv, o, gate_up and down, read in place by forward_lora.
  void set_lora(int64_t index, const std::vector<std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>>>& slots) {
    TORCH_CHECK(index >= 0 && index < num_layers() && slots.size() == 4, "set_lora: a layer index and 4 slots");
    Layer& layer = layers_[index];
    const int64_t hidden = embedding_.size(1), q_size = num_heads_ * head_dim_;
    const int64_t in[4] = {hidden, q_size, hidden, std::get<3>(layer.gate_up) / 2};
    const int64_t out[4] = {std::get<3>(layer.qkv), std::get<3>(layer.o), std::get<3>(layer.gate_up),
                            std::get<3>(layer.down)};
    for (int i = 0; i < 4; ++i) {
      const auto& [a, bt, sizes] = slots[i];
      int64_t width = 0;
      for (int64_t n : sizes) width += n;
      const int64_t pieces = static_cast<int64_t>(sizes.size());
      TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.scalar_type() == at::kBFloat16 &&
                      bt.scalar_type() == at::kBFloat16 && a.is_contiguous() && bt.is_contiguous() &&
                      a.size(0) == bt.size(0) && a.size(1) == bt.size(1) && a.size(2) == in[i] &&
                      bt.size(2) == out[i] && width == out[i] && pieces >= 1 && pieces <= 3 && a.size(1) % pieces == 0,
                  "set_lora: a [slots, R, in] and bt [slots, R, out] bf16 of the layer's shapes");
      const auto* a_p = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
      const auto* bt_p = reinterpret_cast<const uint16_t*>(bt.data_ptr<at::BFloat16>());
      layer.lora[i] = LoRASlots{a, bt, sizes, a_p, bt_p, a.size(1), in[i], out[i]};
      lora_slots_ = a.size(0);
      lora_max_rank_ = a.size(1) / pieces;
    }
  }

 private:
  at::Tensor run(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                 const at::Tensor& lora_runs) const {
    const bool adapted = lora_runs.defined();
    const LoRARows lora = LoRARows::of(lora_runs, input_ids.numel(), lora_slots_, lora_max_rank_);
    TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(), "input_ids, positions: [T]");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == input_ids.numel(),
                "slot_mapping: [T] int64");
    TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.numel() == seq_lens.numel() + 1,
                "query_start: [S + 1] int32");
    // One token per sequence (every sequence has one at least): a decode step, whose query starts
    // are 0..S and need no reading. Otherwise the starts, checked (undefined: one token each).
    const at::Tensor starts =
        input_ids.numel() == seq_lens.numel() ? at::Tensor() : checked_starts(query_start, seq_lens, input_ids.numel());
#ifdef TM_DECODE_TEAM
    if (one_region()) return forward_team(input_ids, positions, slot_mapping, block_tables, seq_lens, starts, lora);
#endif
    const int64_t batch = input_ids.numel(), q_size = num_heads_ * head_dim_;
    at::Tensor residual = embed(input_ids);  // [B, hidden], the residual stream
    const at::Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);  // [B, D / 2]
    at::Tensor x;  // the normed activations
    const at::Tensor slots = slot_mapping.contiguous();
    const int64_t half = head_dim_ / 2;
    const float* cos_rows = cos.data_ptr<float>();
    const float* sin_rows = sin.data_ptr<float>();
    TokenRows token_rows;  // the per-token view paged_decode takes, made on first use
    for (const Layer& layer : layers_) {
      if (!x.defined())  // layer 0 has no residual to add: the same op as the layer-by-layer path
        x = at::rms_norm(residual, {residual.size(1)}, layer.input_norm, eps_);
      else
        ops::add_rms_norm_(x, residual, layer.input_norm, eps_);
      at::Tensor qkv = linear(layer.qkv, x);  // [B, (Hq + 2 * Hkv) * D]
      if (adapted) lora.add_all(layer.lora[0], x, qkv);
      at::Tensor attn;  // [B, Hq, D]
#ifdef TM_ATTN_AVX512
      if (attn::avx512_supports(layer.kv_cache) && !starts.defined()) {  // rotary and cache write in the items
        attn = attn::decode_attention(qkv, num_heads_, layer.kv_cache, slots.data_ptr<int64_t>(), block_tables,
                                      seq_lens, scale_, [&](float* head, int64_t seq) {
                                        ops::rotate_head(head, cos_rows + seq * half, sin_rows + seq * half, half);
                                      });
      } else if (attn::avx512_supports(layer.kv_cache)) {  // every row's k, v written before any row attends
        ops::rotary_(qkv, num_heads_ + num_kv_heads_, head_dim_, cos, sin);
        const int64_t kv_size = num_kv_heads_ * head_dim_;
        attn::write_kv(qkv.narrow(1, q_size, kv_size).view({batch, num_kv_heads_, head_dim_}),
                       qkv.narrow(1, q_size + kv_size, kv_size).view({batch, num_kv_heads_, head_dim_}), layer.kv_cache,
                       slots);
        at::Tensor q = qkv.narrow(1, 0, q_size).view({batch, num_heads_, head_dim_});  // read in place
        attn = attn::paged_attention(q, layer.kv_cache, block_tables, seq_lens, starts, scale_);
      }
#endif
      if (!attn.defined()) {
        ops::rotary_(qkv, num_heads_ + num_kv_heads_, head_dim_, cos, sin);
        write_kv(qkv, layer.kv_cache, slots.data_ptr<int64_t>(), q_size);
        at::Tensor q = qkv.narrow(1, 0, q_size).view({batch, num_heads_, head_dim_});  // read in place
        if (!starts.defined()) {
          attn = attn::paged_decode(q, layer.kv_cache, block_tables, seq_lens, scale_);
        } else {
          if (!token_rows.tables.defined()) token_rows = per_token_rows(block_tables, seq_lens, starts);
          attn = attn::paged_decode(q, layer.kv_cache, token_rows.tables, token_rows.lens, scale_);
        }
      }
      const at::Tensor heads = attn.view({batch, q_size});
      at::Tensor o = linear(layer.o, heads);
      if (adapted) lora.add_all(layer.lora[1], heads, o);
      if (all_reduce_) all_reduce_(o);  // tensor parallel: this rank's heads' share, summed over the ranks
      ops::add_rms_norm_(o, residual, layer.post_attention_norm, eps_);
      if (adapted) {  // the update lands on [gate | up] before the activation
        at::Tensor gate_up = linear(layer.gate_up, o);
        lora.add_all(layer.lora[2], o, gate_up);
        const at::Tensor h = ops::silu_and_mul(gate_up);
        x = linear(layer.down, h);
        lora.add_all(layer.lora[3], h, x);
      } else {
        x = linear(layer.down, linear_silu_mul(layer.gate_up, o));
      }
      if (all_reduce_) all_reduce_(x);
    }
    ops::add_rms_norm_(x, residual, final_norm_, eps_);
    return x;
  }

 public:
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Tensor parallelism: this rank holds its heads' and its MLP slice's weights, and a slice of the
  // vocabulary's embedding rows. `all_reduce(t)` sums a partial [T, hidden] output over the ranks in
  // place after o_proj and after down_proj; `embed(input_ids)` is the vocab-parallel lookup. Both are
  // Python callables, called with the GIL that forward's caller holds (in the one-region path by the
  // region's first thread, the caller's own, between barriers).
  void set_tensor_parallel(pybind11::object all_reduce, pybind11::object embed) {
    all_reduce_ = std::move(all_reduce);
    embed_ = std::move(embed);
  }

  static int64_t max_query_len() { return kMaxQueryLen; }

  // Whether forward runs a step's ops in one parallel region (forward_team), on where every layer
  // allows it; switched off only to measure the op-by-op path against it (bench/scripts/one_region.py).
  bool one_region() const {
#ifdef TM_DECODE_TEAM
    return team_on_ && team_serves_ && !layers_.empty();
#else
    return false;
#endif
  }

  void set_one_region(bool on) {
#ifdef TM_DECODE_TEAM
    TORCH_CHECK(!on || (team_serves_ && !layers_.empty()),
                "one parallel region needs packed AVX-512 GEMMs and a pair-layout cache in every layer");
    team_on_ = on;
#else
    TORCH_CHECK(!on, "one parallel region needs the AVX-512 GEMM and attention kernels, not built here");
#endif
  }

 private:
  // A step's tokens as paged_decode's sequences (one query row each): token j of sequence i has the
  // block table of i and the context up to and including j, so it attends causally within i's query.
  struct TokenRows {
    at::Tensor tables;  // [T, max_blocks] int32
    at::Tensor lens;    // [T] int32
  };

  static TokenRows per_token_rows(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& starts) {
    const int64_t num_seqs = seq_lens.numel();
    const int32_t* start = starts.data_ptr<int32_t>();
    const at::Tensor lens = seq_lens.contiguous();
    at::Tensor seq_of = at::empty({start[num_seqs]}, at::kLong), token_lens = at::empty({start[num_seqs]}, at::kInt);
    for (int64_t i = 0; i < num_seqs; ++i)
      for (int64_t j = start[i]; j < start[i + 1]; ++j) {
        seq_of.data_ptr<int64_t>()[j] = i;
        token_lens.data_ptr<int32_t>()[j] = lens.data_ptr<int32_t>()[i] - (start[i + 1] - j) + 1;
      }
    return {block_tables.index_select(0, seq_of), token_lens};
  }

  // query_start, contiguous, once checked: from 0 to T, 1 to kMaxQueryLen tokens per sequence, at
  // most its context (the kernels trust these to address the cache).
  static at::Tensor checked_starts(const at::Tensor& query_start, const at::Tensor& seq_lens, int64_t tokens) {
    const at::Tensor starts = query_start.contiguous(), lens = seq_lens.contiguous();
    TORCH_CHECK(lens.scalar_type() == at::kInt, "seq_lens: [S] int32");
    const int32_t* start = starts.data_ptr<int32_t>();
    const int64_t num_seqs = lens.numel();
    TORCH_CHECK(start[0] == 0 && start[num_seqs] == tokens, "query_start must run from 0 to the ", tokens,
                " tokens, not ", start[0], " to ", start[num_seqs]);
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t rows = start[i + 1] - start[i];
      TORCH_CHECK(rows >= 1 && rows <= kMaxQueryLen && rows <= lens.data_ptr<int32_t>()[i], "sequence ", i, ": ", rows,
                  " query tokens with a context of ", lens.data_ptr<int32_t>()[i], " (1 to ", kMaxQueryLen,
                  ", at most the context)");
    }
    return starts;
  }

  // forward_team reads the norms' weights as raw float32 rows inside its parallel region, where a
  // failed check could not throw: check them here.
  void check_norm(const at::Tensor& weight, const char* name) const {
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == embedding_.size(1) && weight.is_contiguous() &&
                    weight.scalar_type() == at::kFloat,
                name, ": [hidden] float32, contiguous");
  }

#ifdef TM_DECODE_TEAM
  // Whether forward_team runs a layer: packed AVX-512 GEMMs ([gate | up] in whole panels) and a
  // cache in paged_attention's pair layout.
  static bool team_serves(const Layer& layer) {
    const auto packed = [](const PackedLinear& w) { return std::get<0>(w).dim() == 3; };
    return packed(layer.qkv) && packed(layer.o) && packed(layer.gate_up) && packed(layer.down) &&
           gemm::halves_of_whole_panels(std::get<0>(layer.gate_up).size(0), std::get<3>(layer.gate_up)) &&
           attn::avx512_supports(layer.kv_cache);
  }

  // A GEMM's activation rows, each prepared by the thread that owns the row: int8 groups ([M, KP]
  // values, [M, KP / 32] scales and offsets) or bf16 tiles ([ceil(M / 8)][KP / 2][8] pairs), KP
  // the GEMM's padded in-features (the buffers fit the largest); with AMX, bf16 rows as the tiles
  // read them (tiles then holds [ceil(M / 16) * 16, KP] bf16).
  struct Rows {
    at::Tensor values, scales, offsets, tiles;
    bool amx = false;  // bf16 GEMMs on AMX tiles (gemm::amx_on, read once a step)
  };

  Rows rows_for(int64_t M) const {
    int64_t kp = 0;
    for (const Layer& l : layers_)
      for (const PackedLinear* w : {&l.qkv, &l.o, &l.gate_up, &l.down}) kp = std::max(kp, std::get<0>(*w).size(1));
    const auto i32 = at::TensorOptions().dtype(at::kInt);
    const int64_t tile_rows = (M + 15) / 16 * 16;  // AMX tiles read whole tiles of 16 rows
    return {at::empty({tile_rows * kp}, i32.dtype(at::kChar)),
            at::empty({M * kp / gemm::avx512::kGroup}, i32.dtype(at::kFloat)),
            at::empty({M * kp / gemm::avx512::kGroup}, i32), at::empty({tile_rows * kp / 2}, i32), gemm::amx_on()};
  }

  // Rows [m0, m1) of x ([M, K] float32, K the GEMM's in-features) into rows, as w's GEMM reads
  // them; bf16 rows in whole tiles from m0, a multiple of kRows (as row_share's shares start).
  static void prepare_rows(const PackedLinear& w, const float* x, int64_t K, int64_t m0, int64_t m1, Rows& rows) {
    const at::Tensor& weight = std::get<0>(w);
    const int64_t KP = weight.size(1), G = KP / gemm::avx512::kGroup;
    constexpr int64_t kTile = gemm::avx512::kRows;
    const bool q8 = weight.scalar_type() != at::kBFloat16;  // int8 and grouped weights take int8 groups
#ifdef TM_AMX
    if (!q8 && rows.amx) {
      for (int64_t m = m0; m < m1; ++m)
        gemm::amx::bf16_row(x + m * K, K, KP, reinterpret_cast<uint16_t*>(rows.tiles.data_ptr<int32_t>()) + m * KP);
      return;
    }
#endif
    for (int64_t m = m0; m < m1; m += q8 ? 1 : kTile) {
      if (q8)
        gemm::avx512::quantize_q8_row(x + m * K, K, KP, rows.values.data_ptr<int8_t>() + m * KP,
                                      rows.scales.data_ptr<float>() + m * G, rows.offsets.data_ptr<int32_t>() + m * G);
      else
        gemm::avx512::bf16_tile(x + m * K, std::min(kTile, m1 - m), K, KP,
                                reinterpret_cast<uint32_t*>(rows.tiles.data_ptr<int32_t>()) + m * KP / 2);
    }
  }

  // Thread t's rows of M: an equal share, in whole bf16 tiles where any GEMM takes bf16 rows (a
  // tile's rows interleave in every cache line: two threads writing one tile contend for its lines).
  std::pair<int64_t, int64_t> row_share(int64_t M, int64_t t, int64_t threads) const {
    const int64_t unit = bf16_rows_ ? gemm::avx512::kRows : 1, units = (M + unit - 1) / unit;
    return {std::min(M, t * units / threads * unit), std::min(M, (t + 1) * units / threads * unit)};
  }

  // Thread t's share of w's GEMM over the M prepared rows: y [M, N] (silu_mul: [M, N / 2]).
  static void gemm_share(const PackedLinear& w, Rows& rows, int64_t M, float* y, bool silu_mul, int64_t t,
                         int64_t threads) {
    const at::Tensor& weight = std::get<0>(w);
    const int64_t P = weight.size(0), KP = weight.size(1), N = std::get<3>(w);
    const auto run = [&](const auto* wp, const void* x, const float* group_scales, const int32_t* group_offsets) {
      auto pr = gemm::avx512::layer_problem(wp, P, KP, std::get<1>(w), std::get<2>(w), y, N, silu_mul, weight.size(2));
      pr.x = x;
      pr.group_scales = group_scales;
      pr.group_offsets = group_offsets;
      gemm::avx512::run_share(pr, M, P, t, threads);
    };
#ifdef TM_AMX
    if (weight.scalar_type() == at::kChar && rows.amx && M >= gemm::amx::q8::kRows) {  // the VNNI tiles' bits
      auto pr =
          gemm::avx512::layer_problem(weight.data_ptr<int8_t>(), P, KP, std::get<1>(w), std::get<2>(w), y, N, silu_mul);
      pr.x = rows.values.data_ptr<int8_t>();
      pr.group_scales = rows.scales.data_ptr<float>();
      pr.group_offsets = rows.offsets.data_ptr<int32_t>();
      return gemm::amx::q8::run_share(pr, M, P, t, threads);
    }
#endif
    if (weight.scalar_type() == at::kChar)
      run(weight.data_ptr<int8_t>(), rows.values.data_ptr<int8_t>(), rows.scales.data_ptr<float>(),
          rows.offsets.data_ptr<int32_t>());
    else if (weight.scalar_type() == at::kByte)
      run(weight.data_ptr<uint8_t>(), rows.values.data_ptr<int8_t>(), rows.scales.data_ptr<float>(),
          rows.offsets.data_ptr<int32_t>());
#ifdef TM_AMX
    else if (rows.amx)
      gemm::amx::run_share({reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), P, KP,
                            reinterpret_cast<const uint16_t*>(rows.tiles.data_ptr<int32_t>()),
                            std::get<2>(w).data_ptr<float>(), y, N, silu_mul ? N / 2 : N, silu_mul ? P / 2 : 0},
                           M, t, threads);
#endif
    else
      run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), rows.tiles.data_ptr<int32_t>(), nullptr,
          nullptr);
  }

  // forward's step with every op in one parallel region (Team): per layer, each thread norms and
  // prepares its own rows for the next GEMM, runs its share of the GEMM's panels, attends its
  // items (rotary and cache write included); a barrier between dependent ops.
  // With several tokens per sequence (starts defined), a row's items read the keys of its sequence's
  // earlier rows: every row's k and v are written first, then a barrier, then the items attend.
  // LoRA adapters (`lora`): each thread adds the updates of its own rows right after the barrier that ends
  // a GEMM, then (qkv only: attention reads every row) one more barrier. An adapted [gate | up] is
  // computed whole, updated, then activated row by row.
  at::Tensor forward_team(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& starts,
                          const LoRARows& lora) const {
    const int64_t B = input_ids.numel(), S = seq_lens.numel();  // B tokens of S sequences
    const int64_t hidden = embedding_.size(1), q_size = num_heads_ * head_dim_;
    const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_, half = head_dim_ / 2;
    const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(),
                     slots = slot_mapping.contiguous();
    TORCH_CHECK(
        tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && tables.dim() == 2 && tables.size(0) == S,
        "block_tables: [S, max_blocks] int32, seq_lens: [S] int32");
    const int32_t* len = lens.data_ptr<int32_t>();
    for (int64_t i = 0; i < S; ++i)  // the kernels trust these to address the cache
      TORCH_CHECK(len[i] <= tables.size(1) * attn::avx512::kBlock, "sequence ", i, ": context ", len[i],
                  " past its block table of ", tables.size(1), " blocks");
    for (const Layer& layer : layers_)
      attn::check_slots(slots.data_ptr<int64_t>(), B, layer.kv_cache.size(1) * layer.kv_cache.size(2));
    at::Tensor residual = embed(input_ids);  // [B, hidden], the residual stream
    const at::Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);  // [B, D / 2]
    at::Tensor x = at::rms_norm(residual, {hidden}, layers_[0].input_norm, eps_);  // as forward's layer 0
    const auto f32 = residual.options();
    at::Tensor qkv = at::empty({B, qkv_width}, f32), attn = at::empty({B, q_size}, f32);
    at::Tensor h = at::empty({B, std::get<3>(layers_[0].gate_up) / 2}, f32);
    const bool adapted = lora.any();
    at::Tensor gate_up = adapted ? at::empty({B, 2 * h.size(1)}, f32) : at::Tensor();  // before the activation
    Rows rows = rows_for(B);
    const bool multi = starts.defined();  // some sequence has several query tokens
    const attn::avx512::Plan plan = attn::avx512::plan_items(multi ? starts.data_ptr<int32_t>() : nullptr, len, S,
                                                             num_heads_ / num_kv_heads_, num_kv_heads_);
    float* xp = x.data_ptr<float>();
    float* rp = residual.data_ptr<float>();
    float* qkv_p = qkv.data_ptr<float>();
    float* attn_p = attn.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    float* gu_p = adapted ? gate_up.data_ptr<float>() : nullptr;
    const float* cos_rows = cos.data_ptr<float>();
    const float* sin_rows = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t inter = h.size(1);
    const float eps = static_cast<float>(eps_);
    // Tensor parallel: thread 0 (the caller's thread, holding the GIL) sums x over the ranks while the
    // others wait at the barrier. A failed all-reduce (a dead peer) must not throw inside the region:
    // it is kept, every thread leaves the layer loop after the same barrier, and it is rethrown after.
    std::exception_ptr reduce_error;
    std::atomic<bool> failed{false};
    const auto reduce_x = [&](Team& team, int64_t t) {
      if (t == 0) {
        try {
          all_reduce_(x);
        } catch (...) {
          reduce_error = std::current_exception();
          failed.store(true);
        }
      }
      team.sync();
      return !failed.load();
    };
    Team::run([&](Team& team, int64_t t) {
      const int64_t T = team.size();
      const std::pair<int64_t, int64_t> share = row_share(B, t, T);
      const int64_t r0 = share.first, r1 = share.second;  // this thread's rows
      attn::avx512::Worker<int8_t> int8_worker;
      attn::avx512::Worker<at::BFloat16> bf16_worker;
      std::vector<float> lora_t(kLoRARows * lora.max_width);  // this thread's scratch for a row's LoRA update
      prepare_rows(layers_[0].qkv, xp, hidden, r0, r1, rows);
      for (size_t l = 0; l < layers_.size(); ++l) {
        const Layer& layer = layers_[l];
        team.sync();
        gemm_share(layer.qkv, rows, B, qkv_p, false, t, T);
        team.sync();
        if (adapted) {
          lora.add(layer.lora[0], xp, hidden, qkv_p, qkv_width, r0, r1, lora_t.data());
          team.sync();
        }
        const auto attend = [&](auto* cache, auto& worker) {
          const int64_t cache_half = layer.kv_cache.numel() / 2;
          // Token row's kv heads [kvh0, kvh0 + heads): rotated, k and v into its cache slot.
          const auto prepare = [&](int64_t row, int64_t kvh0, int64_t heads) {
            attn::rotate_and_write(qkv_p + row * qkv_width, kvh0, heads, num_heads_, num_kv_heads_, head_dim_,
                                   slot[row], cache, cache_half, [&](float* head) {
                                     ops::rotate_head(head, cos_rows + row * half, sin_rows + row * half, half);
                                   });
          };
          const auto attend_items = [&](const auto& before_item) {
            attn::avx512::with_chunks(head_dim_, [&](auto c) {
              for (int64_t w = t; w < static_cast<int64_t>(plan.workers.size()); w += T)
                attn::avx512::attend_worker<c()>(plan, w, qkv_p, qkv_width, cache, cache + cache_half,
                                                 tables.data_ptr<int32_t>(), len, attn_p, num_heads_, num_kv_heads_,
                                                 tables.size(1), static_cast<float>(scale_), before_item, worker);
            });
          };
          if (!multi)  // an item's sequence is its one token row: it prepares its row itself
            return attend_items(prepare);
          const int64_t units = B * num_kv_heads_;  // (row, kv head) pairs, an equal share each
          for (int64_t u = t * units / T; u < (t + 1) * units / T; ++u)
            prepare(u / num_kv_heads_, u % num_kv_heads_, 1);
          team.sync();
          attend_items([](int64_t, int64_t, int64_t) {});
        };
        if (layer.kv_cache.scalar_type() == at::kChar)
          attend(layer.kv_cache.data_ptr<int8_t>(), int8_worker);
        else
          attend(layer.kv_cache.data_ptr<at::BFloat16>(), bf16_worker);
        team.sync();
        prepare_rows(layer.o, attn_p, q_size, r0, r1, rows);
        team.sync();
        gemm_share(layer.o, rows, B, xp, false, t, T);  // x <- the attention's output projection
        team.sync();
        if (adapted) lora.add(layer.lora[1], attn_p, q_size, xp, hidden, r0, r1, lora_t.data());
        if (all_reduce_ && !reduce_x(team, t)) break;
        for (int64_t m = r0; m < r1; ++m)
          ops::add_rms_norm_row(xp + m * hidden, rp + m * hidden, layer.post_attention_norm.data_ptr<float>(), hidden,
                                eps);
        prepare_rows(layer.gate_up, xp, hidden, r0, r1, rows);
        team.sync();
        if (adapted) {
          gemm_share(layer.gate_up, rows, B, gu_p, false, t, T);
          team.sync();
          lora.add(layer.lora[2], xp, hidden, gu_p, 2 * inter, r0, r1, lora_t.data());
          for (int64_t m = r0; m < r1; ++m) ops::silu_mul_row(gu_p + m * 2 * inter, hp + m * inter, inter);
        } else {
          gemm_share(layer.gate_up, rows, B, hp, true, t, T);
          team.sync();
        }
        prepare_rows(layer.down, hp, inter, r0, r1, rows);
        team.sync();
        gemm_share(layer.down, rows, B, xp, false, t, T);  // x <- the MLP's output
        team.sync();
        if (adapted) lora.add(layer.lora[3], hp, inter, xp, hidden, r0, r1, lora_t.data());
        if (all_reduce_ && !reduce_x(team, t)) break;
        const at::Tensor& next_norm = l + 1 < layers_.size() ? layers_[l + 1].input_norm : final_norm_;
        for (int64_t m = r0; m < r1; ++m)
          ops::add_rms_norm_row(xp + m * hidden, rp + m * hidden, next_norm.data_ptr<float>(), hidden, eps);
        if (l + 1 < layers_.size()) prepare_rows(layers_[l + 1].qkv, xp, hidden, r0, r1, rows);
      }
    });
    if (reduce_error) std::rethrow_exception(reduce_error);
    return x;
  }

  bool team_serves_ = true;  // every layer so far qualifies (team_serves)
  bool team_on_ = true;
  bool bf16_rows_ = false;  // some GEMM takes bf16 row tiles (row_share)
#endif

  // Copy each row's k and v heads (after rotary) into its cache slot of a plain [.., Hkv, D] cache
  // (a cache in paged_attention's pair layout is written by attn::decode_attention); a bf16 cache
  // rounds them to nearest even, as torch's conversion does in the layer-by-layer path.
  void write_kv(const at::Tensor& qkv, const at::Tensor& kv_cache, const int64_t* slots, int64_t q_size) const {
    const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
    attn::check_slots(slots, qkv.size(0), num_slots);
    if (kv_cache.scalar_type() == at::kBFloat16)
      write_rows(qkv, kv_cache.data_ptr<at::BFloat16>(), num_slots, slots, q_size);
    else
      write_rows(qkv, kv_cache.data_ptr<float>(), num_slots, slots, q_size);
  }

  template <typename T>
  void write_rows(const at::Tensor& qkv, T* k_cache, int64_t num_slots, const int64_t* slots, int64_t q_size) const {
    const int64_t kv_size = num_kv_heads_ * head_dim_;
    T* v_cache = k_cache + num_slots * kv_size;
    const float* rows = qkv.data_ptr<float>();
    for (int64_t b = 0; b < qkv.size(0); ++b) {
      const float* row = rows + b * qkv.stride(0) + q_size;
      for (int64_t i = 0; i < kv_size; ++i) {
        k_cache[slots[b] * kv_size + i] = static_cast<T>(row[i]);
        v_cache[slots[b] * kv_size + i] = static_cast<T>(row[kv_size + i]);
      }
    }
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor final_norm_, embedding_, cos_, sin_;
  std::vector<Layer> layers_;
  pybind11::object all_reduce_, embed_;         // null: one rank (set_tensor_parallel)
  int64_t lora_slots_ = 0, lora_max_rank_ = 0;  // set_lora's slots and the rank they hold at most

  at::Tensor embed(const at::Tensor& input_ids) const {
    if (embed_) return embed_(input_ids).cast<at::Tensor>();
    return embedding_.index_select(0, input_ids);
  }
};

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_amx", &tokenmill::tile::switch_to, "AMX tiles for bf16 GEMMs and attention on (where granted) or off");
  pybind11::class_<tokenmill::DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &tokenmill::DecodeStack::add_layer)
      .def("forward", &tokenmill::DecodeStack::forward)
      .def("forward_lora", &tokenmill::DecodeStack::forward_lora)
      .def("set_lora", &tokenmill::DecodeStack::set_lora)
      .def("set_tensor_parallel", &tokenmill::DecodeStack::set_tensor_parallel)
      .def_property_readonly("num_layers", &tokenmill::DecodeStack::num_layers)
      .def_property_readonly_static("max_query_len",
                                    [](const pybind11::object&) { return tokenmill::DecodeStack::max_query_len(); })
      .def_property("one_region", &tokenmill::DecodeStack::one_region, &tokenmill::DecodeStack::set_one_region);
}

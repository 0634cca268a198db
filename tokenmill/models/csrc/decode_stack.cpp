// Every decoder layer of a CPU decode step (one new token per sequence) in one call from Python.
//
// A small model at batch 1 spends ~15 PyTorch calls per layer; issued from Python they cost as much
// as the weight streaming they wrap. Here the same kernels (packed GEMM or float32 at::linear,
// add+RMSNorm, rotary, paged decode attention, SiLU-and-mul) run back to back from C++, on the same
// weights and cache.
#include <torch/extension.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "packed_gemm.h"
#include "paged_decode.h"

namespace tokenmill {

// Either packed (packed [P, K, 16] int8 or bf16, scale [P * 16], bias [P * 16], out_features; see
// packed_gemm.h) or dense float32 (weight [N, K], an empty tensor, bias [N] or empty, N).
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

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden]
  PackedLinear qkv, o, gate_up, down;
  at::Tensor kv_cache;  // [2, num_blocks, block_size, Hkv, D] float32 or bf16
};

class DecodeStack {
 public:
  // embedding: [vocab, hidden] float32; cos, sin: [max_position, D / 2] float32 (the rotary tables)
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              at::Tensor final_norm, at::Tensor embedding, at::Tensor cos, at::Tensor sin)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        final_norm_(std::move(final_norm)), embedding_(std::move(embedding)), cos_(std::move(cos)),
        sin_(std::move(sin)) {
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.scalar_type() == at::kFloat, "embedding: [vocab, hidden] float32");
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == head_dim / 2 && cos_.sizes() == sin_.sizes() &&
                cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                "cos, sin: [max_position, head_dim / 2] float32");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, PackedLinear qkv, PackedLinear o,
                 PackedLinear gate_up, PackedLinear down, at::Tensor kv_cache) {
    TORCH_CHECK((kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                 attn::avx512_supports(kv_cache)) &&
                kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(3) == num_kv_heads_ &&
                attn::cache_head_dim(kv_cache) == head_dim_,
                "kv_cache: contiguous [2, num_blocks, block_size, Hkv, D] float32 or bf16 (or int8 where paged_attention serves it)");
    TORCH_CHECK(std::get<3>(qkv) == (num_heads_ + 2 * num_kv_heads_) * head_dim_, "qkv width");
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down), std::move(kv_cache)});
  }

  // input_ids, positions: [B] int64 (each sequence's new token); slot_mapping: [B] int64;
  // block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (context length including the new token).
  // Returns the final normed hidden states, [B, hidden].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(), "input_ids, positions: [B]");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == input_ids.numel(),
                "slot_mapping: [B] int64");
    const int64_t batch = input_ids.numel(), q_size = num_heads_ * head_dim_;
    at::Tensor residual = embedding_.index_select(0, input_ids);  // [B, hidden], the residual stream
    const at::Tensor cos = cos_.index_select(0, positions), sin = sin_.index_select(0, positions);  // [B, D / 2]
    at::Tensor x;  // the normed activations
    const at::Tensor slots = slot_mapping.contiguous();
    const int64_t half = head_dim_ / 2;
    const float* cos_rows = cos.data_ptr<float>();
    const float* sin_rows = sin.data_ptr<float>();
    for (const Layer& layer : layers_) {
      if (!x.defined())  // layer 0 has no residual to add: the same op as the layer-by-layer path
        x = at::rms_norm(residual, {residual.size(1)}, layer.input_norm, eps_);
      else
        ops::add_rms_norm_(x, residual, layer.input_norm, eps_);
      at::Tensor qkv = linear(layer.qkv, x);  // [B, (Hq + 2 * Hkv) * D]
      at::Tensor attn;  // [B, Hq, D]
#ifdef TM_ATTN_AVX512
      if (attn::avx512_supports(layer.kv_cache)) {  // rotary and cache write inside the attention's items
        attn = attn::decode_attention(qkv, num_heads_, layer.kv_cache, slots.data_ptr<int64_t>(), block_tables,
                                      seq_lens, scale_, [&](float* head, int64_t seq) {
                                        ops::rotate_head(head, cos_rows + seq * half, sin_rows + seq * half, half);
                                      });
      }
#endif
      if (!attn.defined()) {
        ops::rotary_(qkv, num_heads_ + num_kv_heads_, head_dim_, cos, sin);
        write_kv(qkv, layer.kv_cache, slots.data_ptr<int64_t>(), q_size);
        at::Tensor q = qkv.narrow(1, 0, q_size).view({batch, num_heads_, head_dim_});  // read in place
        attn = attn::paged_decode(q, layer.kv_cache, block_tables, seq_lens, scale_);
      }
      at::Tensor o = linear(layer.o, attn.view({batch, q_size}));
      ops::add_rms_norm_(o, residual, layer.post_attention_norm, eps_);
      x = linear(layer.down, linear_silu_mul(layer.gate_up, o));
    }
    ops::add_rms_norm_(x, residual, final_norm_, eps_);
    return x;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
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
};

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<tokenmill::DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &tokenmill::DecodeStack::add_layer)
      .def("forward", &tokenmill::DecodeStack::forward)
      .def_property_readonly("num_layers", &tokenmill::DecodeStack::num_layers);
}

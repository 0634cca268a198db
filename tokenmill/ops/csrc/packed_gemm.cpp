// Registers the packed weight-only GEMM (packed_gemm.h) as torch.ops.tokenmill_quant.packed_linear
// (and packed_linear_silu_mul, the MLP's gate and up projection with its activation).
#include <torch/library.h>

#include "packed_gemm.h"

TORCH_LIBRARY(tokenmill_quant, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor scale, Tensor bias, int N) -> Tensor");
  // silu(gate) * up of a [gate | up] projection: [M, N / 2] (packed_gemm.h)
  m.def("packed_linear_silu_mul(Tensor x, Tensor packed, Tensor scale, Tensor bias, int N) -> Tensor");
  // packed_linear (or with silu_mul its activation) plus LoRA adapters' updates in the epilogue (AMX tiles only)
  m.def(
      "packed_linear_lora(Tensor x, Tensor packed, Tensor scale, Tensor bias, int N, bool silu_mul, Tensor slot, "
      "Tensor rank, Tensor t, Tensor bt, Tensor piece_end) -> Tensor");
  m.def("packed_gemm_isa() -> str", &tokenmill::gemm::isa);      // "avx512" | "avx2" | "scalar"
  m.def("packed_gemm_amx() -> bool", &tokenmill::gemm::amx_on);  // bf16 layers on AMX tiles
  m.def("packed_gemm_set_amx(bool on) -> bool", &tokenmill::tile::switch_to);
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) {
  m.impl("packed_linear", &tokenmill::gemm::packed_linear_op);
  m.impl("packed_linear_silu_mul", &tokenmill::gemm::packed_linear_silu_mul_op);
  m.impl("packed_linear_lora", &tokenmill::gemm::packed_linear_lora_op);
}

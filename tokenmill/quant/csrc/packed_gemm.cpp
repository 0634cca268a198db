// Registers the packed weight-only GEMM (../../csrc/packed_gemm.h) as torch.ops.tokenmill_quant.packed_linear.
#include <torch/library.h>

#include "packed_gemm.h"

TORCH_LIBRARY(tokenmill_quant, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor scale, Tensor bias, int N) -> Tensor");
  m.def("packed_gemm_isa() -> str", &tokenmill::gemm::isa);  // "avx512" | "avx2" | "scalar"
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) { m.impl("packed_linear", &tokenmill::gemm::packed_linear); }

// Registers the mixture-of-experts op (moe.h) as torch.ops.tokenmill_moe.experts.
#include <torch/library.h>

#include "moe.h"

TORCH_LIBRARY(tokenmill_moe, m) {
  // every chosen expert's silu-gated MLP, weighted and summed per token: [T, H] float32 (moe.h)
  m.def(
      "experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor s13, Tensor w2, Tensor s2, "
      "int intermediate, bool amx) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_moe, CPU, m) { m.impl("experts", &tokenmill::moe::moe_experts); }

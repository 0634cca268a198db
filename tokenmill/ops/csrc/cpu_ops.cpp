// Python bindings for the fused element-wise ops in cpu_ops.h.
#include <torch/extension.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &tokenmill::ops::add_rms_norm_, "residual += x; x = rmsnorm(residual) (in place, float32)");
  m.def("silu_and_mul", &tokenmill::ops::silu_and_mul, "silu(gate) * up (float32)");
  m.def("sample_rows", &tokenmill::ops::sample_rows, "inverse-CDF draws from softmax(logits / temperature)");
  m.def("argmax_rows", &tokenmill::ops::argmax_rows, "each row's first largest index (torch.argmax)");
  m.def("rotary_", &tokenmill::ops::rotary_, "rotate-half rotary embedding in place (float32)");
}

// Python bindings for the paged decode attention in ../../csrc/paged_decode.h.
#include <torch/extension.h>

#include "paged_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &tokenmill::attn::paged_decode, "paged decode attention (CPU)");
}

// Python bindings for the paged attention kernels in paged_decode.h.
#include <torch/extension.h>

#include "paged_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &tokenmill::attn::paged_decode, "paged decode attention (CPU)");
  m.def("paged_attention", &tokenmill::attn::paged_attention,
        "paged attention for decode rows and prompt chunks (CPU, bf16 cache, AVX-512 BF16)");
  m.def("avx512_supports", &tokenmill::attn::avx512_supports,
        "whether paged_attention serves this cache (then in its pair layout)");
  m.def("write_kv", &tokenmill::attn::write_kv, "k, v rows into their slots of a pair-layout cache");
  m.def("set_amx", &tokenmill::tile::switch_to, "AMX tiles for the bf16-cache attention on (where granted) or off");
}

"""Running every engine of a comparison as it would run on an AVX2-only CPU, on a machine with AVX-512.

Many rented x86 servers have AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, older Intel). Where the machine at
hand has AVX-512, `tokenmill bench compare --cpu-isa avx2` restricts every engine to AVX2, each through the
switch its own libraries read, so the comparison is like for like:

    TOKENMILL_CPU_ISA=avx2         tokenmill's kernels compiled with -march=x86-64-v3 (ops/build.py)
    ATEN_CPU_CAPABILITY=avx2       torch's own CPU kernels (every torch-based engine: tokenmill, vLLM, HF)
    MKL_ENABLE_INSTRUCTIONS=AVX2   MKL's sgemm (torch's float32 matmuls)
    ONEDNN_MAX_CPU_ISA=AVX2        oneDNN (torch's bf16 matmuls, vLLM's GEMMs)
    CT2_FORCE_CPU_ISA=AVX2         CTranslate2

and per peer (PeerSpec.avx2_env): vLLM loads its `_C_AVX2` kernels (a sitecustomize that makes torch report
no AVX-512, which is what vLLM's import_kernels asks), llama.cpp loads a ggml CPU backend built without
AVX-512 (llamacpp.py). What cannot be emulated: the cache sizes and memory bandwidth of a real AVX2 machine.
"""

from __future__ import annotations

AVX2_ENV = {
    "TOKENMILL_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "CT2_FORCE_CPU_ISA": "AVX2",
}
CPU_ISAS = ("native", "avx2")

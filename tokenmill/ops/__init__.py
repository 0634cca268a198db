"""The bottom layer: our C++ CPU kernels (csrc/), their one build loader (build.py), thin Python
bindings over them (cpu_ops.py, packed_gemm.py), huge-page memory placement (hugepages.py), and the
fused element-wise Triton kernels for CUDA (triton_fused.py, reached through triton_ops.py).

Imports torch and the standard library only (triton_fused.py triton too, and only when a CUDA tensor
asks for it), never the rest of tokenmill."""

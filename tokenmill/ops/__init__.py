"""The bottom layer: our C++ CPU kernels (csrc/), their one build loader (build.py), thin Python
bindings over them (cpu_ops.py, packed_gemm.py), and huge-page memory placement (hugepages.py).

Imports torch and the standard library only, never the rest of tokenmill."""

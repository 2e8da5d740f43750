"""Linear layers on CPU: packed oneDNN and MKL kernels, weight codes, the coded wide path and its GEMM, bfloat16 GEMMs, fused MLP and norms, and the module swaps that put them in."""

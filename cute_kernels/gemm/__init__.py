"""GEMM engines shared by the tensor-core kernels (vendored from CUTLASS examples)."""

"""GEMM engines shared by the tensor-core kernels: :mod:`.sm90_gemm` (Hopper, written for this
project) and :mod:`.blackwell_tcgen05` (Blackwell, vendored from a CUTLASS example)."""

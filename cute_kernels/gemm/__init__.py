"""GEMM engines shared by the tensor-core kernels, written for this project on the public CuTe
DSL API: :mod:`.sm90_gemm` (Hopper: TMA + wgmma) and :mod:`.sm100_gemm` (Blackwell: TMA +
tcgen05, tensor-memory accumulators)."""

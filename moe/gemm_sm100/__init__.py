"""Blackwell (sm_100a) MoE block-scaled grouped GEMM engine, vendored from NVIDIA CUTLASS.

Source: NVIDIA/cutlass ``examples/python/CuTeDSL/cute/blackwell/kernel/moe/``
(``torch_scaled_grouped_mm.py``, ``moe_persistent_scheduler.py``, ``moe_sched_extension.py``,
``moe_utils.py``; commit 7107b05535f8977f5ecb9d01ee203205b1fd9bc4, BSD-3-Clause, headers
kept). Changes: package-relative imports; the example's tester / command-line runner (the
part after the kernel class) was dropped; and one addition marked ``cute_kernels addition``
in ``torch_scaled_grouped_mm.py``: optional ``silu_q`` / ``silu_sq`` arguments that switch
the epilogue (constexpr) from storing C to computing SiLU(gate) * up + MXFP8 from the
tensor-memory loads (``ScaledGroupedGemmKernel.silu_quant_subtile``). Without them the
kernel is the original.

What it is: ``out[tokens, N] = A[tokens, K] x B[expert(token), K, N]`` with MXFP8 (or
NVFP4) operands and UE8M0 block scales in the tcgen05 block-scale layout; a small
descriptor-init kernel builds per-expert TMA descriptors from the device-side cumulative
offsets, then a warp-specialised persistent kernel (scheduler, TMA, tcgen05
``mma.block_scale`` with scale factors copied to tensor memory, epilogue warps) walks only
the M-tiles that hold rows of some expert. No host sync: graph capturable.
:mod:`moe.experts_sm100` is the project's wrapper.
"""

"""MXFP8 routed-expert GEMM, Blackwell path: ``out[r] = A[r] @ W[expert(r)]^T`` (bf16 out).

``A [rows, K]`` e4m3 holds the routed inputs in the router's expert-sorted, tile-padded
order (:func:`moe.quant.mxfp8_quantize_routed`), with its UE8M0 scales in the tcgen05
block-scale layout; ``W [E, N, K]`` e4m3 with per-expert scales in the same layout;
``expert_offsets[1:]`` (the router's padded cumulative ends, device-resident) tell the
kernel where each expert's rows are. Engine: :mod:`moe.gemm_sm100` (CUTLASS's MoE scaled
grouped GEMM: a descriptor-init kernel writes per-expert TMA descriptors from the offsets,
then a persistent warp-specialised kernel runs ``tcgen05.mma.block_scale`` on only the
M-tiles that hold some expert's rows -- the router's padding makes each 128-row tile belong
to one expert, so ``consistent_token_padding`` holds and no offsets are re-derived).
Nothing is synchronised with the host: graph capturable.

It cannot run here (no Blackwell GPU): CI compiles it for sm_100a and checks the machine
code (``UTCQMMA`` with ``UTCCP`` scale copies to tensor memory, ``UTMALDG``), and
``tests/test_moe_experts.py`` checks on the CPU that the scale layout the kernel reads
(CuTe's ``tile_atom_to_shape_SF``, evaluated on the host) is byte for byte the layout
:mod:`moe.quant` writes, and the block-scaled math against an FP64 dequantised reference.

Constraints: ``K % 128 == 0`` (the MMA's K tile is 4 scale blocks), ``N % 16 == 0``,
E static (one compile per ``(E, N, K)``), rows runtime.
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_kernels import jit
from moe.gemm_sm100.torch_scaled_grouped_mm import ScaledGroupedGemmKernel

MX_BLOCK = 32
B200_SMS = 148  # max active 1x1 clusters on sm_100a


class MoeExpertGemmSm100:
    """Compile-time configuration: experts, N, K, tile N, 2-CTA MMA, persistent CTA count."""

    def __init__(self, E: int, N: int, K: int, tile_n: int = 128, two_cta: bool = False,
                 max_active_clusters: int = B200_SMS, silu_quant: bool = False):
        self.E, self.N, self.K, self.silu_quant = E, N, K, silu_quant
        self.max_active_clusters = max_active_clusters // (2 if two_cta else 1)
        self.gemm = ScaledGroupedGemmKernel(
            "2Dx3D", sf_vec_size=MX_BLOCK, accumulate_on_output=False, separate_tensormap_init=False,
            consistent_token_padding=True, mma_tiler_mnk=(256 if two_cta else 128, tile_n, 128),
            cluster_shape_mnk=(2 if two_cta else 1, 1, 1), use_2cta_instrs=two_cta, fixed_expert_cnt=E)
        self.workspace_bytes = self.gemm.get_workspace_size(E)
        self.kb_pad = -(-(K // MX_BLOCK) // 4) * 4
        self.n_pad = -(-N // 128) * 128

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, w_ptr: cute.Pointer, sfa_ptr: cute.Pointer, sfw_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, offs_ptr: cute.Pointer, ws_ptr: cute.Pointer, q_ptr: cute.Pointer,
                 sq_ptr: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        E, N, K = self.E, self.N, self.K
        mat_a = cute.make_tensor(a_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        # torch's scaled_grouped_mm convention: mat_b is (E, K, N); ours is W [E, N, K]
        mat_b = cute.make_tensor(w_ptr, cute.make_layout((E, K, N), stride=(N * K, 1, K)))
        rows_pad = (rows + 127) // 128 * 128
        scale_a = cute.make_tensor(sfa_ptr, cute.make_layout((rows_pad, self.kb_pad), stride=(self.kb_pad, 1)))
        sfw = self.n_pad * self.kb_pad
        scale_b = cute.make_tensor(sfw_ptr, cute.make_layout((E, sfw), stride=(sfw, 1)))
        out = cute.make_tensor(out_ptr, cute.make_layout((rows, N), stride=(N, 1)))
        offs = cute.make_tensor(offs_ptr, cute.make_layout((E,)))
        ws = cute.make_tensor(ws_ptr, cute.make_layout((self.workspace_bytes,)))
        if cutlass.const_expr(self.silu_quant):
            # SiLU(gate) * up + MXFP8 in the epilogue: q [rows, N/2] e4m3 and swizzled scales
            I = N // 2
            q = cute.make_tensor(q_ptr, cute.make_layout((rows, I), stride=(I, 1)))
            sq = cute.make_tensor(sq_ptr, cute.make_layout((rows_pad * ((I // MX_BLOCK + 3) // 4) * 4,)))
            self.gemm(mat_a, mat_b, scale_a, scale_b, out, offs, ws, self.max_active_clusters, stream,
                      silu_q=q, silu_sq=sq)
        else:
            self.gemm(mat_a, mat_b, scale_a, scale_b, out, offs, ws, self.max_active_clusters, stream)

    @staticmethod
    def can_implement(E: int, N: int, K: int) -> bool:
        return 1 <= E <= 1024 and K % 128 == 0 and K > 0 and N % 16 == 0 and N > 0


def _build(arch: str, *, E: int, N: int, K: int, tile_n: int = 128, two_cta: bool = False,
           silu_quant: bool = False):
    if not MoeExpertGemmSm100.can_implement(E, N, K):
        raise ValueError(f"moe_expert_gemm: unsupported E={E}, N={N}, K={K} (K % 128, N % 16)")
    P = jit.fake_gmem_ptr
    f8, sf = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
    if silu_quant and (N % 64 or tile_n % 64):
        raise ValueError(f"moe_expert_gemm (fused SiLU): N={N} and tile_n={tile_n} must be multiples of 64")
    args = (P(f8, 16), P(f8, 16), P(sf, 16), P(sf, 16), P(cutlass.BFloat16, 16), P(Int32, 4), P(cutlass.Uint8, 128),
            P(f8, 16), P(cutlass.Uint8, 1), Int32(128), jit.fake_stream())
    return MoeExpertGemmSm100(E, N, K, tile_n, two_cta, silu_quant=silu_quant), args


KERNEL = jit.register(jit.KernelDef(
    name="moe_expert_gemm",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), p) for p in (
        "experts_sm100.py", "gemm_sm100/torch_scaled_grouped_mm.py", "gemm_sm100/moe_persistent_scheduler.py",
        "gemm_sm100/moe_sched_extension.py", "gemm_sm100/moe_utils.py")),
    archs=("sm_100a",),
    # DeepSeek-like: gate/up (N = 2 I = 4096, K = 7168) and down (N = 7168, K = I = 2048)
    aot_configs=({"E": 256, "N": 4096, "K": 7168, "silu_quant": True}, {"E": 256, "N": 4096, "K": 7168},
                 {"E": 256, "N": 7168, "K": 2048}),
    description="MXFP8 routed-expert grouped GEMM (tcgen05 block-scaled), bf16 out",
))

"""WO-A at decode T (<= 64 tokens): a weight-streaming kernel, token-major output.

``y[t, g*R + r] = sum_d wo_a[g, r, d] * o[t, g-th head group].flatten()[d]`` (FP32
accumulate, bf16 out), the contract of :func:`cute_kernels.wo_a.wo_a`.

Why a second kernel: at decode T the product is ``G`` skinny GEMMs ``[T, Dg] x [Dg, R]``
whose time is the read of the weights (8-64 MB); the TMA/wgmma engine's 64-128-row M tiles
are mostly padding there and its grid has too few CTAs to keep 132 SMs streaming (issue 4:
36-72% of 4.3 TB/s). Here one CTA owns (64 output columns r of one group g): it streams
``wo_a[g, r0:r0+64, :]`` through a 4-stage cp.async pipeline (64 x 128 bf16 per stage,
padded shared rows for conflict-free ldmatrix) together with the <= 64 live token rows of
``o``, 2 x 2 warps of ``mma.sync m16n8k16`` accumulate in FP32, and the epilogue stores
bf16 pairs straight into the token-major ``y``. Grid ``(R / 64, G)``: 64-256 CTAs at the
model's shapes, each streaming ``64 * Dg * 2`` bytes.

Status: compiled and machine-code checked (sm_90a, sm_100a) in a session without GPU time;
**not yet run**. :func:`wo_a` uses it only with ``decode_kernel=True`` until its staged GPU
test and the benchmark have run.

Constraints: T <= 64, R % 64 == 0, Dg % 128 == 0.
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit

BM, BN, BK = 64, 64, 128
PITCH = BK + 8
STAGES = 4
VEC = 8
MAX_T = BM


class WoADecode:
    def __init__(self, G: int, R: int, Dg: int):
        self.G, self.R, self.Dg = G, R, Dg
        self.threads = 128

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        G, R, Dg = self.G, self.R, self.Dg
        mO = cute.make_tensor(o_ptr, cute.make_layout((num_tokens, G * Dg), stride=(G * Dg, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((G * R, Dg), stride=(Dg, 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, G * R), stride=(G * R, 1)))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout((2, 2, 1)))
        self.kernel(mO, mW, mY, tiled_mma, num_tokens).launch(grid=[R // BN, G, 1], block=[self.threads, 1, 1],
                                                              stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, tiled_mma: cute.TiledMma, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, g, _ = cute.arch.block_idx()
        bf16 = cutlass.BFloat16
        r0 = nt * BN
        KT = self.Dg // BK
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(bf16, cute.make_layout((BM, BK, STAGES), stride=(PITCH, 1, BM * PITCH)), 16)
        sB = smem.allocate_tensor(bf16, cute.make_layout((BN, BK, STAGES), stride=(PITCH, 1, BN * PITCH)), 16)
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), bf16, num_bits_per_copy=128)
        gOv = cute.zipped_divide(mO, (1, VEC))
        gWv = cute.zipped_divide(mW, (1, VEC))
        sAv = cute.zipped_divide(sA, (1, VEC, 1))
        sBv = cute.zipped_divide(sB, (1, VEC, 1))
        a_col0 = g * (self.Dg // VEC)  # group g's columns of o, in 16-byte vectors
        w_row0 = g * self.R + r0

        for s0 in cutlass.range_constexpr(STAGES - 1):
            if s0 < KT:
                self.issue(gOv, gWv, sAv, sBv, atom, s0, s0, a_col0, w_row0, num_tokens)
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[None, None, None, 0])
        cC = cute.make_identity_tensor((BM, BN))
        tCcC = thr_mma.partition_C(cC)
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, BN)))
        acc.fill(0.0)
        s2r_A = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), bf16),
                                       tiled_mma)
        s2r_B = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 2), bf16),
                                       tiled_mma)
        thr_A, thr_B = s2r_A.get_slice(tidx), s2r_B.get_slice(tidx)
        tAsA, tArA = thr_A.partition_S(sA), thr_A.retile(tCrA)
        tBsB, tBrB = thr_B.partition_S(sB), thr_B.retile(tCrB)

        for kt in cutlass.range(0, KT, 1):
            slot = kt % STAGES
            cute.arch.cp_async_wait_group(STAGES - 2)
            # K slice kt has landed for all threads' copies; every warp is done with kt-1.
            cute.arch.barrier()
            if kt + STAGES - 1 < KT:
                self.issue(gOv, gWv, sAv, sBv, atom, kt + STAGES - 1, (kt + STAGES - 1) % STAGES, a_col0, w_row0,
                           num_tokens)
            cute.arch.cp_async_commit_group()
            for kb in cutlass.range_constexpr(BK // 16):
                cute.copy(s2r_A, tAsA[None, None, kb, slot], tArA[None, None, kb])
                cute.copy(s2r_B, tBsB[None, None, kb, slot], tBrB[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            if m < num_tokens:
                mY[m, g * self.R + r0 + n] = acc[i].to(bf16)

    @cute.jit
    def issue(self, gOv: cute.Tensor, gWv: cute.Tensor, sAv: cute.Tensor, sBv: cute.Tensor, atom: cute.CopyAtom,
              kt: Int32, slot: Int32, a_col0: Int32, w_row0: Int32, num_tokens: Int32):
        """cp.async K slice kt: the live token rows of o (group g's columns) and 64 weight rows."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = BK // VEC
        for i in cutlass.range_constexpr(BM * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            if r < num_tokens:
                cute.copy(atom, gOv[(0, None), (r, a_col0 + kt * VPR + v)], sAv[(0, None, 0), (r, v, slot)])
        for i in cutlass.range_constexpr(BN * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            cute.copy(atom, gWv[(0, None), (w_row0 + r, kt * VPR + v)], sBv[(0, None, 0), (r, v, slot)])

    @staticmethod
    def can_implement(T: int, G: int, R: int, Dg: int) -> bool:
        return 1 <= T <= MAX_T and G >= 1 and R % BN == 0 and Dg % BK == 0


def _build(arch: str, *, G: int, R: int, Dg: int):
    if not WoADecode.can_implement(1, G, R, Dg):
        raise ValueError(f"wo_a_decode: unsupported G={G}, R={R}, Dg={Dg} (R % 64, Dg % 128)")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 4), Int32(1), jit.fake_stream())
    return WoADecode(G, R, Dg), args


KERNEL = jit.register(jit.KernelDef(
    name="wo_a_decode",
    build=_build,
    sources=(os.path.abspath(__file__),),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=tuple({"G": G, "R": R, "Dg": Dg} for G in (8, 16) for R in (512, 1024) for Dg in (1024, 2048)),
    description="WO-A decode (T <= 64): weight-streaming warp-MMA, token-major bf16 out (not yet run)",
))

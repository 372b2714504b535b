"""WO-A at decode T (<= 64 tokens): a weight-streaming split-K kernel, token-major output.

``y[t, g*R + r] = sum_d wo_a[g, r, d] * o[t, g-th head group].flatten()[d]`` (FP32
accumulate, bf16 out), the contract of :func:`cute_kernels.wo_a.wo_a`.

Why a second kernel: at decode T the product is ``G`` skinny GEMMs ``[T, Dg] x [Dg, R]``
whose time is the read of the weights (8-64 MB); the TMA/wgmma engine's 64-128-row M tiles
are mostly padding there and its grid has too few CTAs to keep 132 SMs streaming (H200:
36-72% of 4.3 TB/s).

Schedule. One CTA owns ``bn`` (64 or 32) output columns of one group and a 1/``splits`` slice
of K: it streams ``wo_a[g, r0:r0+bn, k-slice]`` through a ``stages``-deep cp.async pipeline
(``bn`` x 128 bf16 per stage, padded shared rows for conflict-free ldmatrix) with the live token
rows of ``o``; warp ``mma.sync m16n8k16`` accumulates in FP32. The token tile ``bm`` is 16 for
T <= 16 (warps side by side along N: 4x less MMA work than a 64-row tile, whose padding made
the first version compute-bound -- 24-53% of the copy bandwidth -- and 87 KB of shared memory,
so 2 CTAs per SM), 32 for T <= 32 (the same warps, two m16 row blocks each) or 64. With
``splits > 1`` each CTA writes its FP32 partial ``[T, bn]`` to a workspace and the last CTA of
the tile (acq_rel counter, as in :mod:`cute_kernels.mhc_stats`) sums the splits in a fixed
order -- deterministic -- rounds to bf16 once, stores token-major and re-zeroes the counter
(graph replays need no reset). :func:`plan` picks the configuration:
the weights stream at the copy bandwidth only with enough bytes in flight on every SM, so one
CTA per SM with a deep pipeline, or two co-resident with 4 stages where the column tiles alone
fill two per SM.

Constraints: T <= 64, R % bn == 0, Dg % 128 == 0, splits a power of two dividing Dg / 128,
shared memory (``smem_bytes``) <= 227 KB.
Run: ``pytest tests/test_wo_a.py -k decode``; bench: ``python bench/bench_wo_a.py``.
"""

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import jit
from .grid_sync import last_arrival
from .warp_mma import ldmatrix_operands

BN, BK = 64, 128
#: the column tiles a CTA may own; the narrow one also sizes the workspace's tile counters
BN_NARROW = 32
PITCH = BK + 8
STAGES = 4
SMEM_PER_CTA = 227 * 1024  # sm_90 / sm_100 opt-in maximum per block
VEC = 8
MAX_T = 64


class WoADecode:
    def __init__(self, G: int, R: int, Dg: int, bm: int = 64, splits: int = 1, pdl: bool = False,
                 stages: int = STAGES, bn: int = BN):
        self.G, self.R, self.Dg, self.bm, self.splits, self.pdl = G, R, Dg, bm, splits, pdl
        self.stages, self.bn = stages, bn
        self.bk = BK  # the K slice issue_o loads (the FP8 subclass widens it)
        # 4 warps -- bm = 16 / 32: side by side along N (bm x bn/4 each); bm = 64: 2 x 2
        # (32 x bn/2).
        self.threads = 128
        self.warp_layout = (1, 4, 1) if bm < 64 else (2, 2, 1)

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, part_ptr: cute.Pointer,
                 count_ptr: cute.Pointer, num_tokens: Int32, stream: cuda.CUstream):
        G, R, Dg = self.G, self.R, self.Dg
        mO = cute.make_tensor(o_ptr, cute.make_layout((num_tokens, G * Dg), stride=(G * Dg, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((G * R, Dg), stride=(Dg, 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, G * R), stride=(G * R, 1)))
        mPart = cute.make_tensor(part_ptr, cute.make_layout((self.splits, num_tokens, G * R),
                                                            stride=(num_tokens * G * R, G * R, 1)))
        mCount = cute.make_tensor(count_ptr, cute.make_layout((G * R // self.bn,)))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout(self.warp_layout))
        self.kernel(mO, mW, mY, mPart, mCount, tiled_mma, num_tokens).launch(
            grid=[R // self.bn, G, self.splits], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def tensor_call(self, mO: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mPart: cute.Tensor, mCount: cute.Tensor,
                    stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mO [T, H, Dv]`` (H * Dv = G * Dg:
        checked by the caller), ``mW [G, R, Dg]``, ``mY [T, G * R]``, the workspace's
        ``mPart`` / ``mCount`` (1-D, their lengths checked by the caller)."""
        self.__call__(mO.iterator, mW.iterator, mY.iterator, mPart.iterator, mCount.iterator, mO.shape[0], stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mPart: cute.Tensor, mCount: cute.Tensor,
               tiled_mma: cute.TiledMma, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, g, z = cute.arch.block_idx()
        bf16 = cutlass.BFloat16
        BM = self.bm
        r0 = nt * self.bn
        KT = self.Dg // BK // self.splits  # K slices of this split
        kt0 = z * KT
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(bf16, cute.make_layout((BM, BK, self.stages), stride=(PITCH, 1, BM * PITCH)), 16)
        sB = smem.allocate_tensor(bf16, cute.make_layout((self.bn, BK, self.stages),
                                                         stride=(PITCH, 1, self.bn * PITCH)), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), bf16, num_bits_per_copy=128)
        gOv = cute.zipped_divide(mO, (1, VEC))
        gWv = cute.zipped_divide(mW, (1, VEC))
        sAv = cute.zipped_divide(sA, (1, VEC, 1))
        sBv = cute.zipped_divide(sB, (1, VEC, 1))
        a_col0 = g * (self.Dg // VEC)  # group g's columns of o, in 16-byte vectors
        w_row0 = g * self.R + r0

        if cutlass.const_expr(self.pdl):
            # Programmatic dependent launch: the weights do not depend on the kernel before
            # this one, so the first stages' weight tiles stream in while it finishes; `o`
            # (its output) and every store of this kernel wait for its grid to complete and
            # flush. One commit group for the whole prologue plus empty ones keeps the main
            # loop's wait_group(stages - 2) count.
            for s0 in cutlass.range_constexpr(self.stages - 1):
                if s0 < KT:
                    self.issue_w(gWv, sBv, atom, kt0 + s0, s0, w_row0)
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
            for s0 in cutlass.range_constexpr(self.stages - 1):
                if s0 < KT:
                    self.issue_o(gOv, sAv, atom, kt0 + s0, s0, a_col0, num_tokens)
            for s0 in cutlass.range_constexpr(self.stages - 1):
                cute.arch.cp_async_commit_group()
        else:
            for s0 in cutlass.range_constexpr(self.stages - 1):
                if s0 < KT:
                    self.issue(gOv, gWv, sAv, sBv, atom, kt0 + s0, s0, a_col0, w_row0, num_tokens)
                cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[None, None, None, 0])
        cC = cute.make_identity_tensor((BM, self.bn))
        tCcC = thr_mma.partition_C(cC)
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, self.bn)))
        acc.fill(0.0)
        s2r_A, tAsA, tArA, s2r_B, tBsB, tBrB = ldmatrix_operands(tiled_mma, bf16, tidx, sA, sB, tCrA, tCrB)

        for kt in cutlass.range(0, KT, 1):
            slot = kt % self.stages
            cute.arch.cp_async_wait_group(self.stages - 2)
            # K slice kt has landed for all threads' copies; every warp is done with kt-1.
            cute.arch.barrier()
            if kt + self.stages - 1 < KT:
                nxt = kt + self.stages - 1
                self.issue(gOv, gWv, sAv, sBv, atom, kt0 + nxt, nxt % self.stages, a_col0, w_row0,
                           num_tokens)
            cute.arch.cp_async_commit_group()
            for kb in cutlass.range_constexpr(BK // 16):
                cute.copy(s2r_A, tAsA[None, None, kb, slot], tArA[None, None, kb])
                cute.copy(s2r_B, tBsB[None, None, kb, slot], tBrB[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

        self.store_tile(acc, tCcC, mY, mPart, mCount, sFlag, num_tokens)

    @cute.jit
    def store_tile(self, acc: cute.Tensor, tCcC: cute.Tensor, mY: cute.Tensor, mPart: cute.Tensor,
                   mCount: cute.Tensor, sFlag: cute.Tensor, num_tokens: Int32):
        """The CTA's FP32 accumulators (token rows x ``bn`` columns) -> token-major bf16 ``y``:
        directly without a split, else through the FP32 partials and the tile's last split."""
        tidx, _, _ = cute.arch.thread_idx()
        nt, g, z = cute.arch.block_idx()
        col0 = g * self.R + nt * self.bn
        if cutlass.const_expr(self.splits == 1):
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                if m < num_tokens:
                    mY[m, col0 + n] = acc[i].to(cutlass.BFloat16)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, n = tCcC[i]
                if m < num_tokens:
                    mPart[z, m, col0 + n] = acc[i]
            # The last split of the tile sees every split's partials (cute_kernels.grid_sync).
            tile = g * (self.R // self.bn) + nt
            if last_arrival(mCount.iterator + tile, sFlag, self.splits):
                for idx in cutlass.range(tidx, num_tokens * self.bn, self.threads):
                    m = idx // self.bn
                    n = idx - m * self.bn
                    s = Float32(0.0)
                    for zz in cutlass.range_constexpr(self.splits):  # fixed order: deterministic
                        s = s + mPart[zz, m, col0 + n]
                    mY[m, col0 + n] = s.to(cutlass.BFloat16)
                if tidx == 0:
                    mCount[tile] = 0  # ready for the next launch (graph replay needs no host reset)

    @cute.jit
    def issue(self, gOv: cute.Tensor, gWv: cute.Tensor, sAv: cute.Tensor, sBv: cute.Tensor, atom: cute.CopyAtom,
              kt: Int32, slot: Int32, a_col0: Int32, w_row0: Int32, num_tokens: Int32):
        """cp.async K slice kt: the live token rows of o (group g's columns) and 64 weight rows."""
        self.issue_o(gOv, sAv, atom, kt, slot, a_col0, num_tokens)
        self.issue_w(gWv, sBv, atom, kt, slot, w_row0)

    @cute.jit
    def issue_o(self, gOv: cute.Tensor, sAv: cute.Tensor, atom: cute.CopyAtom, kt: Int32, slot: Int32,
                a_col0: Int32, num_tokens: Int32):
        """cp.async the live token rows of o's K slice kt (``self.bk`` wide) into stage ``slot``."""
        tidx, _, _ = cute.arch.thread_idx()
        VPR = self.bk // VEC
        for i in cutlass.range_constexpr(self.bm * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            if r < num_tokens:
                cute.copy(atom, gOv[(0, None), (r, a_col0 + kt * VPR + v)], sAv[(0, None, 0), (r, v, slot)])

    @cute.jit
    def issue_w(self, gWv: cute.Tensor, sBv: cute.Tensor, atom: cute.CopyAtom, kt: Int32, slot: Int32,
                w_row0: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        VPR = BK // VEC
        for i in cutlass.range_constexpr(self.bn * VPR // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR, idx % VPR
            cute.copy(atom, gWv[(0, None), (w_row0 + r, kt * VPR + v)], sBv[(0, None, 0), (r, v, slot)])

    @staticmethod
    def can_implement(T: int, G: int, R: int, Dg: int, splits: int = 1, bn: int = BN) -> bool:
        kt = Dg // BK if Dg % BK == 0 else 0
        return (1 <= T <= MAX_T and G >= 1 and bn in (BN_NARROW, BN) and R % bn == 0 and kt >= 1 and splits >= 1
                and splits & (splits - 1) == 0 and kt % splits == 0)


#: pipeline depth of the 16-row tile where its CTAs fit one wave (``stages - 1`` K slices in flight)
DEEP_STAGES = 6


def plan(T: int, G: int, R: int, Dg: int, num_sms: int = 132) -> dict:
    """The compile configuration ``{bm, bn, splits, stages}`` of a decode call.

    The weights stream at the copy bandwidth only with enough bytes in flight on every SM.
    With the 16-row token tile (T <= 16): 32-column tiles where they fit one wave two per SM
    (G * R <= 9292 on 132 SMs; 6 stages are 78 KB), else 64-column tiles, 4 stages (two 87 KB
    CTAs per SM) where they fill two per SM and 6 where each has its SM alone; K splits only to reach one
    CTA per SM, and only while the FP32 partials (written and read once: 8 * splits * T bytes
    per weight row of Dg * 2 bytes) stay under 1/4 of the weight bytes (16 * splits * T <= Dg).
    The 32-row tile (17 <= T <= 32, only with ``decode_kernel=True``): 32-column tiles at 4
    stages only where 64-column ones would leave SMs idle, else 64 columns at 6 stages where
    they fit one wave. The 64-row tile (T > 32) keeps 64 columns and 4 stages. Each choice was
    the fastest of the configs timed on the H200 at its shapes (docs/wo_a.md)."""
    bm = 16 if T <= 16 else 32 if T <= 32 else 64
    if bm == 32:
        bn = BN_NARROW if G * R // BN < num_sms * 0.9 and R % BN_NARROW == 0 else BN
        tiles = G * R // bn
        deep = bn == BN and tiles <= num_sms * 1.1
        return {"bm": bm, "bn": bn, "splits": 1, "stages": max(min(DEEP_STAGES, Dg // BK + 1), 2) if deep else STAGES}
    bn = BN_NARROW if bm == 16 and G * R // BN_NARROW <= 2 * num_sms * 1.1 and R % BN_NARROW == 0 else BN
    tiles = G * R // bn
    splits = 1
    while (tiles * splits * 2 <= num_sms * 1.1 and Dg // BK % (splits * 2) == 0
           and 16 * splits * 2 * T <= Dg):
        splits *= 2
    deep = bm == 16 and (bn == BN_NARROW or tiles * splits <= num_sms * 1.1)
    stages = min(DEEP_STAGES, Dg // BK // splits + 1) if deep else STAGES
    return {"bm": bm, "bn": bn, "splits": splits, "stages": max(stages, 2)}


class WoADecodeWorkspace:
    """FP32 split partials for up to 64 tokens and one counter per column tile (self-resetting).
    One in flight at a time: concurrent calls on different streams need their own."""

    def __init__(self, G: int, R: int, max_splits: int = 8, device="cuda"):
        self.G, self.R, self.max_splits = G, R, max_splits
        self.partials = torch.empty(max_splits * MAX_T * G * R, dtype=torch.float32, device=device)
        self.counters = torch.zeros(G * R // BN_NARROW, dtype=torch.int32, device=device)


def smem_bytes(bm: int, stages: int, bn: int = BN) -> int:
    """Shared memory of one CTA: the padded o and weight stages plus the last-arrival flag."""
    return stages * (bm + bn) * PITCH * 2 + 16


def _build(arch: str, *, G: int, R: int, Dg: int, bm: int = 64, splits: int = 1, pdl: bool = False,
           stages: int = STAGES, bn: int = BN):
    """``pdl``: launched as a programmatic dependent of the previous kernel on the stream
    (weight prefetch overlaps its tail); the same results, a separate compile. ``stages``: the
    cp.async pipeline depth (``stages - 1`` K slices in flight per CTA). ``bn``: the weight rows
    (output columns) of a CTA, 64 or 32."""
    if bm not in (16, 32, 64) or not WoADecode.can_implement(1, G, R, Dg, splits, bn):
        raise ValueError(f"wo_a_decode: unsupported G={G}, R={R}, Dg={Dg}, bm={bm}, bn={bn}, splits={splits} "
                         f"(bn 32 or 64 dividing R, Dg % 128, splits a power of two dividing Dg / 128, "
                         f"bm 16, 32 or 64)")
    if stages < 2 or smem_bytes(bm, stages, bn) > SMEM_PER_CTA:
        need = smem_bytes(bm, stages, bn)
        raise ValueError(f"wo_a_decode: stages={stages} with bm={bm} bn={bn} needs {need} B "
                         f"of shared memory; 2 <= stages and at most {SMEM_PER_CTA} B")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 4), P(Float32, 4), P(Int32, 4),
            Int32(1), jit.fake_stream())
    return WoADecode(G, R, Dg, bm, splits, pdl, stages, bn), args


def _build_tensors(arch: str, *, G: int, R: int, Dg: int, bm: int = 64, splits: int = 1, stages: int = STAGES,
                   bn: int = BN):
    op, _ = _build(arch, G=G, R=R, Dg=Dg, bm=bm, splits=splits, stages=stages, bn=bn)
    sym, bf, T = {}, cutlass.BFloat16, jit.fake_tensor
    args = (T(bf, ("T", "H", "Dv"), 16, sym), T(bf, (G, R, Dg), 16, sym), T(bf, ("T", G * R), 4, sym),
            T(Float32, ("P",), 4, sym), T(Int32, ("C",), 4, sym), jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="wo_a_decode",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("wo_a_decode.py", "grid_sync.py", "warp_mma.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    # the configs wo_a()'s default route takes are set by cute_kernels.wo_a (the router sits
    # above this kernel); imported alone, nothing is built ahead of time
    aot_configs=lambda arch: (),
    description="WO-A decode (T <= 64): weight-streaming split-K warp-MMA, token-major bf16 out",
))
jit.register_tensor_entry(KERNEL, _build_tensors)  # its AOT configs: cute_kernels.wo_a's routes

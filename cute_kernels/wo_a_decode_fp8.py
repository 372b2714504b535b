"""WO-A with FP8 weights: e4m3 ``wo_a`` with one FP32 scale per 128 x 128 block (the checkpoint format).

    y[t, g*R + r] = bf16( sum_kb scale[g, r // 128, kb] * sum_{k in block kb} o[t, g, k] * w[g, r, k] )

over ``o [T, H, Dv]`` (bf16; group g's K = (H/G)*Dv columns), ``w [G, R, Dg]`` (float8_e4m3fn)
and ``scale [G, R/128, Dg/128]`` (FP32): products and sums in FP32, one bf16 rounding at the
end -- :func:`wo_a_fp8_reference` (and the tests' FP32 einsum on the dequantised weights) is
the spec. The weight bytes, which bound decode T, halve against bf16 WO-A.

Schedule: :mod:`cute_kernels.wo_a_decode`'s, on half the weight bytes. One CTA owns ``bn`` (32
or 64) weight rows of one group -- inside one 128-row scale block -- and a 1/``splits`` slice
of K, streamed in ``bk``-wide K slices (128 or 256: one or two scale blocks along K, so a CTA
has one scale per block of a slice) through a ``stages``-deep cp.async pipeline; the CTA's
scales are staged in shared memory once, behind the prologue's loads. Each thread widens its
own MMA fragments in registers (every e4m3 value is exact in bf16) -- through the conversion
instructions (``widen="cvt"``, the default) or by bit patterns (``"bits"``:
:mod:`.e4m3_widen`, integer operations and a bf16 multiply, no conversion instruction; an
opt-in compile option until measured against the default): both operands are read
through one K permutation (:func:`k_permutation`) that makes a lane's values over four k-steps
16 contiguous weight bytes and 16 contiguous o elements -- one 16-byte shared load each (two
for o) -- so a slice needs no bf16 buffer and one barrier. The warps' ``mma.sync m16n8k16``
accumulate each scale block of the slice in FP32 from zero, and the block's sum is added to
the FP32 accumulator times its scale -- the FP32 promotion of block-scaled FP8 GEMMs
(DeepSeek-V3), so no scale ever rounds through bf16. The o loads, the split partials and the
last-CTA reduction are the bf16 kernel's (this class derives from it).

Above decode T (T > 64) :func:`wo_a_fp8` widens the weights once per call
(:mod:`cute_kernels.dequant_fp8_blockwise`, into a reused bf16 buffer) and runs bf16 WO-A
(:func:`cute_kernels.wo_a.wo_a`): there the GEMM is compute bound and the widening costs one
pass over the weights. The widened weight is exact for power-of-two (UE8M0) scales, the
format of DeepSeek-V4-Flash / -Pro; with FP32 scales (V4-Flash-Base) each weight is rounded
once to bf16 (2^-9 relative) -- the one numerical difference from the decode kernel, which
keeps every scale in FP32. :func:`checkpoint_scales_fp32` turns a checkpoint's UE8M0 scales
into the FP32 ones this module takes (exactly, once at load time).

Constraints: decode kernel T <= 64 (``bm`` 16, 32 or 64), R % 128 == 0, Dg % 128 == 0, splits
a power of two dividing Dg / 128, shared memory <= 227 KB; any T through :func:`wo_a_fp8`.
Hopper and Blackwell (warp MMA; the widened path takes each arch's WO-A engine).

Status: H200-tested (``pytest tests/test_wo_a_fp8.py -m gpu``), benched (``python
bench/bench_wo_a_fp8.py``). Blackwell: compile + SASS only.
"""

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from . import jit
from .e4m3_widen import e4m3x2_to_bf16x2
from .validate import check_cuda, check_tensor
from .wo_a_decode import BN, BN_NARROW, SMEM_PER_CTA, VEC, WoADecode, WoADecodeWorkspace, plan as bf16_plan

#: the weights' scale block (rows and K)
SCALE_BLOCK = 128
#: K slice widths: one scale block, or two (the bf16 kernel's 256 bytes per weight row)
BKS = (128, 256)
#: the weights' e4m3 -> bf16 routes in registers (:meth:`WoADecodeFp8.widen_fragment`)
WIDEN = ("cvt", "bits")
#: e4m3 elements per 16-byte cp.async
VEC8 = 16
MAX_T = 64


def pitches(bk: int) -> tuple[int, int]:
    """Padded shared rows of a K slice: bf16 elements (8 of pad: conflict-free 16-byte loads of
    the permuted fragments) and e4m3 bytes (64 of pad: the 8 lanes of a 16-byte load phase read
    two rows' first 64 bytes, and a pitch of 64 mod 128 puts them in disjoint banks)."""
    return bk + 8, bk + 64


def smem_bytes(bm: int, stages: int, bn: int = BN, bk: int = 128, Dg: int = 2048) -> int:
    """The o stages (bf16), the e4m3 weight stages, the flag and a CTA's scales (at most Dg / 128)."""
    pitch, pitch8 = pitches(bk)
    return stages * (bm * pitch * 2 + bn * pitch8) + 16 + 4 * (Dg // SCALE_BLOCK) + 16


def k_permutation(bk: int) -> tuple[tuple, tuple]:
    """(shape, stride) of the K mode: the MMAs' K order inside each 64-wide chunk of a slice, a
    map from the m16n8k16 fragments' logical k to the shared column: logical ``k = 16 s + 8 b1 + 2 q + b0`` (k-step
    s, quad lane q) reads column ``16 q + 4 s + 2 b1 + b0``. Both operands take the same
    permutation, so the dot products are unchanged; what it buys is that a lane's values of the
    four k-steps are 16 contiguous weight bytes and 16 contiguous o elements -- one 128-bit
    shared load (two for o) instead of per-pair loads."""
    return (2, 4, 2, 4, bk // 64), (1, 16, 2, 4, 64)


class WoADecodeFp8(WoADecode):
    """The bf16 decode kernel's configuration (its warps side by side along N for bm = 16 / 32)
    with a ``bk``-wide K slice; its o loads (``issue_o``) and its token-major store through the
    split partials (``store_tile``) are the bf16 kernel's."""

    def __init__(self, G: int, R: int, Dg: int, bm: int = 16, splits: int = 1, stages: int = 4, bn: int = BN,
                 bk: int = 128, widen: str = "cvt"):
        super().__init__(G, R, Dg, bm, splits, False, stages, bn)
        self.bk, self.widen = bk, widen

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, scale_ptr: cute.Pointer, y_ptr: cute.Pointer,
                 part_ptr: cute.Pointer, count_ptr: cute.Pointer, num_tokens: Int32, stream: cuda.CUstream):
        G, R, Dg = self.G, self.R, self.Dg
        mO = cute.make_tensor(o_ptr, cute.make_layout((num_tokens, G * Dg), stride=(G * Dg, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((G * R, Dg), stride=(Dg, 1)))
        kb = Dg // SCALE_BLOCK
        mScale = cute.make_tensor(scale_ptr, cute.make_layout((G * R // SCALE_BLOCK, kb), stride=(kb, 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, G * R), stride=(G * R, 1)))
        mPart = cute.make_tensor(part_ptr, cute.make_layout((self.splits, num_tokens, G * R),
                                                            stride=(num_tokens * G * R, G * R, 1)))
        mCount = cute.make_tensor(count_ptr, cute.make_layout((G * R // self.bn,)))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                                        cute.make_layout(self.warp_layout))
        self.kernel(mO, mW, mScale, mY, mPart, mCount, tiled_mma, num_tokens).launch(
            grid=[R // self.bn, G, self.splits], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tensor_call(self, mO: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor, mY: cute.Tensor, mPart: cute.Tensor,
                    mCount: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mO [T, H, Dv]`` (H * Dv = G * Dg:
        checked by the caller), ``mW [G, R, Dg]`` e4m3, ``mScale [G, R / 128, Dg / 128]`` FP32,
        ``mY [T, G * R]``, the workspace's ``mPart`` / ``mCount`` (1-D, their lengths checked
        by the caller)."""
        self.__call__(mO.iterator, mW.iterator, mScale.iterator, mY.iterator, mPart.iterator, mCount.iterator,
                      mO.shape[0], stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor, mY: cute.Tensor, mPart: cute.Tensor,
               mCount: cute.Tensor, tiled_mma: cute.TiledMma, num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, g, z = cute.arch.block_idx()
        bf16, f8 = cutlass.BFloat16, cutlass.Float8E4M3FN
        BM = self.bm
        r0 = nt * self.bn
        BK = self.bk
        PITCH, PITCH8 = pitches(BK)
        KT = self.Dg // BK // self.splits  # K slices of this split
        kt0 = z * KT
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(bf16, cute.make_layout((BM, BK, self.stages), stride=(PITCH, 1, BM * PITCH)), 16)
        sW8 = smem.allocate_tensor(f8, cute.make_layout((self.bn, BK, self.stages),
                                                        stride=(PITCH8, 1, self.bn * PITCH8)), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        blocks = BK // SCALE_BLOCK  # scale blocks along K in a slice
        sScale = smem.allocate_tensor(Float32, cute.make_layout((KT * blocks,)), 16)
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), bf16, num_bits_per_copy=128)
        atom8 = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), f8, num_bits_per_copy=128)
        gOv = cute.zipped_divide(mO, (1, VEC))
        gWv = cute.zipped_divide(mW, (1, VEC8))
        sAv = cute.zipped_divide(sA, (1, VEC, 1))
        sW8v = cute.zipped_divide(sW8, (1, VEC8, 1))
        a_col0 = g * (self.Dg // VEC)  # group g's columns of o, in 16-byte vectors
        w_row0 = g * self.R + r0
        scale_row = w_row0 // SCALE_BLOCK

        for s0 in cutlass.range_constexpr(self.stages - 1):
            if s0 < KT:
                self.issue_fp8(gOv, gWv, sAv, sW8v, atom, atom8, kt0 + s0, s0, a_col0, w_row0, num_tokens)
            cute.arch.cp_async_commit_group()
        # this CTA's scales, staged once, behind the prologue's loads: read from global memory
        # inside the slice loop, each would put a dependent load's latency between two barriers
        # on every slice (the first slice's barrier makes these stores visible)
        for i in cutlass.range_constexpr((KT * blocks + self.threads - 1) // self.threads):
            idx = tidx + i * self.threads
            if idx < KT * blocks:
                sScale[idx] = mScale[scale_row, kt0 * blocks + idx]

        thr_mma = tiled_mma.get_slice(tidx)
        cC = cute.make_identity_tensor((BM, self.bn))
        tCcC = thr_mma.partition_C(cC)
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, self.bn)))
        acc.fill(0.0)
        part = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, self.bn)))  # a scale block's sum
        # both operands seen through the K permutation: each thread's fragments of a slice are
        # 16-byte runs of shared memory (see k_permutation)
        kshape, kstride = k_permutation(BK)
        sAp = cute.make_tensor(sA.iterator, cute.make_layout((BM, kshape, self.stages),
                                                             stride=(PITCH, kstride, BM * PITCH)))
        sW8p = cute.make_tensor(sW8.iterator, cute.make_layout((self.bn, kshape, self.stages),
                                                               stride=(PITCH8, kstride, self.bn * PITCH8)))
        tCsA = thr_mma.partition_A(sAp)
        tCsB8 = thr_mma.partition_B(sW8p)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sW8p[None, None, 0]))
        rA = cute.make_fragment_like(tCsA[None, None, None, 0])  # in shared-memory order
        rB8 = cute.make_fragment_like(tCsB8[None, None, None, 0])

        for kt in cutlass.range(0, KT, 1):
            slot = kt % self.stages
            cute.arch.cp_async_wait_group(self.stages - 2)
            # K slice kt has landed for all threads' copies; every warp is done with slice kt-1
            cute.arch.barrier()
            if kt + self.stages - 1 < KT:
                nxt = kt + self.stages - 1
                self.issue_fp8(gOv, gWv, sAv, sW8v, atom, atom8, kt0 + nxt, nxt % self.stages, a_col0, w_row0,
                               num_tokens)
            cute.arch.cp_async_commit_group()
            cute.autovec_copy(tCsA[None, None, None, slot], rA)
            cute.autovec_copy(tCsB8[None, None, None, slot], rB8)
            tCrA.store(rA.load())
            self.widen_fragment(rB8, tCrB)
            for h in cutlass.range_constexpr(blocks):
                scale = sScale[kt * blocks + h]
                part.fill(0.0)
                for kb in cutlass.range_constexpr(h * SCALE_BLOCK // 16, (h + 1) * SCALE_BLOCK // 16):
                    cute.gemm(tiled_mma, part, tCrA[None, None, kb], tCrB[None, None, kb], part)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + scale * part[i]  # the FP32 promotion: one scale per block

        self.store_tile(acc, tCcC, mY, mPart, mCount, sFlag, num_tokens)

    def widen_fragment(self, rB8: cute.Tensor, tCrB: cute.Tensor):
        """The thread's e4m3 weight fragment into its bf16 MMA fragment, exactly: through the
        conversion instructions (``widen="cvt"``) or by bit patterns (``"bits"``,
        :mod:`.e4m3_widen`: one word of four weights into two bf16x2 registers -- both
        fragments have one layout, so word i holds elements 4i .. 4i + 3 of each). Called while
        the kernel is traced."""
        if self.widen == "cvt":
            tCrB.store(rB8.load().to(Float32).to(cutlass.BFloat16))  # exact: every e4m3 value is a bf16
            return
        if str(rB8.layout) != str(tCrB.layout):
            raise ValueError(f"wo_a_decode_fp8: widen='bits' needs one layout for the e4m3 and bf16 fragments, "
                             f"got {rB8.layout} and {tCrB.layout}")
        words = cute.recast_tensor(rB8, Uint32)
        pairs = cute.recast_tensor(tCrB, Uint32)
        for i in range(cute.size(words)):
            w = words[i]
            pairs[2 * i] = e4m3x2_to_bf16x2(w, 0)
            pairs[2 * i + 1] = e4m3x2_to_bf16x2(w, 1)

    @cute.jit
    def issue_fp8(self, gOv: cute.Tensor, gWv: cute.Tensor, sAv: cute.Tensor, sW8v: cute.Tensor,
                  atom: cute.CopyAtom, atom8: cute.CopyAtom, kt: Int32, slot: Int32, a_col0: Int32, w_row0: Int32,
                  num_tokens: Int32):
        """cp.async K slice kt: the live token rows of o (bf16) and the CTA's e4m3 weight rows."""
        self.issue_o(gOv, sAv, atom, kt, slot, a_col0, num_tokens)
        tidx, _, _ = cute.arch.thread_idx()
        VPR8 = self.bk // VEC8
        for i in cutlass.range_constexpr(self.bn * VPR8 // self.threads):
            idx = tidx + i * self.threads
            r, v = idx // VPR8, idx % VPR8
            cute.copy(atom8, gWv[(0, None), (w_row0 + r, kt * VPR8 + v)], sW8v[(0, None, 0), (r, v, slot)])

    @staticmethod
    def can_implement(T: int, G: int, R: int, Dg: int, splits: int = 1, bn: int = BN, bk: int = 128) -> bool:
        kt = Dg // bk if bk in BKS and Dg % bk == 0 else 0
        return (1 <= T <= MAX_T and G >= 1 and bn in (BN_NARROW, BN) and R % SCALE_BLOCK == 0 and kt >= 1
                and splits >= 1 and splits & (splits - 1) == 0 and kt % splits == 0)


def plan(T: int, G: int, R: int, Dg: int, num_sms: int = 132) -> dict:
    """``{bm, bn, splits, stages}``: the bf16 decode kernel's plan (its tiles, splits and depth;
    not yet tuned for the halved weight bytes)."""
    return bf16_plan(T, G, R, Dg, num_sms)


#: (G, R, Dg) of the AOT build at every decode T: DeepSeek-V4-Flash and -Pro first
AOT_SHAPES = ((8, 1024, 4096), (16, 1024, 4096), (16, 1024, 1024), (8, 512, 2048))


def aot_configs(shapes=AOT_SHAPES, num_sms: int = 132) -> tuple[dict, ...]:
    """Every distinct config :func:`plan` gives for T = 1 .. 64 of ``shapes``."""
    seen = {}
    for G, R, Dg in shapes:
        for T in range(1, MAX_T + 1):
            cfg = {"G": G, "R": R, "Dg": Dg, **plan(T, G, R, Dg, num_sms)}
            seen.setdefault(tuple(sorted(cfg.items())), cfg)
    return tuple(seen.values())


def _build(arch: str, *, G: int, R: int, Dg: int, bm: int = 16, splits: int = 1, stages: int = 4, bn: int = BN,
           bk: int = 128, widen: str = "cvt"):
    """``bk``: the K slice, 128 (one scale block) or 256 (two: the bf16 kernel's bytes per
    weight row and slice, half the slices). ``widen``: the weights' e4m3 -> bf16 route,
    ``"cvt"`` (conversion instructions) or ``"bits"`` (:mod:`.e4m3_widen`: integer operations
    and a bf16 multiply; e4m3 NaN codes become +-480)."""
    if widen not in WIDEN:
        raise ValueError(f"wo_a_decode_fp8: widen={widen!r}, expected one of {WIDEN}")
    if bm not in (16, 32, 64) or not WoADecodeFp8.can_implement(1, G, R, Dg, splits, bn, bk):
        raise ValueError(f"wo_a_decode_fp8: unsupported G={G}, R={R}, Dg={Dg}, bm={bm}, bn={bn}, splits={splits}, "
                         f"bk={bk} (bm 16, 32 or 64, bn 32 or 64, bk 128 or 256 dividing Dg, R % 128, splits a power "
                         f"of two dividing Dg / bk)")
    if stages < 2 or smem_bytes(bm, stages, bn, bk, Dg) > SMEM_PER_CTA:
        raise ValueError(f"wo_a_decode_fp8: stages={stages} with bm={bm} bn={bn} bk={bk} needs "
                         f"{smem_bytes(bm, stages, bn, bk, Dg)} B of shared memory; 2 <= stages and at most "
                         f"{SMEM_PER_CTA} B")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.Float8E4M3FN, 16), P(Float32, 4), P(cutlass.BFloat16, 4),
            P(Float32, 4), P(Int32, 4), Int32(1), jit.fake_stream())
    return WoADecodeFp8(G, R, Dg, bm, splits, stages, bn, bk, widen), args


def _build_tensors(arch: str, *, G: int, R: int, Dg: int, bm: int = 16, splits: int = 1, stages: int = 4,
                   bn: int = BN, bk: int = 128, widen: str = "cvt"):
    op, _ = _build(arch, G=G, R=R, Dg=Dg, bm=bm, splits=splits, stages=stages, bn=bn, bk=bk, widen=widen)
    sym, T = {}, jit.fake_tensor
    args = (T(cutlass.BFloat16, ("T", "H", "Dv"), 16, sym), T(cutlass.Float8E4M3FN, (G, R, Dg), 16, sym),
            T(Float32, (G, R // SCALE_BLOCK, Dg // SCALE_BLOCK), 4, sym), T(cutlass.BFloat16, ("T", G * R), 4, sym),
            T(Float32, ("P",), 4, sym), T(Int32, ("C",), 4, sym), jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="wo_a_decode_fp8",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("wo_a_decode_fp8.py", "wo_a_decode.py", "grid_sync.py", "warp_mma.py", "e4m3_widen.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=lambda arch: aot_configs(),
    description="WO-A decode (T <= 64) with e4m3 weights and 128x128 block scales, token-major bf16 out",
))
jit.register_tensor_entry(KERNEL, _build_tensors, aot_configs=KERNEL.aot_configs)
#: (o.shape, w.shape, device index) -> the tensor entry (jit.launch_tensor_entry), filled by a
#: first validated call at T <= 64 with TVM-FFI on; that call's workspace under the same key
_TENSOR_FNS: dict = {}
_TENSOR_WORKSPACES: dict = {}


def quantize_wo_a_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 / FP32 ``[G, R, Dg]`` -> (e4m3 ``[G, R, Dg]``, FP32 scales ``[G, R/128, Dg/128]``):
    each 128 x 128 block scaled so its largest magnitude maps to 448 (e4m3's largest finite);
    an all-zero block gets scale 1. Offline (weight preparation), so it checks that every
    weight is finite: a NaN or Inf would poison its whole block's scale."""
    op = "quantize_wo_a_fp8"
    check_tensor(op, "w", w, dtype=(torch.bfloat16, torch.float32), ndim=3, contiguous=True)
    G, R, Dg = w.shape
    if R % SCALE_BLOCK or Dg % SCALE_BLOCK:
        raise ValueError(f"{op}: R={R} and Dg={Dg} must be multiples of {SCALE_BLOCK}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{op}: w has NaN or Inf entries; block-scaled e4m3 weights need finite values")
    blocks = w.float().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(G, R, Dg), scale.contiguous()


def wo_a_fp8_reference(o: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spec in plain PyTorch: per 128 x 128 block, FP32 sums of the e4m3 products times the
    block's scale, summed over K blocks in FP32, one bf16 rounding."""
    T = o.shape[0]
    G, R, Dg = w.shape
    og = o.reshape(T, G, Dg // SCALE_BLOCK, SCALE_BLOCK).float()
    wg = w.float().view(G, R // SCALE_BLOCK, SCALE_BLOCK, Dg // SCALE_BLOCK, SCALE_BLOCK)
    per_block = torch.einsum("tgkd,gbrkd->tgbrk", og, wg)  # [T, G, R/128, 128, K blocks]
    y = (per_block * scale[None, :, :, None, :]).sum(-1)
    return y.reshape(T, G * R).to(torch.bfloat16)


def checkpoint_scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's block scales as the FP32 tensor :func:`wo_a_fp8` takes: FP32 as is; UE8M0
    (``torch.float8_e8m0fnu``, or its exponent bytes as ``torch.uint8``: ``2**(e - 127)``, 255 =
    NaN), the format of DeepSeek-V4-Flash / -Pro's FP8 linears, converted exactly. Load time,
    not per call."""
    op = "checkpoint_scales_fp32"
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype == torch.float32:
        return scale.contiguous()
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"{op}: scale must be float32, float8_e8m0fnu or uint8 (UE8M0 bytes), got {scale.dtype}")
    e = scale.contiguous().view(torch.uint8).to(torch.int32)
    # the bits of 2**(e - 127) as an FP32: exponent field e, mantissa 0 (e = 0: 2**-127, a subnormal)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    out = bits.view(torch.float32).clone()
    out[e == 255] = float("nan")
    return out


_WIDE_WEIGHTS: dict = {}


def _default_wide_weights(device, G: int, R: int, Dg: int) -> torch.Tensor:
    """The bf16 buffer the T > 64 path widens into: one per (device, shape), reused by every
    call (one in flight per stream; create it outside graph capture, e.g. by a warm-up call)."""
    key = (device, G, R, Dg)
    buf = _WIDE_WEIGHTS.get(key)
    if buf is None:
        buf = _WIDE_WEIGHTS[key] = torch.empty(G, R, Dg, dtype=torch.bfloat16, device=device)
    return buf


def wo_a_fp8(o: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None,
             stream=None, arch: str | None = None, workspace: WoADecodeWorkspace | None = None,
             wide_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, G*R]`` (bf16, token-major) from ``o [T, H, Dv]`` (bf16), e4m3 ``w [G, R, (H/G)*Dv]``
    and FP32 ``scale [G, R/128, (H/G)*Dv/128]`` (:func:`quantize_wo_a_fp8` makes both;
    :func:`checkpoint_scales_fp32` converts a checkpoint's UE8M0 scales), any T >= 1, all on
    one CUDA device (as every entry point here); on a GPU this package does not target, the
    PyTorch reference runs.

    T <= 64: the decode kernel (split partials in ``workspace``, as :func:`cute_kernels.wo_a.wo_a`).
    T > 64: the weights widened to bf16 into ``wide_weights`` (``[G, R, Dg]`` bf16; default one
    shared buffer per device and shape), then :func:`cute_kernels.wo_a.wo_a` (its default route)."""
    default_call = stream is None and arch is None and workspace is None
    if (out is not None and default_call and jit.TVM_FFI and isinstance(o, torch.Tensor)
            and isinstance(w, torch.Tensor)):  # the eager hot path (T <= 64)
        key = (o.shape, w.shape, o.get_device())  # (the C checks: dtypes, extents, strides, alignment, device)
        ws = _TENSOR_WORKSPACES.get(key)
        if ws is not None and jit.launch_tensor_entry(_TENSOR_FNS, key, o, w, scale, out, ws.partials, ws.counters):
            return out
    from .arch import current_arch, dispatch, num_sms
    from .dequant_fp8_blockwise import dequantize_fp8_blockwise
    from .wo_a import decode_workspace, group_shapes, wo_a

    op = "wo_a_fp8"
    check_tensor(op, "o", o, dtype=torch.bfloat16, ndim=3, contiguous=True)
    check_tensor(op, "w", w, dtype=torch.float8_e4m3fn, ndim=3, contiguous=True)
    T, H, Dv, G, R, Dg = group_shapes(op, o, w, "w")
    if R % SCALE_BLOCK or Dg % SCALE_BLOCK:
        raise ValueError(f"{op}: R={R} and Dg={Dg} must be multiples of {SCALE_BLOCK} (the scale block)")
    if T * H * Dv >= 2**31 or T * G * R >= 2**31:
        raise ValueError(f"{op}: T={T} tokens: o / out exceed 32-bit indexing")
    check_tensor(op, "scale", scale, dtype=torch.float32, shape=(G, R // SCALE_BLOCK, Dg // SCALE_BLOCK),
                 contiguous=True, align_bytes=4)
    if wide_weights is not None:
        check_tensor(op, "wide_weights", wide_weights, dtype=torch.bfloat16, shape=(G, R, Dg), contiguous=True)
    if out is None:
        out = torch.empty(T, G * R, dtype=torch.bfloat16, device=o.device)
    check_tensor(op, "out", out, dtype=torch.bfloat16, shape=(T, G * R), contiguous=True)
    check_cuda(op, ("o", o), ("w", w), ("scale", scale), ("out", out),
               *((("wide_weights", wide_weights),) if wide_weights is not None else ()))
    a = arch if arch is not None else current_arch(o.device)
    if dispatch(op, ("sm100", "sm90", "reference"), arch=a) == "reference":
        out.copy_(wo_a_fp8_reference(o, w, scale))
        return out
    if T == 0:
        return out
    if T > MAX_T:
        if wide_weights is None:
            wide_weights = _default_wide_weights(o.device, G, R, Dg)
        dequantize_fp8_blockwise(w, scale, out=wide_weights, stream=stream, arch=a)
        return wo_a(o, wide_weights, out=out, stream=stream, arch=a)
    cfg = plan(T, G, R, Dg, num_sms(o.device))
    workspace = decode_workspace(op, workspace, o, G, R, cfg["splits"])
    fn = jit.get_kernel("wo_a_decode_fp8", a, G=G, R=R, Dg=Dg, **cfg)
    P = jit.gmem_ptr
    fn(P(cutlass.BFloat16, o, 16), P(cutlass.Float8E4M3FN, w, 16), P(Float32, scale, 4),
       P(cutlass.BFloat16, out, 4), P(Float32, workspace.partials, 4), P(Int32, workspace.counters, 4), jit.i32(T),
       jit.cu_stream(stream))
    if default_call:  # its tensor entry for the next calls of this shape
        key = (o.shape, w.shape, o.get_device())
        _TENSOR_WORKSPACES[key] = workspace
        jit.remember_tensor_entry(_TENSOR_FNS, key, "wo_a_decode_fp8_tensors", a, G=G, R=R, Dg=Dg, **cfg)
    return out

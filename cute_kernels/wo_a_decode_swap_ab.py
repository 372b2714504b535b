"""WO-A at decode T (<= 64 tokens), Hopper: TMA + wgmma with the weight rows as M ("swap AB").

``y[t, g*R + r] = sum_d wo_a[g, r, d] * o[t, g-th head group].flatten()[d]`` (FP32
accumulate, one bf16 rounding), the contract of :func:`cute_kernels.wo_a.wo_a`.

Why a third WO-A kernel: at decode T the time is the read of the weights (8-64 MB). The
TMA/wgmma engine puts tokens on M, so a 64-row tile is mostly padding and its (T, R) grid
leaves SMs idle (T = 64, G=8 R=512: 64 CTAs); the warp-MMA decode kernel
(:mod:`.wo_a_decode`) streams the weights with 16-byte ``cp.async`` and a CTA barrier per K
slice, and its 64-row token tile is compute-bound. Here, as in :mod:`moe.experts_swap_ab_sm90`:

* a CTA's 64 weight rows are wgmma's **M** (operand A, shared memory) and the live tokens its
  **N** (operand B), ``tok_n`` = 8 / 16 / 32 / 64 wide -- ``m64n{tok_n}k16``, no padding of M;
* both tiles arrive by TMA (``bk``-wide K slices, 128-byte swizzle) through a ``stages``-deep
  mbarrier pipeline: one elected thread issues a whole slice (two instructions), the
  warpgroup consumes. Token rows past T are zero-filled by TMA and never stored;
* no K split: a CTA owns its tile's whole K (a split's partial-sum round trip costs more
  than the SMs it adds win back at every decode shape measured).

Epilogue: the accumulator goes through shared memory (transposed, FP32) so that each
token's 64 output columns are stored contiguously into token-major ``y [T, G*R]``.

``pdl``: a programmatic dependent launch -- the first stages' weight slices are issued before
``griddepcontrol.wait`` (the weights do not depend on the previous kernel); ``o`` and every
store come after it.

Constraints: T <= ``tok_n`` (the host picks ``tok_n`` from T), ``R % 64 == 0``, ``Dg % bk ==
0``, shared memory (:func:`smem_bytes`) <= 227 KB. Hopper only (wgmma); Blackwell keeps its
tcgen05 engine. :func:`cute_kernels.wo_a.route` says where ``wo_a()`` takes it.
Run: ``pytest tests/test_wo_a.py -k swap_ab_decode``.
"""

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from . import jit
from .tma_pipeline import swap_ab_operands, swap_ab_shared_storage, tma_tiles
from .warp_mma import wgmma_fragments
from .wo_a_decode import MAX_T, SMEM_PER_CTA
from .wo_a_sm90 import wo_a_layouts

BM = 64  # weight rows (output columns) per CTA: wgmma M
TOK_N = (8, 16, 32, 64)
BKS = (64, 128)
THREADS = 128


def smem_bytes(tok_n: int, stages: int, bk: int = 64) -> int:
    """Shared memory of one CTA: the swizzled weight and token stages (1 KB aligned), the
    transposed FP32 output tile and the stage mbarriers."""
    return 1024 + stages * (BM + tok_n) * bk * 2 + tok_n * (BM + 1) * 4 + 2 * stages * 8


def group_operand_tiles(tma_w: cute.CopyAtom, mW: cute.Tensor, sW: cute.Tensor, tma_o: cute.CopyAtom,
                        mO: cute.Tensor, sO: cute.Tensor, tile_w: tuple, tile_o: tuple, rt, g):
    """The TMA views of a swap-AB WO-A CTA's operands, per K slice: weight-row tile ``rt`` of
    group ``g`` of ``mW (R, Dg, G)`` and the group's token rows of ``mO (T, Dg, G)`` (tiles
    ``tile_w`` / ``tile_o``; token rows past T are zero-filled by TMA): ``(tWsW, tWgW, tOsO,
    tOgO)``. Called while a kernel is traced (this module's and :mod:`.wo_a_fp8_act_sm90`'s)."""
    gW = cute.local_tile(mW, tile_w, (None, None, None))[(None, None, rt, None, g)]
    gO = cute.local_tile(mO, tile_o, (None, None, None))[(None, None, 0, None, g)]
    return (*tma_tiles(tma_w, sW, gW), *tma_tiles(tma_o, sO, gO))


@cute.jit
def load_k_slice(pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, tma_w: cute.CopyAtom,
                 tWgW: cute.Tensor, tWsW: cute.Tensor, tma_o: cute.CopyAtom, tOgO: cute.Tensor, tOsO: cute.Tensor):
    """K slice ``prod.count`` of both tiles into stage ``prod.index`` (one thread issues; the
    stage's mbarrier counts the bytes)."""
    pipe.producer_acquire(prod)
    kt = prod.count
    cute.copy(tma_w, tWgW[(None, kt)], tWsW[(None, prod.index)], tma_bar_ptr=pipe.producer_get_barrier(prod))
    cute.copy(tma_o, tOgO[(None, kt)], tOsO[(None, prod.index)], tma_bar_ptr=pipe.producer_get_barrier(prod))
    pipe.producer_commit(prod)


@cute.jit
def load_prologue(pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, tma_w: cute.CopyAtom,
                  tWgW: cute.Tensor, tWsW: cute.Tensor, tma_o: cute.CopyAtom, tOgO: cute.Tensor, tOsO: cute.Tensor,
                  n: cutlass.Constexpr, stages: cutlass.Constexpr, pdl: cutlass.Constexpr,
                  warp_idx: Int32, step: cutlass.Constexpr = 1) -> pipeline.PipelineState:
    """The pipeline's first ``n`` K slices of both tiles (warp 0 issues); returns the producer
    state ``n`` slices on from ``prod``, which the caller must take (``prod = load_prologue(...)``:
    an advance inside this function's branches is not seen through the caller's object).
    ``step``: the producer owns every ``step``-th slice and stage from ``prod`` on (warpgroups
    splitting K by turns, :mod:`.wo_a_fp8_act_sm90`); its ``n`` slices are ``prod.count``,
    ``prod.count + step``, ... ``pdl`` (a
    programmatic dependent launch): the weight slices first -- the weights do not depend on the
    kernel before this one -- then, in every thread, ``griddepcontrol`` lets this kernel's own
    dependents launch and waits for the previous grid to complete and flush, and only then the
    token slices (its output) go out; every later access of the kernel follows that wait."""
    if cutlass.const_expr(pdl):
        head = prod.clone()  # (the token slices' producer state: the weights' first slice on)
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(n):
                pipe.producer_acquire(prod)
                cute.copy(tma_w, tWgW[(None, prod.count)], tWsW[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod))
                prod.advance(step)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(n):
                cute.copy(tma_o, tOgO[(None, head.count)], tOsO[(None, head.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(head))
                pipe.producer_commit(head)
                head.advance(step)
    else:
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(n):
                load_k_slice(pipe, prod, tma_w, tWgW, tWsW, tma_o, tOgO, tOsO)
                prod.advance(step)
    return prod


@cute.jit
def store_token_major(acc: cute.Tensor, tCcC: cute.Tensor, sOut: cute.Tensor, mY: cute.Tensor, col0: Int32,
                      num_tokens: Int32, tidx: Int32):
    """The epilogue: the FP32 accumulator of a (BM weight rows, tokens) tile transposed through
    ``sOut`` (token-major, odd pitch: conflict-free) into columns ``col0 ..`` of token-major
    ``mY``, each element rounded once to bf16."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        r, c = tCcC[i]
        sOut[c, r] = acc[i]
    cute.arch.barrier()
    store_tile_rows(sOut, mY, col0, num_tokens, tidx, THREADS)


@cute.jit
def store_tile_rows(sOut: cute.Tensor, mY: cute.Tensor, col0: Int32, num_tokens: Int32, tidx: Int32,
                    threads: cutlass.Constexpr):
    """The transposed tile's live token rows from ``sOut`` into columns ``col0 ..`` of ``mY``
    by the CTA's ``threads`` threads, each element rounded once to bf16."""
    for idx in cutlass.range(tidx, num_tokens * BM, threads):
        c = idx // BM
        r = idx - c * BM
        mY[c, col0 + r] = sOut[c, r].to(cutlass.BFloat16)  # the one bf16 rounding


class WoADecodeSwapAB:
    def __init__(self, G: int, R: int, Dg: int, tok_n: int, stages: int = 4, bk: int = 64, pdl: bool = False):
        self.G, self.R, self.Dg, self.tok_n, self.stages, self.bk, self.pdl = G, R, Dg, tok_n, stages, bk, pdl
        self.tile = (BM, tok_n, bk)
        self.k_tiles = Dg // bk

    @cute.jit
    def __call__(self, o_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        G, R, Dg = self.G, self.R, self.Dg
        bf16 = cutlass.BFloat16
        (sw, dw), (so, do), _ = wo_a_layouts(num_tokens, G, R, Dg, swap_ab=True)
        mW = cute.make_tensor(w_ptr, cute.make_layout(sw, stride=dw))  # (R, Dg, G)
        mO = cute.make_tensor(o_ptr, cute.make_layout(so, stride=do))  # (T, Dg, G)
        mY = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, G * R), stride=(G * R, 1)))

        tiled_mma, w_smem, o_smem, tma_w, tma_tensor_w, tma_o, tma_tensor_o = swap_ab_operands(
            bf16, mW, mO, self.tile, self.stages)
        self.kernel(tiled_mma, tma_w, tma_tensor_w, tma_o, tma_tensor_o, w_smem, o_smem, mY, num_tokens).launch(
            grid=[G * R // BM, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def tensor_call(self, mO: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        """The tensor entry (``jit.get_tensor_kernel``): ``mO [T, H, Dv]`` (H * Dv = G * Dg and
        T <= tok_n: checked by the caller), ``mW [G, R, Dg]``, ``mY [T, G * R]``."""
        self.__call__(mO.iterator, mW.iterator, mY.iterator, mO.shape[0], stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_o: cute.CopyAtom,
               mO: cute.Tensor, w_smem: cute.ComposedLayout, o_smem: cute.ComposedLayout, mY: cute.Tensor,
               num_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bf16 = cutlass.BFloat16
        STAGES, TN, KT = self.stages, self.tok_n, self.k_tiles
        tiles_per_group = self.R // BM
        g = nt // tiles_per_group
        rt = nt - g * tiles_per_group

        sW, sO, sOut, pipe = swap_ab_shared_storage(bf16, w_smem, o_smem, STAGES, self.tile, THREADS // 32)

        # This CTA's 64 weight rows of group g and the group's token rows, in bk-wide K slices.
        tWsW, tWgW, tOsO, tOgO = group_operand_tiles(tma_w, mW, sW, tma_o, mO, sO, (BM, self.bk), (TN, self.bk), rt, g)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        prod = load_prologue(pipe, prod, tma_w, tWgW, tWsW, tma_o, tOgO, tOsO, min(STAGES, KT), STAGES, self.pdl,
                             warp_idx)

        tCrW, tCrO, tCcC, acc = wgmma_fragments(tiled_mma, tidx, sW, sO, (BM, TN))
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        for _ in cutlass.range(KT, unroll=1):
            pipe.consumer_wait(cons)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(self.bk // 16):
                cute.gemm(tiled_mma, acc, tCrW[(None, None, kb, cons.index)], tCrO[(None, None, kb, cons.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            # the slice's wgmmas have read their stage before it is handed back to the producer
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(cons)
            cons.advance()
            if warp_idx == 0 and prod.count < KT:
                load_k_slice(pipe, prod, tma_w, tWgW, tWsW, tma_o, tOgO, tOsO)
                prod.advance()

        store_token_major(acc, tCcC, sOut, mY, nt * BM, num_tokens, tidx)  # nt * BM = g * R + rt * 64

    @staticmethod
    def can_implement(T: int, G: int, R: int, Dg: int, tok_n: int, stages: int = 4, bk: int = 64) -> bool:
        return (1 <= T <= tok_n and tok_n in TOK_N and G >= 1 and R % BM == 0 and R > 0 and bk in BKS
                and Dg % bk == 0 and Dg >= bk and 2 <= stages and smem_bytes(tok_n, stages, bk) <= SMEM_PER_CTA)


def tok_n_for(T: int) -> int | None:
    """The narrowest token tile holding T tokens, or None (T > 64)."""
    for n in TOK_N:
        if T <= n:
            return n
    return None


def plan(T: int, G: int, R: int, Dg: int, num_sms: int = 132) -> dict:
    """The compile configuration ``{tok_n, stages, bk}`` of a decode call: the narrowest token
    tile; where the 64-row weight tiles fit one wave at one CTA per SM, 128-wide slices as deep
    as shared memory allows (8 stages; 6 for the 64-token tile), else 64-wide slices at 4
    stages, two CTAs per SM (each measured faster than the other where it is chosen, H200)."""
    tok_n = tok_n_for(T)
    if tok_n is None:
        raise ValueError(f"wo_a_decode_swap_ab: T={T} > {MAX_T}")
    if G * R // BM <= num_sms and Dg % 128 == 0:
        return {"tok_n": tok_n, "stages": 8 if tok_n <= 32 else 6, "bk": 128}
    return {"tok_n": tok_n, "stages": 4, "bk": 64}


def _build(arch: str, *, G: int, R: int, Dg: int, tok_n: int, stages: int = 4, bk: int = 64, pdl: bool = False):
    """``tok_n``: the token tile (wgmma N; T <= tok_n). ``stages``: TMA pipeline depth. ``bk``:
    K elements per slice (64 or 128). ``pdl``: a programmatic dependent launch (weights
    prefetched before the grid-dependency wait)."""
    if not WoADecodeSwapAB.can_implement(1, G, R, Dg, tok_n, stages, bk):
        raise ValueError(f"wo_a_decode_swap_ab: unsupported G={G}, R={R}, Dg={Dg}, tok_n={tok_n}, stages={stages}, "
                         f"bk={bk} (R % 64, tok_n in {TOK_N}, bk in {BKS} dividing Dg, stages >= 2 within "
                         f"{SMEM_PER_CTA} B of shared memory: {smem_bytes(tok_n, stages, bk)} B)")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 16), P(cutlass.BFloat16, 4), Int32(1), jit.fake_stream())
    return WoADecodeSwapAB(G, R, Dg, tok_n, stages, bk, pdl), args


def _build_tensors(arch: str, *, G: int, R: int, Dg: int, tok_n: int, stages: int = 4, bk: int = 64):
    op, _ = _build(arch, G=G, R=R, Dg=Dg, tok_n=tok_n, stages=stages, bk=bk)
    sym, bf, T = {}, cutlass.BFloat16, jit.fake_tensor
    args = (T(bf, ("T", "H", "Dv"), 16, sym), T(bf, (G, R, Dg), 16, sym), T(bf, ("T", G * R), 4, sym),
            jit.fake_env_stream())
    return op.tensor_call, args


KERNEL = jit.register(jit.KernelDef(
    name="wo_a_decode_swap_ab",
    build=_build,
    sources=tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                  for f in ("wo_a_decode_swap_ab.py", "wo_a_sm90.py", "tma_pipeline.py", "warp_mma.py")),
    archs=("sm_90a",),
    # the configs wo_a()'s default route takes are set by cute_kernels.wo_a (the router sits
    # above this kernel); imported alone, nothing is built ahead of time
    aot_configs=lambda arch: (),
    description="WO-A decode (T <= 64), Hopper: TMA + wgmma, weight rows as M, token-major bf16 out",
))
jit.register_tensor_entry(KERNEL, _build_tensors)  # its AOT configs: cute_kernels.wo_a's routes

"""Routed-input MXFP8 quantization: bf16 ``x [T, K]`` -> e4m3 ``q`` + UE8M0 scales per 32 elements.

Scale rule: round up, so nothing clips -- the rule of cuBLAS, TensorRT-LLM and FlashInfer, not
OCP MX's floor rule (``e = floor(log2(amax)) - 8``, which clips blocks whose maximum mantissa
exceeds 1.75). For each block of 32 consecutive elements of a row, with ``amax`` the largest
magnitude, the scale is the smallest power of two ``s = 2**e`` with ``amax / s <= 448`` (448 =
e4m3's largest finite value), i.e. ``e = ceil(log2(amax / 448))``. Writing ``amax = m * 2**E``
with ``1 <= m < 2``::

    e = E - 8 + (m > 1.75)          # 448 = 1.75 * 2**8
    scale byte = clamp(e + 127, 0, 254)

computed exactly from the bf16 bit pattern (exponent field and top mantissa bits), no
floating-point log. ``q = e4m3(x * 2**-e)`` with round-to-nearest-even; the product is
exact (power-of-two scaling of a bf16 value stays a normal fp32), and its magnitude is
<= 448, so e4m3 saturation never triggers; results below e4m3's subnormal range follow
e4m3's subnormal rounding.

Special blocks:

* all zero (or only bf16 subnormals so small that e < -127): ``e`` clamps to -127
  (byte 0x00); zeros stay 0;
* any NaN or +-Inf in the block: scale byte 0xFF (E8M0 NaN) and every element 0x7F
  (e4m3 NaN) -- e4m3fn cannot encode Inf, and a NaN scale makes the whole block dequantize
  to NaN;
* padding rows of the routed variant (sentinel ids): q = 0, scale byte 0x00 (or left
  unwritten with ``zero_padding=False``).

Dequantization: ``x' = float(q) * 2**(byte - 127)``.

Scale layouts:

* ``plain``: row-major ``[rows, K/32]`` uint8;
* ``swizzled``: the block-scale layout that Blackwell tcgen05 block-scaled MMA (and
  cuBLAS) read -- CUTLASS's scale-factor atom of 128 rows x 4 scale columns, 512 bytes,
  atoms ordered with the K direction fastest; rows padded to 128 and scale columns to 4
  with zero bytes::

      offset(r, c) = ((r // 128) * ceil(K/128) + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4

Routed variant: output row ``r`` is the routed row ``sorted_token_ids[r]`` of the router
(:mod:`moe.router`): token ``id // k`` (the same x row for each of its k experts), or a
zero row for the padding sentinel ``T * k``. Only rows below the router's padded total
(read from device memory, no host sync) are written; rows past it are never read. With the
padding left unwritten (``zero_padding=False``) and the router's ``routed_row_pos``, the kernel
walks the ``T * k`` routed rows instead (``by_row_pos``): routed row ``t*k + i`` is quantized
into slot ``routed_row_pos[t*k + i]`` -- the same bytes in the live rows, work proportional to
them rather than to the padded total (at decode, ~40 experts x 128-row tiles for 48 rows).

Prequantized routed variant (:func:`mxfp8_gather_routed`): the tokens were quantized first
(``layout="plain"``; the decode runtime does it on a side stream while the router runs), and
each output block is the routed token's block, moved byte for byte with its scale byte --
the same bytes as quantizing the gathered rows, since every row is quantized on its own.

Kernel, plain scales: one thread per 32-element block: four 16-byte loads, integer amax of the
bf16 magnitude bits, the scale byte, 32 multiplies and packed fp32->e4m3 conversions, two
16-byte stores and one scale byte (consecutive lanes: consecutive blocks, so a warp's scale
bytes are one 32-byte segment). Swizzled scales: the same walk over whole atoms; the four
lanes holding one row's 4-column group pass their scale bytes down by shuffles and the first
stores the word (no byte stores into the atoms). The routed-rows walk (``by_row_pos``) takes
one thread per 32-bit scale word instead: four consecutive blocks of a row (sixteen 16-byte
loads issued first, eight 16-byte stores), the word stored whole. The prequantized gather
moves 32-byte blocks (two 16-byte loads and stores) and scale bytes; on the routed-rows walk a
thread's four blocks and scale bytes are all loaded before its first store. A grid-stride loop over a
fixed grid keeps launches graph-capturable when the live row count is a device value.

Programmatic dependent launch (``pdl=True``, a compile option): the kernel is launched as a
programmatic dependent of the kernel before it on the stream, so its launch and CTA start
overlap that kernel's tail. Every CTA waits for the previous grid to complete and flush
(``griddepcontrol.wait``) before its first memory access -- everything the quantizer reads
(``x``, the router's packing) may be that grid's output -- and signals its own dependents
after its last store. Results are identical; only the launch differs.

Constraints: K % 32 == 0 (the MX block; other K raise ``ValueError``), 16-byte aligned
rows; T * K < 2**31. The same source compiles for sm_90a and sm_100a (no tensor cores).

Test / bench::

    pytest tests/test_moe_quant.py
    python bench/bench_moe.py
"""

from __future__ import annotations

import os

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint16, Uint32

from cute_kernels import jit
from cute_kernels.arch import current_arch, dispatch
from cute_kernels import mx_scales
from cute_kernels.mx_scales import swizzled_scale_word
from cute_kernels.validate import check_bool, check_cuda, check_int32_indexable, check_tensor

MX_BLOCK = 32
SF_ATOM_ROWS, SF_ATOM_COLS = 128, 4
LAYOUTS = ("plain", "swizzled")
#: the scale buffer's alignment (bytes): the swizzled layout's scales are stored as 32-bit words
SCALE_ALIGN = {"plain": 1, "swizzled": 4}
DEFAULT_MAX_CTAS = 132 * 8  # H200 SMs x resident CTAs; the kernel grid-strides over the rest


def scale_buffer_size(rows: int, K: int, layout: str) -> int:
    """Bytes of the scale buffer for ``rows`` x ``K`` in ``layout``."""
    nb = K // MX_BLOCK
    if layout == "plain":
        return rows * nb
    return -(-rows // SF_ATOM_ROWS) * SF_ATOM_ROWS * (-(-nb // SF_ATOM_COLS) * SF_ATOM_COLS)


class MxQuant:
    """Compile-time configuration: row length, scale layout, routed gather (and its top-k);
    ``prequantized``: the input is already MXFP8 (e4m3 rows + plain scales), so a routed call
    only gathers its blocks and scale bytes into the routed order and scale layout."""

    def __init__(self, K: int, layout: str, routed: bool, topk: int = 1, threads: int = 256,
                 zero_padding: bool = True, prequantized: bool = False, by_row_pos: bool = False,
                 pdl: bool = False):
        self.K = K
        self.pdl = pdl  # launched as a programmatic dependent (module docstring)
        # routed, padding unwritten: walk the T k routed rows through the router's
        # routed_row_pos (work proportional to the live rows) instead of every padded slot
        self.by_row_pos = by_row_pos
        self.zero_padding = zero_padding
        self.prequantized = prequantized
        self.nblk = K // MX_BLOCK
        self.layout = layout
        self.routed = routed
        self.topk = topk
        self.threads = threads
        self.ncb = -(-self.nblk // SF_ATOM_COLS)  # swizzled: scale-column atoms per row block

    def __str__(self) -> str:
        # the DSL names the kernel after str(self): profiles tell the variants apart
        return "MxGatherRouted" if self.prequantized else ("MxQuantRouted" if self.routed else "MxQuant")

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, xs_ptr: cute.Pointer, q_ptr: cute.Pointer, s_ptr: cute.Pointer,
                 ids_ptr: cute.Pointer, total_ptr: cute.Pointer, num_tokens: Int32, out_rows: Int32,
                 max_ctas: Int32, stream: cuda.CUstream):
        # Routed: x has num_tokens rows, q has out_rows (capacity) rows and the live row count
        # is *total_ptr. Plain: out_rows == num_tokens and ids/total are unused. xs: x's plain
        # scales (prequantized only; unused otherwise).
        mX = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, self.K), stride=(self.K, 1)))
        mXs = cute.make_tensor(xs_ptr, cute.make_layout((num_tokens * self.nblk,)))
        mQ = cute.make_tensor(q_ptr, cute.make_layout((out_rows, self.K), stride=(self.K, 1)))
        mS = cute.make_tensor(s_ptr, cute.make_layout(((out_rows + SF_ATOM_ROWS) * self.ncb * SF_ATOM_COLS,)))
        mIds = cute.make_tensor(ids_ptr, cute.make_layout((out_rows,)))
        if cutlass.const_expr(self.by_row_pos):  # ids: routed_row_pos [T k]
            mIds = cute.make_tensor(ids_ptr, cute.make_layout((num_tokens * self.topk,)))
        mTotal = cute.make_tensor(total_ptr, cute.make_layout((1,)))
        # Size the grid by the (upper bound of the) work so that a small quantization
        # leaves SMs free for work running beside it on another stream.
        work = out_rows * self.nblk  # plain: a thread per block
        if cutlass.const_expr(self.layout == "swizzled"):  # the whole atoms
            work = (out_rows + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS * SF_ATOM_ROWS * self.ncb * SF_ATOM_COLS
        if cutlass.const_expr(self.by_row_pos):  # the routed rows only (swizzled: a thread per scale word)
            work = num_tokens * self.topk * (self.ncb if self.layout == "swizzled" else self.nblk)
        grid = cutlass.min((work + self.threads - 1) // self.threads, max_ctas)
        self.kernel(mX, mXs, mQ, mS, mIds, mTotal, num_tokens, out_rows, grid).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def tensor_call(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        """The tensor entry of the plain, unrouted quantization (``jit.get_tensor_kernel``):
        ``mX [T, K]`` bf16, ``mQ [T, K]`` e4m3, ``mS [T, K / 32]`` uint8. The routing pointers
        are not read on this path: ``x``'s address stands in for them."""
        ids = cute.recast_ptr(mX.iterator, dtype=Int32)
        self.__call__(mX.iterator, mS.iterator, mQ.iterator, mS.iterator, ids, ids, mX.shape[0], mX.shape[0],
                      max_ctas, stream)

    @cute.jit
    def tensor_call_routed(self, mX: cute.Tensor, mIds: cute.Tensor, mTotal: cute.Tensor, mQ: cute.Tensor,
                           mS: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        """The routed quantization's tensor entry: ``mX [T, K]`` bf16, the router's
        ``mIds [S]`` and ``mTotal [1]``, ``mQ [S, K]`` e4m3, ``mS`` the scale buffer (its size
        for ``S`` rows checked by the caller)."""
        self.__call__(mX.iterator, mS.iterator, mQ.iterator, mS.iterator, mIds.iterator, mTotal.iterator,
                      mX.shape[0], mIds.shape[0], max_ctas, stream)

    @cute.jit
    def tensor_call_gather(self, mX: cute.Tensor, mXs: cute.Tensor, mIds: cute.Tensor, mTotal: cute.Tensor,
                           mQ: cute.Tensor, mS: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        """The prequantized gather's tensor entry: ``mX [T, K]`` e4m3 and ``mXs [T, K / 32]``
        uint8 (plain scales), then as :meth:`tensor_call_routed`."""
        self.__call__(mX.iterator, mXs.iterator, mQ.iterator, mS.iterator, mIds.iterator, mTotal.iterator,
                      mX.shape[0], mIds.shape[0], max_ctas, stream)

    @cute.jit
    def tensor_call_by_row_pos(self, mX: cute.Tensor, mXs: cute.Tensor, mSorted: cute.Tensor, mPos: cute.Tensor,
                               mQ: cute.Tensor, mS: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        """The routed rows' tensor entry (``by_row_pos``): ``mX [T, K]`` (bf16, or e4m3 with its
        plain scales ``mXs``; without, ``mXs`` is a stand-in, not read), ``mSorted [S]`` (not
        read: it ties ``mQ [S, K]`` to the router's capacity), ``mPos [T k]`` (its length
        checked by the caller), ``mS`` (its size checked by the caller)."""
        self.__call__(mX.iterator, mXs.iterator, mQ.iterator, mS.iterator, mPos.iterator, mPos.iterator,
                      mX.shape[0], mSorted.shape[0], max_ctas, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXs: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mIds: cute.Tensor,
               mTotal: cute.Tensor, num_tokens: Int32, out_rows: Int32, grid: Int32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # before any access: x and the packing may be its output
        live_rows = num_tokens
        if cutlass.const_expr(self.routed):
            live_rows = cutlass.min(mTotal[0], out_rows)
        # (32 elements, (row, block)) views of x and q.
        gX = cute.zipped_divide(mX, (1, MX_BLOCK))
        gQ = cute.zipped_divide(mQ, (1, MX_BLOCK))
        if cutlass.const_expr(self.by_row_pos):
            self.routed_rows(gX, gQ, mXs, mS, mIds, num_tokens, out_rows, grid)
        elif cutlass.const_expr(self.layout == "swizzled"):
            self.swizzled_blocks(gX, gQ, mXs, mS, mIds, live_rows, num_tokens, grid)
        else:
            self.plain_blocks(gX, gQ, mXs, mS, mIds, live_rows, num_tokens, grid)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def padding_row(self, mIds: cute.Tensor, r: Int32, live_rows: Int32, sentinel: Int32) -> Int32:
        """1 when output row ``r`` is skipped (``zero_padding=False``): past the live total (the
        swizzled atom's last rows) or a router sentinel. Every consumer reads a row on its own
        (a GEMM column / row, the finalize's live rows), and at decode padding is most of the
        rows (T = 6: ~40 experts x 128-row tiles for 48 live rows)."""
        skip = Int32(0)
        if cutlass.const_expr(self.routed and not self.zero_padding):
            if r >= live_rows:
                skip = Int32(1)
            else:
                pid = mIds[r]
                if pid >= sentinel or pid < 0:
                    skip = Int32(1)
        return skip

    @cute.jit
    def source_row(self, mIds: cute.Tensor, r: Int32, sentinel: Int32) -> Int32:
        """The x row of output row ``r``: ``r`` itself, or (routed) the token of its routed row;
        -1 for a padding slot (a zero row)."""
        src = r
        if cutlass.const_expr(self.routed):
            rid = mIds[r]
            src = -1
            if rid < sentinel and rid >= 0:
                src = rid // self.topk
        return src

    @cute.jit
    def plain_blocks(self, gX, gQ, mXs, mS, mIds, live_rows: Int32, num_tokens: Int32, grid: Int32):
        """Plain scales: one thread per 32-element block, ``mS[r, c]`` its byte (consecutive
        lanes: consecutive blocks of a row, so the scale bytes go out as one 32-byte segment)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        cols = self.nblk
        sentinel = num_tokens * self.topk
        for idx in cutlass.range(bidx * self.threads + tidx, live_rows * cols, grid * self.threads):
            r = idx // cols
            c = idx - r * cols
            if self.padding_row(mIds, r, live_rows, sentinel) == 0:
                scale = self.block(gX, gQ, mXs, self.source_row(mIds, r, sentinel), r, c)
                mS[r * self.nblk + c] = Uint8(scale)

    @cute.jit
    def swizzled_blocks(self, gX, gQ, mXs, mS, mIds, live_rows: Int32, num_tokens: Int32, grid: Int32):
        """Swizzled scales: one thread per 32-element block as in :meth:`plain_blocks`, over the
        whole atoms (rows padded to 128, scale columns to 4: zero bytes there). The four lanes
        of a row's 4-column group (``c % 4 = 0..3``, since a row has ``4 ncb`` columns and
        whole warps run every iteration) pass their scale bytes down by shuffles and the
        group's first lane stores them as one 32-bit word: no byte stores into the atoms."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        sentinel = num_tokens * self.topk
        mS32 = cute.recast_tensor(mS, Uint32)
        cols = self.ncb * SF_ATOM_COLS
        work = (live_rows + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS * SF_ATOM_ROWS * cols
        for idx in cutlass.range(bidx * self.threads + tidx, (work + 31) // 32 * 32, grid * self.threads):
            r = idx // cols
            c = idx - r * cols
            skip = Int32(1)
            if idx < work:  # (else: a lane of the rounded-up last warp, with no block)
                skip = self.padding_row(mIds, r, live_rows, sentinel)
            scale = Int32(0)
            if (skip == 0) & (r < live_rows) & (c < self.nblk):
                scale = self.block(gX, gQ, mXs, self.source_row(mIds, r, sentinel), r, c)
            word = scale & 0xFF
            for j in cutlass.range_constexpr(1, SF_ATOM_COLS):
                word = word | ((cute.arch.shuffle_sync_down(scale, offset=j) & 0xFF) << (8 * j))
            if (lane % SF_ATOM_COLS == 0) & (skip == 0):
                mS32[swizzled_scale_word(r, c // SF_ATOM_COLS, self.ncb)] = Uint32(word)

    @cute.jit
    def routed_rows(self, gX, gQ, mXs, mS, mPos, num_tokens: Int32, out_rows: Int32, grid: Int32):
        """Routed rows only (padding left unwritten): routed row ``rr = t k + i`` is token
        ``t``'s row, written to slot ``p = routed_row_pos[rr]`` (skipped unless ``0 <= p <
        out_rows``). Plain scales: a thread per (routed row, block); swizzled: a thread per
        (routed row, 4-column group) -- four blocks and their scale word, at the word of row
        ``p`` in its atom (consecutive threads: consecutive 256-byte pieces of one x row)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        cols = self.ncb if self.layout == "swizzled" else self.nblk
        mS32 = mS
        if cutlass.const_expr(self.layout == "swizzled"):
            mS32 = cute.recast_tensor(mS, Uint32)
        for u in cutlass.range(bidx * self.threads + tidx, num_tokens * self.topk * cols, grid * self.threads):
            rr = u // cols
            c = u - rr * cols
            p = mPos[rr]
            src = rr // self.topk
            if (p >= 0) & (p < out_rows):
                if cutlass.const_expr(self.layout == "swizzled"):
                    word = self.blocks4(gX, gQ, mXs, src, p, c * SF_ATOM_COLS)
                    mS32[swizzled_scale_word(p, c, self.ncb)] = word
                else:
                    mS[p * self.nblk + c] = Uint8(self.block(gX, gQ, mXs, src, p, c))

    @cute.jit
    def block(self, gX, gQ, mXs, src: Int32, r: Int32, c: Int32) -> Int32:
        """Output block ``(r, c)`` from x's row ``src`` (zeros for ``src < 0``): quantized, or
        (prequantized) copied with its plain scale byte; returns the scale byte."""
        scale = Int32(0)
        if cutlass.const_expr(self.prequantized):
            self.copy_block(gX, gQ, src, r, c)
            if src >= 0:
                scale = Int32(mXs[src * self.nblk + c]) & 0xFF  # (the uint8 widens with its sign)
        else:
            scale = self.quantize_block(gX, gQ, src, r, c)
        return scale

    @cute.jit
    def blocks4(self, gX, gQ, mXs, src: Int32, r: Int32, c0: Int32) -> Uint32:
        """Output blocks ``(r, c0 .. c0 + 3)`` (those below ``K / 32``) as :meth:`block`; their
        scale bytes as one little-endian word (the swizzled layout's)."""
        word = Uint32(0)
        if cutlass.const_expr(self.prequantized):
            word = self.gather_blocks4(gX, gQ, mXs, src, r, c0)
        else:
            word = self.quantize_blocks4(gX, gQ, src, r, c0)
        return word

    @cute.jit
    def gather_blocks4(self, gX, gQ, mXs, src: Int32, r: Int32, c0: Int32) -> Uint32:
        """Prequantized :meth:`blocks4`: the four blocks' bytes and scale bytes are all loaded
        (under one branch) before the first store. (Block by block, each behind its own
        branch, every block's loads waited for the store of the one before: a memory round
        trip per block.)"""
        full = self.nblk % SF_ATOM_COLS == 0  # (static) every group has its four blocks
        tQrQ = cute.make_rmem_tensor(cute.make_layout((MX_BLOCK, SF_ATOM_COLS)), gQ.element_type)
        cute.recast_tensor(tQrQ, Uint8).fill(0)
        rS = cute.make_rmem_tensor(cute.make_layout((SF_ATOM_COLS,)), Int32)
        rS.fill(0)
        if src >= 0:
            for j in cutlass.range_constexpr(SF_ATOM_COLS):
                if cutlass.const_expr(full):
                    cute.autovec_copy(gX[(0, None), (src, c0 + j)], tQrQ[None, j])
                    rS[j] = Int32(mXs[src * self.nblk + c0 + j]) & 0xFF  # (the uint8 widens with its sign)
                elif c0 + j < self.nblk:
                    cute.autovec_copy(gX[(0, None), (src, c0 + j)], tQrQ[None, j])
                    rS[j] = Int32(mXs[src * self.nblk + c0 + j]) & 0xFF
        word = Uint32(0)
        for j in cutlass.range_constexpr(SF_ATOM_COLS):
            if cutlass.const_expr(full):
                cute.autovec_copy(tQrQ[None, j], gQ[(0, None), (r, c0 + j)])
            elif c0 + j < self.nblk:
                cute.autovec_copy(tQrQ[None, j], gQ[(0, None), (r, c0 + j)])
            word = word | (Uint32(rS[j]) << Uint32(8 * j))
        return word

    @cute.jit
    def quantize_blocks4(self, gX: cute.Tensor, gQ: cute.Tensor, src: Int32, r: Int32, c0: Int32) -> Uint32:
        """Output blocks ``(r, c0 .. c0 + 3)`` (those below ``K / 32``) = MXFP8 of x's blocks
        ``(src, ...)``; all four are loaded before the first is quantized (four 64-byte requests
        in flight). Returns their scale bytes as one little-endian word."""
        rX = cute.make_rmem_tensor(cute.make_layout((MX_BLOCK, SF_ATOM_COLS), stride=(1, MX_BLOCK)),
                                   gX.element_type)
        rX.fill(0.0)
        for j in cutlass.range_constexpr(SF_ATOM_COLS):
            if (src >= 0) & (c0 + j < self.nblk):
                cute.autovec_copy(gX[(0, None), (src, c0 + j)], rX[None, j])
        word = Uint32(0)
        for j in cutlass.range_constexpr(SF_ATOM_COLS):
            if c0 + j < self.nblk:
                scale = self.quantize_loaded(rX[None, j], gQ, r, c0 + j)
                word = word | (Uint32(scale) << Uint32(8 * j))
        return word

    @cute.jit
    def copy_block(self, gX: cute.Tensor, gQ: cute.Tensor, src: Int32, r: Int32, c: Int32):
        """Prequantized input: output block (r, c) is x's block (src, c) byte for byte (zeros
        for a padding row, src < 0)."""
        tQrQ = cute.make_rmem_tensor(cute.make_layout((MX_BLOCK,)), gQ.element_type)
        cute.recast_tensor(tQrQ, Uint8).fill(0)
        if src >= 0:
            cute.autovec_copy(gX[(0, None), (src, c)], tQrQ)
        cute.autovec_copy(tQrQ, gQ[(0, None), (r, c)])

    @cute.jit
    def quantize_block(self, gX: cute.Tensor, gQ: cute.Tensor, src: Int32, r: Int32, c: Int32) -> Int32:
        """Output block (r, c) = MXFP8 of x's block (src, c) (zeros for a padding row, src < 0);
        returns its scale byte."""
        tXrX = cute.make_rmem_tensor(cute.make_layout((MX_BLOCK,)), gX.element_type)
        tXrX.fill(0.0)
        if src >= 0:
            cute.autovec_copy(gX[(0, None), (src, c)], tXrX)
        return self.quantize_loaded(tXrX, gQ, r, c)

    @cute.jit
    def quantize_loaded(self, tXrX: cute.Tensor, gQ: cute.Tensor, r: Int32, c: Int32) -> Int32:
        """Output block (r, c) = MXFP8 of the 32 bf16 values ``tXrX`` (registers); returns its
        scale byte."""
        # amax as the integer max of the bf16 magnitude bits: monotonic for finite
        # values, and any NaN/Inf (bits >= 0x7F80) dominates.
        bits = cute.recast_tensor(tXrX, Uint16)
        amax = Int32(0)
        for i in cutlass.range_constexpr(MX_BLOCK):
            amax = cutlass.max(amax, Int32(bits[i]) & 0x7FFF)
        nonfinite = amax >= 0x7F80
        expfield = amax >> 7
        # m > 1.75 <=> top two mantissa bits set and any lower bit set (mantissa7 > 0x60)
        e_biased = expfield - 8 + cutlass.select_(Int32(amax & 0x7F) > 0x60, Int32(1), Int32(0))
        scale = cutlass.max(cutlass.min(e_biased, Int32(254)), Int32(0))
        # 2**-e as fp32: exponent field 254 - scale (scale <= 248 for finite bf16).
        inv = cutlass.Uint32(254 - scale) << 23
        inv_f = cute.make_rmem_tensor(cute.make_layout((1,)), Uint32)
        inv_f[0] = inv
        mult = cute.recast_tensor(inv_f, Float32)[0]
        tQrQ = cute.make_rmem_tensor(cute.make_layout((MX_BLOCK,)), gQ.element_type)
        tQrQ.store((tXrX.load().to(Float32) * mult).to(gQ.element_type))
        if nonfinite:
            scale = Int32(0xFF)
            qbits = cute.recast_tensor(tQrQ, Uint8)
            qbits.fill(0x7F)
        cute.autovec_copy(tQrQ, gQ[(0, None), (r, c)])
        return scale

    @staticmethod
    def can_implement(K: int) -> bool:
        return K % MX_BLOCK == 0 and 0 < K <= 1 << 16


def _build(arch: str, *, K: int, layout: str, routed: bool, topk: int = 1, zero_padding: bool = True,
           prequantized: bool = False, by_row_pos: bool = False, pdl: bool = False):
    if not MxQuant.can_implement(K) or layout not in LAYOUTS or (prequantized and not routed) or (
            by_row_pos and (not routed or zero_padding)):
        raise ValueError(f"moe.quant: unsupported K={K}, layout={layout}, prequantized={prequantized} "
                         f"(routed={routed}, zero_padding={zero_padding}, by_row_pos={by_row_pos})")
    x_type = cutlass.Float8E4M3FN if prequantized else cutlass.BFloat16
    args = (jit.fake_gmem_ptr(x_type, 16), jit.fake_gmem_ptr(Uint8, 1), jit.fake_gmem_ptr(cutlass.Float8E4M3FN, 16),
            jit.fake_gmem_ptr(Uint8, SCALE_ALIGN[layout]), jit.fake_gmem_ptr(Int32, 4), jit.fake_gmem_ptr(Int32, 4),
            Int32(1), Int32(1), Int32(1), jit.fake_stream())
    return MxQuant(K, layout, routed, topk, zero_padding=zero_padding, prequantized=prequantized,
                   by_row_pos=by_row_pos, pdl=pdl), args


KERNEL = jit.register(jit.KernelDef(
    name="mxfp8_quant",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.abspath(mx_scales.__file__)),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=tuple(
        {"K": 7168, "layout": lay, "routed": routed, "topk": 8 if routed else 1}
        for lay in LAYOUTS for routed in (False, True)
    ) + ({"K": 7168, "layout": "swizzled", "routed": True, "topk": 8, "zero_padding": False},
         # DeepSeek-V4-Flash's routed input: tokens quantized on a side stream, then gathered
         {"K": 4096, "layout": "plain", "routed": False, "topk": 1},
         {"K": 4096, "layout": "swizzled", "routed": True, "topk": 6, "zero_padding": False, "prequantized": True},
         # ... walking the routed rows only (routed_row_pos), as the decode runtime calls them
         {"K": 4096, "layout": "swizzled", "routed": True, "topk": 6, "zero_padding": False, "prequantized": True,
          "by_row_pos": True},
         {"K": 7168, "layout": "swizzled", "routed": True, "topk": 8, "zero_padding": False, "by_row_pos": True}),
    description="bf16 -> MXFP8 (e4m3 + UE8M0 per 32), plain or tcgen05-swizzled scales, optional routed gather "
                "(of bf16 rows, or of rows already MXFP8)",
))


def _build_tensors(arch: str, *, K: int):
    op, _ = _build(arch, K=K, layout="plain", routed=False)
    sym = {}
    T = jit.fake_tensor
    args = (T(cutlass.BFloat16, ("T", K), 16, sym), T(cutlass.Float8E4M3FN, ("T", K), 16, sym),
            T(Uint8, ("T", K // MX_BLOCK), 1, sym), Int32(1), jit.fake_env_stream())
    return op.tensor_call, args


jit.register_tensor_entry(KERNEL, _build_tensors, "mxfp8_quantize_tensors",
                          "mxfp8_quantize (plain scales) taking torch tensors through TVM-FFI",
                          aot_configs=tuple({"K": c["K"]} for c in KERNEL.aot_configs
                                            if c["layout"] == "plain" and not c["routed"]))
#: (K, device index) -> the tensor entry (jit.launch_tensor_entry)
_TENSOR_FNS: dict = {}


def _build_routed_tensors(arch: str, *, K: int, layout: str, topk: int, zero_padding: bool = True,
                          prequantized: bool = False, by_row_pos: bool = False):
    op, _ = _build(arch, K=K, layout=layout, routed=True, topk=topk, zero_padding=zero_padding,
                   prequantized=prequantized, by_row_pos=by_row_pos)
    sym, T, f8 = {}, jit.fake_tensor, cutlass.Float8E4M3FN
    x = T(f8 if prequantized else cutlass.BFloat16, ("T", K), 16, sym)
    routing = (T(Int32, ("S",), 4, sym), T(Int32, (1,), 4, sym))
    q = T(f8, ("S", K), 16, sym)
    s = T(Uint8, ("S", K // MX_BLOCK), 1, sym) if layout == "plain" else T(Uint8, ("B",), SCALE_ALIGN[layout], sym)
    tail = (Int32(1), jit.fake_env_stream())
    if by_row_pos:
        xs = T(Uint8, ("T", K // MX_BLOCK), 1, sym) if prequantized else T(Uint8, ("X",), 1, sym)
        return op.tensor_call_by_row_pos, (x, xs, routing[0], T(Int32, ("Tk",), 4, sym), q, s) + tail
    if prequantized:
        return op.tensor_call_gather, (x, T(Uint8, ("T", K // MX_BLOCK), 1, sym)) + routing + (q, s) + tail
    return op.tensor_call_routed, (x,) + routing + (q, s) + tail


jit.register_tensor_entry(KERNEL, _build_routed_tensors, "mxfp8_quantize_routed_tensors",
                          "mxfp8_quantize_routed / mxfp8_gather_routed taking torch tensors through TVM-FFI",
                          aot_configs=tuple({k: v for k, v in c.items() if k != "routed"}
                                            for c in KERNEL.aot_configs if c["routed"]))
#: (K, capacity, topk, layout, zero_padding, prequantized, by_row_pos, device index) -> the routed tensor
#: entry; the scale buffer's bytes for that capacity under the same key (the one size the C
#: checks cannot make)
_ROUTED_TENSOR_FNS: dict = {}
_ROUTED_SCALE_BYTES: dict = {}


def _routed_hot_path(x, xs, sorted_token_ids, total_rows, topk, layout, q, scales, zero_padding, row_pos) -> bool:
    """The routed calls' eager hot path (the caller checked the defaults: no stream, arch or
    grid cap): with TVM-FFI on and the outputs given, launch the memoised tensor entry and
    return True, or False (the caller validates)."""
    if not (jit.TVM_FFI and q is not None and isinstance(x, torch.Tensor) and isinstance(sorted_token_ids, torch.Tensor)
            and isinstance(scales, torch.Tensor)):
        return False
    shape = x.shape
    by_pos = row_pos is not None
    key = (shape[1], sorted_token_ids.shape[0], topk, layout, zero_padding, xs is not None, by_pos, x.get_device())
    nbytes = _ROUTED_SCALE_BYTES.get(key)
    if nbytes is None or scales.numel() != nbytes or x.numel() >= 2**31:
        return False
    if by_pos:
        if not isinstance(row_pos, torch.Tensor) or row_pos.numel() != shape[0] * topk:
            return False
        return jit.launch_tensor_entry(_ROUTED_TENSOR_FNS, key, x, scales if xs is None else xs, sorted_token_ids,
                                       row_pos, q, scales, DEFAULT_MAX_CTAS)
    args = (x,) if xs is None else (x, xs)
    return jit.launch_tensor_entry(_ROUTED_TENSOR_FNS, key, *args, sorted_token_ids, total_rows, q, scales,
                                   DEFAULT_MAX_CTAS)


def _remember_routed(x, xs, sorted_token_ids, topk, layout, scales, zero_padding, row_pos) -> None:
    """After a validated routed call with the defaults: its tensor entry for the next calls."""
    K, cap = x.shape[1], sorted_token_ids.shape[0]
    by_pos = row_pos is not None
    key = (K, cap, topk, layout, zero_padding, xs is not None, by_pos, x.get_device())
    _ROUTED_SCALE_BYTES[key] = scales.numel()
    jit.remember_tensor_entry(_ROUTED_TENSOR_FNS, key, "mxfp8_quantize_routed_tensors", current_arch(x.device),
                              K=K, layout=layout, topk=topk, zero_padding=zero_padding,
                              **(dict(prequantized=True) if xs is not None else {}),
                              **(dict(by_row_pos=True) if by_pos else {}))


def _check_row_pos(op: str, row_pos, T: int, topk, zero_padding) -> None:
    """``routed_row_pos``: the router's int32 ``[T topk]`` slots; only with padding unwritten."""
    if row_pos is None:
        return
    if zero_padding:
        raise ValueError(f"{op}: routed_row_pos walks the routed rows only: it needs zero_padding=False "
                         f"(padding rows unwritten)")
    check_tensor(op, "routed_row_pos", row_pos, dtype=torch.int32, shape=(T * topk,), contiguous=True,
                 align_bytes=4)


def _check_x(op: str, x: torch.Tensor) -> tuple[int, int]:
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, contiguous=True, align_bytes=0)
    T, K = x.shape
    if K % MX_BLOCK:
        raise ValueError(f"{op}: x.shape[1]={K} must be a multiple of {MX_BLOCK} (the MX block); pad K")
    check_tensor(op, "x", x, align_bytes=16)
    check_int32_indexable(op, "x", T * K)
    return T, K


def _outputs(op: str, x: torch.Tensor, rows: int, K: int, layout: str, q, scales):
    """Allocate (when None) and validate ``q [rows, K]`` and the scale buffer of ``layout``."""
    if q is None:
        q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    check_tensor(op, "q", q, dtype=torch.float8_e4m3fn, shape=(rows, K), contiguous=True)
    nbytes = scale_buffer_size(rows, K, layout)
    if scales is None:
        shape = (rows, K // MX_BLOCK) if layout == "plain" else (nbytes,)
        scales = torch.empty(shape, dtype=torch.uint8, device=x.device)
    if scales.dtype != torch.uint8:
        raise TypeError(f"{op}: scales must have dtype uint8, got {scales.dtype}")
    if not scales.is_contiguous() or scales.numel() != nbytes:
        raise ValueError(f"{op}: scales must be contiguous with {nbytes} bytes for layout={layout!r}, "
                         f"got shape {list(scales.shape)}")
    if scales.data_ptr() % SCALE_ALIGN[layout]:
        raise ValueError(f"{op}: scales data pointer must be {SCALE_ALIGN[layout]}-byte aligned for layout={layout!r}")
    return q, scales


def _check_routing(op: str, sorted_token_ids, total_rows, topk, zero_padding, K: int) -> int:
    """The router's packing as a routed call takes it (and ``topk``, ``zero_padding``);
    returns the output rows (the capacity: ``sorted_token_ids.numel()``)."""
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"{op}: topk must be a positive int, got {topk!r}")
    check_bool(op, "zero_padding", zero_padding)
    check_tensor(op, "sorted_token_ids", sorted_token_ids, dtype=torch.int32, ndim=1, contiguous=True, align_bytes=4)
    check_tensor(op, "total_rows", total_rows, dtype=torch.int32, contiguous=True, align_bytes=4)
    if total_rows.numel() < 1:
        raise ValueError(f"{op}: total_rows must hold at least one int32")
    cap = sorted_token_ids.numel()
    check_int32_indexable(op, "q (sorted_token_ids.numel() rows x K)", cap * K)
    return cap


def _launch(op, x, q, s, ids, total, T, out_rows, K, layout, routed, topk, stream, arch, max_ctas,
            zero_padding=True, xs=None, row_pos=None, pdl=False):
    if max_ctas is None:
        max_ctas = DEFAULT_MAX_CTAS
    if not isinstance(max_ctas, int) or max_ctas < 1:
        raise ValueError(f"{op}: max_ctas must be a positive int, got {max_ctas!r}")
    a = arch if arch is not None else current_arch(x.device)
    if dispatch(op, ("portable",), arch=a) != "portable":  # pragma: no cover - portable always exists
        raise RuntimeError(op)
    pre = xs is not None  # x is MXFP8 already (xs: its plain scales): gather only
    cfg = dict(prequantized=True) if pre else {}
    if row_pos is not None:  # the routed rows only: the kernel reads routed_row_pos where it read the ids
        cfg["by_row_pos"] = True
        ids = row_pos
    if pdl:  # in the compile key only when asked
        cfg["pdl"] = True
    fn = jit.get_kernel("mxfp8_quant", a, K=K, layout=layout, routed=routed, topk=topk, zero_padding=zero_padding,
                        **cfg)
    fn(jit.gmem_ptr(cutlass.Float8E4M3FN if pre else cutlass.BFloat16, x, 16), jit.gmem_ptr(Uint8, xs if pre else s, 1),
       jit.gmem_ptr(cutlass.Float8E4M3FN, q, 16), jit.gmem_ptr(Uint8, s, SCALE_ALIGN[layout]), jit.gmem_ptr(Int32, ids, 4),
       jit.gmem_ptr(Int32, total, 4), jit.i32(T), jit.i32(out_rows), jit.i32(max_ctas), jit.cu_stream(stream))


def mxfp8_quantize(x: torch.Tensor, *, layout: str = "plain", q: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None, stream=None, arch: str | None = None,
                   max_ctas: int | None = None, pdl: bool = False):
    """Quantize bf16 ``x [T, K]`` to MXFP8. Returns ``(q [T, K] float8_e4m3fn, scales uint8)``.

    ``scales`` is ``[T, K/32]`` for ``layout='plain'`` and a flat buffer of
    :func:`scale_buffer_size` bytes for ``'swizzled'``. Pass ``q``/``scales`` to allocate nothing.
    ``max_ctas`` caps the grid (default 132 SMs x 8): on a side stream, a small cap leaves
    SMs to the kernels it should overlap with. ``pdl``: launch as a programmatic dependent of
    the previous kernel on the stream (module docstring; a separate compile).
    """
    default_call = stream is None and arch is None and max_ctas is None and pdl is False
    if (scales is not None and q is not None and layout == "plain" and default_call and jit.TVM_FFI
            and isinstance(x, torch.Tensor)):  # the eager hot path
        shape = x.shape  # (the C checks: dtypes, extents, strides, alignment, device)
        if (len(shape) == 2 and shape[0] and x.numel() < 2**31
                and jit.launch_tensor_entry(_TENSOR_FNS, (shape[1], x.get_device()), x, q, scales, DEFAULT_MAX_CTAS)):
            return q, scales
    op = "mxfp8_quantize"
    check_bool(op, "pdl", pdl)
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    T, K = _check_x(op, x)
    q, scales = _outputs(op, x, T, K, layout, q, scales)
    check_cuda(op, ("x", x), ("q", q), ("scales", scales))
    if T == 0:
        return q, scales
    _launch(op, x, q, scales, x, x, T, T, K, layout, False, 1, stream, arch, max_ctas, pdl=pdl)
    if layout == "plain" and default_call and scales.dim() == 2:
        jit.remember_tensor_entry(_TENSOR_FNS, (K, x.get_device()), "mxfp8_quantize_tensors",
                                  current_arch(x.device), K=K)
    return q, scales


def mxfp8_quantize_routed(x: torch.Tensor, sorted_token_ids: torch.Tensor, total_rows: torch.Tensor, topk: int, *,
                          layout: str = "swizzled", q: torch.Tensor | None = None,
                          scales: torch.Tensor | None = None, stream=None, arch: str | None = None,
                          max_ctas: int | None = None, zero_padding: bool = True,
                          routed_row_pos: torch.Tensor | None = None, pdl: bool = False):
    """Gather ``x`` rows through the router's ``sorted_token_ids`` and quantize them in
    expert-sorted, tile-padded order. ``q`` is ``[capacity, K]`` with capacity =
    ``sorted_token_ids.numel()``; rows at or past ``total_rows[0]`` are not written.
    Padding slots (``id == T * topk``) become zero rows with scale byte 0 -- or, with
    ``zero_padding=False``, are not written at all (nor the swizzled atom's rows past the
    total): for consumers that read each row on its own, as the expert GEMMs do (a padding
    row only ever feeds its own, discarded, output row); at decode most rows are padding.
    With ``zero_padding=False``, passing the router's ``routed_row_pos`` (int32 ``[T topk]``)
    walks the ``T topk`` routed rows instead of every padded slot: the same bytes in the live
    rows, work proportional to them (``sorted_token_ids`` then only sizes the output).
    ``pdl``: as in :func:`mxfp8_quantize`.
    """
    default_call = stream is None and arch is None and max_ctas is None and pdl is False
    if default_call and _routed_hot_path(x, None, sorted_token_ids, total_rows, topk, layout, q, scales,
                                         zero_padding, routed_row_pos):
        return q, scales
    op = "mxfp8_quantize_routed"
    check_bool(op, "pdl", pdl)
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    T, K = _check_x(op, x)
    cap = _check_routing(op, sorted_token_ids, total_rows, topk, zero_padding, K)
    _check_row_pos(op, routed_row_pos, T, topk, zero_padding)
    q, scales = _outputs(op, x, cap, K, layout, q, scales)
    check_cuda(op, ("x", x), ("sorted_token_ids", sorted_token_ids), ("total_rows", total_rows), ("q", q),
               ("scales", scales), *((("routed_row_pos", routed_row_pos),) if routed_row_pos is not None else ()))
    if cap == 0:
        return q, scales
    _launch(op, x, q, scales, sorted_token_ids, total_rows, T, cap, K, layout, True, topk, stream, arch, max_ctas,
            zero_padding, row_pos=routed_row_pos, pdl=pdl)
    if default_call and total_rows.numel() == 1:
        _remember_routed(x, None, sorted_token_ids, topk, layout, scales, zero_padding, routed_row_pos)
    return q, scales


def mxfp8_gather_routed(xq: torch.Tensor, xs: torch.Tensor, sorted_token_ids: torch.Tensor, total_rows: torch.Tensor,
                        topk: int, *, layout: str = "swizzled", q: torch.Tensor | None = None,
                        scales: torch.Tensor | None = None, stream=None, arch: str | None = None,
                        max_ctas: int | None = None, zero_padding: bool = True,
                        routed_row_pos: torch.Tensor | None = None, pdl: bool = False):
    """:func:`mxfp8_quantize_routed` for tokens already quantized (:func:`mxfp8_quantize`,
    ``layout="plain"``: ``xq [T, K]`` e4m3, ``xs [T, K/32]`` uint8): the routed rows' 32-byte
    blocks and scale bytes gathered into the expert-sorted, tile-padded order and ``layout``.
    MXFP8 quantizes each row on its own, so ``mxfp8_gather_routed(*mxfp8_quantize(x), ...)``
    equals ``mxfp8_quantize_routed(x, ...)`` byte for byte. Why: the tokens can be quantized on
    a side stream while the router runs; what stays on the critical path after the router
    reads a byte per element instead of two and computes nothing. ``pdl``: as in
    :func:`mxfp8_quantize`."""
    default_call = stream is None and arch is None and max_ctas is None and pdl is False
    if default_call and _routed_hot_path(xq, xs, sorted_token_ids, total_rows, topk, layout, q, scales,
                                         zero_padding, routed_row_pos):
        return q, scales
    op = "mxfp8_gather_routed"
    check_bool(op, "pdl", pdl)
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    check_tensor(op, "xq", xq, dtype=torch.float8_e4m3fn, ndim=2, contiguous=True, align_bytes=16)
    T, K = xq.shape
    if K % MX_BLOCK:
        raise ValueError(f"{op}: xq.shape[1]={K} must be a multiple of {MX_BLOCK} (the MX block)")
    check_int32_indexable(op, "xq", T * K)
    check_tensor(op, "xs", xs, dtype=torch.uint8, shape=(T, K // MX_BLOCK), contiguous=True, align_bytes=0)
    cap = _check_routing(op, sorted_token_ids, total_rows, topk, zero_padding, K)
    _check_row_pos(op, routed_row_pos, T, topk, zero_padding)
    q, scales = _outputs(op, xq, cap, K, layout, q, scales)
    check_cuda(op, ("xq", xq), ("xs", xs), ("sorted_token_ids", sorted_token_ids), ("total_rows", total_rows),
               ("q", q), ("scales", scales),
               *((("routed_row_pos", routed_row_pos),) if routed_row_pos is not None else ()))
    if cap == 0:
        return q, scales
    _launch(op, xq, q, scales, sorted_token_ids, total_rows, T, cap, K, layout, True, topk, stream, arch, max_ctas,
            zero_padding, xs=xs, row_pos=routed_row_pos, pdl=pdl)
    if default_call and total_rows.numel() == 1:
        _remember_routed(xq, xs, sorted_token_ids, topk, layout, scales, zero_padding, routed_row_pos)
    return q, scales

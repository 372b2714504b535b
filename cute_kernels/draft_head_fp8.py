"""The speculative draft's LM head in FP8 on Hopper: per-row argmax-preserving scores.

The draft proposes ``d = argmax_v (h @ W^T)[v]`` per row of ``h [B, C]`` (bf16) against the
LM head ``W [V, C]`` -- five such reads of ``W`` per draft step. Here::

    scores[b, v] = sum_c e4m3(h[b, c] * s_b) * e4m3(W[v, c] * s_w)     (FP32 accumulation, bf16 out)

with one positive scale per row of ``h`` (``s_b = 448 / max|h[b]|``) and one for the whole of
``W`` (``s_w = 448 / max|W|``, made once): ``scores[b] = s_b * s_w * logits[b]`` up to the
e4m3 rounding, so each row's argmax -- all the draft needs -- is the logits' argmax up to that
rounding, and no epilogue rescale is needed. Per-row weight scales would reorder a row;
hence one scale for ``W``. ``W``'s bytes halve against bf16; unlike the MX block-scaled
expert kernel (:mod:`moe.experts_swap_ab_sm90`, which promotes an FP32 fragment per 32-wide K
block and is bound by that at 64 live rows), the wgmma accumulates across all of K.

Kernel: the project's Hopper TMA + wgmma engine (:mod:`cute_kernels.gemm.sm90_gemm`, e4m3
operands, both K-major) over ``A = h_q (M=B, K=C)``, ``B = W_q (N=V, K=C)``, ``C = scores
(M=B, N=V)``: rows past ``B`` are clipped by TMA, so one compile serves every batch.

Constraints: ``C % 64 == 0`` (whole K tiles, 16-byte TMA rows), ``V % 8 == 0`` (16-byte
score rows); sm_90a only (other archs: the PyTorch reference, for tests). Status: compiled and
machine-code checked on the CPU; GPU tests in ``tests/test_draft_head_fp8.py`` and
``tests/test_spec_decode.py -k draft_head``.

    pytest tests/test_draft_head_fp8.py tests/test_spec_decode.py -k draft_head
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from . import jit
from .arch import current_arch, dispatch
from .gemm.sm90_gemm import Sm90Gemm
from .validate import check_cuda, check_int32_indexable, check_tensor

E4M3_MAX = 448.0
F8 = torch.float8_e4m3fn


class DraftHeadFp8Sm90:
    """Compile-time configuration: vocab ``V``, hidden ``C``, CTA tile."""

    #: 64-row tiles (one covers a draft batch of up to 64), 256-wide vocab tiles: 505 CTAs at
    #: vocab 129280 (an unmeasured choice; bench/bench_draft_head.py times it)
    TILE = (64, 256)

    def __init__(self, V: int, C: int, tile_mn: tuple[int, int]):
        self.V, self.C = V, C
        self.gemm = Sm90Gemm(tile_mn)

    @cute.jit
    def __call__(self, h_ptr: cute.Pointer, w_ptr: cute.Pointer, out_ptr: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        V, C = self.V, self.C
        a = cute.make_tensor(h_ptr, cute.make_layout((rows, C, 1), stride=(C, 1, rows * C)))
        b = cute.make_tensor(w_ptr, cute.make_layout((V, C, 1), stride=(C, 1, V * C)))
        c = cute.make_tensor(out_ptr, cute.make_layout((rows, V, 1), stride=(V, 1, rows * V)))
        self.gemm(a, b, c, stream)

    @staticmethod
    def can_implement(V: int, C: int) -> bool:
        return V > 0 and C > 0 and C % 64 == 0 and V % 8 == 0


def _build(arch: str, *, V: int, C: int, tile_m: int = 64, tile_n: int = 256):
    if not DraftHeadFp8Sm90.can_implement(V, C):
        raise ValueError(f"draft_head_fp8: unsupported V={V}, C={C} (C % 64 == 0, V % 8 == 0)")
    P = jit.fake_gmem_ptr
    args = (P(cutlass.Float8E4M3FN, 16), P(cutlass.Float8E4M3FN, 16), P(cutlass.BFloat16, 16), Int32(64),
            jit.fake_stream())
    return DraftHeadFp8Sm90(V, C, (tile_m, tile_n)), args


KERNEL = jit.register(jit.KernelDef(
    name="draft_head_fp8",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "gemm", "sm90_gemm.py")),
    archs=("sm_90a",),
    aot_configs=(dict(V=129280, C=7168),),
    description="draft LM head, e4m3 x e4m3 wgmma, argmax-preserving scores",
))


def quantize_head(lm_head: torch.Tensor) -> tuple[torch.Tensor, float]:
    """bf16 ``[V, C]`` -> (e4m3 ``[V, C]``, its one scale ``s_w``); offline, once."""
    check_tensor("quantize_head", "lm_head", lm_head, dtype=torch.bfloat16, ndim=2, contiguous=True)
    amax = float(lm_head.abs().max())
    if not amax > 0 or amax == float("inf"):
        raise ValueError(f"quantize_head: lm_head's max |value| is {amax}: need a finite, non-zero head")
    s_w = E4M3_MAX / amax
    return (lm_head.float() * s_w).to(F8), s_w


def quantize_rows(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:B] = e4m3(h * 448 / max|h[b]|)`` per row (an all-zero row stays zero)."""
    amax = h.abs().amax(-1, keepdim=True).float()
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    return out[: h.shape[0]].copy_((h.float() * scale).to(F8))


def draft_head_scores(h: torch.Tensor, w_q: torch.Tensor, *, h_q: torch.Tensor, out: torch.Tensor,
                      stream=None, arch: str | None = None) -> torch.Tensor:
    """``out[:B]`` = bf16 scores whose per-row argmax is the draft token (module docstring).

    ``h [B, C]`` bf16; ``w_q [V, C]`` e4m3 from :func:`quantize_head`; ``h_q [>= B, C]`` e4m3
    and ``out [>= B, V]`` bf16 are caller-owned buffers (nothing is allocated but the row
    quantisation's temporaries). Returns ``out[:B]``.
    """
    op = "draft_head_scores"
    check_tensor(op, "h", h, dtype=torch.bfloat16, ndim=2, contiguous=True)
    check_tensor(op, "w_q", w_q, dtype=F8, ndim=2, contiguous=True, align_bytes=16)
    B, C = h.shape
    V, Cw = w_q.shape
    if Cw != C:
        raise ValueError(f"{op}: w_q.shape[1] = {Cw} must equal h.shape[1] = {C}")
    if not DraftHeadFp8Sm90.can_implement(V, C):
        raise ValueError(f"{op}: need hidden % 64 == 0 and vocab % 8 == 0, got hidden={C}, vocab={V}")
    check_tensor(op, "h_q", h_q, dtype=F8, ndim=2, contiguous=True, align_bytes=16)
    check_tensor(op, "out", out, dtype=torch.bfloat16, ndim=2, contiguous=True, align_bytes=16)
    if h_q.shape[0] < B or h_q.shape[1] != C:
        raise ValueError(f"{op}: h_q must be [>= {B}, {C}], got {list(h_q.shape)}")
    if out.shape[0] < B or out.shape[1] != V:
        raise ValueError(f"{op}: out must be [>= {B}, {V}], got {list(out.shape)}")
    check_int32_indexable(op, "out / w_q", max(out.shape[0] * V, V * C))
    check_cuda(op, ("h", h), ("w_q", w_q), ("h_q", h_q), ("out", out))
    quantize_rows(h, h_q)
    if B == 0:
        return out[:0]
    a = arch if arch is not None else current_arch(h.device)
    if dispatch(op, ("sm90", "reference"), arch=a) == "reference":
        return out[:B].copy_(h_q[:B].float() @ w_q.float().T)
    tm, tn = DraftHeadFp8Sm90.TILE
    fn = jit.get_kernel("draft_head_fp8", a, V=V, C=C, tile_m=tm, tile_n=tn)
    P = jit.gmem_ptr
    fn(P(cutlass.Float8E4M3FN, h_q, 16), P(cutlass.Float8E4M3FN, w_q, 16), P(cutlass.BFloat16, out, 16),
       jit.i32(B), jit.cu_stream(stream))
    return out[:B]

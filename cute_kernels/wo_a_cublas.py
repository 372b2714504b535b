"""WO-A through cuBLAS, storing the token-major output itself (no transposing copy).

Viewed as ``[G, T, R]`` with strides ``(R, G*R, 1)``, token-major ``y [T, G*R]`` is a valid
strided-batched C (leading dimension G*R, batch stride R), and ``o [T, G*Dg]`` viewed as
``[G, T, Dg]`` a valid A, so one ``torch.bmm(..., out=)`` -- one cuBLAS kernel, no copy --
computes WO-A (FP32 accumulation, one rounding to bf16, as the CuTe kernels). On the H200 it
runs as fast as the group-major ``bmm`` alone, and over measured T ranges faster than this
project's Hopper kernels; :func:`cute_kernels.wo_a.route` takes it there
(:data:`cute_kernels.wo_a.SM90_CUBLAS_T`).

Constraints: a CUDA device PyTorch's cuBLAS serves; bf16; the stream is the caller's (an
explicit one is entered as PyTorch's current stream for the call); capturable in CUDA graphs;
it allocates nothing (PyTorch's cuBLAS workspace is per handle and stream, created on a
stream's first call -- warm up outside capture, as with the CuTe kernels' first compile). Not
a programmatic dependent launch.

    pytest tests/test_wo_a.py -k cublas
"""

from __future__ import annotations

import torch

_EXTERNAL_STREAMS: dict[int, torch.cuda.ExternalStream] = {}


def _torch_stream(stream):
    """The caller's stream as a torch stream (None: the current one; an int: a raw
    ``cudaStream_t``, wrapped once per handle)."""
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return stream
    handle = stream if isinstance(stream, int) else int(stream.cuda_stream)
    s = _EXTERNAL_STREAMS.get(handle)
    if s is None:
        s = _EXTERNAL_STREAMS[handle] = torch.cuda.ExternalStream(handle)
    return s


def wo_a_cublas(o: torch.Tensor, w: torch.Tensor, out: torch.Tensor, stream=None) -> torch.Tensor:
    """``out [T, G*R]`` = WO-A of ``o [T, H, Dv]`` and ``w [G, R, Dg]`` by one strided-batched
    cuBLAS GEMM into ``out``'s token-major storage. The caller (:func:`cute_kernels.wo_a.wo_a`)
    has validated dtypes, shapes, contiguity and devices."""
    T = o.shape[0]
    G, R, Dg = w.shape
    a = o.view(T, G, Dg).transpose(0, 1)
    b = w.transpose(1, 2)
    c = out.view(T, G, R).transpose(0, 1)
    s = _torch_stream(stream)
    if s is None:
        torch.bmm(a, b, out=c)
    else:
        with torch.cuda.stream(s):
            torch.bmm(a, b, out=c)
    return out

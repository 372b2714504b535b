"""Tensor entries (``cute_kernels.jit.get_tensor_kernel``): with TVM-FFI on, an entry point's
calls after its first validated one hand the torch tensors to a TVM-FFI function that checks
them in C. The launch must be the pointer launch's, bit for bit, on the current stream and in
a graph; an input the C checks or the hot path refuse must still get the entry point's named
error with nothing launched. (row_rms: the same in ``tests/test_row_rms.py``.)

CPU: the tensor entries compile for sm_90a and sm_100a, and the AOT build leaves them out."""

import pytest
import torch

from cute_kernels import catalog, jit

ENTRIES = {"row_rms_tensors": dict(hidden=7168), "mhc_pre_mix_tensors": dict(n=4, hidden=4096),
           "mhc_post_mix_tensors": dict(n=4, hidden=4096),
           "moe_finalize_tensors": dict(hidden=4096, topk=6, add_shared=True)}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_tensor_entry_compiles(name, arch):
    pytest.importorskip("tvm_ffi")
    kdef = catalog.kernels()[name]
    assert kdef.tensor_entry_of and kdef.tensor_entry_of in catalog.kernels()
    assert not [k for k, _ in jit.iter_aot(catalog.kernels(), arch=arch) if k.name == name]
    fn = jit.compile_now(kdef, arch, ENTRIES[name], options=f"{jit.default_options(arch)} {jit.TVM_FFI_OPTION}").fn
    assert callable(fn)


def _cases():
    """(name, call(out) -> out, fresh() re-randomising the inputs in place, out, bad calls) per op."""
    from cute_kernels.mhc_post_mix import mhc_post_mix
    from cute_kernels.mhc_pre_mix import mhc_pre_mix
    from moe.finalize import moe_finalize

    T, n, C, k, rows = 6, 4, 4096, 6, 48
    bf = lambda *s: torch.randn(*s, device="cuda").bfloat16()  # noqa: E731
    x, h, f = bf(T, n, C), torch.rand(T, 2 * n + n * n, device="cuda"), bf(T, C)
    xx = bf(T + 1, n, C)  # two overlapping [T, n, C] views
    y, w, sh = bf(rows, C), torch.rand(T, k, device="cuda"), bf(T, C)
    pos = torch.randperm(rows, device="cuda")[:T * k].int()

    def fresh():
        for t in (x, h, f, y, w, sh):
            t.copy_(torch.randn_like(t.float()).to(t.dtype))

    cases = [
        ("mhc_pre_mix", lambda out, **kw: mhc_pre_mix(x, h, out=out, **kw), torch.empty(T, C, device="cuda").bfloat16(),
         [(lambda out: mhc_pre_mix(x.float(), h, out=out), TypeError, "x must have dtype"),
          (lambda out: mhc_pre_mix(x, h[:5], out=out), ValueError, "h must have shape"),
          (lambda out: mhc_pre_mix(x, h.double(), out=out), TypeError, "h must have dtype"),
          (lambda out: mhc_pre_mix(x.transpose(1, 2).contiguous().transpose(1, 2), h, out=out), ValueError,
           "contiguous")]),
        ("mhc_post_mix", lambda out, **kw: mhc_post_mix(x, h, f, out=out, **kw), torch.empty_like(x),
         [(lambda out: mhc_post_mix(x, h, f[:, :C // 2], out=out), ValueError, "f must have shape"),
          (lambda out: mhc_post_mix(x, h, f.cpu(), out=out), ValueError, "CUDA tensor"),
          (lambda out: mhc_post_mix(xx[:T], h, f, out=xx[1:]), ValueError, "overlap")]),
        ("moe_finalize", lambda out, **kw: moe_finalize(y, w, pos, sh, out=out, **kw), torch.empty(T, C, device="cuda")
         .bfloat16(),
         [(lambda out: moe_finalize(y, w, pos[:-1], sh, out=out), ValueError, "routed_row_pos must have shape"),
          (lambda out: moe_finalize(y, w, pos.long(), sh, out=out), TypeError, "routed_row_pos must have dtype"),
          (lambda out: moe_finalize(y, w, pos, sh[:5], out=out), ValueError, "shared must have shape"),
          (lambda out: moe_finalize(y[:, :C // 2], w, pos, sh, out=out), ValueError, "shape")]),
    ]
    return cases, fresh


@pytest.mark.gpu
def test_tensor_entries_equal_the_pointer_launch_and_refuse_by_name(seed):
    pytest.importorskip("tvm_ffi")
    import cute_kernels.mhc_post_mix as post
    import cute_kernels.mhc_pre_mix as pre
    import moe.finalize as fin

    cases, fresh = _cases()
    memos = {"mhc_pre_mix": pre._TENSOR_FNS, "mhc_post_mix": post._TENSOR_FNS, "moe_finalize": fin._TENSOR_FNS}
    for name, call, out, bad in cases:
        want = out.clone()
        jit.use_tvm_ffi()
        try:
            call(out)  # first call: validated, memoises the tensor entry
            assert memos[name], f"{name}: no tensor entry memoised"
            for _ in range(3):
                fresh()
                jit.use_tvm_ffi(False)
                call(want)  # the pointer launch
                jit.use_tvm_ffi()
                out.fill_(float("nan"))
                assert call(out) is out
                torch.cuda.synchronize()
                assert torch.equal(out, want), name
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out.fill_(float("nan"))
                call(out)
            s.synchronize()
            assert torch.equal(out, want), f"{name} on a side stream"
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call(out)
            fresh()
            jit.use_tvm_ffi(False)
            call(want)
            jit.use_tvm_ffi()
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"{name} in a graph"
            poisoned = torch.full_like(out, float("nan"))
            for make, exc, words in bad:
                with pytest.raises(exc, match=words):
                    make(poisoned)
            torch.cuda.synchronize()
            assert poisoned.float().isnan().all(), f"{name}: a refused call wrote its output"
        finally:
            jit.use_tvm_ffi(False)

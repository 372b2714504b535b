"""Tensor entries (``cute_kernels.jit.get_tensor_kernel``): with TVM-FFI on, an entry point's
calls after its first validated one hand the torch tensors to a TVM-FFI function that checks
them in C. The launch must be the pointer launch's, bit for bit, on the current stream and in
a graph; an input the C checks or the hot path refuse must still get the entry point's named
error with nothing launched. (row_rms: the same in ``tests/test_row_rms.py``.)

CPU: the tensor entries compile for sm_90a and sm_100a, with TVM-FFI in their key's options; the
AOT build compiles them only when asked (``--tensor-entries``)."""

import pytest
import torch

from cute_kernels import catalog, jit

ENTRIES = {"row_rms_tensors": dict(hidden=7168), "mhc_pre_mix_tensors": dict(n=4, hidden=4096),
           "mhc_post_mix_tensors": dict(n=4, hidden=4096),
           "moe_finalize_tensors": dict(hidden=4096, topk=6, add_shared=True),
           "mxfp8_quantize_tensors": dict(K=4096), "rms_norm_tensors": dict(hidden=512, weighted=False, rope_dim=64, rank=3),
           "masked_softmax_tensors": dict(length=592, heads=16, mask_stride=608, lead_dims=2),
           "moe_router_tensors": dict(num_experts=256, n_group=1, topk_group=1, top_k=6, routed_scaling_factor=1.5,
                                      tile_m=16, logits_dtype="float32", has_bias=True, score="sqrtsoftplus",
                                      single_cta=True),
           "moe_router_buffer_tensors": dict(num_experts=256, n_group=1, topk_group=1, top_k=6,
                                             routed_scaling_factor=1.5, tile_m=16, logits_dtype="float32",
                                             has_bias=False, score="sqrtsoftplus", hash_routed=True,
                                             cluster=8),
           "mhc_stats_tensors": dict(n=4, hidden=4096, sinkhorn_iters=20, hc_eps=1e-6),
           "wo_a_decode_tensors": dict(G=8, R=1024, Dg=4096, bm=16, bn=32, splits=1, stages=6),
           "wo_a_decode_swap_ab_tensors": dict(G=16, R=1024, Dg=4096, tok_n=8, stages=4, bk=64),
           "wo_a_decode_fp8_tensors": dict(G=8, R=1024, Dg=4096, bm=16, bn=32, splits=1, stages=6),
           "mxfp8_quantize_routed_tensors": dict(K=4096, layout="swizzled", topk=6, zero_padding=False,
                                                 prequantized=True),
           "moe_expert_swap_ab_sm90_tensors": dict(E=256, N=4096, K=4096, tok_n=16, silu_quant=True,
                                                   swiglu_limit=10.0),
           "moe_expert_gemm_tiled_sm90_tensors": dict(E=256, N=4096, K=2048, silu_quant=False, tile_k=256, stages=2,
                                                      ctas_per_sm=2),
           "indexer_topk_tensors": dict(topk=512, compress_ratio=4),
           "indexer_topk_split_tensors": dict(topk=512, compress_ratio=4, cluster=8, items=8),
           "wo_a_fp8_act_sm90_tensors": dict(G=8, R=1024, Dg=4096, tok_n=16, stages=8)}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_tensor_entry_compiles(name, arch):
    pytest.importorskip("tvm_ffi")
    kdef = catalog.kernels()[name]
    if arch not in kdef.archs:
        pytest.skip(f"{name} has no {arch} path")
    assert kdef.tensor_entry_of and kdef.tensor_entry_of in catalog.kernels()
    assert not [k for k, _ in jit.iter_aot(catalog.kernels(), arch=arch) if k.name == name]
    built = [c for k, c in jit.iter_aot(catalog.kernels(), arch=arch, tensor_entries=True) if k.name == name]
    # every AOT config (WO-A's decode kernels: those its default route takes, none on sm_100a)
    assert built or (arch == "sm_100a" and name.startswith("wo_a_decode"))
    assert jit.CacheKey.make(kdef, arch, ENTRIES[name]).options == jit.entry_options(kdef, arch)
    fn = jit.compile_now(kdef, arch, ENTRIES[name], options=jit.entry_options(kdef, arch)).fn
    assert callable(fn)


def _cases():
    """(name, call(out) -> out, fresh() re-randomising the inputs in place, out, bad calls) per op."""
    from cute_kernels.mhc_post_mix import mhc_post_mix
    from cute_kernels.mhc_pre_mix import mhc_pre_mix
    from cute_kernels.masked_softmax import masked_softmax
    from cute_kernels.rms_norm import rms_norm
    from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_split_phi, mhc_stats
    from cute_kernels.indexer_topk import IndexerWorkspace, indexer_select
    from cute_kernels.wo_a import wo_a
    from cute_kernels.wo_a_decode_fp8 import quantize_wo_a_fp8, wo_a_fp8
    from cute_kernels.wo_a_fp8_act_sm90 import wo_a_fp8_act
    from moe.finalize import moe_finalize

    T, n, C, k, rows = 6, 4, 4096, 6, 48
    bf = lambda *s: torch.randn(*s, device="cuda").bfloat16()  # noqa: E731
    x, h, f = bf(T, n, C), torch.rand(T, 2 * n + n * n, device="cuda"), bf(T, C)
    rn = bf(T, C)  # rms_norm's input, and its weight below
    rw = bf(C)
    qh, kv, kw_ = bf(T, 64, 512), bf(T, 512), bf(512)  # the V4 norms with RoPE on the last 64 features
    ang = torch.rand(T, 32, device="cuda") * 6.3
    cs = torch.stack([ang.cos(), ang.sin()], -1)
    sc, mask = bf(T, 16, 592), torch.rand(T, 608, device="cuda") < 0.7  # masked_softmax's scores, mask
    sc4, mask4 = sc.view(2, T // 2, 16, 592), mask.view(2, T // 2, 608)
    xx = bf(T + 1, n, C)  # two overlapping [T, n, C] views
    y, w, sh = bf(rows, C), torch.rand(T, k, device="cuda"), bf(T, C)
    pos = torch.randperm(rows, device="cuda")[:T * k].int()
    # bf16 WO-A where the default route takes a decode kernel (G = 8: the split-K warp-MMA one,
    # G = 16: the wgmma one), o [T, H, 512], Dg = 2048 -- V4's Dg = 4096 takes cuBLAS at T <= 32
    # on the H100 / H200, and cuBLAS has no tensor entry
    wo = {G: (bf(T, 4 * G, 512), bf(G, 1024, 2048) / 64) for G in (8, 16)}
    o4 = bf(T, 64, 512)  # FP8 WO-A at V4-Flash's shape (G = 8, Dg = 4096)
    w8, s8 = quantize_wo_a_fp8(bf(8, 1024, 4096) / 64)  # the checkpoint's format: e4m3, 128 x 128 block scales
    # MXFP8 activations for wo_a_fp8_act: e4m3 values and UE8M0 block scales near 1
    q8 = torch.randn(T, 64, 512, device="cuda").to(torch.float8_e4m3fn)
    qs8 = torch.randint(120, 130, (T, 8 * 4096 // 32), device="cuda").to(torch.uint8)
    # V4-Flash's CSA indexer select: top-512 of compressed entries (ratio 4) over score rows
    iws = IndexerWorkspace(T + 2, 3000, device="cuda")
    kv_len = torch.tensor([3000, 2500, 17, 1, 3000, 700], dtype=torch.int32, device="cuda")
    ipos = torch.tensor([11999, 9000, 70, 3, 2047, 2799], dtype=torch.int32, device="cuda")

    def fresh():
        for t in (x, h, f, y, w, sh, rn, rw, sc, wo[8][0], wo[16][0], o4, qh, kv, kw_, iws.scores, q8):
            t.copy_(torch.randn_like(t.float()).to(t.dtype))
        qs8.copy_(torch.randint(120, 130, qs8.shape, device="cuda").to(torch.uint8))
        mask.copy_(torch.rand(T, 608, device="cuda") < 0.7)

    cases = [(f"wo_a G={G}", lambda out, G=G, **kw: wo_a(*wo[G], out=out, **kw),
              torch.empty(T, G * 1024, device="cuda").bfloat16(),
              [(lambda out, G=G: wo_a(wo[G][0].float(), wo[G][1], out=out), TypeError, "o must have dtype"),
               (lambda out, G=G: wo_a(wo[G][0], wo[G][1][:, :512].contiguous(), out=out), ValueError,
                "out must have shape"),
               (lambda out, G=G: wo_a(wo[G][0], wo[G][1], out=out[:5]), ValueError, "out must have shape"),
               (lambda out, G=G: wo_a(wo[G][0].transpose(1, 2), wo[G][1], out=out), ValueError, "contiguous")])
             for G in (8, 16)]
    cases.append(("wo_a_fp8", lambda out, **kw: wo_a_fp8(o4, w8, s8, out=out, **kw),
                  torch.empty(T, 8 * 1024, device="cuda").bfloat16(),
                  [(lambda out: wo_a_fp8(o4, w8, s8[:, :4], out=out), ValueError, "scale must have shape"),
                   (lambda out: wo_a_fp8(o4, w8.view(torch.uint8), s8, out=out), TypeError,
                    "w must have dtype"),
                   (lambda out: wo_a_fp8(o4, w8, s8, out=out[:5]), ValueError, "out must have shape")]))
    cases.append(("wo_a_fp8_act", lambda out, **kw: wo_a_fp8_act(q8, qs8, w8, s8, out=out, **kw),
                  torch.empty(T, 8 * 1024, device="cuda").bfloat16(),
                  [(lambda out: wo_a_fp8_act(q8, qs8[:, :512], w8, s8, out=out), ValueError,
                    "q_scales must have shape"),
                   (lambda out: wo_a_fp8_act(q8, qs8, w8, s8[:, :4], out=out), ValueError, "w_scale must have shape"),
                   (lambda out: wo_a_fp8_act(q8, qs8, w8, s8, out=out[:5]), ValueError, "out must have shape")]))
    cases.append(("indexer_select", lambda out, **kw: indexer_select(iws, kv_len, ipos, topk=512, compress_ratio=4,
                                                                     out=out, **kw),
                  torch.empty(T, 512, dtype=torch.int32, device="cuda"),
                  [(lambda out: indexer_select(iws, kv_len.long(), ipos, topk=512, compress_ratio=4, out=out),
                    TypeError, "kv_len must have dtype"),
                   (lambda out: indexer_select(iws, kv_len, ipos[:3], topk=512, compress_ratio=4, out=out), ValueError,
                    "pos must have shape"),
                   (lambda out: indexer_select(iws, kv_len, ipos, topk=512, compress_ratio=4, out=out[:, :100]),
                    ValueError, "out must have shape")]))
    phi = mhc_split_phi(torch.randn(2 * n + n * n, n * C, device="cuda") / (n * C) ** 0.5)
    alpha, bias, ws = torch.rand(3, device="cuda") + 0.5, torch.randn(2 * n + n * n, device="cuda"), \
        MhcStatsWorkspace(n, T, device="cuda")
    cases.append(("mhc_stats", lambda out, **kw: mhc_stats(x, phi, alpha, bias, hc_eps=1e-6, workspace=ws, out=out,
                                                           **kw), torch.empty(T, 2 * n + n * n, device="cuda"),
                  [(lambda out: mhc_stats(x, phi.float(), alpha, bias, hc_eps=1e-6, workspace=ws, out=out), ValueError,
                    "phi must have shape"),
                   (lambda out: mhc_stats(x, phi, alpha[:2], bias, hc_eps=1e-6, workspace=ws, out=out), ValueError,
                    "alpha must have shape"),
                   (lambda out: mhc_stats(x, phi, alpha, bias, hc_eps=1e-6, workspace=MhcStatsWorkspace(n, T - 1),
                                          out=out), ValueError, "workspace is for"),
                   (lambda out: mhc_stats(x, phi, alpha, bias, hc_eps=1e-6, workspace=ws, out=out[:, :8]), ValueError,
                    "out must have shape")]))
    cases += [
        ("masked_softmax", lambda out, **kw: masked_softmax(sc, mask, out=out, **kw), torch.empty_like(sc),
         [(lambda out: masked_softmax(sc, mask.byte(), out=out), TypeError, "mask must have dtype"),
          (lambda out: masked_softmax(sc, mask[:5], out=out), ValueError, "mask must be"),
          (lambda out: masked_softmax(sc, mask[:, :584].contiguous(), out=out), ValueError, "mask.shape"),
          (lambda out: masked_softmax(sc, mask, out=out[:, :8]), ValueError, "out must have shape")]),
        # two lead dims: [B, S, H, M] scores, [B, S, W] mask (the runtime's [batch, step] form)
        ("masked_softmax 4-D", lambda out, **kw: masked_softmax(sc4, mask4, out=out, **kw), torch.empty_like(sc4),
         [(lambda out: masked_softmax(sc4, mask4[:, :1].contiguous(), out=out), ValueError, "mask must be"),
          (lambda out: masked_softmax(sc4, mask4, out=out[:1]), ValueError, "out must have shape")]),
        ("rms_norm", lambda out, **kw: rms_norm(rn, 1e-6, rw, out=out, **kw), torch.empty_like(rn),
         [(lambda out: rms_norm(rn, 1e-6, rw[:C // 2], out=out), ValueError, "weight must have shape"),
          (lambda out: rms_norm(rn, 1e-6, rw.float(), out=out), TypeError, "weight must have dtype"),
          (lambda out: rms_norm(rn, 1e-6, rw, out=out[:5]), ValueError, "out must have shape"),
          (lambda out: rms_norm(rn, -1.0, rw, out=out), TypeError, "eps")]),
        # V4's per-head q norm + RoPE ([T, H, 512], no weight) and its KV norm + RoPE ([T, 512], weighted)
        ("rms_norm per head", lambda out, **kw: rms_norm(qh, 1e-6, None, rotate=cs, out=out, **kw), torch.empty_like(qh),
         [(lambda out: rms_norm(qh, 1e-6, None, rotate=cs[..., :1].contiguous(), out=out), ValueError, "rotate must be"),
          (lambda out: rms_norm(qh, 1e-6, None, rotate=cs.double(), out=out), TypeError, "rotate must have dtype"),
          (lambda out: rms_norm(qh, 1e-6, None, rotate=cs[:5], out=out), ValueError, "groups")]),
        ("rms_norm kv", lambda out, **kw: rms_norm(kv, 1e-6, kw_, rotate=cs, out=out, **kw), torch.empty_like(kv),
         [(lambda out: rms_norm(kv, 1e-6, kw_[:256], rotate=cs, out=out), ValueError, "weight must have shape"),
          (lambda out: rms_norm(kv, 1e-6, kw_, rotate=cs, out=out[:, :256]), ValueError, "out must have shape")]),
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
          (lambda out: moe_finalize(y[:, :C // 2].contiguous(), w, pos, sh, out=out), ValueError, "shape"),
          (lambda out: moe_finalize(y[:, :C // 2], w, pos, sh, out=out), ValueError, "y must be contiguous")]),
    ]
    return cases, fresh


def _pointer_path_forbidden(*args, **kwargs):
    raise AssertionError("the call took the validated pointer path, not its tensor entry")


def _through_tensor_entry(monkeypatch, call, reference, steps):
    """For each step (``"eager"``, ``"side stream"`` or ``"graph"``): ``reference()`` with TVM-FFI
    off (fresh inputs, the pointer launch), then ``call()`` with TVM-FFI on and the pointer path
    forbidden -- eagerly, on a side stream, or captured (then new inputs through
    ``reference()`` and a replay); yields the step once the GPU is done, for the caller's check."""
    for step in steps:
        jit.use_tvm_ffi(False)
        reference()
        jit.use_tvm_ffi()
        with monkeypatch.context() as m:
            m.setattr(jit, "get_kernel", _pointer_path_forbidden)
            if step == "eager":
                call()
            elif step == "side stream":
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call()
                torch.cuda.current_stream().wait_stream(s)
            else:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call()
        if step == "graph":  # new inputs after the capture (the pointer launch allowed again), then the replay
            jit.use_tvm_ffi(False)
            reference()
            g.replay()
            jit.use_tvm_ffi()
        torch.cuda.synchronize()
        yield step


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no kernel writes: NaN (floating point) or the type's minimum
    (integer indices)."""
    return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


@pytest.mark.gpu
def test_tensor_entries_equal_the_pointer_launch_and_refuse_by_name(seed, monkeypatch):
    """Per op: after its first (validated) call, every call -- eager, on a side stream, captured
    -- goes through the tensor entry (the pointer path's kernel lookup is made to fail), and
    its output equals the pointer launch's bit for bit on fresh inputs."""
    pytest.importorskip("tvm_ffi")
    import cute_kernels.masked_softmax as msm
    import cute_kernels.mhc_post_mix as post
    import cute_kernels.mhc_pre_mix as pre
    import cute_kernels.rms_norm as rms
    import cute_kernels.mhc_stats as stats
    import cute_kernels.wo_a as woa
    import cute_kernels.indexer_topk as itk
    import cute_kernels.wo_a_decode_fp8 as woa8
    import cute_kernels.wo_a_fp8_act_sm90 as woa8a
    import moe.finalize as fin

    cases, fresh = _cases()
    memos = {"masked_softmax": msm._TENSOR_FNS, "rms_norm": rms._TENSOR_FNS, "mhc_pre_mix": pre._TENSOR_FNS,
             "mhc_post_mix": post._TENSOR_FNS, "moe_finalize": fin._TENSOR_FNS, "wo_a G=8": woa._TENSOR_FNS,
             "wo_a G=16": woa._TENSOR_FNS, "mhc_stats": stats._TENSOR_FNS, "rms_norm per head": rms._TENSOR_FNS,
             "rms_norm kv": rms._TENSOR_FNS, "masked_softmax 4-D": msm._TENSOR_FNS, "wo_a_fp8": woa8._TENSOR_FNS,
             "indexer_select": itk._TENSOR_FNS, "wo_a_fp8_act": woa8a._TENSOR_FNS}
    failures = []  # every op is checked; the failures are reported together
    for name, call, out, bad in cases:
        want = out.clone()

        def reference():
            fresh()
            call(want)  # the pointer launch (TVM-FFI off)
            _poison(out)

        try:
            jit.use_tvm_ffi()
            call(out)  # first call: validated, memoises the tensor entry
            assert memos[name], f"{name}: no tensor entry memoised"
            for step in _through_tensor_entry(monkeypatch, lambda: call(out), reference,
                                              ("eager", "eager", "eager", "side stream", "graph")):
                assert torch.equal(out, want), f"{name}: {step}"
            poisoned = _poison(torch.empty_like(out))
            untouched = poisoned.clone()
            for make, exc, words in bad:
                with pytest.raises(exc, match=words):
                    make(poisoned)
            torch.cuda.synchronize()
            # byte for byte: NaN poison compares unequal to itself as a number
            assert torch.equal(poisoned.view(torch.uint8), untouched.view(torch.uint8)), \
                f"{name}: a refused call wrote its output"
        except (AssertionError, pytest.fail.Exception, RuntimeError) as e:
            failures.append(f"{name}: {e}")
        finally:
            jit.use_tvm_ffi(False)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_mxfp8_quantize_tensor_entry_equals_the_pointer_launch(seed):
    """mxfp8_quantize (plain scales, q and scales given): the tensor entry's bytes equal the
    pointer launch's over fresh inputs and in a graph; refused calls are named and write
    nothing."""
    pytest.importorskip("tvm_ffi")
    import moe.quant as mq

    T, K = 6, 4096
    x = torch.randn(T, K, device="cuda").bfloat16()
    q, s = torch.empty(T, K, device="cuda").to(torch.float8_e4m3fn), torch.empty(T, K // 32, device="cuda").byte()
    wq, ws = q.clone(), s.clone()

    def launch(q, s):
        return mq.mxfp8_quantize(x, q=q, scales=s)

    jit.use_tvm_ffi()
    try:
        launch(q, s)
        assert mq._TENSOR_FNS
        g = None
        for replay in (False, True):
            if replay:  # captured after the eager calls loaded the tensor entry
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    launch(q, s)
            for _ in range(2):
                x.copy_(torch.randn(T, K, device="cuda").bfloat16() * 100)
                jit.use_tvm_ffi(False)
                launch(wq, ws)
                jit.use_tvm_ffi()
                q.view(torch.uint8).fill_(0xAB)
                s.fill_(0xAB)
                g.replay() if replay else launch(q, s)
                torch.cuda.synchronize()
                assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
        pq, ps = q.clone().view(torch.uint8).fill_(0xAB).view(torch.float8_e4m3fn), s.clone().fill_(0xAB)
        for kw, exc, words in [(dict(x=x.float()), TypeError, "x must have dtype"),
                               (dict(x=x, scales=ps[:5]), ValueError, "scales must be contiguous"),
                               (dict(x=x, q=pq.view(torch.uint8)), TypeError, "q must have dtype"),
                               (dict(x=x[:, :K // 2]), ValueError, "contiguous")]:
            kw = {"q": pq, "scales": ps, **kw}
            with pytest.raises(exc, match=words):
                mq.mxfp8_quantize(**kw)
        torch.cuda.synchronize()
        assert (pq.view(torch.uint8) == 0xAB).all() and (ps == 0xAB).all()
    finally:
        jit.use_tvm_ffi(False)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["routed", "gather"])
def test_routed_quantization_tensor_entry_equals_the_pointer_launch(seed, monkeypatch, form):
    """mxfp8_quantize_routed / mxfp8_gather_routed (V4-Flash: K = 4096, top-6, swizzled scales,
    padding left unwritten) behind the router's packing at T = 6: after the first call every
    call -- eager, captured -- takes the tensor entry, and the live rows' bytes and every scale
    byte equal the pointer launch's on fresh inputs; a wrong-sized scale buffer (the one size
    the C checks cannot make) and other bad arguments are refused by name."""
    pytest.importorskip("tvm_ffi")
    import moe.quant as mq
    from moe.router import V4_FLASH_ROUTER, MoeRouter

    T, K, k = 6, 4096, 6
    router = MoeRouter(V4_FLASH_ROUTER, max_tokens=T)
    r = router(torch.randn(T, 256, device="cuda"), torch.zeros(256, device="cuda"))
    cap = r.sorted_token_ids.numel()
    x = torch.randn(T, K, device="cuda").bfloat16()
    xq, xs = mq.mxfp8_quantize(x)
    nbytes = mq.scale_buffer_size(cap, K, "swizzled")
    q, s = torch.zeros(cap, K, device="cuda").to(torch.float8_e4m3fn), torch.zeros(nbytes, device="cuda").byte()
    wq, ws = q.clone(), s.clone()
    live = int(r.total_rows[0])

    def call(q, s):
        if form == "gather":
            return mq.mxfp8_gather_routed(xq, xs, r.sorted_token_ids, r.total_rows, k, q=q, scales=s,
                                          zero_padding=False)
        return mq.mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, k, q=q, scales=s, zero_padding=False)

    def fresh():
        x.copy_(torch.randn(T, K, device="cuda").bfloat16() * 10)
        mq.mxfp8_quantize(x, q=xq, scales=xs)
        for t in (wq.view(torch.uint8), ws, q.view(torch.uint8), s):  # padding rows stay unwritten: poisoned alike
            t.fill_(0xAB)
        call(wq, ws)  # the pointer launch (TVM-FFI off)

    try:
        jit.use_tvm_ffi()
        call(q, s)
        assert mq._ROUTED_TENSOR_FNS, "no tensor entry memoised"
        for step in _through_tensor_entry(monkeypatch, lambda: call(q, s), fresh, ("eager", "eager", "graph")):
            assert torch.equal(q.view(torch.uint8)[:live], wq.view(torch.uint8)[:live]), step
            assert torch.equal(s[:mq.scale_buffer_size(live, K, "swizzled")],
                               ws[:mq.scale_buffer_size(live, K, "swizzled")]), step
        pq, ps = q.clone().view(torch.uint8).fill_(0xAB).view(torch.float8_e4m3fn), s.clone().fill_(0xAB)
        with pytest.raises(ValueError, match="scales must be contiguous"):
            call(pq, ps[:-4])
        with pytest.raises(ValueError, match="q must have shape"):
            call(pq[:-1], ps)
        with pytest.raises(TypeError, match="sorted_token_ids must have dtype"):
            mq.mxfp8_quantize_routed(x, r.sorted_token_ids.long(), r.total_rows, k, q=pq, scales=ps,
                                     zero_padding=False)
        torch.cuda.synchronize()
        assert (pq.view(torch.uint8) == 0xAB).all() and (ps == 0xAB).all()
    finally:
        jit.use_tvm_ffi(False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 40], ids=["decode-kernel", "row-passes"])
def test_expert_gemm_tensor_entries_equal_the_pointer_launch(seed, monkeypatch, T):
    """The routed experts as the runtime calls them (V4-Flash's widths on 32 experts: gate/up
    with the SwiGLU clamp and the MXFP8 requantisation fused, then down; the kernel choice of
    expert_kernel_args): after the first calls both take their tensor entries, eager and
    captured, and the live rows equal the pointer launches' bit for bit on fresh inputs; a
    wrong-sized scale buffer (a size the C checks cannot make) and a bad dtype are refused by
    name."""
    pytest.importorskip("tvm_ffi")
    import moe.experts as mx
    from moe.quant import mxfp8_quantize_routed, scale_buffer_size
    from moe.router import MoeRouter, RouterConfig

    E, H, I, k = 32, 4096, 2048, 6
    cfg = RouterConfig(num_experts=E, n_group=1, topk_group=1, top_k=k, routed_scaling_factor=1.5,
                       score="sqrtsoftplus")
    r = MoeRouter(cfg, max_tokens=T)(torch.randn(T, E, device="cuda"), torch.zeros(E, device="cuda"))
    cap = r.sorted_token_ids.numel()
    x = torch.randn(T, H, device="cuda").bfloat16()
    aq, asc = mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, k, zero_padding=False)
    wgu = mx.quantize_expert_weights(mx.interleave_gate_up(*(torch.randn(E, I, H, device="cuda").bfloat16() / 32
                                                             for _ in range(2))))
    wd = mx.quantize_expert_weights(torch.randn(E, H, I, device="cuda").bfloat16() / 32)
    kw = dict(routed_rows=T * k, **mx.expert_kernel_args(T))
    router = (r.expert_offsets, r.expert_counts, r.tile_expert)
    hq, hs = torch.empty(cap, I, device="cuda").to(torch.float8_e4m3fn), \
        torch.empty(scale_buffer_size(cap, I, "swizzled"), device="cuda").byte()
    y = torch.empty(cap, H, device="cuda").bfloat16()
    want = [t.clone() for t in (hq, hs, y)]
    rows = r.sorted_token_ids[:int(r.total_rows[0])]
    live = (rows < T * k).nonzero().flatten()

    def call(hq, hs, y):
        mx.moe_expert_gate_up(aq, asc, *wgu, *router, q_out=hq, scales_out=hs, swiglu_limit=10.0, **kw)
        mx.moe_expert_gemm(hq, hs, *wd, *router, out=y, **kw)

    def fresh():
        x.copy_(torch.randn(T, H, device="cuda").bfloat16())
        mxfp8_quantize_routed(x, r.sorted_token_ids, r.total_rows, k, q=aq, scales=asc, zero_padding=False)
        call(*want)  # the pointer launches (TVM-FFI off)
        for t in (hq, y):
            t.view(torch.uint8).fill_(0xFF)

    try:
        jit.use_tvm_ffi()
        call(hq, hs, y)
        assert len(mx._TENSOR_FNS) >= 2, "no tensor entries memoised"
        for step in _through_tensor_entry(monkeypatch, lambda: call(hq, hs, y), fresh, ("eager", "eager", "graph")):
            assert torch.equal(hq.view(torch.uint8)[live], want[0].view(torch.uint8)[live]), step
            assert torch.equal(y[live], want[2][live]), step
        py = torch.full_like(y, float("nan"))
        with pytest.raises(ValueError, match="scales_out must have shape"):
            mx.moe_expert_gate_up(aq, asc, *wgu, *router, q_out=hq, scales_out=hs[:-16], swiglu_limit=10.0, **kw)
        with pytest.raises(TypeError, match="out must have dtype"):
            mx.moe_expert_gemm(hq, hs, *wd, *router, out=py.float(), **kw)
        with pytest.raises(ValueError, match="a_scales"):
            mx.moe_expert_gemm(hq, hs[:-16], *wd, *router, out=py, **kw)
        torch.cuda.synchronize()
        assert py.isnan().all()
    finally:
        jit.use_tvm_ffi(False)


@pytest.mark.gpu
@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash-routed"])
def test_router_tensor_entry_equals_the_pointer_launch(seed, monkeypatch, hashed):
    """MoeRouter (DeepSeek-V4-Flash's scored and hash-routed configs, T = 6): after its first
    call every call -- eager and captured -- takes the tensor entry, and every output equals a
    second router's pointer launch on the same fresh inputs; a refused call is named."""
    pytest.importorskip("tvm_ffi")
    from moe.router import V4_FLASH_HASH_ROUTER, V4_FLASH_ROUTER, MoeRouter

    cfg = V4_FLASH_HASH_ROUTER if hashed else V4_FLASH_ROUTER
    T, E, k = 6, cfg.num_experts, cfg.top_k
    ours, ref = MoeRouter(cfg, max_tokens=64), MoeRouter(cfg, max_tokens=64)
    logits = torch.randn(T, E, device="cuda")
    bias = None if hashed else torch.randn(E, device="cuda") * 0.1
    ids = torch.randint(0, 1000, (T,), device="cuda", dtype=torch.int32) if hashed else None
    if hashed:
        table = torch.stack([torch.randperm(E)[:k] for _ in range(1000)]).int()
        ours.set_hash_table(table)
        ref.set_hash_table(table)

    def outputs(r):
        total = int(r.total_rows[0])
        return [r.topk_ids[:T], r.topk_weights[:T], r.expert_counts, r.expert_offsets, r.sorted_token_ids[:total],
                r.total_rows, r.routed_row_pos[:T * k]]

    def fresh():
        logits.copy_(torch.randn(T, E, device="cuda"))
        if hashed:
            ids.copy_(torch.randint(0, 1000, (T,), device="cuda", dtype=torch.int32))
        ref(logits, bias, token_ids=ids)  # the pointer launch (TVM-FFI off)
        for t in outputs(ours):
            t.fill_(-7)

    try:
        jit.use_tvm_ffi()
        ours(logits, bias, token_ids=ids)
        assert ours._tensor_fns, "no tensor entry memoised"
        for step in _through_tensor_entry(monkeypatch, lambda: ours(logits, bias, token_ids=ids), fresh,
                                          ("eager", "eager", "graph")):
            for got, want in zip(outputs(ours), outputs(ref)):
                assert torch.equal(got, want), step
        with pytest.raises(TypeError, match="logits must have dtype"):
            ours(logits.double(), bias, token_ids=ids)
        if hashed:
            with pytest.raises(ValueError, match="token_ids must have shape"):
                ours(logits, token_ids=ids[:3])
        else:
            with pytest.raises(ValueError, match="bias must have shape"):
                ours(logits, bias[:10])
    finally:
        jit.use_tvm_ffi(False)


def test_hot_paths_name_a_non_tensor_argument(monkeypatch):
    """With TVM-FFI on, each entry point's tensor-entry hot path reads its tensors' attributes
    only after checking they are tensors: a non-tensor argument still gets the validated
    path's TypeError naming it (CPU: the memo is empty, nothing launches)."""
    from cute_kernels.masked_softmax import masked_softmax
    from cute_kernels.mhc_post_mix import mhc_post_mix
    from cute_kernels.mhc_pre_mix import mhc_pre_mix
    from cute_kernels.mhc_stats import MhcStatsWorkspace, mhc_stats
    from cute_kernels.rms_norm import rms_norm
    from cute_kernels.row_rms import row_rms
    from cute_kernels.wo_a import wo_a
    from cute_kernels.wo_a_decode_fp8 import wo_a_fp8
    from cute_kernels.indexer_topk import IndexerWorkspace, indexer_select
    from moe.experts import moe_expert_gate_up, moe_expert_gemm
    from moe.finalize import moe_finalize
    from moe.quant import mxfp8_gather_routed, mxfp8_quantize, mxfp8_quantize_routed
    from moe.router import MoeRouter

    monkeypatch.setattr(jit, "TVM_FFI", True)
    t, rows, b = torch.zeros(2, 64), [[0.0] * 64] * 2, torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    calls = [
        (lambda: row_rms(rows, out=t[:, 0]), "x must be a torch.Tensor"),
        (lambda: rms_norm(rows, 1e-6, t[0], out=t), "x must be a torch.Tensor"),
        (lambda: masked_softmax(b, rows, out=b), "mask must be a torch.Tensor"),
        (lambda: mhc_pre_mix(rows, t, out=t), "x must be a torch.Tensor"),
        (lambda: mhc_post_mix(rows, t, t, out=t), "x must be a torch.Tensor"),
        (lambda: mhc_stats(rows, t, t, t, workspace=MhcStatsWorkspace(4, 2, device="cpu"), out=t),
         "x must be a torch.Tensor"),
        (lambda: wo_a(rows, t, out=t), "o must be a torch.Tensor"),
        (lambda: moe_finalize(b[0], rows, t, out=b[0]), "topk_weights must be a torch.Tensor"),
        (lambda: mxfp8_quantize(rows, q=t, scales=t), "x must be a torch.Tensor"),
        (lambda: mxfp8_quantize_routed(rows, t, t, 2, q=t, scales=t), "x must be a torch.Tensor"),
        (lambda: mxfp8_quantize_routed(b[0], rows, t, 2, q=t, scales=t), "sorted_token_ids must be a torch.Tensor"),
        (lambda: mxfp8_gather_routed(rows, t, t, t, 2, q=t, scales=t), "xq must be a torch.Tensor"),
        (lambda: wo_a_fp8(rows, t, t, out=t), "o must be a torch.Tensor"),
        (lambda: indexer_select(IndexerWorkspace(2, 8, device="cpu"), rows, t, out=t), "kv_len must be a torch.Tensor"),
        (lambda: moe_expert_gemm(rows, t, t, t, t, t, t, out=t), "a_q must be a torch.Tensor"),
        (lambda: moe_expert_gate_up(rows, t, t, t, t, t, t, q_out=t, scales_out=t), "a_q must be a torch.Tensor"),
        (lambda: MoeRouter(max_tokens=4, device="cpu")(rows), "logits must be a torch.Tensor"),
    ]
    for call, words in calls:
        with pytest.raises(TypeError, match=words):
            call()


def test_an_entry_that_fails_to_build_leaves_the_validated_path(monkeypatch):
    """remember_tensor_entry after a launch: a tensor entry that fails to build or load warns
    once and marks its key, so the call that launched does not fail and later calls take the
    validated path (CPU)."""
    def broken(*args, **kwargs):
        raise RuntimeError("no TVM-FFI here")

    monkeypatch.setattr(jit, "TVM_FFI", True)
    monkeypatch.setattr(jit, "get_tensor_kernel", broken)
    memo = {}
    with pytest.warns(RuntimeWarning, match="row_rms_tensors .* unavailable"):
        jit.remember_tensor_entry(memo, "k", "row_rms_tensors", "sm_90a", hidden=7168)
    assert memo == {"k": None} and not jit.launch_tensor_entry(memo, "k", 1, 2)
    jit.remember_tensor_entry(memo, "k", "row_rms_tensors", "sm_90a", hidden=7168)  # marked: not retried


def test_refused_calls_are_counted():
    """A tensor entry whose C checks refuse the arguments (TypeError / ValueError / BufferError,
    nothing launched) leaves the call to the validated path and counts it per key
    (``jit.TENSOR_ENTRY_REFUSALS``, which the host-cost bench reports); an accepted call is not
    counted, and any other error propagates (CPU)."""
    calls = []

    def entry(x):
        if x < 0:
            raise TypeError("refused")
        if x == 0:
            raise RuntimeError("launch failed")
        calls.append(x)

    key = ("refusal-test", 1)
    memo = {key: entry}
    before = jit.TENSOR_ENTRY_REFUSALS.get(key, 0)
    assert jit.launch_tensor_entry(memo, key, 3) and calls == [3]
    assert not jit.launch_tensor_entry(memo, key, -1) and not jit.launch_tensor_entry(memo, key, -2)
    assert jit.TENSOR_ENTRY_REFUSALS[key] == before + 2 and calls == [3]
    with pytest.raises(RuntimeError, match="launch failed"):
        jit.launch_tensor_entry(memo, key, 0)
    jit.TENSOR_ENTRY_REFUSALS.pop(key)

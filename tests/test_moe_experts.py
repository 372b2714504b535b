"""MXFP8 routed-expert GEMM: the Blackwell kernel's data layout and machine code on the CPU,
the block-scaled math against an FP64 reference, and the GPU entry point (reference path
off Blackwell)."""

import numpy as np
import pytest
import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.blockscaled_layout as blockscaled_utils

from cute_kernels import jit
from cute_kernels.testing import sass
from cute_kernels.testing.layouts import offsets
from moe.experts import (expert_gemm_torch, dequantize, expert_scale_bytes, moe_expert_gate_up, moe_expert_gemm,
                         mxfp4_expert_weights, silu_mul_interleaved, unswizzle_scales)
from moe.experts import interleave_gate_up as moe_interleave
from moe.experts_sm100 import MoeExpertGemmSm100
from references import (expert_gemm_ref, e2m1_value_ref, e4m3_step_ref, mxfp4_dequant_ref, mxfp8_dequant_ref, mxfp8_quant_ref,
                        swizzle_scales_ref)


def _sf_offsets(shape, coords):
    """Offsets CuTe's tile_atom_to_shape_SF layout (what the kernel's TMA reads) gives coords."""
    out = []

    @cute.jit
    def trace():
        layout = blockscaled_utils.tile_atom_to_shape_SF(shape, 32)
        for c in coords:
            out.append(int(cute.crd2idx(c, layout)))

    trace()
    return out


@pytest.mark.parametrize("E, N, K", [(3, 256, 512), (2, 7168, 2048)])
def test_weight_scale_layout_is_what_the_kernel_reads(E, N, K):
    """W's scales as the kernel's (N, K, expert) view reads them: expert e's buffer is row e of
    ``w_scales [E, expert_scale_bytes]``, each laid out as quantize_expert_weights writes it."""
    kb = K // 32
    g = torch.Generator().manual_seed(E + N + K)
    raw = torch.randint(0, 255, (E, N, kb), dtype=torch.uint8, generator=g)
    flat = torch.stack([swizzle_scales_ref(raw[e]) for e in range(E)])
    assert flat.shape[1] == expert_scale_bytes(N, K)
    ns = list(range(0, N, 97)) + [N - 1]
    ks = list(range(0, kb, 5)) + [kb - 1]
    coords = [(n, k * 32, e) for e in range(E) for n in ns for k in ks]
    offs = _sf_offsets((N, K, E), coords)
    got = torch.tensor([int(flat.view(-1)[o]) for o in offs])
    want = torch.tensor([int(raw[e, n, k]) for e in range(E) for n in ns for k in ks])
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows, K", [(256, 512), (128, 2048), (384, 7168)])
def test_activation_scale_layout_is_what_the_kernel_reads(rows, K):
    """Byte (r, k-block) of our swizzled buffer is the byte the kernel's SFA view maps there."""
    kb = K // 32
    g = torch.Generator().manual_seed(rows + K)
    raw = torch.randint(0, 255, (rows, kb), dtype=torch.uint8, generator=g)
    flat = swizzle_scales_ref(raw)
    kb_pad = -(-kb // 4) * 4
    rs = list(range(0, rows, 7)) + [rows - 1]
    ks = list(range(0, kb, 5)) + [kb - 1]
    coords = [(r, k * 32, 0) for r in rs for k in ks]
    offs = _sf_offsets((rows, kb_pad * 32, 1), coords)
    got = torch.tensor([int(flat[o]) for o in offs])
    want = torch.tensor([int(raw[r, k]) for r in rs for k in ks])
    assert torch.equal(got, want)
    assert torch.equal(unswizzle_scales(flat, rows, K), raw)


def _padded_layout(counts):
    """Router-like padded layout: expert e's rows at [offs[e], offs[e] + counts[e]), 128-aligned;
    (offs [E + 1], rows = the capacity, one tile beyond the live total)."""
    padded = [-(-c // 128) * 128 for c in counts]
    offs = torch.tensor([0] + list(torch.tensor(padded).cumsum(0)), dtype=torch.int32)
    return offs, int(offs[-1]) + 128


def _quantized_problem(E, N, K, counts, gen):
    """Bf16 operands and their MXFP8 forms in :func:`_padded_layout`."""
    offs, rows = _padded_layout(counts)
    a = torch.randn(rows, K, generator=gen).bfloat16()
    for e in range(E):  # padding rows are zero, as mxfp8_quantize_routed writes them
        a[int(offs[e]) + counts[e]:int(offs[e + 1])] = 0
    a[int(offs[-1]):] = 0
    w = (torch.randn(E, N, K, generator=gen) / K**0.5).bfloat16()
    aq, asc = mxfp8_quant_ref(a)
    wq, wsc = zip(*(mxfp8_quant_ref(w[e]) for e in range(E)))
    return (a, w, aq, swizzle_scales_ref(asc), torch.stack(wq), torch.stack([swizzle_scales_ref(s) for s in wsc]),
            offs, asc, wsc)


def _router_maps(offs, counts, rows):
    """The router's expert_counts and tile_expert for a padded layout."""
    tiles = -(-rows // 128)
    te = torch.full((tiles,), -1, dtype=torch.int32)
    for e in range(len(counts)):
        for j in range(int(offs[e]) // 128, int(offs[e + 1]) // 128):
            te[j] = e
    return torch.tensor(counts, dtype=torch.int32), te


def emulate_sm100_tiles(aq, asc, wq, wsc, tile_expert, tile_n=128, k_tile=128):
    """CPU emulation of the Blackwell kernel's walk: one (128-row, tile_n) C tile per CTA,
    the expert from ``tile_expert`` (tiles of -1 skipped: left NaN), FP32 accumulation of
    dequantised 128-wide k-tiles (4 scale blocks each) in order, one bf16 rounding."""
    rows, K = aq.shape
    E, N, _ = wq.shape
    a = mxfp8_dequant_ref(aq, asc)
    out = torch.full((rows, N), float("nan")).bfloat16()
    for m in range(tile_expert.numel()):
        e = int(tile_expert[m])
        if e < 0:
            continue
        w = mxfp8_dequant_ref(wq[e], wsc[e])
        r0, r1 = m * 128, min(rows, m * 128 + 128)
        for n0 in range(0, N, tile_n):
            acc = torch.zeros(r1 - r0, tile_n)
            for k0 in range(0, K, k_tile):
                acc += a[r0:r1, k0:k0 + k_tile].float() @ w[n0:n0 + tile_n, k0:k0 + k_tile].float().T
            out[r0:r1, n0:n0 + tile_n] = acc.bfloat16()
    return out


@pytest.mark.parametrize("tile_n", [128, 256])
def test_sm100_tile_walk_emulation_matches_reference(tile_n):
    """The Blackwell kernel's expert-per-tile walk (the router's tile_expert, as it reads it)
    gives the reference's rows for every live and padding row, and leaves the tiles past the
    routed total unwritten."""
    E, N, K = 4, 256, 384
    gen = torch.Generator().manual_seed(1)
    counts = [5, 0, 130, 1]
    a, w, aq, asw, wq, wsw, offs, asc, wsc = _quantized_problem(E, N, K, counts, gen)
    rows = aq.shape[0]
    _, te = _router_maps(offs, counts, rows)
    got = emulate_sm100_tiles(aq, asc, wq, wsc, te, tile_n)
    ref = torch.full((rows, N), float("nan")).bfloat16()
    expert_gemm_torch(aq, asw, wq, wsw, offs, ref)
    live = int(offs[-1])
    assert torch.allclose(got[:live].float(), ref[:live].float(), rtol=2**-7, atol=1e-3)
    assert torch.isnan(got[live:].float()).all()


def sm100_expert_footprint(E, N, K, rows, tile_n, tile_expert):
    """Trace the Blackwell expert GEMM on the CPU (compiled for sm_100a, never launched) and
    read back its own layout objects' coordinates: per CTA (m, n) of its grid, A as its TMA
    warp loads it (``partition_gmem`` at (m, all k, 0)), W at (n, all k, the tile's expert),
    C as the bf16 epilogue's TMA stores write it (``epilogue_subtiles`` at (m, n, 0)); and per
    epilogue thread, the (row, column) of each value it loads from tensor memory per subtile
    (``subtile_coords``: what the fused SiLU/MXFP8 epilogue pairs). The TMA tensors the kernel
    partitions are coordinate tensors over the views' shapes: identity tensors here."""
    from cutlass import Float32

    from cute_kernels.gemm.sm100_gemm import epilogue_subtiles, tmem_subtiles
    from cute_kernels.testing.layouts import coords, flatten

    kern, got = MoeExpertGemmSm100(E, N, K, tile_n), {}

    def walk(a, w, c):
        tiled_mma = kern.configure()
        got["views"] = [(flatten(x.layout.shape), flatten(x.layout.stride)) for x in (a, w, c)]
        mA, mB, mC = (cute.make_identity_tensor(x.shape) for x in (a, w, c))
        tCgA, tCgB, tCgC = kern.partition_gmem(tiled_mma, mA, mB, mC)
        gC = epilogue_subtiles(tCgC, kern.epi_tile)
        gx, gy, _ = kern.grid(rows)
        for m in range(gx):
            for n in range(gy):
                e = int(tile_expert[m])
                got[(m, n)] = (coords(tCgA[(None,) * 3 + (m, None, 0)]), coords(tCgB[(None,) * 3 + (n, None, e)]),
                               coords(gC[(None,) * 4 + (m, n, 0)]))
        acc = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem),
                               tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(kern.mma_tiler[:2])).layout)
        for tidx in range(32 * 4):  # the four epilogue warps
            _, thr_t2r, _ = tmem_subtiles(acc, kern.epi_tile, kern.t2r_atom(kern.epi_tile), tidx)
            cC = kern.subtile_coords(thr_t2r, kern.epi_tile)
            got[("t2r", tidx)] = [coords(cC[(None, None, None, s)]) for s in range(cute.size(cC, mode=[3]))]

    @cute.jit
    def trace(a_ptr: cute.Pointer, w_ptr: cute.Pointer, out_ptr: cute.Pointer):
        walk(*kern.operand_views(a_ptr, w_ptr, out_ptr, rows))

    f8 = cutlass.Float8E4M3FN
    cute.compile(trace, jit.fake_gmem_ptr(f8), jit.fake_gmem_ptr(f8), jit.fake_gmem_ptr(cutlass.BFloat16),
                 options="--gpu-arch=sm_100a")
    return got, got.pop("views")


@pytest.mark.parametrize("tile_n", [128, 256])
def test_sm100_kernel_layouts_follow_the_router_tiles(tile_n):
    """The Blackwell expert GEMM's own layout objects, evaluated on the CPU: CTA (m, n) reads A
    rows 128m .. 128m + 127 and W rows n*tile_n .. of expert ``tile_expert[m]``, all of K once;
    its bf16 epilogue writes exactly (those rows) x (those columns), and every output element
    is written by one CTA; the views put A at ``a[r, k]``, W at ``w[e, n, k]``, C at
    ``out[r, n]`` (the definitions, as ``torch.arange`` views). The fused epilogue's threads:
    thread t holds row t, subtile s columns 32s .. 32s + 31 in register order, so subtiles 2f /
    2f + 1 are the gate / up of one 32-feature block of the interleaved weights (checked
    against ``interleave_gate_up`` of tagged gate / up rows)."""
    E, N, K, rows = 3, 2 * tile_n, 256, 300
    te = torch.tensor([2, 0, 1], dtype=torch.int32)  # 3 tiles of 128 rows (the last partial)
    blocks, views = sm100_expert_footprint(E, N, K, rows, tile_n, te)
    written = []
    for (m, n), (A, W, C) in ((k, v) for k, v in blocks.items() if k[0] != "t2r"):
        e = int(te[m])
        A, C = A[A[:, 0] < rows], C[C[:, 0] < rows]
        want_rows = np.arange(128 * m, min(rows, 128 * m + 128))
        assert (A[:, 2] == 0).all() and (W[:, 2] == e).all() and (C[:, 2] == 0).all()
        assert np.array_equal(np.unique(A[:, 0]), want_rows)
        assert len(np.unique(A[:, 0] * K + A[:, 1])) == len(A) == len(want_rows) * K
        assert np.array_equal(np.unique(W[:, 0]), np.arange(n * tile_n, (n + 1) * tile_n))
        assert len(np.unique(W[:, 0] * K + W[:, 1])) == len(W) == tile_n * K
        assert np.array_equal(np.unique(C[:, 0]), want_rows)
        assert np.array_equal(np.unique(C[:, 1]), np.arange(n * tile_n, (n + 1) * tile_n))
        assert len(C) == len(want_rows) * tile_n
        written.append(C[:, 0] * N + C[:, 1])
    key = np.concatenate(written)
    assert len(key) == rows * N and len(np.unique(key)) == rows * N
    (sa, da), (sw, dw), (sc, dc) = views
    r, k, n = np.arange(rows), np.arange(K), np.arange(N)
    xyz = np.stack(np.broadcast_arrays(r[:, None], k[None], 0), -1).reshape(-1, 3)
    assert np.array_equal(offsets(xyz, sa, da), torch.arange(rows * K).view(rows, K).numpy()[xyz[:, 0], xyz[:, 1]])
    for e in range(E):
        xyz = np.stack(np.broadcast_arrays(n[:, None], k[None], e), -1).reshape(-1, 3)
        w_def = torch.arange(E * N * K).view(E, N, K).numpy()
        assert np.array_equal(offsets(xyz, sw, dw), w_def[e, xyz[:, 0], xyz[:, 1]])
    xyz = np.stack(np.broadcast_arrays(r[:, None], n[None], 0), -1).reshape(-1, 3)
    assert np.array_equal(offsets(xyz, sc, dc), torch.arange(rows * N).view(rows, N).numpy()[xyz[:, 0], xyz[:, 1]])
    # the fused epilogue's pairing, against the interleave's definition: gate feature i tagged
    # i + 1, up feature i tagged -(i + 1)
    I = N // 2
    tag = torch.arange(1, I + 1, dtype=torch.float64).view(1, I, 1)
    inter = moe_interleave(tag, -tag)[0, :, 0]  # interleaved weight row -> tag
    held = []
    for tidx in range(128):
        subs = blocks[("t2r", tidx)]
        assert len(subs) == tile_n // 32
        for n_tile in range(N // tile_n):
            for f in range(len(subs) // 2):
                g, u = subs[2 * f], subs[2 * f + 1]
                assert (g[:, 0] == tidx).all() and (u[:, 0] == tidx).all()  # one row per thread
                fb = (n_tile * tile_n + int(g[0, 1])) // 64  # the kernel's output block formula
                feats = fb * 32 + np.arange(32)
                assert torch.equal(inter[n_tile * tile_n + g[:, 1]], torch.from_numpy(feats + 1.0))
                assert torch.equal(inter[n_tile * tile_n + u[:, 1]], torch.from_numpy(-(feats + 1.0)))
                held.append(tidx * I + feats)
    assert len(np.unique(np.concatenate(held))) == 128 * I  # every (row, feature) once


def test_block_scaled_math_against_fp64():
    """Dequantise-then-FP32 (what tcgen05 block_scale computes, up to summation order) equals
    the FP64 product of the exactly dequantised operands, and is within MXFP8 error of bf16."""
    E, N, K = 4, 128, 256
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 130, 1]  # an empty expert, a two-tile expert, single rows
    a, w, aq, asw, wq, wsw, offs, asc, wsc = _quantized_problem(E, N, K, counts, gen)
    rows = aq.shape[0]
    assert torch.equal(dequantize(aq, asw, rows, K), mxfp8_dequant_ref(aq, asc))
    out = torch.full((rows, N), float("nan")).bfloat16()
    expert_gemm_torch(aq, asw, wq, wsw, offs, out)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        ref = mxfp8_dequant_ref(aq[lo:hi], asc[lo:hi]).double() @ mxfp8_dequant_ref(wq[e], wsc[e]).double().T
        assert torch.allclose(out[lo:hi].double(), ref, rtol=2**-7, atol=1e-3)
        exact = a[lo:hi].double() @ w[e].double().T
        if hi > lo:
            assert (out[lo:hi].double() - exact).norm() / exact.norm() < 0.06  # two e4m3 roundings
        assert (out[hi:int(offs[e + 1])] == 0).all()  # padding rows: zero inputs -> zero
    assert torch.isnan(out[int(offs[-1]):].float()).all()  # past the total: never written


@pytest.mark.parametrize("cfg", [dict(E=256, N=4096, K=7168), dict(E=256, N=7168, K=2048),
                                 dict(E=8, N=512, K=512, tile_n=256)])
def test_machine_code(cfg):
    """The project's Blackwell engine: per k-tile TMA loads of A, W (3-D: the tile's expert)
    and both scale tiles, ``tcgen05.cp`` of the scales to tensor memory, the block-scaled
    MMA on 8-bit operands, tensor-memory loads and TMA stores in the epilogue, no spills."""
    h = sass.sass_histogram("moe_expert_gemm_sm100", "sm_100a", **cfg)
    assert sass.count(h, "UTCQMMA") >= 1  # tcgen05 MMA on 8-bit operands ...
    assert sass.count(h, "UTCCP") >= 2  # ... with both scale tiles copied to tensor memory: block-scaled
    assert sass.count(h, "UTMALDG") >= 4 and sass.count(h, "LDTM") >= 1 and sass.count(h, "UTMASTG") >= 1
    assert sass.count(h, "UTMALDG.3D") >= 1  # W through its (N, K, expert) view
    assert sass.local_memory_ops(h) == 0


def test_machine_code_has_no_descriptor_writes():
    """The expert is a TMA batch coordinate: no per-expert descriptors are built on the device
    (no tensormap replace / fence of a descriptor-init kernel) and the launch is one kernel."""
    h = sass.sass_histogram("moe_expert_gemm_sm100", "sm_100a", E=256, N=7168, K=2048)
    assert not [op for op in h if "TENSORMAP" in op or op.startswith("UTMACCTL.IV")], h


@pytest.mark.parametrize("cfg", [dict(E=256, N=4096, K=7168), dict(E=8, N=512, K=512, tile_n=256)])
def test_machine_code_fused_silu_sm100(cfg):
    """Blackwell gate/up with the SiLU * up + MXFP8 epilogue: the same block-scaled tcgen05
    mainloop, tensor-memory loads feeding SiLU's exp, and no C store (UTMASTG) at all."""
    h = sass.sass_histogram("moe_expert_gemm_sm100", "sm_100a", silu_quant=True, **cfg)
    assert sass.count(h, "UTCQMMA") >= 1 and sass.count(h, "UTCCP") >= 1 and sass.count(h, "UTMALDG") >= 2
    assert sass.count(h, "LDTM") >= 1 and sass.count(h, "MUFU.EX2") >= 32
    assert sass.count(h, "UTMASTG") == 0
    assert sass.local_memory_ops(h) == 0


def _emulate_sm100_silu_epilogue(acc_tile, n_tile=0):
    """The fused Blackwell epilogue's data flow for one 128 x tile_n accumulator, in Python:
    per feature block f, 32-column subtile 2f (gate) bf16-rounded, subtile 2f + 1 (up)
    bf16-rounded, SiLU * up -> h (bf16) into output block n_tile * tile_n / 64 + f."""
    rows, n = acc_tile.shape
    h = torch.zeros(rows, n // 2, dtype=torch.bfloat16)
    for f in range(n // 64):
        g = acc_tile[:, 64 * f:64 * f + 32].bfloat16().float()
        u = acc_tile[:, 64 * f + 32:64 * f + 64].bfloat16().float()
        sg = (g / (1 + torch.exp(-g))).bfloat16().float()
        fb = (n_tile * n + 64 * f) // 64 - n_tile * n // 64  # the output block, relative to this tile's
        h[:, 32 * fb:32 * fb + 32] = (sg * u).bfloat16()
    return h


@pytest.mark.parametrize("tile_n", [128, 256])
def test_sm100_silu_epilogue_pairing_matches_spec(tile_n):
    """Per column tile, the epilogue's pairing of subtiles 2f / 2f + 1 gives the unfused path's
    h = bf16(bf16(silu(g)) * u) on the interleaved layout, tile by tile."""
    acc = torch.randn(128, 4 * tile_n) * 3
    spec = silu_mul_interleaved(acc.bfloat16())
    got = torch.cat([_emulate_sm100_silu_epilogue(acc[:, j * tile_n:(j + 1) * tile_n], j) for j in range(4)], 1)
    assert torch.equal(got, spec)


def test_can_implement_and_validation():
    assert MoeExpertGemmSm100.can_implement(256, 4096, 7168)
    assert not MoeExpertGemmSm100.can_implement(256, 4096, 7000)
    aq = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(4, 128, 512, dtype=torch.float8_e4m3fn)
    asc = torch.zeros(256 * 16, dtype=torch.uint8)
    wsc = torch.zeros(4, expert_scale_bytes(128, 512), dtype=torch.uint8)
    offs = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(TypeError, match="a_q must have dtype"):
        moe_expert_gemm(aq.float(), asc, wq, wsc, offs)
    with pytest.raises(ValueError, match="K % 128"):
        moe_expert_gemm(aq[:, :480].contiguous(), asc, wq[:, :, :480].contiguous(), wsc, offs)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        moe_expert_gemm(aq, asc, wq, wsc[:, :10].contiguous(), offs)
    with pytest.raises(ValueError, match="expert_offsets must have shape"):
        moe_expert_gemm(aq, asc, wq, wsc, offs[:4].contiguous())
    with pytest.raises(ValueError, match="CUDA"):
        moe_expert_gemm(aq, asc, wq, wsc, offs)


def _poison_padding(aq, offs, counts):
    """e4m3 NaN (0x7F) in every padding row of A: a kernel that mixed rows would leak it."""
    aq = aq.clone()
    for e in range(len(counts)):
        aq.view(torch.uint8)[int(offs[e]) + counts[e]:int(offs[e + 1])] = 0x7F
    aq.view(torch.uint8)[int(offs[-1]):] = 0x7F
    return aq


@pytest.mark.gpu
@pytest.mark.parametrize("E, N, K, counts", [
    (4, 256, 512, [3, 0, 129, 64]),           # empty expert, a two-tile expert
    (8, 4096, 7168, [1, 0, 0, 2, 0, 1, 5, 0]),  # decode-like gate/up, K = hidden
    (3, 7168, 2048, [128, 7, 0]),             # down projection, a full tile
    (4, 512, 1024, [0, 0, 301, 0]),           # every token on one expert, three tiles, odd count
])
def test_gpu_kernel_matches_emulation(seed, E, N, K, counts):
    """H200: the Hopper kernel; live rows equal the block-scaled CPU emulation, with NaN in
    every padding row of A (padding never leaks into live rows)."""
    n = sum(counts)  # routed rows; None: the grid spans the whole capacity
    _gemm_matches_emulation(seed, E, N, K, counts, [
        dict(routed_rows=r, tile_k=tk, stages=st, ctas_per_sm=c)
        for r, tk, st, c in ((None, 128, None, 1), (n, 128, None, 1), (n, 256, None, 1), (n, 128, 4, 2),
                             (n, 128, 3, 2), (n, 256, 2, 2))])


@pytest.mark.gpu
def test_gpu_weights_past_2_gib(seed):
    """H200: an expert whose weights start past 2^31 bytes (E = 76 experts of 4096 x 7168 e4m3,
    2.2 GB; expert 75 at 2.2e9). The tiled kernel indexed W with a 32-bit row offset times K,
    which wrapped for experts >= 74 (an illegal address at the slice config, B = 64); every
    kernel must read expert 75's own weights. Experts 1..74 are empty, so their weights stay
    zero and only experts 0 and 75 are quantised on the CPU."""
    E, N, K, counts2 = 76, 4096, 7168, [2, 3]
    gen = torch.Generator().manual_seed(seed)
    a, w, aq, asw, wq2, wsw2, offs2, asc, wsc = _quantized_problem(2, N, K, counts2, gen)
    cpu = expert_gemm_ref(aq, asc, wq2, wsc, offs2, counts2)  # float64, from the definition
    wq = torch.zeros(E, N, K, dtype=torch.uint8, device="cuda")  # e4m3 bytes, as the CPU problem's
    wsw = torch.zeros(E, wsw2.shape[1], dtype=torch.uint8, device="cuda")
    for src, dst in ((0, 0), (1, E - 1)):
        wq[dst].copy_(wq2[src])
        wsw[dst].copy_(wsw2[src])
    counts = [2] + [0] * (E - 2) + [3]
    offs = torch.tensor([0] + [128] * (E - 1) + [256], dtype=torch.int32)
    cnt, te = _router_maps(offs, counts, aq.shape[0])
    aq_cpu, aq = aq, _poison_padding(aq, offs2, counts2).cuda()
    for kw in (dict(routed_rows=5), dict(tile_k=256, stages=2, ctas_per_sm=2, routed_rows=5),
               dict(max_expert_rows=3, routed_rows=5), dict(expert_row_tile=16, routed_rows=5)):
        out = torch.full((aq.shape[0], N), float("nan"), device="cuda").bfloat16()
        moe_expert_gemm(aq, asw.cuda(), wq, wsw, offs.cuda(), cnt.cuda(), te.cuda(), out=out, **kw)
        torch.cuda.synchronize()
        assert_gemm_within_bound(out.float().cpu(), aq_cpu, asc, wq2, wsc, offs2, counts2, cpu, str(kw))


def test_row_offset_bound_is_validated():
    """rows * max(K, N) >= 2^31 would wrap the kernels' 32-bit A / out offsets: a ValueError
    (checked before any launch; meta tensors need no memory)."""
    from moe.experts import _launch_sm90
    rows, K, E, N = 300_032, 7168, 2, 4096
    m = dict(device="meta")
    with pytest.raises(ValueError, match="2\\^31"):
        _launch_sm90("moe_expert_gemm", "sm_90a", torch.empty(rows, K, dtype=torch.float8_e4m3fn, **m), None,
                     torch.empty(E, N, K, dtype=torch.float8_e4m3fn, **m), None, None,
                     torch.empty(E, dtype=torch.int32, **m), torch.empty(rows // 128, dtype=torch.int32, **m),
                     None, None, None)


def assert_gemm_within_bound(out, aq, asc, wq, wsc, offs, counts, ref, what):
    """Per element and norm-wise bounds of an MXFP8 expert GEMM's bf16 output against the
    float64 product of its dequantised operands ``ref`` (live rows of each expert).

    Per element, sound whatever the data: the bf16 output rounding (half an ulp, 2^-9 |y|;
    2^-8 allows the accumulator's own error to carry it over) plus Hopper's FP8 MMA
    accumulation, which keeps ~14 mantissa bits inside each 32-deep block before the FP32
    promotion with the block's scales: at most 32 additions of 2^-14 of the running sum each,
    <= 2^-9 of the block's sum of |a_k w_k| -- summed over blocks, 2^-9 (|a| @ |w|), the same
    GEMM of the operands' magnitudes (sign bits cleared). Norm-wise, the statistical error of
    that rounding (about 2^-9 / sqrt(3) relative): <= 2^-8, which a dropped or mis-scaled
    32-block (sqrt(32 / K) of the norm, >= 0.06 at K = 7168) cannot meet."""
    mag = expert_gemm_ref(aq & 0x7F, asc, wq & 0x7F, wsc, offs, counts)
    bound = 2.0**-8 * ref.abs() + 2.0**-9 * mag + 2.0**-126
    for e in range(wq.shape[0]):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        if hi == lo:
            continue
        o, r = out[lo:hi].double(), ref[lo:hi]
        bad = int(((o - r).abs() > bound[lo:hi]).sum()) + int((~torch.isfinite(o)).sum())
        assert bad == 0, f"{what}: expert {e}: {bad} elements outside the per-element bound"
        rel = float((o - r).norm() / r.norm().clamp_min(1e-300))
        assert rel <= 2.0**-8, f"{what}: expert {e}: norm-wise relative error {rel:.2e}"


def _gemm_matches_emulation(seed, E, N, K, counts, launches):
    """moe_expert_gemm with each keyword set in ``launches`` against the float64 product of the
    dequantised operands (references.expert_gemm_ref), on live rows, with NaN-poisoned padding
    rows of A."""
    gen = torch.Generator().manual_seed(seed)
    a, w, aq, asw, wq, wsw, offs, asc, wsc = _quantized_problem(E, N, K, counts, gen)
    cnt, te = _router_maps(offs, counts, aq.shape[0])
    cpu = expert_gemm_ref(aq, asc, wq, wsc, offs, counts)  # float64, from the definition
    aq = _poison_padding(aq, offs, counts)
    for kw in launches:
        out = torch.full((aq.shape[0], N), float("nan"), device="cuda").bfloat16()
        moe_expert_gemm(aq.cuda(), asw.cuda(), wq.cuda(), wsw.cuda(), offs.cuda(), cnt.cuda(), te.cuda(), out=out,
                        **kw)
        torch.cuda.synchronize()
        assert_gemm_within_bound(out.float().cpu(), aq, asc, wq, wsc, offs, counts, cpu, str(kw))


def test_tile_config_validation():
    from moe.experts_tiled_sm90 import MoeExpertGemmTiledSm90
    assert MoeExpertGemmTiledSm90.can_implement(256, 4096, 7168, 128, 4, 2)  # 113 KB x 2 fits 227 KB
    assert not MoeExpertGemmTiledSm90.can_implement(256, 4096, 7168, 256, 3, 2)  # 162 KB x 2 does not
    assert MoeExpertGemmTiledSm90.can_implement(256, 4096, 7168, 256, None, 1)
    assert not MoeExpertGemmTiledSm90.can_implement(256, 4096, 7040, 256)  # K % 256


def test_grid_tile_bound():
    from moe.experts import grid_tiles
    # T = 1, k = 8, E = 256: capacity 8 + 256 * 127 rows -> 255 tiles; 8 live rows need <= 9
    assert grid_tiles("op", 8 + 256 * 127, 10**6, 256, 8) == 9
    assert grid_tiles("op", 8 + 256 * 127, 10**6, 256, None) == 255
    assert grid_tiles("op", 1000, 10**6, 4, 10**6) == 8  # never above the capacity
    # an expert-parallel shard (8 of 32 experts) at T = 6, k = 6: the router's live tiles, up to
    # ceil(36 / 128) + 32 of them, hold the shard's anywhere -- the bound takes the router's 32
    assert grid_tiles("op", 36 + 32 * 127, 10**6, 32, 36) == 33
    with pytest.raises(ValueError, match="routed_rows"):
        grid_tiles("op", 1000, 10, 4, -1)


def test_expert_kernel_args_by_token_count():
    """The runtime's kernel choice: one decode pass while the token count bounds every expert
    at 16 rows, row passes of the caller's tile up to ROW_PASS_MAX_TOKENS and of LARGE_ROW_TILE
    above; without a row tile, one pass up to 64 tokens and the tiled kernel above."""
    from moe.experts import LARGE_ROW_TILE, ROW_PASS_MAX_TOKENS, expert_kernel_args
    assert expert_kernel_args(0) == dict(max_expert_rows=1)
    assert expert_kernel_args(1) == dict(max_expert_rows=1)
    assert expert_kernel_args(16) == dict(max_expert_rows=16)
    assert expert_kernel_args(17) == dict(expert_row_tile=16)
    assert expert_kernel_args(64, 32) == dict(expert_row_tile=32)
    assert expert_kernel_args(ROW_PASS_MAX_TOKENS) == dict(expert_row_tile=16)
    assert expert_kernel_args(ROW_PASS_MAX_TOKENS + 1) == dict(expert_row_tile=LARGE_ROW_TILE)
    assert expert_kernel_args(4096, None) == {}  # no row tile: the tiled kernel
    assert expert_kernel_args(64, None) == dict(max_expert_rows=64)
    assert expert_kernel_args(65, None) == {}
    with pytest.raises(ValueError, match="row_tile"):
        expert_kernel_args(64, 24)
    with pytest.raises(ValueError, match="tokens"):
        expert_kernel_args(-1)


@pytest.mark.parametrize("cfg", [dict(E=256, N=4096, K=7168), dict(E=256, N=7168, K=2048)])
def test_machine_code_sm90(cfg):
    h = sass.sass_histogram("moe_expert_gemm_tiled_sm90", "sm_90a", **cfg)
    assert sass.count(h, "HMMA") >= 1 and sass.count(h, "LDSM") >= 1 and sass.count(h, "LDGSTS") >= 1
    assert sass.count(h, "FFMA") >= 32 * 4  # per-block scale promotion of the 32 accumulators, 4 blocks
    assert sass.local_memory_ops(h) == 0


def _gate_up_problem(E, I, K, counts, gen):
    a, w, aq, asw, wq, wsw, offs, asc, wsc = _quantized_problem(E, 2 * I, K, counts, gen)
    cnt, te = _router_maps(offs, counts, aq.shape[0])
    return aq, asw, wq, wsw, offs, cnt, te


def _gate_up_reference(aq, asw, wq, wsw, offs, counts, I, gemm_out=None, swiglu_limit=None):
    """Independent spec: per expert, bf16 GEMM outputs (or the given ``gemm_out [rows, 2I]``),
    de-interleave, DeepSeek-V4's clamp (``swiglu_limit``: gate <= limit, |up| <= limit),
    bf16(bf16(silu(g)) * u), then the MX rule of tests/references."""
    rows, K = aq.shape
    E = wq.shape[0]
    h = torch.zeros(rows, I).bfloat16()
    a = dequantize(aq, asw, rows, K)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        if hi == lo:
            continue
        y = gemm_out[lo:hi] if gemm_out is not None else (a[lo:hi] @ dequantize(wq[e], wsw[e], 2 * I, K).T).bfloat16()
        y = y.view(hi - lo, I // 32, 2, 32)
        g, u = y[:, :, 0].reshape(hi - lo, I), y[:, :, 1].reshape(hi - lo, I)
        if swiglu_limit is not None:
            g = torch.minimum(g, torch.tensor(swiglu_limit, dtype=g.dtype))
            u = torch.maximum(torch.minimum(u, torch.tensor(swiglu_limit, dtype=u.dtype)),
                              torch.tensor(-swiglu_limit, dtype=u.dtype))
        h[lo:hi] = torch.nn.functional.silu(g) * u
    q, s = mxfp8_quant_ref(h)
    return q, s


def test_interleave_gate_up_layout():
    g = torch.arange(2 * 64 * 3, dtype=torch.float32).view(2, 64, 3)
    u = -g
    w = moe_interleave(g, u)
    assert w.shape == (2, 128, 3)
    assert torch.equal(w[:, 0:32], g[:, 0:32]) and torch.equal(w[:, 32:64], u[:, 0:32])
    assert torch.equal(w[:, 64:96], g[:, 32:64]) and torch.equal(w[:, 96:128], u[:, 32:64])


#: a SwiGLU clamp small enough that a good share of the test problems' gate / up values hit it
#: (DeepSeek-V4 uses 10.0 on its real activations)
TEST_LIMIT = 0.75


@pytest.mark.parametrize("limit", [None, TEST_LIMIT])
def test_gate_up_fallback_matches_spec(limit):
    """The CPU path of moe_expert_gate_up (GEMM -> clamp -> SiLU * up -> MX quantiser) against
    the spec; with the clamp, a good share of values is clamped (else the test proves little)."""
    E, I, K, counts = 3, 64, 256, [2, 0, 130]
    gen = torch.Generator().manual_seed(1)
    aq, asw, wq, wsw, offs, cnt, te = _gate_up_problem(E, I, K, counts, gen)
    q, s = moe_expert_gate_up(aq, asw, wq, wsw, offs, cnt, te, swiglu_limit=limit)
    q_ref, s_ref = _gate_up_reference(aq, asw, wq, wsw, offs, counts, I, swiglu_limit=limit)
    if limit is not None:  # expert 2's GEMM outputs, from the dequantised operands
        lo = int(offs[2])
        y = dequantize(aq, asw, aq.shape[0], K)[lo:lo + counts[2]] @ dequantize(wq[2], wsw[2], 2 * I, K).T
        assert 0.1 < float((y.abs() > limit).float().mean()) < 0.9
    got_s = unswizzle_scales(s, aq.shape[0], I)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        assert torch.equal(q.view(torch.uint8)[lo:hi], q_ref[lo:hi])
        assert torch.equal(got_s[lo:hi], s_ref[lo:hi])


@pytest.mark.gpu
@pytest.mark.parametrize("E, I, K, counts", [(4, 64, 256, [3, 0, 129, 64]), (8, 2048, 7168, [1, 0, 2, 0, 1, 5, 0, 3])])
@pytest.mark.parametrize("tile_k, stages, ctas", [(128, None, 1), (256, None, 1), (128, 3, 2)])
@pytest.mark.parametrize("limit", [None, TEST_LIMIT])
def test_gpu_fused_gate_up_matches_spec(seed, E, I, K, counts, tile_k, stages, ctas, limit):
    """H200: the fused Hopper epilogue (its staging tile aliases the A stages), with and
    without the SwiGLU clamp."""
    _gate_up_matches_spec(seed, E, I, K, counts, tile_k=tile_k, stages=stages, ctas_per_sm=ctas,
                          swiglu_limit=limit)


def _gate_up_matches_spec(seed, E, I, K, counts, own_gemm=False, **kw):
    """moe_expert_gate_up (keywords ``kw``) against the spec. The GPU's FP32 summation order
    and exp differ from the CPU's, so a rare bf16 g, u or h differs by an ulp and its e4m3 byte
    by one step (relatively large for the block's subnormals): compare dequantised values to
    one e4m3 step, and require 99% of the bytes to match exactly. ``own_gemm``: the spec's
    GEMM outputs are the same kernel's unfused bf16 outputs (moe_expert_gemm, same ``kw``),
    for kernels whose accumulation is not FP32-exact (see the decode kernel's test)."""
    gen = torch.Generator().manual_seed(seed)
    aq, asw, wq, wsw, offs, cnt, te = _gate_up_problem(E, I, K, counts, gen)
    dev = [t.cuda() for t in (aq, asw, wq, wsw, offs, cnt, te)]
    limit = kw.pop("swiglu_limit", None)
    y = moe_expert_gemm(*dev, routed_rows=sum(counts), **kw).cpu() if own_gemm else None
    q_ref, s_ref = _gate_up_reference(aq, asw, wq, wsw, offs, counts, I, gemm_out=y, swiglu_limit=limit)
    kw = dict(kw, swiglu_limit=limit)
    q, s = moe_expert_gate_up(*dev, routed_rows=sum(counts), **kw)
    torch.cuda.synchronize()
    q, s = q.cpu(), s.cpu()
    got = dequantize(q.view(torch.uint8), s, aq.shape[0], I)
    ref = mxfp8_dequant_ref(q_ref, s_ref)
    got_s = unswizzle_scales(s, aq.shape[0], I)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        if hi > lo:
            mag = torch.maximum(got[lo:hi].abs(), ref[lo:hi].abs())
            step = torch.maximum(e4m3_step_ref(mag, s_ref[lo:hi]), e4m3_step_ref(mag, got_s[lo:hi]))
            err = (got[lo:hi] - ref[lo:hi]).abs()
            assert bool((err <= step).all()), (
                f"expert {e}: {int((err > step).sum())} values beyond one e4m3 step, "
                f"worst |err| / step = {float((err / step).max()):.2f}")
            same = (q.view(torch.uint8)[lo:hi] == q_ref[lo:hi]).float().mean()
            assert same > 0.99, f"expert {e}: only {same:.3f} of the e4m3 bytes match"


def test_machine_code_sm90_fused():
    h = sass.sass_histogram("moe_expert_gemm_tiled_sm90", "sm_90a", E=256, N=4096, K=7168, silu_quant=True)
    assert sass.count(h, "HMMA") >= 1 and sass.count(h, "MUFU.EX2") >= 1  # SiLU's exp in the epilogue
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("tile_k", [128, 256])
def test_sm90_scale_addressing_transcribed(tile_k):
    """The Hopper kernel's scale-byte addressing (sa_base / sw_base, the tile_k / 128 atoms of
    512 bytes copied per K slice, the in-atom index), transcribed to Python, lands on the byte
    the quantiser wrote for (row, k-block) -- both operands, several experts, N-tiles, K slices."""
    E, N, K, rows = 3, 256, 1024, 384
    SB = 512 * (tile_k // 128)
    kb_pad, n_pad = -(-(K // 32) // 4) * 4, -(-N // 128) * 128
    cb = kb_pad // 4
    g = torch.Generator().manual_seed(3)
    raw_a = torch.randint(0, 255, (rows, K // 32), dtype=torch.uint8, generator=g)
    raw_w = torch.randint(0, 255, (E, N, K // 32), dtype=torch.uint8, generator=g)
    flat_a = swizzle_scales_ref(raw_a)
    flat_w = torch.stack([swizzle_scales_ref(raw_w[e]) for e in range(E)]).view(-1)
    for e in range(E):
        for row0 in (0, 128, 256):
            for n0 in (0, 64, 128, 192):
                sa_base = (row0 // 128) * cb * 512
                sw_base = (e * n_pad + n0 // 128 * 128) // 128 * cb * 512
                for kt in range(K // tile_k):
                    st_a = flat_a[sa_base + kt * SB: sa_base + kt * SB + SB]  # one stage's scale bytes
                    st_w = flat_w[sw_base + kt * SB: sw_base + kt * SB + SB]
                    nb = tile_k // 32
                    for kb in range(nb):
                        for m in (0, 5, 31, 32, 77, 127):
                            got = st_a[(kb // 4) * 512 + (m % 32) * 16 + (m // 32) * 4 + kb % 4]
                            assert got == raw_a[row0 + m, kt * nb + kb]
                        for n in (0, 9, 31, 32, 63):
                            nr = n0 % 128 + n
                            got = st_w[(kb // 4) * 512 + (nr % 32) * 16 + (nr // 32) * 4 + kb % 4]
                            assert got == raw_w[e, n0 + n, kt * nb + kb]


def test_sm90_fused_scale_store_addressing_transcribed():
    """The fused epilogue's scale store (row r, feature block fb) hits swizzle_scales_ref's byte."""
    rows, I = 256, 256
    ncb_i = -(-(I // 32) // 4)
    raw = torch.randint(0, 255, (rows, I // 32), dtype=torch.uint8)
    flat = swizzle_scales_ref(raw)
    for r in (0, 1, 31, 32, 127, 128, 200, 255):
        for fb in range(I // 32):
            off = ((r // 128) * ncb_i + fb // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + fb % 4
            assert flat[off] == raw[r, fb]


@pytest.mark.parametrize("name, cfg, arch", [
    ("moe_expert_gemm_tiled_sm90", dict(E=8, N=512, K=1024, silu_quant=True), "sm_90a"),
    ("moe_expert_swap_ab_sm90", dict(E=8, N=512, K=1024, tok_n=16, silu_quant=True), "sm_90a"),
    ("moe_expert_gemm_sm100", dict(E=8, N=512, K=1024, silu_quant=True), "sm_100a"),
])
def test_machine_code_swiglu_clamp(name, cfg, arch):
    """With ``swiglu_limit`` every fused epilogue clamps each feature's gate once (min) and
    its up twice (min, max): three float min/max per feature of a 32-feature block; none
    without it; no spills."""
    h = sass.sass_histogram(name, arch, **cfg, swiglu_limit=10.0)
    h0 = sass.sass_histogram(name, arch, **cfg)
    assert sass.count(h, "FMNMX") >= 3 * 32 and sass.count(h0, "FMNMX") == 0
    assert sass.local_memory_ops(h) == 0


@pytest.mark.parametrize("limit, words", [(-1.0, "finite float > 0"), (float("inf"), "finite float > 0"),
                                          ("10", "finite float > 0")])
def test_swiglu_limit_validation(limit, words):
    aq = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    z = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=words):
        moe_expert_gate_up(aq, None, wq, None, z, z, z, swiglu_limit=limit)
    with pytest.raises(ValueError, match="fused SiLU"):
        jit.get_kernel("moe_expert_gemm_tiled_sm90", "sm_90a", E=8, N=512, K=1024, swiglu_limit=10.0,
                       use_disk=False)


def test_gate_up_validation():
    aq = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    z = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError, match="a_q must be a torch.Tensor"):
        moe_expert_gate_up([1], None, wq, None, z, z, z)
    with pytest.raises(TypeError, match="w_q must have dtype"):
        moe_expert_gate_up(aq, None, wq.float(), None, z, z, z)
    with pytest.raises(ValueError, match="must equal a_q.shape"):
        moe_expert_gate_up(aq, None, wq[:, :, :128].contiguous(), None, z, z, z)
    with pytest.raises(ValueError, match="multiple of 64"):
        moe_expert_gate_up(aq, None, wq[:, :96].contiguous(), None, z, z, z)
    with pytest.raises(TypeError, match="a_scales must be a torch.Tensor"):
        moe_expert_gate_up(aq, None, wq, None, z, z, z)
    asc = torch.zeros(128 * 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        moe_expert_gate_up(aq, asc, wq, torch.zeros(2, 7, dtype=torch.uint8), z, z, z)


@pytest.mark.gpu
@pytest.mark.parametrize("E, N, K, counts, max_rows", [
    (4, 256, 512, [3, 0, 16, 1], 16),         # empty expert, a full 16-row token tile
    (8, 4096, 7168, [1, 0, 0, 2, 0, 1, 5, 0], 5),  # decode-like gate/up, K = hidden
    (3, 7168, 2048, [40, 7, 0], 64),          # down projection, the 64-wide token tile
])
def test_gpu_decode_kernel_matches_emulation(seed, E, N, K, counts, max_rows):
    """H200: the swap-AB TMA + FP8 wgmma decode kernel; NaN padding
    rows of A are loaded by its token tile and must stay in their own output columns."""
    _gemm_matches_emulation(seed, E, N, K, counts, [dict(routed_rows=sum(counts), max_expert_rows=max_rows)])


@pytest.mark.gpu
@pytest.mark.parametrize("E, I, K, counts, max_rows", [
    (8, 2048, 7168, [1, 0, 2, 0, 1, 5, 0, 3], 8),
    (4, 1024, 2048, [33, 0, 64, 17], 64),
])
@pytest.mark.parametrize("limit", [None, TEST_LIMIT])
def test_gpu_decode_kernel_fused_gate_up(seed, E, I, K, counts, max_rows, limit):
    """H200: the decode kernel's fused SiLU * up + MXFP8 epilogue against the spec applied to
    the same kernel's bf16 GEMM output. Not the CPU GEMM: FP8 wgmma sums a 32-wide block's
    products at reduced precision (DeepSeek-V3 measured ~14 bits on Hopper) before the FP32
    promotion, so where g cancels to near zero h moves by a few of its block's subnormal e4m3
    steps (the first GPU run: one value of 8 rows, 5 steps); the GEMM itself is checked against
    the emulation in test_gpu_decode_kernel_matches_emulation."""
    _gate_up_matches_spec(seed, E, I, K, counts, own_gemm=True, max_expert_rows=max_rows, swiglu_limit=limit)


@pytest.mark.gpu
@pytest.mark.parametrize("E, N, K, counts, row_tile", [
    (4, 256, 512, [3, 0, 40, 130], 16),  # one pass, three passes, an expert over two router tiles
    (3, 4096, 7168, [17, 1, 64], 16),  # gate/up-like: a second pass of one row
    (3, 7168, 2048, [65, 0, 5], 64),  # down-like, the 64-wide token tile
    (4, 512, 1024, [33, 2, 0, 97], 32),  # the 32-wide token tile: 2 and 4 passes
])
def test_gpu_decode_kernel_row_passes(seed, E, N, K, counts, row_tile):
    """H200: the decode kernel covering any rows per expert in passes of ``row_tile``
    token columns; NaN padding rows inside the last pass stay in their own columns."""
    _gemm_matches_emulation(seed, E, N, K, counts, [dict(routed_rows=sum(counts), expert_row_tile=row_tile)])


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [None, TEST_LIMIT])
@pytest.mark.parametrize("row_tile", [16, 32])  # 32: expert_kernel_args above ROW_PASS_MAX_TOKENS
def test_gpu_decode_kernel_row_passes_fused(seed, limit, row_tile):
    """H200: the fused epilogue once per pass (its staging tile reused across passes)."""
    _gate_up_matches_spec(seed, 4, 1024, 2048, [33, 0, 129, 17], own_gemm=True, expert_row_tile=row_tile,
                          swiglu_limit=limit)


@pytest.mark.parametrize("tok_n, silu_quant, row_passes", [(16, False, False), (16, True, False), (64, False, False),
                                                           (16, True, True), (32, False, True), (32, True, True)])
def test_machine_code_swap_ab_sm90(tok_n, silu_quant, row_passes):
    """Native FP8 wgmma (QGMMA e4m3, not mma.sync's f16 unpacks) fed by TMA, no spills."""
    h = sass.sass_histogram("moe_expert_swap_ab_sm90", "sm_90a", E=256, N=4096, K=7168, tok_n=tok_n,
                            silu_quant=silu_quant, row_passes=row_passes)
    assert sass.count(h, f"QGMMA.64x{tok_n}x32.F32.E4M3.E4M3") >= 1 and sass.count(h, "UTMALDG") >= 1
    assert sass.count(h, "F2FP.F16.E4M3.UNPACK_B") == 0
    assert sass.local_memory_ops(h) == 0


def test_decode_kernel_selection():
    from moe.experts_swap_ab_sm90 import STAGES, SMEM_PER_SM, MoeExpertSwapABSm90, smem_bytes, tok_n_for
    assert [tok_n_for(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]
    # the default depth keeps 6 / 5 / 3 CTAs per SM by shared memory
    assert [SMEM_PER_SM // smem_bytes(tn, STAGES[tn]) for tn in (16, 32, 64)] == [6, 5, 3]
    assert MoeExpertSwapABSm90.can_implement(256, 4096, 7168, 64, 5)
    assert not MoeExpertSwapABSm90.can_implement(256, 4096, 7168, 64, 14)  # over shared memory
    assert not MoeExpertSwapABSm90.can_implement(256, 4096, 7168, 16, 1)
    assert not MoeExpertSwapABSm90.can_implement(256, 4096, 7168, 48)  # not a token tile


def test_swap_ab_decode_scale_words_transcribed():
    """The decode kernel's scale reads -- one 4-byte word per (row, K slice) at word
    ``(atom + kt) * 128 + (r % 32) * 4 + r // 32``, block ``kb`` in byte ``kb`` -- transcribed
    to Python, land on the quantiser's byte for (row, k-block): weight rows of several experts
    and 64-row halves, token rows of several router tiles."""
    E, N, K, rows = 3, 256, 1024, 384
    kb_pad, n_pad = -(-(K // 32) // 4) * 4, -(-N // 128) * 128
    cb = kb_pad // 4
    g = torch.Generator().manual_seed(4)
    raw_a = torch.randint(0, 255, (rows, K // 32), dtype=torch.uint8, generator=g)
    raw_w = torch.randint(0, 255, (E, N, K // 32), dtype=torch.uint8, generator=g)
    words_a = swizzle_scales_ref(raw_a).contiguous().view(torch.int32)
    words_w = torch.stack([swizzle_scales_ref(raw_w[e]) for e in range(E)]).contiguous().view(-1).view(torch.int32)

    def byte(word, kb):
        return (int(word) >> (8 * kb)) & 0xFF

    for kt in range(K // 128):
        for e in range(E):
            for n0 in (0, 64, 128, 192):  # CTA tiles of 64 weight rows
                sw_atom = (e * n_pad + n0 // 128 * 128) // 128 * cb
                for r in (0, 7, 8, 31, 32, 63):
                    nr = n0 % 128 + r
                    wd = words_w[(sw_atom + kt) * 128 + (nr % 32) * 4 + nr // 32]
                    for kb in range(4):
                        assert byte(wd, kb) == raw_w[e, n0 + r, kt * 4 + kb]
        for row0 in (0, 128, 256):
            sa_atom = (row0 // 128) * cb
            for m in (0, 1, 15, 16, 33, 63):
                wd = words_a[(sa_atom + kt) * 128 + (m % 32) * 4 + m // 32]
                for kb in range(4):
                    assert byte(wd, kb) == raw_a[row0 + m, kt * 4 + kb]


# ------------------------------------------ DeepSeek-V4's MXFP4 routed-expert checkpoints ------
def _mxfp4_problem(E, N, K, gen):
    """Random MXFP4 expert weights as a V4 checkpoint stores them: packed e2m1 codes (every byte
    value appears) and UE8M0 scales around 2^-7, with NaN (255), 0 and 254 scale edge cases."""
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale = torch.randint(127 - 10, 127 - 4, (E, N, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale.view(-1)[:3] = torch.tensor([0, 254, 255], dtype=torch.uint8)
    return packed, scale


def test_mxfp4_codes_are_exact_in_e4m3():
    """Each of the 16 e2m1 codes maps to the e4m3 byte of the same value (OCP definitions)."""
    packed = torch.arange(16, dtype=torch.uint8).view(1, 1, 16) * 0x11  # code c in both nibbles
    w_q, _ = mxfp4_expert_weights(packed.expand(1, 1, 16).contiguous(), torch.full((1, 1, 1), 127, dtype=torch.uint8))
    got = w_q.view(-1).float()
    assert got.tolist() == [e2m1_value_ref(c) for c in range(16) for _ in (0, 1)]


@pytest.mark.parametrize("E, N, K", [(2, 130, 96), (3, 256, 4096)])
def test_mxfp4_conversion_is_bit_exact(seed, E, N, K):
    """The converted MXFP8 weights dequantise to the checkpoint's MXFP4 values exactly (float64
    reference from the e2m1 / UE8M0 definitions, NaN scales included), in the swizzled scale
    layout the kernels read; the float4 / e8m0 dtypes give the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    packed, scale = _mxfp4_problem(E, N, K, gen)
    w_q, w_s = mxfp4_expert_weights(packed, scale)
    assert w_q.dtype == torch.float8_e4m3fn and w_q.shape == (E, N, K)
    assert w_s.shape == (E, expert_scale_bytes(N, K))
    ones = torch.full((N, K // 32), 127, dtype=torch.uint8)
    for e in range(E):
        # element values (scale 2^0 in the reference) and the scales, each exactly the checkpoint's
        assert torch.equal(w_q[e].double(), mxfp4_dequant_ref(packed[e], ones))
        assert torch.equal(unswizzle_scales(w_s[e], N, K), scale[e])
        # and the package's FP32 dequantisation agrees wherever FP32 holds the value
        ref = mxfp4_dequant_ref(packed[e], scale[e])
        got = dequantize(w_q[e], w_s[e], N, K).double()
        fits = ref.abs() < 2.0 ** 127
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert torch.equal(got[fits], ref[fits])
    w_q2, w_s2 = mxfp4_expert_weights(packed.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu))
    assert torch.equal(w_q2.view(torch.uint8), w_q.view(torch.uint8)) and torch.equal(w_s2, w_s)


@pytest.mark.parametrize("w, s, exc, words", [
    (torch.zeros(2, 4, 16, dtype=torch.int8), torch.zeros(2, 4, 1, dtype=torch.uint8), TypeError, "w must be"),
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 1), TypeError, "w_scale must be"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), ValueError, "3 dims"),
    (torch.zeros(2, 4, 8, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8), ValueError, "multiple of 32"),
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8), ValueError, "w_scale must have"),
])
def test_mxfp4_validation(w, s, exc, words):
    with pytest.raises(exc, match=words):
        mxfp4_expert_weights(w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("E, N, K, counts", [
    (4, 4096, 4096, [1, 0, 3, 2]),    # V4-Flash gate/up (2 x I = 4096, hidden 4096), decode rows
    (3, 7168, 3072, [5, 0, 130]),     # V4-Pro down (hidden 7168, I = 3072), a two-tile expert
])
def test_gpu_mxfp4_weights_per_element(seed, E, N, K, counts):
    """H200: MXFP8 activations x a V4 checkpoint's MXFP4 weights (converted) through the GEMM,
    live rows against float64 products of the dequantised operands, each element within its
    bf16 rounding plus the FP32 accumulation (K * 2^-24 of sum |a w|)."""
    gen = torch.Generator().manual_seed(seed)
    packed, scale = _mxfp4_problem(E, N, K, gen)
    scale.view(-1)[:3] = 120  # finite scales here: a NaN scale poisons its whole row by design
    w_q, w_s = mxfp4_expert_weights(packed, scale)
    offs, rows = _padded_layout(counts)
    a = torch.randn(rows, K, generator=gen).bfloat16()
    aq, asc = mxfp8_quant_ref(a)
    cnt, te = _router_maps(offs, counts, rows)
    out = torch.full((rows, N), float("nan"), device="cuda").bfloat16()
    moe_expert_gemm(aq.cuda(), swizzle_scales_ref(asc).cuda(), w_q.cuda(), w_s.cuda(), offs.cuda(), cnt.cuda(),
                    te.cuda(), out=out, routed_rows=sum(counts))
    torch.cuda.synchronize()
    a64 = mxfp8_dequant_ref(aq, asc).double()
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e]) + counts[e]
        if hi == lo:
            continue
        w64 = mxfp4_dequant_ref(packed[e], scale[e])
        ref = a64[lo:hi] @ w64.T
        bound = 2.0 ** -8 * ref.abs() + K * 2.0 ** -24 * (a64[lo:hi].abs() @ w64.abs().T) + 1e-30
        err = (out[lo:hi].double().cpu() - ref).abs()
        assert bool((err <= bound).all()), f"expert {e}: {int((err > bound).sum())} elements out of bound"

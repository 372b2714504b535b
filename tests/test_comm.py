"""Push all-reduce: protocol model (CPU), backend selection (CPU), simulated ranks (H200)."""

import re

import pytest
import torch

from comm.backend import select_allreduce_backend
from comm.protocol_model import Model
from cute_kernels.testing import sass
from references import allreduce_ref, finalize_shared_ref


# ----------------------------------------------------------- protocol model (CPU) -----
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seed", range(25))
def test_protocol_no_stale_read_no_deadlock(world, seed):
    slow = {0: 0.9} if seed % 3 == 0 else ({world - 1: 0.97} if seed % 3 == 1 else {})
    m = Model(world, phases=12, seed=seed, slow=slow)
    assert m.run(), "deadlock"
    assert not m.errors, m.errors[:3]


def test_protocol_model_catches_a_single_buffer_half():
    """With one half (no double buffering) a fast writer overwrites a slow reader's slot."""
    caught = False
    for seed in range(50):
        m = Model(4, phases=12, halves=1, seed=seed, slow={1: 0.95})
        m.run()
        caught |= bool(m.errors)
    assert caught


def test_protocol_model_catches_an_exact_match_wait():
    """Waiting for flag == p+1 deadlocks once a fast peer has raised p+2."""
    assert any(not Model(4, phases=12, seed=s, slow={2: 0.9}, exact_wait=True).run() for s in range(50))


# ------------------------------------------------------------ backend selection -------
def test_backend_selection():
    ok = dict(world_size=4, tokens=64, hidden=7168, arch="sm_90a", p2p_ok=True)
    assert select_allreduce_backend(**ok).backend == "custom_push"
    assert "Blackwell" in select_allreduce_backend(**dict(ok, arch="sm_100a")).reason
    for change, words in [(dict(world_size=16), "world size"), (dict(p2p_ok=False), "peer-to-peer"),
                          (dict(tokens=4096), "exceeds"), (dict(arch=None), "arch"),
                          (dict(single_node=False), "nodes")]:
        with pytest.warns(RuntimeWarning):
            c = select_allreduce_backend(**dict(ok, **change))
        assert c.backend == "nccl" and words in c.reason
    assert select_allreduce_backend(**ok, force="nccl").backend == "nccl"
    with pytest.raises(ValueError, match="forced but unsupported"):
        select_allreduce_backend(**dict(ok, p2p_ok=False), force="custom_push")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("fused", [False, True])
def test_machine_code(arch, fused):
    text = sass.disassemble(sass.compile_cubin("push_allreduce", arch, world=4, hidden=7168, fused=fused,
                                               topk=8 if fused else 1))
    h = sass.histogram(text)
    # the kernel's name tells the variants apart in a profile (the runtime bench counts them)
    names = set(re.findall(r"\.text\.(\S+?):", text))
    assert names and all(("FinalizeSharedAllReduce" in n) == fused and ("PushAllReduce" in n) != fused
                         for n in names), names
    assert h["STG.E.128"] >= 4  # 16-byte pushes to the 4 peers
    assert sass.count(h, "LDG.E.STRONG.SYS") >= 1  # acquire polls of the flags
    assert sass.count(h, "STG.E.STRONG.SYS") >= 1  # release flag stores
    assert not any(m.startswith(("MULTIMEM", "UBLKRED")) for m in h)  # no NVLink multicast
    assert sass.local_memory_ops(h) == 0


# ------------------------------------------------------- simulated ranks (H200) -------
def run_ranks(group, fn_per_rank, streams, delays=None):
    """Launch every rank's kernel on its own stream, concurrently."""
    cur = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(cur)
    outs = []
    for r, s in enumerate(streams):
        with torch.cuda.stream(s):
            outs.append(fn_per_rank(r, (delays or {}).get(r, 0)))
    for s in streams:
        cur.wait_stream(s)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("T", [1, 8, 64, 37])
def test_allreduce_matches_fp32_reference(seed, world, T):
    from comm.buffers import PushAllReduceGroup

    H = 7168
    g = PushAllReduceGroup.simulated(world, max_tokens=64, hidden=H)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for _ in range(3):  # several phases, both buffer halves
        parts = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(world)]
        outs = [torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(world)]
        run_ranks(g, lambda r, d: g.allreduce(r, parts[r], out=outs[r]), streams)
        torch.cuda.synchronize()
        g.check()
        ref = allreduce_ref([p.cpu() for p in parts])
        for r in range(world):
            assert torch.equal(outs[r].cpu(), ref), f"rank {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_finalize_shared_allreduce_bit_exact(seed, world):
    from comm.buffers import PushAllReduceGroup
    from moe.finalize import moe_finalize

    T, H, k, rows = 5, 7168, 8, 640
    g = PushAllReduceGroup.simulated(world, max_tokens=16, hidden=H)
    streams = [torch.cuda.Stream() for _ in range(world)]
    ys = [torch.randn(rows, H, device="cuda").bfloat16() for _ in range(world)]
    ws = [torch.rand(T, k, device="cuda") for _ in range(world)]
    pos = [torch.randperm(rows, device="cuda")[: T * k].int() for _ in range(world)]
    sh = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(world)]
    outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    run_ranks(g, lambda r, d: g.finalize_shared_allreduce(r, ys[r], ws[r], pos[r], sh[r], out=outs[r]), streams)
    torch.cuda.synchronize()
    g.check()
    # reference: the unfused rounding sequence, in FP32 on the CPU
    parts = [finalize_shared_ref(ys[r].cpu(), ws[r].cpu(), pos[r].cpu(), sh[r].cpu()) for r in range(world)]
    ref = allreduce_ref(parts)
    # and the unfused GPU path: standalone finalize, bf16 add, push all-reduce
    unf = [moe_finalize(ys[r], ws[r], pos[r]) + sh[r] for r in range(world)]
    outs2 = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    run_ranks(g, lambda r, d: g.allreduce(r, unf[r], out=outs2[r]), streams)
    torch.cuda.synchronize()
    for r in range(world):
        assert torch.equal(outs[r].cpu(), ref) and torch.equal(outs2[r].cpu(), ref)


@pytest.mark.gpu
def test_graph_replays_with_delayed_reader(seed):
    from comm.buffers import PushAllReduceGroup

    world, T, H = 4, 8, 7168
    g = PushAllReduceGroup.simulated(world, max_tokens=T, hidden=H)
    streams = [torch.cuda.Stream() for _ in range(world)]
    parts = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(world)]
    outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    run_ranks(g, lambda r, d: g.allreduce(r, parts[r], out=outs[r]), streams)  # compile, warm
    torch.cuda.synchronize()
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(cap), torch.cuda.graph(graph, stream=cap):
        run_ranks(g, lambda r, d: g.allreduce(r, parts[r], out=outs[r], delay=d), streams, delays={2: 20000})
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bad = torch.zeros((), dtype=torch.int32, device="cuda")
    for it in range(1000):
        for p in parts:  # fresh inputs before every replay: a stale read cannot pass
            p.copy_(torch.randn(T, H, device="cuda", generator=gen).bfloat16())
        graph.replay()
        # every replay checked: the FP32 rank-order sum rounded once (on the GPU, no sync)
        want = parts[0].float()
        for p in parts[1:]:
            want = want + p.float()
        want = want.bfloat16()
        for r in range(world):
            bad += (~torch.eq(outs[r], want)).sum().int()
        if it % 100 == 99:
            assert int(bad) == 0, f"replay {it}: {int(bad)} wrong elements so far"
    torch.cuda.synchronize()
    g.check()
    assert int(bad) == 0
    ref = allreduce_ref([p.cpu() for p in parts])  # and the last replay against the CPU reference
    for r in range(world):
        assert torch.equal(outs[r].cpu(), ref)
    assert (torch.stack([rb.phase for rb in g.ranks]) == 1001).all()  # advanced in-kernel, no host reset


@pytest.mark.gpu
def test_warm_up_then_first_capture_replays(seed):
    """A group whose kernels this process has never launched: ``warm_up`` compiles, loads and
    launches both variants once (phases in step), so a graph can capture them -- the decode
    runtime's first TP capture. Fresh inputs before every replay, every replay checked."""
    from comm.buffers import PushAllReduceGroup

    world, T, H, k, rows = 4, 6, 4096, 6, 48  # V4-Flash's hidden and top-k: variants unused above
    g = PushAllReduceGroup.simulated(world, max_tokens=8, hidden=H)
    streams = [torch.cuda.Stream() for _ in range(world)]
    g.warm_up(dict(enumerate(streams)), topk=k)
    assert (torch.stack([rb.phase for rb in g.ranks]) == 2).all()
    parts = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    ys = [torch.empty(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    ws = [torch.empty(T, k, device="cuda") for _ in range(world)]
    pos = [torch.randperm(rows, device="cuda")[: T * k].int() for _ in range(world)]
    outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    fouts = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(cap), torch.cuda.graph(graph, stream=cap):
        run_ranks(g, lambda r, d: g.allreduce(r, parts[r], out=outs[r]), streams)
        run_ranks(g, lambda r, d: g.finalize_shared_allreduce(r, ys[r], ws[r], pos[r], parts[r], out=fouts[r]),
                  streams)
    for it in range(3):
        for r in range(world):
            parts[r].copy_(torch.randn(T, H, device="cuda").bfloat16())
            ys[r].copy_(torch.randn(rows, H, device="cuda").bfloat16())
            ws[r].copy_(torch.rand(T, k, device="cuda"))
        for o in outs + fouts:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        g.check()
        ref = allreduce_ref([p.cpu() for p in parts])
        fref = allreduce_ref([finalize_shared_ref(ys[r].cpu(), ws[r].cpu(), pos[r].cpu(), parts[r].cpu())
                              for r in range(world)])
        for r in range(world):
            assert torch.equal(outs[r].cpu(), ref) and torch.equal(fouts[r].cpu(), fref), f"replay {it}, rank {r}"
    assert (torch.stack([rb.phase for rb in g.ranks]) == 2 + 2 * 3).all()


@pytest.mark.gpu
def test_absent_rank_times_out_with_error(seed):
    from comm.buffers import AllReduceTimeout, PushAllReduceGroup

    world, T, H = 4, 2, 1024
    g = PushAllReduceGroup.simulated(world, max_tokens=T, hidden=H)
    g.max_spins = 20000
    parts = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(world)]
    for r in range(world - 1):  # rank 3 never launches
        g.allreduce(r, parts[r])
    torch.cuda.synchronize()
    with pytest.raises(AllReduceTimeout, match="timed out"):
        g.check()
    g.reset()
    g.check()

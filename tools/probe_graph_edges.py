"""Which launches of a captured CUDA graph overlap their predecessor (programmatic dependent
launch): the edge types between the kernel nodes of back-to-back calls, as the benches capture
them -- cuBLAS ``bmm`` alone (issue 4's baseline (b)) and WO-A with and without ``pdl``.

    python tools/probe_graph_edges.py

Prints, per graph, each kernel node's function name and each edge's type
(``default`` = full serialization; ``programmatic`` = the next kernel may start once every
CTA of the previous one has triggered or exited).
"""
import os
import sys

import cuda.bindings.driver as cu
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_wo_a import bmm_only  # noqa: E402

from cute_kernels.wo_a import wo_a  # noqa: E402


def _ok(res):
    err, *rest = res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(err)
    return rest[0] if len(rest) == 1 else rest


def graph_nodes(launch, calls=3):
    """Capture ``calls`` back-to-back ``launch()`` calls (after one eager warm-up call) and
    return the graph's nodes as ``(node id, label)`` -- a kernel node's label is its function
    name (``kernel`` where a library kernel has none here) and grid, any other node its type
    (``CU_GRAPH_NODE_TYPE_MEMCPY`` ...) -- and its edges as ``(from id, to id, type)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)  # the cudaGraph_t stays readable
    with torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            launch()
    graph = cu.CUgraph(g.raw_cuda_graph())
    nodes, n = _ok(cu.cuGraphGetNodes(graph, 64))
    labels = []
    for node in nodes[:n]:
        kind = _ok(cu.cuGraphNodeGetType(node))
        label = getattr(kind, "name", str(kind))
        if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            try:
                params = _ok(cu.cuGraphKernelNodeGetParams(node))
                grid = f"grid={params.gridDimX}x{params.gridDimY}x{params.gridDimZ}"
                try:
                    label = _ok(cu.cuFuncGetName(params.func))
                    label = label.decode() if isinstance(label, bytes) else str(label)
                except Exception:  # noqa: BLE001 - a library kernel (CUkernel) has no function name here
                    label = "kernel"
                label = f"{label[:70]} {grid}"
            except Exception as e:  # noqa: BLE001
                label = f"kernel ({e})"
        labels.append((int(node), label))
    frm, to, data, m = _ok(cu.cuGraphGetEdges(graph, 64))
    edges = [(int(frm[i]), int(to[i]), {0: "default", 1: "programmatic", 2: "launch-completion"}.get(
        int(data[i].type), int(data[i].type))) for i in range(m)]
    return labels, edges


def describe(name, launch, calls=3):
    labels, edges = graph_nodes(launch, calls)
    print(f"{name}: {len(labels)} nodes, {len(edges)} edges", flush=True)
    for node, label in labels:
        print(f"  node {node & 0xffff:04x}: {label}")
    for frm, to, kind in edges:
        print(f"  edge {frm & 0xffff:04x} -> {to & 0xffff:04x}: {kind}")


def main():
    for G, R, Dg, T in [(8, 512, 2048, 320), (16, 1024, 1024, 320), (8, 512, 2048, 5)]:
        o = torch.randn(T, G * 8, Dg // 8, device="cuda").bfloat16()
        w = (torch.randn(G, R, Dg, device="cuda") / Dg**0.5).bfloat16()
        y = torch.empty(T, G * R, device="cuda", dtype=torch.bfloat16)
        tag = f"G={G} R={R} Dg={Dg} T={T}"
        describe(f"bmm alone, {tag}", lambda: bmm_only(o, w))
        describe(f"wo_a, {tag}", lambda: wo_a(o, w, out=y))
        describe(f"wo_a pdl, {tag}", lambda: wo_a(o, w, out=y, pdl=True))


if __name__ == "__main__":
    main()

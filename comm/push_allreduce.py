"""One-shot push all-reduce for decode-sized messages, optionally fused with the MoE finalize.

Every rank ``r`` pushes its bf16 partial into slot ``r`` of every peer's receive buffer with
peer-to-peer stores, raises one flag per peer carrying the launch's **phase**, waits for all
peers' flags of that phase, and reduces the ``world`` slots in rank order ``0..world-1`` in
FP32, rounding once to bf16 -- so every rank computes the identical, deterministic result.
``finalize_shared_allreduce`` computes the partial in the same launch from the expert outputs
(:func:`moe.finalize.finalize_shared_vec`): finalize -> bf16, + shared -> bf16, then the
all-reduce, exactly the rounding points of the unfused sequence.

Buffers (per rank, allocated once; peers' buffers mapped through CUDA IPC on a real group,
separate allocations on one GPU for the simulated group -- :mod:`comm.buffers`)::

    recv   bf16  [2 parity][world][max_tokens * hidden]   slot s of half (phase & 1) <- rank s
    flags  int32 [world][ctas]     flags[s][b] = phase + 1 once rank s's CTA b pushed its slice
    phase  int32 [ctas]            launches completed by this rank's CTA b (advanced in-kernel)
    error  int32 [1]               set to 1 by a CTA whose wait timed out

CTA ``b`` of every rank owns the same slice of the ``T * hidden`` elements (a grid-stride
partition over 16-byte vectors), so CTAs synchronise pairwise, never grid-wide.

Protocol of CTA ``b`` on rank ``r`` at phase ``p`` (read from ``phase[b]``), half ``h = p & 1``:

    | step | action                                                       | ordering                  |
    |------|--------------------------------------------------------------|---------------------------|
    | 1    | store partial slice into ``recv_q[h][r]`` for every peer q   | plain stores              |
    | 2    | ``flags_q[r][b] = p + 1`` for every q                        | bar.sync; fence.acq_rel.sys; st.release.sys |
    | 3    | wait ``flags_r[s][b] >= p + 1`` for every s (bounded)        | ld.acquire.sys            |
    | 4    | ``out = bf16(sum_s recv_r[h][s])`` in rank order             | bar.sync; fence.acq_rel.sys |
    | 5    | ``phase[b] = p + 1``                                         | read by the next launch   |

Why reuse is safe without an explicit acknowledgement: rank r writes half h of peer q again
at phase p + 2. Before that, in its launch p + 1, r waited for q's phase-(p+1) flag of CTA b,
which q's CTA b raised in q's launch p + 1 -- and that launch started only after q's launch p
(which read half h at phase p) had finished, by stream order on q. So half h is never
overwritten before its reader is done, however late a reader runs (a delayed reader only
delays its peers by one phase), and phase p + 1 uses the other half. The wait is ``>=``:
a fast peer may already have raised its phase-(p+1) flag (its p+1 data went to the other
half, so nothing this rank reads was touched); flags only grow. A CPU model of this
protocol with random interleavings (:mod:`comm.protocol_model`) checks it in CI.

Spin-waits are bounded: after ``max_spins`` polls a CTA sets ``error[0] = 1`` and skips its
reduction (its output slice is left as it was); the host API raises when it sees the flag
(:meth:`comm.buffers.PushAllReduceGroup.check`). No NVLink multicast is used: plain
``st``/``ld`` to peer memory only (no ``multimem``, no ``cuMulticastCreate``).

Supported batches: T up to the group's ``max_tokens`` (buffers are sized for it); the
backend selector (:mod:`comm.backend`) routes messages up to 8 MiB here -- T <= 585 tokens at
hidden 7168 -- and larger ones to NCCL.

Constraints: world in {2, 4, 8}; hidden % 8 == 0; T <= the group's ``max_tokens``; all of one
launch's ranks run the same T and the same number of CTAs (``ctas``, default 16) and must be
co-resident (true across GPUs; for the one-GPU simulation, world * ctas <= the SM count).
"""

from __future__ import annotations

import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_kernels import jit
from moe.finalize import VEC, finalize_shared_vec, stage_layout

MAX_WORLD = 8
WORLDS = (2, 4, 8)


class PushAllReduce:
    """Compile-time configuration: world size, hidden size, fused finalize (and its top-k)."""

    def __init__(self, world: int, hidden: int, fused: bool, topk: int = 1, threads: int = 256):
        self.world, self.H, self.fused, self.k, self.threads = world, hidden, fused, topk, threads
        self.nvec = hidden // VEC

    def __str__(self) -> str:
        # the DSL names the kernel after str(self): profiles tell the two variants apart
        return "FinalizeSharedAllReduce" if self.fused else "PushAllReduce"

    @cute.jit
    def __call__(self, in_ptr: cute.Pointer, w_ptr: cute.Pointer, pos_ptr: cute.Pointer, shared_ptr: cute.Pointer,
                 out_ptr: cute.Pointer,
                 recv0: cute.Pointer, recv1: cute.Pointer, recv2: cute.Pointer, recv3: cute.Pointer,
                 recv4: cute.Pointer, recv5: cute.Pointer, recv6: cute.Pointer, recv7: cute.Pointer,
                 flag0: cute.Pointer, flag1: cute.Pointer, flag2: cute.Pointer, flag3: cute.Pointer,
                 flag4: cute.Pointer, flag5: cute.Pointer, flag6: cute.Pointer, flag7: cute.Pointer,
                 phase_ptr: cute.Pointer, error_ptr: cute.Pointer, rank: Int32, num_tokens: Int32,
                 in_rows: Int32, slot_vecs: Int32, ctas: Int32, max_spins: Int32, delay: Int32,
                 stream: cuda.CUstream):
        H = self.H
        # fused: in = expert outputs y [in_rows, H]; else in = this rank's partial [T, H]
        mIn = cute.make_tensor(in_ptr, cute.make_layout((in_rows, H), stride=(H, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, self.k), stride=(self.k, 1)))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout((num_tokens * self.k,)))
        mShared = cute.make_tensor(shared_ptr, cute.make_layout((num_tokens, H), stride=(H, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, H), stride=(H, 1)))
        # recv of rank q: (slot element, src rank, parity); flags of rank q: (cta, src rank)
        slot_elems = cute.assume(slot_vecs * VEC, divby=VEC)  # every slot stays 16-byte aligned
        recv_layout = cute.make_layout((slot_elems, self.world, 2), stride=(1, slot_elems, self.world * slot_elems))
        flag_layout = cute.make_layout((ctas, self.world), stride=(1, ctas))
        recvs = [recv0, recv1, recv2, recv3, recv4, recv5, recv6, recv7]
        flags = [flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7]
        mRecv = [cute.make_tensor(recvs[q], recv_layout) for q in range(self.world)]
        mFlag = [cute.make_tensor(flags[q], flag_layout) for q in range(self.world)]
        mPhase = cute.make_tensor(phase_ptr, cute.make_layout((ctas,)))
        mErr = cute.make_tensor(error_ptr, cute.make_layout((1,)))
        self.kernel(mIn, mW, mPos, mShared, mOut, mRecv, mFlag, mPhase, mErr, rank, num_tokens, max_spins,
                    delay).launch(grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mW: cute.Tensor, mPos: cute.Tensor, mShared: cute.Tensor, mOut: cute.Tensor,
               mRecv: list, mFlag: list, mPhase: cute.Tensor, mErr: cute.Tensor, rank: Int32, num_tokens: Int32,
               max_spins: Int32, delay: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        W = self.world
        smem = cutlass.memory.SmemAllocator()
        sCtl = smem.allocate_tensor(Int32, cute.make_layout((2,)), 4)  # [phase, failed]
        sStage = None  # the fused finalize's per-thread stage of its routed and shared rows
        if cutlass.const_expr(self.fused):
            sStage = smem.allocate_tensor(mIn.element_type, stage_layout(self.k, self.threads), 16)
        if tidx == 0:
            sCtl[0] = mPhase[b]
            sCtl[1] = 0
        cute.arch.barrier()
        p = sCtl[0]
        h = p & 1
        nvec = num_tokens * self.nvec
        gOut = cute.zipped_divide(mOut, (1, VEC))
        gIn = cute.zipped_divide(mIn, (1, VEC))

        # 1. push this rank's partial slice into slot `rank` of every peer's half h
        for v in cutlass.range(b * self.threads + tidx, nvec, ctas * self.threads):
            t = v // self.nvec
            c = v - t * self.nvec
            part = cute.make_rmem_tensor(cute.make_layout((VEC,)), mOut.element_type)
            if cutlass.const_expr(self.fused):
                finalize_shared_vec(mIn, mW, mPos, mShared, t, c, self.k, True, part, sStage[None, None, tidx])
            else:
                cute.autovec_copy(gIn[(0, None), (t, c)], part)
            for q in cutlass.range_constexpr(W):
                dst = cute.zipped_divide(mRecv[q][None, rank, h], (VEC,))
                cute.autovec_copy(part, dst[(None, v)])

        # 2. signal: every thread's pushes are ordered (bar.sync, then a cumulative
        #    system-scope release by thread q) before the flag store into peer q.
        cute.arch.barrier()
        if tidx < W:
            cute.arch.fence_acq_rel_sys()
            for q in cutlass.range_constexpr(W):
                if tidx == q:
                    cute.arch.store((mFlag[q].iterator + (b + rank * ctas)).llvm_ptr, p + 1,
                                    sem="release", scope="sys")

        # 3. wait for every peer's flag of this phase (bounded)
        if tidx < W:
            spins = Int32(0)
            seen = self.poll_flag(mFlag, rank, b, ctas, tidx)
            # >=, not ==: a fast peer may already have raised its phase-(p+1) flag
            while seen < p + 1 and spins < max_spins:
                seen = self.poll_flag(mFlag, rank, b, ctas, tidx)
                spins += 1
            if seen < p + 1:
                sCtl[1] = 1
                mErr[0] = 1
        if delay > 0:  # test-only: a slow reader
            t0 = cute.arch.clock64()
            while cute.arch.clock64() - t0 < cutlass.Int64(delay):
                pass
        cute.arch.barrier()

        # 4. reduce the world slots of half h in rank order, one bf16 rounding
        if sCtl[1] == 0:
            cute.arch.fence_acq_rel_sys()  # acquire side for every reading thread
            for v in cutlass.range(b * self.threads + tidx, nvec, ctas * self.threads):
                t = v // self.nvec
                c = v - t * self.nvec
                acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
                acc.fill(0.0)
                rIn = cute.make_rmem_tensor(cute.make_layout((VEC,)), mOut.element_type)
                for s in cutlass.range_constexpr(W):
                    self.load_own_slot(mRecv, rank, s, h, v, rIn)
                    acc.store(acc.load() + rIn.load().to(Float32))
                res = cute.make_rmem_tensor(cute.make_layout((VEC,)), mOut.element_type)
                res.store(acc.load().to(mOut.element_type))
                cute.autovec_copy(res, gOut[(0, None), (t, c)])
            # 5. this CTA's phase advances only after a complete exchange
            cute.arch.barrier()
            if tidx == 0:
                mPhase[b] = p + 1

    @cute.jit
    def poll_flag(self, mFlag: list, rank: Int32, b: Int32, ctas: Int32, src: Int32) -> Int32:
        """flags_rank[src][b] with acquire semantics (rank is a runtime value: select its tensor)."""
        val = Int32(0)
        for q in cutlass.range_constexpr(self.world):
            if rank == q:
                val = cute.arch.load((mFlag[q].iterator + (b + src * ctas)).llvm_ptr, Int32, sem="acquire",
                                     scope="sys")
        return val

    @cute.jit
    def load_own_slot(self, mRecv: list, rank: Int32, s: int, h: Int32, v: Int32, dst: cute.Tensor):
        for q in cutlass.range_constexpr(self.world):
            if rank == q:
                src = cute.zipped_divide(mRecv[q][None, s, h], (VEC,))
                cute.autovec_copy(src[(None, v)], dst)


def _build(arch: str, *, world: int, hidden: int, fused: bool, topk: int = 1):
    if world not in WORLDS or hidden % VEC:
        raise ValueError(f"push_allreduce: world={world} must be one of {WORLDS}, hidden={hidden} a multiple of {VEC}")
    P = jit.fake_gmem_ptr
    bf = cutlass.BFloat16
    args = (P(bf, 16), P(Float32, 4), P(Int32, 4), P(bf, 16), P(bf, 16), *[P(bf, 16) for _ in range(MAX_WORLD)],
            *[P(Int32, 4) for _ in range(MAX_WORLD)], P(Int32, 4), P(Int32, 4),
            Int32(0), Int32(1), Int32(1), Int32(8), Int32(8), Int32(1), Int32(0), jit.fake_stream())
    return PushAllReduce(world, hidden, fused, topk), args


KERNEL = jit.register(jit.KernelDef(
    name="push_allreduce",
    build=_build,
    sources=(os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "moe", "finalize.py")),
    archs=("sm_90a", "sm_100a", "sm_103a"),
    aot_configs=tuple({"world": w, "hidden": 7168, "fused": f, "topk": 8 if f else 1}
                      for w in WORLDS for f in (False, True)),
    description="one-shot push all-reduce over P2P stores with phase flags (optionally fused finalize + shared add)",
))

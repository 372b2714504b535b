"""Stores and adds into the shared memory of another CTA of the same thread-block cluster (sm_90+).

A cluster's CTAs can write each other's shared memory (``mapa`` maps a local shared-memory
address to the same offset in CTA ``rank``). The writer must know the target CTA is running: a
cluster barrier arrived at on entry (``cute.arch.cluster_arrive_relaxed``) and waited on before
the first remote store.

:func:`store_async_to_cta` / :func:`store_async_to_cta_x4` (``st.async ...
mbarrier::complete_tx::bytes``, the exchange quack's cluster reductions use) publish the stores
without a second cluster barrier: each store credits its bytes to the target CTA's mbarrier at
the same offset; the reader arms its own mbarrier with the bytes it expects
(``cute.arch.mbarrier_arrive_and_expect_tx``; initialised with one arrival and published by
``mbarrier_init_fence`` before the entry arrive) and waits on it (``mbarrier_wait``, phase 0).
Credits that come before the arming leave the transaction count below zero, which the phase
allows. A CTA that waits for every byte sent to it cannot exit while stores to it are in
flight. The alternative, ``st.shared::cluster`` published by a release / acquire cluster
barrier, pays on sm_90 a GPU-scope ``MEMBAR`` for the release, which waits for every earlier
store of the thread, global ones included. Used by the router's cluster path and the KV
compressor's split entries.

Counts summed over the cluster (the split top-k select, :mod:`cute_kernels.indexer_topk_split`)
need adds: :func:`add_to_cta` (``red.shared::cluster``, published by a release / acquire cluster
barrier) or :func:`add_async_to_cta` (``red.async``, crediting the receiver's mbarrier like
``st.async``), whose senders announce their bytes with :func:`arrive_expect_bytes_at_cta` -- the
receiver need not know how many adds come.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of ``x`` as an unsigned integer (a bitcast, no conversion)."""
    return Uint32(llvm.bitcast(Uint32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _at_cta(instr: str, ptrs, rank, vals, vtype, loc, ip):
    """One PTX instruction on the shared memory of CTA ``rank``: each of the shared-memory
    pointers ``ptrs`` is mapped to that CTA (``mapa``) into ``p0``, ``p1``, ...; ``instr`` names
    them and the 32-bit ``vals`` (of ``vtype``) as ``{v}`` -- one register, or a ``{..}``
    vector of them."""
    n = len(ptrs)
    regs = [f"${n + 1 + i}" for i in range(len(vals))]
    v = regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"
    names = [f"p{i}" for i in range(n)]
    asm = ("{\n\t.reg .b32 " + ", ".join(names) + ";\n\t"
           + "".join(f"mapa.shared::cluster.u32 {p}, ${i}, ${n};\n\t" for i, p in enumerate(names))
           + instr.format(v=v) + ";\n\t}")
    llvm.inline_asm(
        None, [*[Int32(p.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip) for p in ptrs],
               Int32(rank).ir_value(loc=loc, ip=ip), *[vtype(x).ir_value(loc=loc, ip=ip) for x in vals]],
        asm, ",".join(["r"] * (n + 1 + len(vals))) + ",~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _remote_async_store(vals, smem_ptr, rank, mbar_ptr, loc, ip):
    """``st.async`` of the 32-bit ``vals`` (one, or a ``.v2`` / ``.v4`` vector) to ``smem_ptr`` in
    CTA ``rank``, crediting that CTA's mbarrier at ``mbar_ptr``'s offset."""
    vec = "" if len(vals) == 1 else f".v{len(vals)}"
    _at_cta(f"st.async.shared::cluster.mbarrier::complete_tx::bytes{vec}.b32 [p0], {{v}}, [p1]", [smem_ptr, mbar_ptr],
            rank, vals, Uint32, loc, ip)


@dsl_user_op
def store_async_to_cta(smem_ptr: cute.Pointer, rank: Int32, value: Uint32, mbar_ptr: cute.Pointer, *, loc=None,
                       ip=None) -> None:
    """``*smem_ptr = value`` in the shared memory of CTA ``rank`` of this cluster, crediting 4
    bytes to that CTA's mbarrier at ``mbar_ptr``'s offset (``st.async``; module docstring)."""
    _remote_async_store([value], smem_ptr, rank, mbar_ptr, loc, ip)


@dsl_user_op
def store_async_to_cta_x4(smem_ptr: cute.Pointer, rank: Int32, v0: Uint32, v1: Uint32, v2: Uint32, v3: Uint32,
                          mbar_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """:func:`store_async_to_cta` of four consecutive 32-bit words (one 16-byte ``st.async``;
    ``smem_ptr`` 16-byte aligned), crediting 16 bytes."""
    _remote_async_store([v0, v1, v2, v3], smem_ptr, rank, mbar_ptr, loc, ip)


@dsl_user_op
def add_to_cta(smem_ptr: cute.Pointer, rank: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """``*smem_ptr += value`` in the shared memory of CTA ``rank`` of this cluster (a relaxed
    ``red.shared::cluster``, no return value). Published by a release / acquire cluster barrier
    (``cute.arch.cluster_arrive`` then ``cluster_wait``); for counts summed over the cluster's
    CTAs, which a store cannot do."""
    _at_cta("red.relaxed.cluster.shared::cluster.add.u32 [p0], {v}", [smem_ptr], rank, [value], Int32, loc, ip)


@dsl_user_op
def add_async_to_cta(smem_ptr: cute.Pointer, rank: Int32, value: Int32, mbar_ptr: cute.Pointer, *, loc=None,
                     ip=None) -> None:
    """``*smem_ptr += value`` in the shared memory of CTA ``rank``, crediting 4 bytes to that
    CTA's mbarrier at ``mbar_ptr``'s offset (``red.async``: :func:`store_async_to_cta`'s
    publication for an add). The number of adds a CTA receives need not be known to it: each
    sender announces its bytes with :func:`arrive_expect_bytes_at_cta`."""
    _at_cta("red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add.u32 [p0], {v}, [p1]",
            [smem_ptr, mbar_ptr], rank, [value], Int32, loc, ip)


@dsl_user_op
def arrive_expect_bytes_at_cta(mbar_ptr: cute.Pointer, rank: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    """One arrival on CTA ``rank``'s mbarrier at ``mbar_ptr``'s offset that also raises its
    expected transaction bytes by ``nbytes`` (``mbarrier.arrive.expect_tx`` on a remote
    mbarrier, relaxed): a sender's announcement of the bytes its async adds / stores credit
    there. With the mbarrier initialised to the number of senders' arrivals, its phase completes
    once every sender has arrived and every announced byte has landed, in whatever order."""
    _at_cta("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster.b64 _, [p0], {v}", [mbar_ptr], rank,
            [nbytes], Int32, loc, ip)

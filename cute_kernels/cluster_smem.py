"""Stores into the shared memory of another CTA of the same thread-block cluster (sm_90+).

A cluster's CTAs can write each other's shared memory (``mapa`` maps a local shared-memory
address to the same offset in CTA ``rank``; ``st.shared::cluster`` stores there). The writer
must know the target CTA is running (a cluster barrier arrived at on entry and waited on before
the first remote store), and the reader sees the stores after a cluster barrier whose arrive
has release and whose wait has acquire semantics (``cute.arch.cluster_arrive`` /
``cluster_wait``). Used by the router's cluster path and the KV compressor's split entries.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of ``x`` as an unsigned integer (a bitcast, no conversion)."""
    return Uint32(llvm.bitcast(Uint32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def store_to_cta(smem_ptr: cute.Pointer, rank: Int32, value: Uint32, *, loc=None, ip=None) -> None:
    """``*smem_ptr = value`` in the shared memory of CTA ``rank`` of this cluster (the same
    offset there): ``mapa`` + ``st.shared::cluster``."""
    llvm.inline_asm(
        None, [Int32(smem_ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip),
               Uint32(value).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $0, $1;\n\tst.shared::cluster.u32 [a], $2;\n\t}",
        "r,r,r,~{memory}", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)

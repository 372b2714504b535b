"""Device helpers for MX block scales (UE8M0: a power of two per block, stored as its biased
exponent byte): their FP32 value, for the kernels that apply them (the Hopper routed-expert
GEMMs :mod:`moe.experts_tiled_sm90` / :mod:`moe.experts_swap_ab_sm90` and WO-A with FP8
activations :mod:`cute_kernels.wo_a_fp8_act_sm90`), and where a block's byte sits in the
swizzled scale layout (tcgen05's 128-row x 4-block atoms, which :mod:`moe.quant` writes and
the fused requantising epilogues write too). Called while a kernel is traced."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def u32_as_f32(x: Uint32, *, loc=None, ip=None) -> Float32:
    """The FP32 number whose bit pattern is ``x`` (a bit cast, no conversion)."""
    return Float32(llvm.bitcast(Float32.mlir_type, Uint32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def e8m0_to_f32(s: Uint32) -> Float32:
    """2^(s - 127) from its exponent field; 0xFF (E8M0 NaN) -> NaN; 0 -> 0 (zero blocks)."""
    return u32_as_f32(cutlass.select_(s == Uint32(0xFF), Uint32(0x7FC00000), s << 23))


def swizzled_scale_word(r, g, ncb):
    """The 32-bit word holding row ``r``'s scale bytes of blocks ``4g .. 4g + 3`` in the swizzled
    layout with ``ncb`` 4-block atoms per 128-row band: atom ``(r // 128, g)`` of 512 bytes, byte
    ``16 (r % 32) + 4 ((r // 32) % 4)`` in it."""
    return ((r // 128) * ncb + g) * 128 + (r % 32) * 4 + (r // 32) % 4


def swizzled_scale_byte(r, c, ncb):
    """The byte of row ``r``'s block ``c`` in the swizzled layout: byte ``c % 4`` of
    :func:`swizzled_scale_word`'s word ``(r, c // 4)``, written out in bytes."""
    return ((r // 128) * ncb + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4

"""e4m3 -> bf16 widening in registers by bit patterns, for kernels that feed FP8 weights to a
bf16 MMA (:mod:`.wo_a_decode_fp8`'s ``widen="bits"``).

The conversion instructions' route (``F2FP.F16.E4M3.UNPACK_B``, two ``HADD2.F32``, one
``F2FP.BF16.F32.PACK_AB`` per two weights) issues four instructions, two of them conversions.
This one builds the two bf16 patterns from the bytes with integer operations and one bf16
multiply -- five instructions, none a conversion:

    x = prmt(word, 0, pair)            # bytes 2p, 2p+1 of the word into the high byte of each
                                       # 16-bit lane, the low bytes zero
    t = ((x >> 4) & 0x07F007F0) | (x & 0x80008000)
                                       # per lane: the sign at bit 15, the byte's exponent and
                                       # mantissa fields at bits 7-10 / 4-6 -- the bf16 pattern
                                       # of w * 2^-120 (bf16's exponent bias 127, e4m3's 7)
    y = t * 2^120                      # bf16x2 multiply (0x7B80 = 2^120)

Exact for every finite e4m3 value: a normal one's pattern is a normal bf16 and the multiply
by a power of two is exact; a subnormal one (exponent field 0) lands on a bf16 subnormal
``m/8 * 2^-126``, which the multiply takes to ``m/8 * 2^-6`` exactly (bf16 arithmetic keeps
subnormals). ``+-0`` stays ``+-0``. e4m3's NaN codes (0x7F, 0xFF) become ``+-480``, not NaN:
use it on weights that hold none (:func:`cute_kernels.wo_a_decode_fp8.quantize_wo_a_fp8`
produces none; a checkpoint's FP8 weights hold none). :func:`e4m3_pairs_to_bf16_model` is the
same sequence in Python, checked against torch's conversion for all 256 codes on the CPU.
"""

from cutlass import Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: prmt selectors: bytes (0, 1) / (2, 3) of a word into the high byte of each 16-bit lane
PAIR_SELECTORS = (0x1404, 0x3424)
#: 2^120 as a bf16x2 pair
BF16X2_2_POW_120 = 0x7B807B80


@dsl_user_op
def e4m3x2_to_bf16x2(word: Uint32, pair: int, *, loc=None, ip=None) -> Uint32:
    """Bytes ``2 pair`` and ``2 pair + 1`` of ``word`` (e4m3) as a bf16x2 word (the lower byte
    in the lower half), by the sequence in the module docstring."""
    sel = PAIR_SELECTORS[pair]
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(word).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 x, t, s, c;\n\t"
        f"prmt.b32 x, $1, 0, {sel:#x};\n\t"
        "shr.u32 t, x, 4;\n\t"
        "and.b32 t, t, 0x07F007F0;\n\t"
        "and.b32 s, x, 0x80008000;\n\t"
        "or.b32 t, t, s;\n\t"
        f"mov.b32 c, {BF16X2_2_POW_120:#x};\n\t"
        "mul.rn.bf16x2 $0, t, c;\n\t}",
        "=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


def e4m3_pairs_to_bf16_model(word: int, pair: int) -> tuple[int, int]:
    """:func:`e4m3x2_to_bf16x2` in Python on a 32-bit ``word``: the two bf16 bit patterns
    (lower lane first) -- the prmt, the masks and the exact multiply by 2^120."""
    import torch

    b = [(word >> (8 * i)) & 0xFF for i in range(4)]
    x = (b[2 * pair] << 8) | (b[2 * pair + 1] << 24)  # prmt: bytes into the lanes' high bytes
    t = ((x >> 4) & 0x07F007F0) | (x & 0x80008000)
    lanes = torch.tensor([t & 0xFFFF, t >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    y = (lanes.double() * 2.0 ** 120).to(torch.bfloat16)  # exact: a power of two, no overflow
    out = y.view(torch.int16).to(torch.int32) & 0xFFFF
    return int(out[0]), int(out[1])



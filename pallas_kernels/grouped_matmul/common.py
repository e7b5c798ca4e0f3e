"""What both Triton grouped-matmul kernels use: the PTX dequantization of codes and the int32 guard."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# Triton computes element offsets in int32: an operand of 2**31 elements or more would be read at wrapped
# offsets (silently wrong output).
MAX_OPERAND_ELEMENTS = 2**31


def check_int32_offsets(*operands) -> None:
    """Refuses operands a Triton kernel would address past int32.

    Raises:
      ValueError: an operand of `MAX_OPERAND_ELEMENTS` elements or more.
    """
    for operand in operands:
        if operand.size >= MAX_OPERAND_ELEMENTS:
            raise ValueError(
                f"gmm operand of shape {tuple(operand.shape)} has {operand.size} elements, more than "
                f"the kernel's int32 offsets address ({MAX_OPERAND_ELEMENTS}); split it (the offload "
                f"scheduler gathers the experts a chunk needs out of its pool)"
            )


# Four codes per PTX block: each code's byte is permuted into the low byte of 2**23 (prmt with 0x4B000000),
# 2**23 (+ 128 for int8, whose bytes are first offset by 128 with an XOR) is subtracted, exactly, then the
# scale is applied in f32 (int8: code * scale; 4 bits: code * scale + offset) and pairs are rounded to bf16 by
# one cvt.rn.bf16x2. For 4 bits the subtraction and the scale are one fma, (2**23 + code) * scale - 2**23 *
# scale: its one rounding is that of code * scale (2**23 * scale is exact).
# int8 with float16 / bfloat16 scales (`int8_fma`): the byte b = code + 128 goes into bits 8-15 of 2**15
# (prmt with 0x47000000, selector 0x76i4), so f = 2**15 + b exactly, and one fma f * scale - (2**15 + 128) *
# scale gives round(code * scale): (2**15 + 128) * scale has at most 9 + 11 significant bits, so it is exact
# in f32, and the fma's exact result is code * scale. (With float32 scales it would not be exact: two steps
# then.) Operands: $0, $1 the two bf16x2 results, $2 four codes (bytes), then four f32 scales (and four f32
# offsets).
_ASM_CODES = {
    8: "xor.b32 t, $2, 0x80808080;",
    "lo": "and.b32 t, $2, 0x0F0F0F0F;",
    "hi": "shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F;",
}


def _asm_byte_to_float(i: int, fma8: bool) -> tuple[str, str]:
    """(the power of two moved into m, the prmt putting byte i of t into f{i}): 2**15 + byte << 8 for the
    one-fma
    int8 form (`fma8`), else 2**23 + byte."""
    if fma8:
        return "mov.b32 m, 0x47000000;", f"prmt.b32 f{i}, t, m, {0x7604 + 16 * i:#x};"
    return "mov.b32 m, 0x4B000000;", f"prmt.b32 f{i}, t, m, {0x7540 + i:#x};"


def dequantize_asm(codes, scale, offset=None, *, part, int8_fma=False, f32=False):
    """Weights from packed codes by inline PTX (sm_80+; compiled kernels only).

    Args:
      codes: any shape; int8 for part=8, packed uint8 for the 4-bit "lo" / "hi" nibbles.
      scale, offset: float32 of the codes' shape (offset optional for int8).
      part: 8, "lo" or "hi".
      int8_fma: the scales are float16 / bfloat16 values, so int8 takes one fma per code (see above).
      f32: return float32 weights, not rounded to bf16 (the matrix-vector kernel).

    Returns:
      bf16 (or float32) weights of the codes' shape.
    """
    fma8 = part == 8 and int8_fma
    lines = [".reg .b32 t, m, f<4>, n<4>;", _ASM_CODES[part], _asm_byte_to_float(0, fma8)[0]]
    for i in range(4):
        lines.append(_asm_byte_to_float(i, fma8)[1])
        # 2**15 + 128 + code, one fma (the four products by -(2**15 + 128) are one where scales agree)
        if fma8:
            lines.append(f"mul.rn.f32 n{i}, ${3 + i}, 0fC7008000; fma.rn.f32 f{i}, f{i}, ${3 + i}, n{i};")
        elif part == 8:  # 2**23 + 128 + code: the int8 bias times an f32 scale is not exact, so two steps
            lines.append(f"sub.rn.f32 f{i}, f{i}, 0f4B000080; mul.rn.f32 f{i}, f{i}, ${3 + i};")
        else:  # (the four scales are usually one register: ptxas keeps one product by -2**23)
            lines.append(f"mul.rn.f32 n{i}, ${3 + i}, 0fCB000000; fma.rn.f32 f{i}, f{i}, ${3 + i}, n{i};")
        if offset is not None:  # not one fma: the same roundings as the other conversions (bitwise equal)
            lines.append(f"add.rn.f32 f{i}, f{i}, ${7 + i};")
    args = [codes, scale] + ([] if offset is None else [offset])
    if f32:  # four f32 results instead of two bf16 pairs: every input operand moves up by two
        text = re.sub(r"\$(\d+)", lambda op: f"${int(op.group(1)) + 2}", " ".join(lines))
        text += " mov.b32 $0, f0; mov.b32 $1, f1; mov.b32 $2, f2; mov.b32 $3, f3;"
        results, dtype = "=f,=f,=f,=f", jnp.float32
    else:
        text = " ".join(lines + ["cvt.rn.bf16x2.f32 $0, f1, f0;", "cvt.rn.bf16x2.f32 $1, f3, f2;"])
        results, dtype = "=r,=r", jnp.bfloat16
    constraints = results + ",r," + ",".join(["f"] * 4 * (len(args) - 1))
    [w] = plgpu.elementwise_inline_asm(
        "{" + text + "}",
        args=args,
        constraints=constraints,
        pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, dtype)],
    )
    return w

"""Grouped matmul as a Pallas kernel through the Triton lowering (Ampere, Ada, Hopper; interpreter on CPU).

Work decomposition. A *work item* is a chunk of at most `block_m` consecutive rows of ONE group, starting at
the group's first row (chunks are aligned to group starts, not to multiples of block_m): a group of s rows
gives cdiv(s, block_m) items, so a group smaller than block_m reads its weights exactly once and no row is
multiplied by another group's weights. The megablox/tokamax alternative, m-tiles aligned to block_m and
visited once per overlapping group, recomputes every straddling tile: 1.5x the useful rows at M=65536,
block_m=128, 256 router-skewed groups, against 1.25x here (docs/benchmarks_gmm.md: 318 -> 366 TFLOP/s).
Rows past sum(group_sizes) form one extra "padding group" whose items store zeros without any matmul. The item list is built on device from group_sizes (`make_schedule`; no host sync); its length is
bounded statically by m // block_m + groups + 1, and the surplus items exit at once.

The 1-D grid runs (work item, n-tile) pairs with the n-tile fastest, so programs that run together share
one lhs chunk and one group's weights (L2 reuse). Each program loops over k in steps of `block_k`,
accumulating in float32 registers, and writes its `[block_m, block_n]` output tile once.

Quantized weights (`QuantizedWeights`) are dequantized in registers inside the k loop (codes * scale
[+ offset], scales broadcast over each 32-row block, cast to the lhs dtype) and fed to the same
tensor-core dot: bf16 weights never exist in HBM. For 4 bits one packed byte tile feeds two dots:
lhs[:, kk:] with the low nibbles and lhs[:, k/2 + kk:] with the high nibbles (the split-half layout of
`QuantizedWeights`). Other orders of dequantization are selectable by `BlockSizes.quant_mode`. Codes stored
k-major (`QuantizedWeights.k_major`, the default layout) reach the tensor-core operand layout four to a 32-bit
load, and their defaults dequantize them by inline PTX (`_dequantize_asm`); codes stored `[groups, k, n]` are
read one byte per load (H100 timings of both in docs/benchmarks_gmm.md).

With `lhs_index` the rows of the product are gathered inside the kernel: each program loads its chunk's
indices once and reads lhs[index, kk:kk + block_k] through them (clamped into range), so the MoE dispatch's
[tokens * top_k, hidden] sorted copy of the activations is never written (measured as fast as on
pre-gathered rows on an H100, docs/benchmarks_gmm.md).

Default tile shapes pass `within_shared_memory`: Triton buffers `num_stages` copies of each step's tiles in
shared memory and refuses a kernel that needs more than the device has (`pallas_kernels.gpu_limits`).

gmm_swiglu keeps two accumulators (gate columns j and up columns ffn + j of the same group) and writes
silu(gate) * up, so the [m, 2 * ffn] intermediate never reaches memory.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_limits
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.quantized import QuantizedWeights
from pallas_kernels.triton_math import silu_approx

# Rows per tensor-core tile where each work item is one row (`row_groups`): the smallest M of a Triton dot.
ROW_BLOCK_M = 16

# Triton computes element offsets in int32: an operand of 2**31 elements or more would be read at wrapped
# offsets (silently wrong output, seen on an H100 with a 12 GiB pool of 4-bit experts as one rhs).
MAX_OPERAND_ELEMENTS = 2**31


# jnp.searchsorted's method in make_schedule. Its default, "scan", is a loop of log2(groups) steps that XLA runs as
# a while loop on the GPU: the schedule alone took 0.26-0.30 ms on an H100 (2026-11-25) against 0.05-0.09 for the
# loop-free methods, and a whole int8 gmm_swiglu call at m = 4096 0.417 against 0.304 ms (docs/benchmarks_gmm.md).
# "compare_all": items x groups comparisons in one fusion.
SCHEDULE_SEARCH = "compare_all"


# Four codes per PTX block (`BlockSizes.int_to_float="asm"`): each code's byte is permuted into the low byte of
# 2**23 (prmt with 0x4B000000), 2**23 (+ 128 for int8, whose bytes are first offset by 128 with an XOR) is
# subtracted, exactly, then the scale is applied in f32 (int8: code * scale; 4 bits: code * scale + offset) and
# pairs are rounded to bf16 by one cvt.rn.bf16x2. For 4 bits the subtraction and the scale are one fma,
# (2**23 + code) * scale - 2**23 * scale: its one rounding is that of code * scale (2**23 * scale is exact).
# int8 with float16 / bfloat16 scales (`int8_fma`): the byte b = code + 128 goes into bits 8-15 of 2**15
# (prmt with 0x47000000, selector 0x76i4), so f = 2**15 + b exactly, and one fma f * scale - (2**15 + 128) * scale
# gives round(code * scale): (2**15 + 128) * scale has at most 9 + 11 significant bits, so it is exact in f32,
# and the fma's exact result is code * scale. (With float32 scales it would not be exact: two steps then.)
# Operands: $0, $1 the two bf16x2 results, $2 four codes (bytes), then four f32 scales (and four f32 offsets).
_ASM_CODES = {
    8: "xor.b32 t, $2, 0x80808080;",
    "lo": "and.b32 t, $2, 0x0F0F0F0F;",
    "hi": "shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F;",
}


def _asm_byte_to_float(i: int, fma8: bool) -> tuple[str, str]:
    """(the power of two moved into m, the prmt putting byte i of t into f{i}): 2**15 + byte << 8 for the one-fma
    int8 form (`fma8`), else 2**23 + byte. Shared with the Mosaic GPU kernel's conversion (`pallas_mosaic`)."""
    if fma8:
        return "mov.b32 m, 0x47000000;", f"prmt.b32 f{i}, t, m, {0x7604 + 16 * i:#x};"
    return "mov.b32 m, 0x4B000000;", f"prmt.b32 f{i}, t, m, {0x7540 + i:#x};"


def _dequantize_asm(codes, scale, offset=None, *, part, int8_fma=False, f32=False):
    """bf16 (or float32) weights from codes (any shape; int8 for part=8; packed uint8 for the 4-bit "lo" / "hi"
    nibbles) and float32 `scale` (and `offset`) of the same shape, by inline PTX (sm_80+; compiled kernels only).
    int8_fma: the scales are float16 / bfloat16 values, so int8 takes one fma per code (see above).
    f32: the weights in float32, not rounded to bf16 (the matrix-vector kernel, `pallas_gemv`)."""
    fma8 = part == 8 and int8_fma
    lines = [".reg .b32 t, m, f<4>, n<4>;", _ASM_CODES[part], _asm_byte_to_float(0, fma8)[0]]
    for i in range(4):
        lines.append(_asm_byte_to_float(i, fma8)[1])
        if fma8:   # 2**15 + 128 + code, one fma (the four products by -(2**15 + 128) are one where scales agree)
            lines.append(f"mul.rn.f32 n{i}, ${3 + i}, 0fC7008000; fma.rn.f32 f{i}, f{i}, ${3 + i}, n{i};")
        elif part == 8:   # 2**23 + 128 + code: the int8 bias times an f32 scale is not exact, so two steps
            lines.append(f"sub.rn.f32 f{i}, f{i}, 0f4B000080; mul.rn.f32 f{i}, f{i}, ${3 + i};")
        else:   # (the four scales are usually one register: ptxas keeps one product by -2**23)
            lines.append(f"mul.rn.f32 n{i}, ${3 + i}, 0fCB000000; fma.rn.f32 f{i}, f{i}, ${3 + i}, n{i};")
        if offset is not None:   # not one fma: the same roundings as the other conversions (bitwise equal)
            lines.append(f"add.rn.f32 f{i}, f{i}, ${7 + i};")
    args = [codes, scale] + ([] if offset is None else [offset])
    if f32:   # four f32 results instead of two bf16 pairs: every input operand moves up by two
        text = re.sub(r"\$(\d+)", lambda op: f"${int(op.group(1)) + 2}", " ".join(lines))
        text += " mov.b32 $0, f0; mov.b32 $1, f1; mov.b32 $2, f2; mov.b32 $3, f3;"
        results, dtype = "=f,=f,=f,=f", jnp.float32
    else:
        text = " ".join(lines + ["cvt.rn.bf16x2.f32 $0, f1, f0;", "cvt.rn.bf16x2.f32 $1, f3, f2;"])
        results, dtype = "=r,=r", jnp.bfloat16
    constraints = results + ",r," + ",".join(["f"] * 4 * (len(args) - 1))
    [w] = plgpu.elementwise_inline_asm("{" + text + "}", args=args, constraints=constraints, pack=4,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, dtype)])
    return w


# 4-bit codes in bf16 arithmetic (`BlockSizes.int_to_float="asm_bf16"`), four codes per PTX block: the high
# nibbles are first shifted down (a bf16 mantissa has 7 bits, too few for a nibble at bits 4-7), two bytes at a
# time are permuted into the low bytes of a bf16 pair, the nibbles are masked into the mantissa of 128 (and,
# or 0x4300), one bf16x2 fma takes the code out exactly ((128 + q) - 128), and one bf16x2 fma
# applies the scale and offset. The last rounds once, in bf16, with the scale and offset themselves rounded to
# bf16 first: not the "convert" weights bit for bit (see BlockSizes). Operands: $0, $1 the two bf16x2 results,
# $2 four packed bytes, $3, $4 the scales and $5, $6 the offsets as bf16 pairs.


def _dequantize_asm_bf16(codes, scale, offset, *, part):
    """bf16 weights from packed 4-bit codes `[rows, cols]` uint8 ("lo" / "hi" nibbles) and bf16 `scale`,
    `offset` of the same shape, in bf16x2 arithmetic by inline PTX (sm_80+; compiled kernels only)."""
    lines = [".reg .b32 t, p, x, u, c, z;", "mov.b32 u, 0x3F803F80; mov.b32 c, 0xC300C300; mov.b32 z, 0;",
             "shr.b32 t, $2, 4;" if part == "hi" else "mov.b32 t, $2;"]   # u = (1, 1), c = (-128, -128)
    for i, selector in enumerate(("0x4140", "0x4342")):   # bytes 0, 1 (then 2, 3) into the two halves
        lines.append(f"prmt.b32 p, t, z, {selector}; and.b32 x, p, 0x000F000F; or.b32 x, x, 0x43004300;")
        lines.append(f"fma.rn.bf16x2 x, x, u, c; fma.rn.bf16x2 ${i}, x, ${3 + i}, ${5 + i};")
    [w] = plgpu.elementwise_inline_asm("{" + " ".join(lines) + "}", args=[codes, scale, offset],
                                       constraints="=r,=r,r,r,r,r,r", pack=4,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)])
    return w


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile shape and Triton launch parameters.

    block_m rows x block_n output columns per program; block_k elements of k per loop step (a multiple of
    the quantization block, 32, for quantized weights; for 4 bits it counts packed rows, i.e. each step
    covers block_k rows of each half). num_warps / num_stages: Triton warps per program and software
    pipelining depth. quant_mode (quantized weights only): "tile" dequantizes a whole [block_k, block_n]
    weight tile (scales broadcast over each 32-row block) and issues one dot per step; "block" issues one
    dot per 32-row quantization block; "scale_after_dot" multiplies the integer codes (exact in bf16) on
    the tensor cores per block and applies the scale (and the offset, as rowsum(x) * offset) to the float32
    partial product; "tile_swapped" is "tile" with the operands swapped, out^T = W^T x^T, so the weights
    dequantized in registers are the dot's first operand (Hopper wgmma reads that one from registers,
    skipping a shared-memory round trip) and the few rows of x are its second. int_to_float ("tile" modes):
    "convert" turns codes into float32 with the int-to-float instruction (quarter rate on Hopper); "magic" ORs
    the code's byte into the mantissa of 2**23 and subtracts 2**23 (+ 128 for int8, whose byte is first offset
    by 128 with an XOR): integer and float instructions only, exact for 8-bit codes; "asm" (bf16 lhs, compiled
    kernels) dequantizes four codes per PTX block (`_dequantize_asm`: the same 2**23 construction by byte
    permutes, the scale multiply and a paired f32 -> bf16 rounding); it pays with k-major codes, which reach
    it four to a 32-bit load (with [groups, k, n] codes Triton loads bytes one at a time and packs them for
    it, slower than "convert"); the interpreter and f32 lhs run "magic" instead (the same arithmetic).
    "asm_bf16" (4-bit codes; int8 takes "asm"): the PTX works in bf16 pairs (`_dequantize_asm_bf16`: a
    permute, a mask (and, or) and two bf16x2 fmas per two codes), with the scale and offset rounded to bf16 first and
    the weight rounded once in bf16: each weight within (15 |scale| + |offset| + |weight|) 2**-9 of the exact
    value, against |weight| 2**-9 for the other modes (for Q4_0's offset -8 scale at most ~6% of the
    quantization step), so not their weights bit for bit; the interpreter runs the same arithmetic in jnp.
    fast_silu (gmm_swiglu, bf16 lhs, compiled kernels): the epilogue's silu by `triton_math.silu_approx` (one
    ex2.approx and one rcp.approx per output) instead of `jax.nn.sigmoid`, which lowers to libdevice's expf and an
    IEEE division (~20 instructions); the interpreter and f32 lhs keep the exact form.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    quant_mode: Literal["tile", "tile_swapped", "block", "scale_after_dot"] = "tile"
    int_to_float: Literal["convert", "magic", "asm", "asm_bf16"] = "convert"
    fast_silu: bool = True

    @classmethod
    def get_default(cls, m: int, k: int, n: int, groups: int, *, bits: int | None = None,
                    swiglu: bool = False, k_major: bool = False) -> BlockSizes:
        """A tile shape for this problem; the figures behind it are in docs/benchmarks_gmm.md.

        k_major: quantized weights stored k-contiguous (`QuantizedWeights.k_major`, what the quantizers and the
        GGUF loader produce); those get the "asm" dequantization and their own tiles.
        """
        rows_per_group = m / max(groups, 1)
        if bits is not None and k_major:
            return cls._get_default_k_major(rows_per_group, bits, swiglu)
        if bits == 4:   # 2**23 conversion: 4-bit weight-read bound 5-14% faster, prefill sizes within 1% (11-25)
            return dataclasses.replace(cls._get_default(m, k, n, groups, rows_per_group, bits, swiglu),
                                       int_to_float="magic")
        return cls._get_default(m, k, n, groups, rows_per_group, bits, swiglu)

    @classmethod
    def get_default_rows(cls, *, bits: int | None = None, swiglu: bool = False, k_major: bool = False) -> BlockSizes:
        """A tile shape for rows in any order with their groups given (`row_groups`: a decode step's (token,
        expert) pairs, one row per item, block_m `ROW_BLOCK_M`): each program reads one expert's [k, block_n]
        weight tile for one row. H100 sweep of 2026-11-26 (1 and 8 tokens x top-8, 8 layers' distinct weights,
        docs/benchmarks_gmm.md): the weight-read-bound tiles, except 4-bit (block_n 64, block_k 128: gate_up
        18 against 31 us at 1 token, level at 8; down 20 against 21, 30 against 35) and the bf16 gate_up
        (block_n 128, block_k 128: 22 against 25 us at 1 token, level at 8)."""
        bs = cls.get_default(1, 1, 1, 1, bits=bits, swiglu=swiglu, k_major=k_major)   # one row per group
        if bits == 4 and k_major:
            return dataclasses.replace(bs, block_n=64, block_k=128)
        if bits is None and swiglu:
            return dataclasses.replace(bs, block_k=128)
        return bs

    @classmethod
    def _get_default_k_major(cls, rows_per_group, bits, swiglu) -> BlockSizes:
        # H100 sweeps of 2026-11-25 (benchmarks/gmm_tiles.py, k-major codes; docs/benchmarks_gmm.md), ms.
        # Weight-read bound (m = 4096, 16 rows per group): int8 gate_up 32x64x128 0.249 (32x128x128 0.264,
        # 32x128x64 0.344), int8 down 32x128x128 0.138, 4-bit gate_up 32x128x64 0.275, 4-bit down 32x128x64
        # 0.155 (32x128x128 s4 0.152). Prefill (m = 65536, 256 rows per group): 64x128x64 with 4 warps the best
        # of eight for all four (int8 gate_up 1.011, down 0.552; 4-bit 1.106, 0.657). m = 262144 (~1 000 rows
        # per group): the same, except the int8 down product, 128x128x64 1.647 against 1.960.
        if rows_per_group <= 32:
            if bits == 8:
                return cls(block_m=32, block_n=64 if swiglu else 128, block_k=128, num_warps=4, num_stages=3,
                           int_to_float="asm")
            return cls(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, int_to_float="asm")
        if bits == 8 and not swiglu and rows_per_group >= 512:
            return cls(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3, int_to_float="asm")
        return cls(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, int_to_float="asm")

    @classmethod
    def _get_default(cls, m, k, n, groups, rows_per_group, bits, swiglu) -> BlockSizes:
        if bits == 4 and not swiglu and rows_per_group <= 32:   # 4-bit down product, weight-read bound:
            # 16-row chunks, 4 stages (2026-11-23, m=4096, k=512: 0.305 ms against 0.411 for 32x128x64 s3)
            return cls(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4)
        if bits == 4 and rows_per_group <= 32:   # 4-bit gate_up, weight-read bound: weights as the register
            # operand (2026-11-25, m=4096: 0.328 ms against 0.372 for the same tile unswapped)
            return cls(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="tile_swapped")
        if bits is not None and rows_per_group <= 64:   # weight-read bound: small chunks and n-tiles
            return cls(block_m=32 if rows_per_group <= 32 else 64, block_n=128, block_k=64,
                       num_warps=4, num_stages=3)
        # Compute bound, dequantizing in registers: 8 warps per 128x64 tile (2026-11-23 sweep,
        # benchmarks/gmm_tiles.py: 1.2-1.3x faster than 4 warps for the int8 gate_up), 256-row chunks where
        # groups are long (int8 down at 1024 rows per group 1.17x; 4-bit gate_up 1.3x at 256, 1.55x at 1024).
        if bits == 8:
            if rows_per_group >= 512 and not swiglu:
                return cls(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=3)
            return cls(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
        if bits == 4:
            if rows_per_group >= 256 and swiglu:
                return cls(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=3)
            return cls(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3,
                       quant_mode="tile_swapped")
        if rows_per_group <= 64:   # weight-read bound (decode / small prefill chunks)
            # gmm_swiglu loads two weight tiles per step: block_k 128 asked 240 KiB of shared memory for 3
            # stages (more than the H100's 227; failed to compile at m=4096, 2026-11-23).
            return cls(block_m=64, block_n=128, block_k=64 if swiglu else 128, num_warps=4, num_stages=3)
        if swiglu:                 # two accumulators per program
            return cls(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
        return cls(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


def check_int32_offsets(*operands) -> None:
    """Raises ValueError for an operand of `MAX_OPERAND_ELEMENTS` elements or more, which a Triton kernel would read
    at wrapped int32 offsets (this kernel's and `pallas_gemv`'s)."""
    for operand in operands:
        if operand.size >= MAX_OPERAND_ELEMENTS:
            raise ValueError(f"gmm operand of shape {tuple(operand.shape)} has {operand.size} elements, more than "
                             f"the kernel's int32 offsets address ({MAX_OPERAND_ELEMENTS}); split it (the offload "
                             f"scheduler gathers the experts a chunk needs out of its pool)")


def make_schedule(group_sizes: jax.Array, m: int, block_m: int, search: str | None = None):
    """Work items (group, chunk of <= block_m rows) for `m` rows sorted by group, on device.

    Args:
      group_sizes: `[groups]` int32; sum may be < m (the rest is the padding group `groups`). A sum > m is
        clipped to m.
      m: rows of lhs.
      block_m: rows per chunk.
      search: `jnp.searchsorted`'s method for item -> group; None = `SCHEDULE_SEARCH`.

    Returns:
      (group, row_start, row_end), each `[m // block_m + groups + 1]` int32: the item's group (in
      [0, groups], `groups` = padding rows; `groups + 1` = unused item) and the half-open row range
      [row_start, row_end) it owns, row_end - row_start <= block_m.
    """
    groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.append(starts, ends[-1])                    # [groups + 1], the padding group last
    ends = jnp.append(ends, jnp.int32(m))
    chunks = (ends - starts + block_m - 1) // block_m          # [groups + 1]
    cum = jnp.cumsum(chunks)
    num_items = m // block_m + groups + 1                      # static bound on sum(chunks)
    item = jnp.arange(num_items, dtype=jnp.int32)
    group = jnp.searchsorted(cum, item, side="right", method=search or SCHEDULE_SEARCH).astype(jnp.int32)   # groups + 1 = unused
    g = jnp.minimum(group, groups)
    row_start = starts[g] + (item - (cum[g] - chunks[g])) * block_m
    row_end = jnp.minimum(ends[g], row_start + block_m)
    used = group <= groups
    return group, jnp.where(used, row_start, 0), jnp.where(used, row_end, 0)


def row_schedule(row_groups: jax.Array, groups: int):
    """Work items for rows in any order with their groups given (`gmm(..., row_groups=)`): one item per row.

    Args:
      row_groups: `[m]` integer group of each row; a value outside [0, groups) makes a zero row.
      groups: number of groups.

    Returns:
      (group, row_start, row_end), each `[m]` int32, as `make_schedule`'s: item i is row i alone.
    """
    g = row_groups.astype(jnp.int32)
    rows = jnp.arange(g.shape[0], dtype=jnp.int32)
    return jnp.where((g >= 0) & (g < groups), g, groups), rows, rows + 1


def _kernel(group_ref, start_ref, end_ref, lhs_ref, *rest, m, k, n_out, groups, n_tiles,
            bs: BlockSizes, swiglu: bool, bits: int | None, quant_block: int, dot_dtype, precision,
            gather: bool, asm: bool, k_major: bool, fast_silu: bool, int8_fma: bool = False):
    if gather:                                 # rows of the product are lhs rows index_ref[r]
        index_ref, *rest = rest
    if bits is None:
        (rhs_ref, out_ref), scale_ref, offset_ref = rest, None, None
    else:   # offsets: always for 4 bits, where given for 8 (Q5_1 / Q5_K kept)
        rhs_ref, scale_ref, *offset, out_ref = rest
        offset_ref = offset[0] if offset else None
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    pid = pl.program_id(0)
    item, j = pid // n_tiles, pid % n_tiles
    g, first_row, row_end = group_ref[item], start_ref[item], end_ref[item]
    rows = first_row + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    row_in = rows < row_end                    # rows of this item's group (other rows are not even read)
    col_in = cols < n_out
    out_mask = row_in[:, None] & col_in[None, :]
    if gather:   # clamped like jnp's gather, so that a bad index never reads outside lhs
        src = jnp.clip(plgpu.load(index_ref.at[pl.ds(first_row, bm)], mask=row_in, other=0),
                       0, lhs_ref.shape[0] - 1)

    def load_lhs(kk, width):
        mask = row_in[:, None]
        if k % width:
            mask = mask & ((kk + jnp.arange(width)) < k)[None, :]
        if gather:   # two broadcast index arrays (the interpreter does not mix an index array and a slice)
            at = lhs_ref.at[src[:, None], (kk + jnp.arange(width, dtype=jnp.int32))[None, :]]
        else:
            at = lhs_ref.at[pl.ds(first_row, bm), pl.ds(kk, width)]
        return plgpu.load(at, mask=mask, other=0)

    def load_rhs(col0, kk, width):
        # [width, bn] float weights of group g, columns col0 + [0, bn), k-rows kk + [0, width).
        mask = col_in[None, :]
        if k % width:
            mask = mask & ((kk + jnp.arange(width)) < k)[:, None]
        return plgpu.load(rhs_ref.at[g, pl.ds(kk, width), pl.ds(col0, bn)], mask=mask, other=0)

    def load_codes(col0, qrow0, rows):
        # [rows, bn] raw `values` rows qrow0 + [0, rows) of group g (int8, or packed uint8).
        if k_major:   # stored [bn, rows], k contiguous
            return plgpu.load(rhs_ref.at[g, pl.ds(col0, bn), pl.ds(qrow0, rows)], mask=col_in[:, None], other=0).T
        return plgpu.load(rhs_ref.at[g, pl.ds(qrow0, rows), pl.ds(col0, bn)], mask=col_in[None, :], other=0)

    def load_per_block(ref, col0, kb):
        # [1, bn] float32 row kb of scales / offsets.
        return plgpu.load(ref.at[g, pl.ds(kb, 1), pl.ds(col0, bn)], mask=col_in[None, :],
                          other=0).astype(jnp.float32)

    def quant_dot(acc, x, codes, col0, kb):
        # acc += x @ (scale * codes [+ offset]) for one quantization block kb; codes [quant_block, bn] ints.
        scale = load_per_block(scale_ref, col0, kb)
        if bs.quant_mode == "scale_after_dot":
            acc = acc + dot(x, codes.astype(dot_dtype)) * scale
            if offset_ref is not None:
                acc = acc + jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True) * load_per_block(
                    offset_ref, col0, kb)
            return acc
        w = codes.astype(jnp.float32) * scale
        if offset_ref is not None:
            w = w + load_per_block(offset_ref, col0, kb)
        return acc + dot(x, w.astype(dot_dtype))

    def quant_tile_step(kk, acc, col0):
        # One loop step over k-rows kk + [0, bk) (packed rows for 4 bits): dequantize the whole tile.
        nb = bk // quant_block

        def expand(ref, kb):      # [nb, bn] per-block rows -> [bk, bn], each repeated quant_block times
            v = plgpu.load(ref.at[g, pl.ds(kb, nb), pl.ds(col0, bn)], mask=col_in[None, :],
                           other=0).astype(jnp.float32)
            return jnp.broadcast_to(v[:, None, :], (nb, quant_block, bn)).reshape(bk, bn)

        codes = load_codes(col0, kk, bk)
        if bits == 8:
            scale = expand(scale_ref, kk // quant_block)
            offset = None if offset_ref is None else expand(offset_ref, kk // quant_block)
            if asm:
                w = _dequantize_asm(codes, scale, offset, part=8, int8_fma=int8_fma)
            else:
                w = to_float(codes, signed=True) * scale
                w = (w if offset is None else w + offset).astype(dot_dtype)
            return acc + mul(load_lhs(kk, bk), w)
        half = k // 2
        for x_row0, part in ((kk, "lo"), (half + kk, "hi")):
            kb = x_row0 // quant_block
            scale, offset = expand(scale_ref, kb), expand(offset_ref, kb)
            if bs.int_to_float == "asm_bf16":   # the PTX's operands (the jnp form below: q * scale exact in f32)
                scale, offset = scale.astype(jnp.bfloat16), offset.astype(jnp.bfloat16)
            if asm:
                dequantize = _dequantize_asm_bf16 if bs.int_to_float == "asm_bf16" else _dequantize_asm
                w = dequantize(codes, scale, offset, part=part)
            else:
                q = codes & 0xF if part == "lo" else codes >> 4
                w = (to_float(q, signed=False) * scale.astype(jnp.float32) + offset.astype(jnp.float32)).astype(
                    dot_dtype)
            acc = acc + mul(load_lhs(x_row0, bk), w)
        return acc

    def to_float(q, signed: bool):   # integer codes (int8, or uint8 in [0, 15]) -> exact float32
        if bs.int_to_float == "convert":
            return q.astype(jnp.float32)
        # "magic", and "asm" where the PTX does not apply (interpreter, f32 lhs):
        u = q.astype(jnp.int32) & 0xFF                       # the code's byte
        if signed:
            u = u ^ 0x80                                     # q + 128, in [0, 255]
        f = jax.lax.bitcast_convert_type(u | 0x4B000000, jnp.float32)   # 2**23 + byte, exactly
        return f - jnp.float32(2.0**23 + (128 if signed else 0))

    swapped = bits is not None and bs.quant_mode == "tile_swapped"

    def mul(x, w):   # x [bm, bk] @ w [bk, bn], or its transpose [bn, bm] when swapped
        if swapped:
            return jnp.dot(w.T, x.astype(dot_dtype).T, preferred_element_type=jnp.float32, precision=precision)
        return dot(x, w)

    def dot(x, w):
        return jnp.dot(x.astype(dot_dtype), w, preferred_element_type=jnp.float32, precision=precision)

    col_bases = (j * bn, n_out + j * bn) if swiglu else (j * bn,)

    def step(i, accs):
        kk = i * bk
        if bits is None:
            x = load_lhs(kk, bk)
            return tuple(acc + dot(x, load_rhs(c, kk, bk)) for acc, c in zip(accs, col_bases))
        accs = list(accs)
        half = k // 2
        if bs.quant_mode in ("tile", "tile_swapped"):
            return tuple(quant_tile_step(kk, acc, c) for acc, c in zip(accs, col_bases))
        for sub in range(bk // quant_block):
            r = kk + sub * quant_block
            if bits == 8:
                x = load_lhs(r, quant_block)
                for a, c in enumerate(col_bases):
                    accs[a] = quant_dot(accs[a], x, load_codes(c, r, quant_block), c, r // quant_block)
            else:   # r counts packed rows: low nibble = k-row r, high nibble = k-row half + r
                x_lo, x_hi = load_lhs(r, quant_block), load_lhs(half + r, quant_block)
                for a, c in enumerate(col_bases):
                    packed = load_codes(c, r, quant_block).astype(jnp.int32)
                    accs[a] = quant_dot(accs[a], x_lo, packed & 0xF, c, r // quant_block)
                    accs[a] = quant_dot(accs[a], x_hi, (packed >> 4) & 0xF, c, (half + r) // quant_block)
        return tuple(accs)

    k_rows = k // 2 if bits == 4 else k        # rows the loop walks (packed rows for 4 bits)

    @pl.when(g < groups)
    def _compute():
        zeros = tuple(jnp.zeros((bn, bm) if swapped else (bm, bn), jnp.float32) for _ in col_bases)
        accs = jax.lax.fori_loop(0, pl.cdiv(k_rows, bk), step, zeros)
        if swapped:
            accs = tuple(acc.T for acc in accs)
        if not swiglu:
            out = accs[0]
        elif fast_silu:
            out = silu_approx(accs[0]) * accs[1]
        else:
            out = jax.nn.sigmoid(accs[0]) * accs[0] * accs[1]
        plgpu.store(out_ref.at[pl.ds(first_row, bm), pl.ds(j * bn, bn)], out.astype(out_ref.dtype),
                    mask=out_mask)

    @pl.when(g == groups)
    def _padding_rows():
        plgpu.store(out_ref.at[pl.ds(first_row, bm), pl.ds(j * bn, bn)],
                    jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


def shared_memory_bytes(bs: BlockSizes, *, swiglu: bool, lhs_bytes: int, bits: int | None,
                        rhs_bytes: int = 2) -> int:
    """Estimated shared memory of one program: `num_stages` copies of the step's lhs tile(s) and weight tile(s)
    (Triton's software pipeline; exactly what Triton asked for in the one failure seen, bf16 gmm_swiglu
    64x128x128 with 3 stages: 240 KiB)."""
    tiles = 2 if swiglu else 1
    lhs = bs.block_m * bs.block_k * lhs_bytes * (2 if bits == 4 else 1)   # 4 bits: both k-halves per step
    weights = tiles * bs.block_k * bs.block_n * (1 if bits else rhs_bytes)
    return bs.num_stages * (lhs + weights)


def within_shared_memory(bs: BlockSizes, limit: int | None, **sizes) -> BlockSizes:
    """`bs` with fewer pipeline stages (down to 2), then a smaller block_k (down to 32), while
    `shared_memory_bytes(bs, **sizes)` exceeds `limit` (None: no limit): a tile shape the device cannot hold
    is never launched (Triton refuses it at compile time: "Shared memory size limit exceeded")."""
    if limit is None:
        return bs
    while shared_memory_bytes(bs, **sizes) > limit and bs.num_stages > 2:
        bs = dataclasses.replace(bs, num_stages=bs.num_stages - 1)
    while shared_memory_bytes(bs, **sizes) > limit and bs.block_k > 32:
        bs = dataclasses.replace(bs, block_k=bs.block_k // 2)
    return bs


@functools.partial(jax.jit, static_argnames=("swiglu", "preferred_element_type", "block_sizes", "interpret"))
def _gmm_pallas(lhs, rhs, group_sizes, lhs_index=None, row_groups=None, *, swiglu: bool, preferred_element_type,
                block_sizes, interpret):
    m, k = lhs.shape
    if lhs_index is not None:
        if lhs_index.ndim != 1:
            raise ValueError(f"lhs_index must be [m], got shape {lhs_index.shape}")
        m = lhs_index.shape[0]
    quantized = isinstance(rhs, QuantizedWeights)
    if quantized:
        rhs.check()
    groups, k_rhs, n_rhs = rhs.shape
    if k_rhs != k:
        raise ValueError(f"lhs.shape={lhs.shape} and rhs.shape={tuple(rhs.shape)} disagree on k")
    reference.check_groups(group_sizes, row_groups, m, groups)
    if swiglu and n_rhs % 2:
        raise ValueError(f"w_gate_up has {n_rhs} columns; expected 2 * ffn")
    n_out = n_rhs // 2 if swiglu else n_rhs
    bits = rhs.bits if quantized else None
    k_major = quantized and rhs.k_major
    if row_groups is not None:   # one row per item: the smallest tensor-core tile
        bs = block_sizes or BlockSizes.get_default_rows(bits=bits, swiglu=swiglu, k_major=k_major)
        bs = dataclasses.replace(bs, block_m=ROW_BLOCK_M)
    else:
        bs = block_sizes or BlockSizes.get_default(m, k, n_out, groups, bits=bits, swiglu=swiglu, k_major=k_major)
    # Triton blocks are powers of two; do not use blocks far larger than the problem.
    bs = dataclasses.replace(bs, block_m=min(bs.block_m, max(16, pl.next_power_of_2(m))),
                             block_n=min(bs.block_n, max(16, pl.next_power_of_2(n_out))))
    if not quantized:
        bs = dataclasses.replace(bs, block_k=min(bs.block_k, max(16, pl.next_power_of_2(k))))
    if quantized and bs.block_k % rhs.block_size:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of the quantization block "
                         f"{rhs.block_size}")
    if quantized and (k // 2 if bits == 4 else k) % bs.block_k:
        bs = dataclasses.replace(bs, block_k=rhs.block_size)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if block_sizes is None:   # defaults only: a shape asked for explicitly is the caller's choice
        bs = within_shared_memory(
            bs, None if interpret else gpu_limits.shared_memory_limit(), swiglu=swiglu, bits=bits,
            lhs_bytes=jnp.dtype(lhs.dtype).itemsize, rhs_bytes=1 if quantized else jnp.dtype(rhs.dtype).itemsize)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    dot_dtype = jnp.float32 if lhs.dtype == jnp.float32 else lhs.dtype
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    asm = quantized and bs.int_to_float in ("asm", "asm_bf16") and not interpret and dot_dtype == jnp.bfloat16

    if row_groups is None:
        schedule = make_schedule(group_sizes, m, bs.block_m)   # (group, row_start, row_end)
    else:
        schedule = row_schedule(row_groups, groups)
    n_tiles = pl.cdiv(n_out, bs.block_n)
    grid = (schedule[0].shape[0] * n_tiles,)
    if quantized:
        weights = (rhs.values, rhs.scales) + (() if rhs.offsets is None else (rhs.offsets,))
    else:
        weights = (rhs,)
    check_int32_offsets(lhs, *weights)
    kernel = functools.partial(
        _kernel, m=m, k=k, n_out=n_out, groups=groups, n_tiles=n_tiles, bs=bs, swiglu=swiglu, bits=bits,
        quant_block=rhs.block_size if quantized else 0, dot_dtype=dot_dtype, precision=precision,
        gather=lhs_index is not None, asm=asm, k_major=k_major,
        int8_fma=quantized and rhs.half_precision_scales,
        fast_silu=swiglu and bs.fast_silu and not interpret and dot_dtype == jnp.bfloat16)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="gmm_swiglu" if swiglu else "gmm",
    )(*schedule, lhs, *(() if lhs_index is None else (lhs_index.astype(jnp.int32),)), *weights)


def gmm_pallas(lhs, rhs, group_sizes=None, *, row_groups=None, lhs_index=None, preferred_element_type=None,
               interpret=None, block_sizes: BlockSizes | None = None) -> jax.Array:
    """Grouped matmul kernel; arguments and result as `reference.gmm_reference`.

    Args (beyond the shared ones):
      block_sizes: tile shape; None = `BlockSizes.get_default` (`get_default_rows` with row_groups, whose items
        are single rows: block_m is then always `ROW_BLOCK_M`).
      interpret: run in the Pallas interpreter; None = only when no GPU is present.

    Raises:
      ValueError: shapes that disagree, or both or neither of group_sizes and row_groups.
    """
    return _gmm_pallas(lhs, rhs, group_sizes, lhs_index, row_groups, swiglu=False,
                       preferred_element_type=preferred_element_type, block_sizes=block_sizes, interpret=interpret)


def gmm_swiglu_pallas(lhs, w_gate_up, group_sizes=None, *, row_groups=None, lhs_index=None,
                      preferred_element_type=None, interpret=None, block_sizes: BlockSizes | None = None) -> jax.Array:
    """Fused silu(x @ W_gate) * (x @ W_up); arguments and result as `reference.gmm_swiglu_reference`.

    Raises:
      ValueError: shapes that disagree, or both or neither of group_sizes and row_groups.
    """
    return _gmm_pallas(lhs, w_gate_up, group_sizes, lhs_index, row_groups, swiglu=True,
                       preferred_element_type=preferred_element_type, block_sizes=block_sizes, interpret=interpret)

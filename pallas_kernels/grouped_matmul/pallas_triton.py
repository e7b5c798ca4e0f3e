"""Grouped matmul as a Pallas kernel through the Triton lowering (Ampere, Ada, Hopper; interpreter on CPU).

Work decomposition. A *work item* is a chunk of at most `block_m` consecutive rows of ONE group, starting at
the group's first row (chunks are aligned to group starts, not to multiples of block_m): a group of s rows
gives cdiv(s, block_m) items, so a group smaller than block_m reads its weights exactly once and no row is
multiplied by another group's weights (megablox / tokamax align m-tiles to block_m instead and recompute
every tile that straddles two groups). Rows past sum(group_sizes) form one extra "padding group" whose items
store zeros without any matmul. The item list is built on device from group_sizes (`make_schedule`; no host
sync); its length is bounded statically by m // block_m + groups + 1, and the surplus items exit at once.

The 1-D grid runs (work item, n-tile) pairs with the n-tile fastest, so programs that run together share
one lhs chunk and one group's weights (L2 reuse). Each program loops over k in steps of `block_k`,
accumulating in float32 registers, and writes its `[block_m, block_n]` output tile once.

Quantized weights (`QuantizedWeights`) are dequantized in registers inside the k loop (codes * scale
[+ offset], scales broadcast over each 32-row block, cast to the lhs dtype) and fed to the same
tensor-core dot: bf16 weights never exist in HBM. For 4 bits one packed byte tile feeds two dots:
lhs[:, kk:] with the low nibbles and lhs[:, k/2 + kk:] with the high nibbles (the split-half layout of
`QuantizedWeights`). Codes stored k-major (`QuantizedWeights.k_major`, the default layout) reach the
tensor-core operand layout four to a 32-bit load and are dequantized by inline PTX (`common.dequantize_asm`).

With `lhs_index` the rows of the product are gathered inside the kernel: each program loads its chunk's
indices once and reads lhs[index, kk:kk + block_k] through them (clamped into range), so the MoE dispatch's
[tokens * top_k, hidden] sorted copy of the activations is never written.

Tile shapes come from `default_config`: the measured table of the device (`pallas_kernels.tuning`, op
"grouped_matmul.triton", keyed by `shape_class`) over `heuristic_config`. Default shapes pass
`within_shared_memory`: Triton buffers `num_stages` copies of each step's tiles in shared memory and refuses a
kernel that needs more than the device has (`pallas_kernels.gpu_limits`).

gmm_swiglu keeps two accumulators (gate columns j and up columns ffn + j of the same group) and writes
silu(gate) * up, so the [m, 2 * ffn] intermediate never reaches memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_limits, tuning
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.common import check_int32_offsets, dequantize_asm
from pallas_kernels.q4_k import Q4KExperts
from pallas_kernels.quantized import QuantizedWeights
from pallas_kernels.triton_math import silu_approx

# Rows per tensor-core tile where each work item is one row (`row_groups`): the smallest M of a Triton dot.
ROW_BLOCK_M = 16

# The key of this kernel's measured tile shapes in the tuning tables.
TUNING_OP = "grouped_matmul.triton"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tile shape and Triton launch parameters.

    Attributes:
      block_m: rows per work item (a power of two).
      block_n: output columns per program.
      block_k: k per loop step; a multiple of the quantization block (32) for quantized weights, and for 4
        bits it counts packed rows (each step covers block_k rows of each k-half).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth.
      swap_operands: quantized weights only: compute out^T = W^T x^T, so that the weights dequantized in
        registers are the dot's first operand (Hopper wgmma reads that one from registers, skipping a
        shared-memory round trip) and the few rows of x its second.
      int_to_float: quantized weights only: "convert" turns codes into float32 by the int-to-float
        instruction; "magic" ORs the code's byte into the mantissa of 2**23 and subtracts 2**23 (+ 128 for
        int8, whose byte is first XORed with 128), integer and float instructions only, exact; "asm" (bf16
        lhs, compiled kernels, k-major codes) dequantizes four codes per PTX block (`common.dequantize_asm`);
        the interpreter and f32 lhs run "magic" instead (the same arithmetic).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    swap_operands: bool = False
    int_to_float: Literal["convert", "magic", "asm"] = "convert"


def shape_class(
    rows_per_group: float, *, bits: int | None, swiglu: bool, k_major: bool, rows: bool = False
) -> str:
    """The tuning-table key of a problem: "<format>.<op>.<regime>", e.g. "int8.swiglu.le32".

    format: "float", "int8", "int4" (k-major codes) or "int8_kn", "int4_kn" (codes stored [groups, k, n]);
    op: "swiglu" or "gmm"; regime: "rows" (`row_groups`, one row per item), else the rows per group:
    "le32", "le64", "lt256", "lt512", "ge512" (the bounds where `heuristic_config` changes its choice).
    """
    fmt = "float" if bits is None else f"int{bits}" + ("" if k_major else "_kn")
    if rows:
        regime = "rows"
    elif rows_per_group <= 32:
        regime = "le32"
    elif rows_per_group <= 64:
        regime = "le64"
    elif rows_per_group < 256:
        regime = "lt256"
    elif rows_per_group < 512:
        regime = "lt512"
    else:
        regime = "ge512"
    return f"{fmt}.{'swiglu' if swiglu else 'gmm'}.{regime}"


def heuristic_config(
    rows_per_group: float, *, bits: int | None, swiglu: bool, k_major: bool, rows: bool = False
) -> Config:
    """The tile shape where the device has no measured one: weight-read-bound problems (few rows per group)
    take small chunks and n-tiles with 4 warps, compute-bound ones (many rows per group) large chunks with 8
    warps.

    rows: the rows come in any order with their groups given (`row_groups`: one row per item, block_m
    `ROW_BLOCK_M`); each program reads one group's [k, block_n] weight tile for one row.
    """
    if rows:
        cfg = heuristic_config(1.0, bits=bits, swiglu=swiglu, k_major=k_major)
        if bits == 4 and k_major:
            cfg = dataclasses.replace(cfg, block_n=64, block_k=128)
        elif bits is None and swiglu:
            cfg = dataclasses.replace(cfg, block_k=128)
        return dataclasses.replace(cfg, block_m=ROW_BLOCK_M)
    if bits is not None and k_major:
        return _heuristic_k_major(rows_per_group, bits, swiglu)
    cfg = _heuristic(rows_per_group, bits, swiglu)
    # 4-bit codes stored [groups, k, n]: the 2**23 construction beats the int-to-float instruction.
    return dataclasses.replace(cfg, int_to_float="magic") if bits == 4 else cfg


def _heuristic_k_major(rows_per_group: float, bits: int, swiglu: bool) -> Config:
    asm = {"num_warps": 4, "num_stages": 3, "int_to_float": "asm"}
    if rows_per_group <= 32:  # weight-read bound
        if bits == 8:
            return Config(block_m=32, block_n=64 if swiglu else 128, block_k=128, **asm)
        return Config(block_m=32, block_n=128, block_k=64, **asm)
    if bits == 8 and not swiglu and rows_per_group >= 512:
        return Config(block_m=128, block_n=128, block_k=64, **asm)
    return Config(block_m=64, block_n=128, block_k=64, **asm)


def _heuristic(rows_per_group: float, bits: int | None, swiglu: bool) -> Config:
    if bits == 4 and not swiglu and rows_per_group <= 32:  # 4-bit down product, weight-read bound
        return Config(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4)
    # 4-bit gate_up, weight-read bound: weights as the register operand
    if bits == 4 and rows_per_group <= 32:
        return Config(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_operands=True)
    if bits is not None and rows_per_group <= 64:  # weight-read bound: small chunks and n-tiles
        return Config(
            block_m=32 if rows_per_group <= 32 else 64, block_n=128, block_k=64, num_warps=4, num_stages=3
        )
    # Compute bound, dequantizing in registers: 8 warps per 128x64 tile, 256-row chunks where groups are long.
    if bits == 8:
        if rows_per_group >= 512 and not swiglu:
            return Config(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=3)
        return Config(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
    if bits == 4:
        if rows_per_group >= 256 and swiglu:
            return Config(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=3)
        return Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, swap_operands=True)
    if rows_per_group <= 64:  # weight-read bound (decode / small prefill chunks)
        # gmm_swiglu loads two weight tiles per step: block_k 128 would not fit 3 stages in 227 KiB.
        return Config(block_m=64, block_n=128, block_k=64 if swiglu else 128, num_warps=4, num_stages=3)
    if swiglu:  # two accumulators per program
        return Config(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
    return Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


def default_config(
    m: int, groups: int, *, bits: int | None, swiglu: bool, k_major: bool, rows: bool = False
) -> Config:
    """The tile shape for `m` rows over `groups` groups: the device's measured one for its `shape_class`
    (`pallas_kernels.tuning`), field by field over `heuristic_config`."""
    rows_per_group = m / max(groups, 1)
    kw = {"bits": bits, "swiglu": swiglu, "k_major": k_major, "rows": rows}
    measured = tuning.lookup(TUNING_OP, shape_class(rows_per_group, **kw))
    return dataclasses.replace(heuristic_config(rows_per_group, **kw), **measured)


def make_schedule(group_sizes: jax.Array, m: int, block_m: int):
    """Work items (group, chunk of <= block_m rows) for `m` rows sorted by group, on device.

    Args:
      group_sizes: `[groups]` int32; sum may be < m (the rest is the padding group `groups`). A sum > m is
        clipped to m.
      m: rows of lhs.
      block_m: rows per chunk.

    Returns:
      (group, row_start, row_end), each `[m // block_m + groups + 1]` int32: the item's group (in
      [0, groups], `groups` = padding rows; `groups + 1` = unused item) and the half-open row range
      [row_start, row_end) it owns, row_end - row_start <= block_m.
    """
    groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.append(starts, ends[-1])  # [groups + 1], the padding group last
    ends = jnp.append(ends, jnp.int32(m))
    chunks = (ends - starts + block_m - 1) // block_m  # [groups + 1]
    cum = jnp.cumsum(chunks)
    num_items = m // block_m + groups + 1  # static bound on sum(chunks)
    item = jnp.arange(num_items, dtype=jnp.int32)
    # item -> group by items x groups comparisons in one fusion: the default "scan" is a loop of log2(groups)
    # steps, which XLA runs as a while loop on the GPU, slower than the whole kernel's weight reads at decode.
    group = jnp.searchsorted(cum, item, side="right", method="compare_all").astype(
        jnp.int32
    )  # groups + 1 = unused
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


def _kernel(
    group_ref,
    start_ref,
    end_ref,
    lhs_ref,
    *rest,
    m,
    k,
    n_out,
    groups,
    n_tiles,
    bs: Config,
    swiglu: bool,
    bits: int | None,
    quant_block: int,
    dot_dtype,
    precision,
    gather: bool,
    asm: bool,
    k_major: bool,
    fast_silu: bool,
    int8_fma: bool = False,
):
    if gather:  # rows of the product are lhs rows index_ref[r]
        index_ref, *rest = rest
    if bits is None:
        (rhs_ref, out_ref), scale_ref, offset_ref = rest, None, None
    else:  # offsets: always for 4 bits, where given for 8 (Q5_1 / Q5_K kept)
        rhs_ref, scale_ref, *offset, out_ref = rest
        offset_ref = offset[0] if offset else None
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    pid = pl.program_id(0)
    item, j = pid // n_tiles, pid % n_tiles
    g, first_row, row_end = group_ref[item], start_ref[item], end_ref[item]
    rows = first_row + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    row_in = rows < row_end  # rows of this item's group (other rows are not even read)
    col_in = cols < n_out
    out_mask = row_in[:, None] & col_in[None, :]
    if gather:  # clamped like jnp's gather, so that a bad index never reads outside lhs
        src = jnp.clip(
            plgpu.load(index_ref.at[pl.ds(first_row, bm)], mask=row_in, other=0), 0, lhs_ref.shape[0] - 1
        )

    def load_lhs(kk, width):
        mask = row_in[:, None]
        if k % width:
            mask = mask & ((kk + jnp.arange(width)) < k)[None, :]
        if gather:  # two broadcast index arrays (the interpreter does not mix an index array and a slice)
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
        if k_major:  # stored [bn, rows], k contiguous
            return plgpu.load(
                rhs_ref.at[g, pl.ds(col0, bn), pl.ds(qrow0, rows)], mask=col_in[:, None], other=0
            ).T
        return plgpu.load(rhs_ref.at[g, pl.ds(qrow0, rows), pl.ds(col0, bn)], mask=col_in[None, :], other=0)

    def quant_tile_step(kk, acc, col0):
        # One loop step over k-rows kk + [0, bk) (packed rows for 4 bits): dequantize the whole tile.
        nb = bk // quant_block

        def expand(ref, kb):  # [nb, bn] per-block rows -> [bk, bn], each repeated quant_block times
            v = plgpu.load(ref.at[g, pl.ds(kb, nb), pl.ds(col0, bn)], mask=col_in[None, :], other=0).astype(
                jnp.float32
            )
            return jnp.broadcast_to(v[:, None, :], (nb, quant_block, bn)).reshape(bk, bn)

        codes = load_codes(col0, kk, bk)
        if bits == 8:
            scale = expand(scale_ref, kk // quant_block)
            offset = None if offset_ref is None else expand(offset_ref, kk // quant_block)
            if asm:
                w = dequantize_asm(codes, scale, offset, part=8, int8_fma=int8_fma)
            else:
                w = to_float(codes, signed=True) * scale
                w = (w if offset is None else w + offset).astype(dot_dtype)
            return acc + mul(load_lhs(kk, bk), w)
        half = k // 2
        for x_row0, part in ((kk, "lo"), (half + kk, "hi")):
            kb = x_row0 // quant_block
            scale, offset = expand(scale_ref, kb), expand(offset_ref, kb)
            if asm:
                w = dequantize_asm(codes, scale, offset, part=part)
            else:
                q = codes & 0xF if part == "lo" else codes >> 4
                w = (
                    to_float(q, signed=False) * scale.astype(jnp.float32) + offset.astype(jnp.float32)
                ).astype(dot_dtype)
            acc = acc + mul(load_lhs(x_row0, bk), w)
        return acc

    def to_float(q, signed: bool):  # integer codes (int8, or uint8 in [0, 15]) -> exact float32
        if bs.int_to_float == "convert":
            return q.astype(jnp.float32)
        # "magic", and "asm" where the PTX does not apply (interpreter, f32 lhs):
        u = q.astype(jnp.int32) & 0xFF  # the code's byte
        if signed:
            u = u ^ 0x80  # q + 128, in [0, 255]
        f = jax.lax.bitcast_convert_type(u | 0x4B000000, jnp.float32)  # 2**23 + byte, exactly
        return f - jnp.float32(2.0**23 + (128 if signed else 0))

    swapped = bits is not None and bs.swap_operands

    def mul(x, w):  # x [bm, bk] @ w [bk, bn], or its transpose [bn, bm] when swapped
        if swapped:
            return jnp.dot(
                w.T, x.astype(dot_dtype).T, preferred_element_type=jnp.float32, precision=precision
            )
        return dot(x, w)

    def dot(x, w):
        return jnp.dot(x.astype(dot_dtype), w, preferred_element_type=jnp.float32, precision=precision)

    col_bases = (j * bn, n_out + j * bn) if swiglu else (j * bn,)

    def step(i, accs):
        kk = i * bk
        if bits is None:
            x = load_lhs(kk, bk)
            return tuple(acc + dot(x, load_rhs(c, kk, bk)) for acc, c in zip(accs, col_bases, strict=True))
        return tuple(quant_tile_step(kk, acc, c) for acc, c in zip(accs, col_bases, strict=True))

    k_rows = k // 2 if bits == 4 else k  # rows the loop walks (packed rows for 4 bits)

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
        plgpu.store(
            out_ref.at[pl.ds(first_row, bm), pl.ds(j * bn, bn)], out.astype(out_ref.dtype), mask=out_mask
        )

    @pl.when(g == groups)
    def _padding_rows():
        plgpu.store(
            out_ref.at[pl.ds(first_row, bm), pl.ds(j * bn, bn)],
            jnp.zeros((bm, bn), out_ref.dtype),
            mask=out_mask,
        )


def shared_memory_bytes(
    bs: Config, *, swiglu: bool, lhs_bytes: int, bits: int | None, rhs_bytes: int = 2
) -> int:
    """Estimated shared memory of one program in bytes: `num_stages` copies of the step's lhs tile(s) and
    weight tile(s) (Triton's software pipeline; it matches what Triton asks for)."""
    tiles = 2 if swiglu else 1
    lhs = bs.block_m * bs.block_k * lhs_bytes * (2 if bits == 4 else 1)  # 4 bits: both k-halves per step
    weights = tiles * bs.block_k * bs.block_n * (1 if bits else rhs_bytes)
    return bs.num_stages * (lhs + weights)


def within_shared_memory(bs: Config, limit: int | None, **sizes) -> Config:
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


def _fitted_config(config, lhs, rhs, *, m, k, n_out, groups, swiglu, rows, interpret) -> Config:
    """`config` (None: `default_config`) fitted to the problem: blocks no larger than it, block_k dividing the
    quantized k, and (defaults only) within the device's shared memory."""
    quantized = isinstance(rhs, QuantizedWeights)
    bits = rhs.bits if quantized else None
    k_major = quantized and rhs.k_major
    bs = config or default_config(m, groups, bits=bits, swiglu=swiglu, k_major=k_major, rows=rows)
    if rows:  # one row per item: the smallest tensor-core tile
        bs = dataclasses.replace(bs, block_m=ROW_BLOCK_M)
    # Triton blocks are powers of two; do not use blocks far larger than the problem.
    bs = dataclasses.replace(
        bs,
        block_m=min(bs.block_m, max(16, pl.next_power_of_2(m))),
        block_n=min(bs.block_n, max(16, pl.next_power_of_2(n_out))),
    )
    if not quantized:
        bs = dataclasses.replace(bs, block_k=min(bs.block_k, max(16, pl.next_power_of_2(k))))
    if quantized and bs.block_k % rhs.block_size:
        raise ValueError(
            f"block_k={bs.block_k} must be a multiple of the quantization block {rhs.block_size}"
        )
    if quantized and (k // 2 if bits == 4 else k) % bs.block_k:
        bs = dataclasses.replace(bs, block_k=rhs.block_size)
    if config is None:  # defaults only: a shape asked for explicitly is the caller's choice
        bs = within_shared_memory(
            bs,
            None if interpret else gpu_limits.shared_memory_limit(),
            swiglu=swiglu,
            bits=bits,
            lhs_bytes=jnp.dtype(lhs.dtype).itemsize,
            rhs_bytes=1 if quantized else jnp.dtype(rhs.dtype).itemsize,
        )
    return bs


@functools.partial(jax.jit, static_argnames=("swiglu", "preferred_element_type", "config", "interpret"))
def _gmm(
    lhs,
    rhs,
    group_sizes,
    lhs_index=None,
    row_groups=None,
    *,
    swiglu: bool,
    preferred_element_type,
    config,
    interpret,
):
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
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bs = _fitted_config(
        config,
        lhs,
        rhs,
        m=m,
        k=k,
        n_out=n_out,
        groups=groups,
        swiglu=swiglu,
        rows=row_groups is not None,
        interpret=interpret,
    )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    dot_dtype = jnp.float32 if lhs.dtype == jnp.float32 else lhs.dtype
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    asm = quantized and bs.int_to_float == "asm" and not interpret and dot_dtype == jnp.bfloat16

    if row_groups is None:
        schedule = make_schedule(group_sizes, m, bs.block_m)  # (group, row_start, row_end)
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
        _kernel,
        m=m,
        k=k,
        n_out=n_out,
        groups=groups,
        n_tiles=n_tiles,
        bs=bs,
        swiglu=swiglu,
        bits=bits,
        quant_block=rhs.block_size if quantized else 0,
        dot_dtype=dot_dtype,
        precision=precision,
        gather=lhs_index is not None,
        asm=asm,
        k_major=k_major,
        int8_fma=quantized and rhs.half_precision_scales,
        fast_silu=swiglu and not interpret and dot_dtype == jnp.bfloat16,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="gmm_swiglu" if swiglu else "gmm",
    )(*schedule, lhs, *(() if lhs_index is None else (lhs_index.astype(jnp.int32),)), *weights)


def _refuse_q4_k(rhs) -> None:
    if isinstance(rhs, Q4KExperts):
        raise NotImplementedError(
            "the tensor-core kernel does not read Q4_K rows in place (Q4KExperts): give row_groups (the "
            "matrix-vector kernel) or expand them first (Q4KExperts.to_quantized())"
        )


def gmm_triton(
    lhs,
    rhs,
    group_sizes=None,
    *,
    row_groups=None,
    lhs_index=None,
    preferred_element_type=None,
    interpret=None,
    config: Config | None = None,
) -> jax.Array:
    """Grouped matmul kernel; arguments and result as `reference.gmm_reference`.

    Args (beyond the shared ones):
      interpret: run in the Pallas interpreter; None = only when no GPU is present.
      config: tile shape; None = `default_config` (with row_groups, whose items are single rows, block_m is
        always `ROW_BLOCK_M`).

    Raises:
      ValueError: shapes that disagree, both or neither of group_sizes and row_groups, or an operand of 2**31
        elements or more (Triton's offsets are int32).
      NotImplementedError: `Q4KExperts` weights (the matrix-vector kernel reads those).
    """
    _refuse_q4_k(rhs)
    return _gmm(
        lhs,
        rhs,
        group_sizes,
        lhs_index,
        row_groups,
        swiglu=False,
        preferred_element_type=preferred_element_type,
        config=config,
        interpret=interpret,
    )


def gmm_swiglu_triton(
    lhs,
    w_gate_up,
    group_sizes=None,
    *,
    row_groups=None,
    lhs_index=None,
    preferred_element_type=None,
    interpret=None,
    config: Config | None = None,
) -> jax.Array:
    """Fused silu(x @ W_gate) * (x @ W_up); arguments and result as `reference.gmm_swiglu_reference`, the
    rest as `gmm_triton`.

    Raises:
      ValueError: as `gmm_triton`, or an odd number of columns.
    """
    _refuse_q4_k(w_gate_up)
    return _gmm(
        lhs,
        w_gate_up,
        group_sizes,
        lhs_index,
        row_groups,
        swiglu=True,
        preferred_element_type=preferred_element_type,
        config=config,
        interpret=interpret,
    )

"""Grouped matrix-vector products for decode: a few rows, each times its own expert's matrix (Pallas Triton).

At decode each of a few tokens sends one row to each of its top-k experts (`row_groups`: each row names its
group), so the grouped matmul is a set of matrix-vector products bound by reading the experts' weights. The
tensor-core kernel (`pallas_triton`, row mode) pads each row to a 16-row tile and walks k in a loop per
(row, column tile), so one token gives few programs, each a chain of dependent k steps. This kernel is
llama.cpp's `mul_mat_vec` shape instead:

- one program per (output row, `block_n` columns), with few columns per program, so that one token already
  gives hundreds of programs;
- no tensor cores: each program multiplies its `[block_n, block_k]` weight tile by the row chunk element-wise
  into a float32 accumulator of the tile's shape (fma per weight) and reduces it over k once at the end;
- the k loop unrolled in the kernel;
- quantized weights (k-major codes, `QuantizedWeights.k_major`) are read in their stored layout, `[n, k]`
  contiguous along k, as `[block_n, blocks, 32]` tiles, and dequantized in float32 (code * scale [+ offset])
  by the PTX of `common.dequantize_asm` (byte permutes into a power of two's mantissa, no int-to-float
  instruction), the float32 results kept: the reference's weights exactly.

Outputs agree with `reference.gmm_reference` (float32 weights and accumulation; the order of the sum differs).
The kernel also takes float weights `[groups, k, n]` (tiles `[block_k, block_n]`, n contiguous), but `gmm`'s
default keeps those on the tensor-core kernel, which reads them faster (`takes`). Knobs: `Config`, over which
the device's measured ones (`pallas_kernels.tuning`, op "grouped_matmul.gemv") apply.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tuning
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.common import check_int32_offsets, dequantize_asm
from pallas_kernels.q4_k import Q4_K_BYTES, QK_K, Q4KExperts
from pallas_kernels.quantized import QuantizedWeights
from pallas_kernels.triton_math import silu_approx

# The key of this kernel's measured knobs in the tuning tables; its "default" entry may also hold "max_rows".
TUNING_OP = "grouped_matmul.gemv"

# Up to this many rows with their groups named and quantized weights (`takes`), `gmm`'s default runs this
# kernel instead of the tensor-core one, where the device's table does not say otherwise ("max_rows"): beyond
# a token's top-k copies the tensor-core kernel's weight reuse across rows wins.
MAX_ROWS = 8

# Triton's pipelining depth: the k loop is unrolled, so there is nothing to pipeline.
NUM_STAGES = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Columns per program (`block_n`), k per step (`block_k`, a multiple of the quantization block; for 4
    bits it counts packed rows, each step covering block_k k-rows of each half) and Triton warps."""

    block_n: int = 8
    block_k: int = 256
    num_warps: int = 4


def default_config() -> Config:
    """`Config` with the device's measured knobs (`pallas_kernels.tuning`) over its defaults."""
    measured = tuning.lookup(TUNING_OP)
    return Config(**{f.name: measured[f.name] for f in dataclasses.fields(Config) if f.name in measured})


def max_rows() -> int:
    """Rows up to which `takes` holds: the device's measured "max_rows", else `MAX_ROWS`."""
    return tuning.lookup(TUNING_OP).get("max_rows", MAX_ROWS)


def _kernel(
    group_ref,
    lhs_ref,
    *rest,
    k,
    n_out,
    groups,
    bs: Config,
    swiglu: bool,
    bits,
    quant_block,
    gather: bool,
    fast_silu: bool,
    asm: bool,
    int8_fma: bool,
):
    rest = list(rest)
    index_ref = rest.pop(0) if gather else None
    out_ref = rest.pop()
    rhs_ref, scale_ref, offset_ref = (rest + [None, None])[:3]
    r, j = pl.program_id(0), pl.program_id(1)
    bn, bk = bs.block_n, bs.block_k
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    col_in = cols < n_out
    col_bases = (j * bn, n_out + j * bn) if swiglu else (j * bn,)
    k_rows = k // 2 if bits == 4 else k
    steps = pl.cdiv(k_rows, bk)
    nb = bk // quant_block if bits else 0  # quantization blocks per step

    g = group_ref[r]
    valid = (g >= 0) & (g < groups)  # a row of no group: group 0's weights are read, zeros stored
    g = jnp.clip(g, 0, groups - 1)
    src = jnp.clip(index_ref[r], 0, lhs_ref.shape[0] - 1) if gather else r

    def x_chunk(kk):
        # [1, bk] f32 (float weights) or [1, nb, 32] (quantized) chunk of the row
        if bits is None:
            at = lhs_ref.at[pl.ds(src, 1), pl.ds(kk, bk)]
            x = (
                plgpu.load(at, mask=((kk + jnp.arange(bk)) < k)[None, :], other=0)
                if k % bk
                else plgpu.load(at)
            )
        else:
            x = plgpu.load(lhs_ref.at[pl.ds(src, 1), pl.ds(kk // quant_block, nb), :])
        return x.astype(jnp.float32)

    def per_block(ref, kb, col0):
        # [bn, nb, 1] f32 scales / offsets of blocks kb + [0, nb) (stored [groups, k / 32, n])
        v = plgpu.load(ref.at[g, pl.ds(kb, nb), pl.ds(col0, bn)], mask=col_in[None, :], other=0)
        return v.astype(jnp.float32).T[:, :, None]

    def product(acc, kk, col0):
        # acc [bn, nb, 32] (float weights: [bk, bn]) += x * weights for k-rows kk + [0, bk) (packed rows for
        # 4 bits)
        if bits is None:  # rhs [groups, k, n]: the tile [bk, bn], n contiguous
            mask = col_in[None, :]
            if k % bk:
                mask = mask & ((kk + jnp.arange(bk)) < k)[:, None]
            wt = plgpu.load(rhs_ref.at[g, pl.ds(kk, bk), pl.ds(col0, bn)], mask=mask, other=0)
            return acc + x_chunk(kk).T * wt.astype(jnp.float32)
        codes = plgpu.load(
            rhs_ref.at[g, pl.ds(col0, bn), pl.ds(kk // quant_block, nb), :],
            mask=col_in[:, None, None],
            other=0,
        )  # [bn, nb, 32], k contiguous
        if bits == 8:
            scale = per_block(scale_ref, kk // quant_block, col0)
            offset = (
                None
                if offset_ref is None
                else jnp.broadcast_to(per_block(offset_ref, kk // quant_block, col0), codes.shape)
            )
            if asm:
                wt = dequantize_asm(
                    codes, jnp.broadcast_to(scale, codes.shape), offset, part=8, int8_fma=int8_fma, f32=True
                )
            else:
                wt = codes.astype(jnp.float32) * scale
                wt = wt if offset is None else wt + offset
            return acc + x_chunk(kk) * wt
        for x_row0, part in ((kk, "lo"), (k // 2 + kk, "hi")):  # split-half nibbles
            kb = x_row0 // quant_block
            scale, offset = per_block(scale_ref, kb, col0), per_block(offset_ref, kb, col0)
            if asm:
                wt = dequantize_asm(
                    codes,
                    jnp.broadcast_to(scale, codes.shape),
                    jnp.broadcast_to(offset, codes.shape),
                    part=part,
                    f32=True,
                )
            else:
                q = codes.astype(jnp.int32)
                q = q & 0xF if part == "lo" else (q >> 4) & 0xF
                wt = q.astype(jnp.float32) * scale + offset
            acc = acc + x_chunk(x_row0) * wt
        return acc

    shape = (bk, bn) if bits is None else (bn, nb, quant_block)
    accs = tuple(jnp.zeros(shape, jnp.float32) for _ in col_bases)

    def step(i, accs):
        return tuple(product(acc, i * bk, c) for acc, c in zip(accs, col_bases, strict=True))

    for i in range(steps):
        accs = step(i, accs)
    sums = [
        jnp.sum(acc, axis=0) if bits is None else jnp.sum(jnp.sum(acc, axis=2), axis=1) for acc in accs
    ]  # [bn]
    _store(out_ref, r, j * bn, sums, swiglu=swiglu, fast_silu=fast_silu, valid=valid, col_in=col_in)


def _store(out_ref, r, col0, sums, *, swiglu, fast_silu, valid, col_in):
    """Row r's output columns col0 + [0, bn) from the column sums [bn] (gate and up with `swiglu`); zeros
    for a row of no group."""
    if swiglu:
        out = (silu_approx(sums[0]) if fast_silu else jax.nn.sigmoid(sums[0]) * sums[0]) * sums[1]
    else:
        out = sums[0]
    bn = sums[0].shape[0]
    plgpu.store(out_ref.at[r, pl.ds(col0, bn)], jnp.where(valid, out, 0.0).astype(out_ref.dtype), mask=col_in)


def _q4_k_kernel(
    group_ref,
    lhs_ref,
    *rest,
    k,
    n_out,
    groups,
    first_block,
    block_n,
    swiglu: bool,
    gather: bool,
    fast_silu: bool,
):
    """`_kernel` on `Q4KExperts`: data_ref uint8 [groups, blocks, 144] (the rows' super-blocks), lhs_ref
    [rows, k / 64, 2, 32] (each 64 values' halves, as a Q4_K code group's low and high nibbles hold them)."""
    rest = list(rest)
    index_ref = rest.pop(0) if gather else None
    data_ref, out_ref = rest
    r, j = pl.program_id(0), pl.program_id(1)
    bn, nsb = block_n, k // QK_K
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    col_in = cols < n_out
    g = group_ref[r]
    valid = (g >= 0) & (g < groups)  # a row of no group: group 0's weights are read, zeros stored
    g = jnp.clip(g, 0, groups - 1)
    src = jnp.clip(index_ref[r], 0, lhs_ref.shape[0] - 1) if gather else r
    lanes = jnp.arange(32, dtype=jnp.int32)
    column_sets = (cols, n_out + cols) if swiglu else (cols,)  # gate and up columns of a fused gate_up

    def sub_block_scales(block):
        # per sub-block t: (d * sc[t], -dmin * m[t]) [bn] float32, as `q4_k_to_quantized` computes them
        def byte(i):
            at = data_ref.at[g, block, jnp.full((bn,), i, jnp.int32)]
            return plgpu.load(at, mask=col_in, other=0).astype(jnp.int32)

        def half(lo, hi):
            bits = (byte(lo) | (byte(hi) << 8)).astype(jnp.uint16)
            return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)

        d, dmin = half(0, 1), half(2, 3)
        b = [byte(4 + i) for i in range(12)]  # get_scale_min_k4
        sc = [b[t] & 0x3F for t in range(4)] + [(b[t + 8] & 0x0F) | ((b[t] >> 6) << 4) for t in range(4)]
        m = [b[t + 4] & 0x3F for t in range(4)] + [(b[t + 8] >> 4) | ((b[t + 4] >> 6) << 4) for t in range(4)]
        return [(d * sc[t].astype(jnp.float32), -(dmin * m[t].astype(jnp.float32))) for t in range(8)]

    accs = [jnp.zeros((bn, 32), jnp.float32) for _ in column_sets]
    for s in range(nsb):  # unrolled: k / 256 steps
        x = [
            [
                plgpu.load(lhs_ref.at[src, jnp.int32(4 * s + q), jnp.int32(h), :]).astype(jnp.float32)
                for h in (0, 1)
            ]
            for q in range(4)
        ]  # [q][half] [32]: the values of code group q's low and high nibbles
        for a, columns in enumerate(column_sets):
            block = first_block + columns * nsb + s  # [bn] each column's super-block s
            scales = sub_block_scales(block)
            for q in range(4):
                codes = plgpu.load(
                    data_ref.at[g, block[:, None], (16 + 32 * q + lanes)[None, :]],
                    mask=col_in[:, None],
                    other=0,
                ).astype(jnp.int32)  # [bn, 32]
                for h, nibble in enumerate((codes & 0x0F, codes >> 4)):
                    scale, offset = scales[2 * q + h]
                    w = nibble.astype(jnp.float32) * scale[:, None] + offset[:, None]
                    accs[a] = accs[a] + x[q][h][None, :] * w
    sums = [jnp.sum(acc, axis=1) for acc in accs]  # [bn]
    _store(out_ref, r, j * bn, sums, swiglu=swiglu, fast_silu=fast_silu, valid=valid, col_in=col_in)


def _gemv_q4_k(
    lhs, rhs: Q4KExperts, row_groups, lhs_index, n_out, out_dtype, *, swiglu, bs: Config, interpret
):
    """`_gemv` on checked `Q4KExperts` (`_q4_k_kernel`), n_out output columns in `out_dtype`."""
    groups, k, _ = rhs.shape
    if not addressable(rhs.data):
        raise NotImplementedError(
            f"Q4_K rows of {rhs.data.size} bytes: the kernel addresses fewer than 2**31 or more than 2**32 "
            "bytes (Pallas Triton's offsets are int32 below 4 GiB)"
        )
    m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
    bn = min(bs.block_n, pl.next_power_of_2(n_out))
    kernel = functools.partial(
        _q4_k_kernel,
        k=k,
        n_out=n_out,
        groups=groups,
        first_block=rhs.offset // Q4_K_BYTES,
        block_n=bn,
        swiglu=swiglu,
        gather=lhs_index is not None,
        fast_silu=swiglu and not interpret and lhs.dtype == jnp.bfloat16,
    )
    extra = () if lhs_index is None else (lhs_index.astype(jnp.int32),)
    data = rhs.data.reshape(groups, -1, Q4_K_BYTES)  # free: the rows' super-blocks
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=(m, pl.cdiv(n_out, bn)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=NUM_STAGES),
        interpret=interpret,
        name="gemv_q4_k_swiglu" if swiglu else "gemv_q4_k",
    )(row_groups.astype(jnp.int32), lhs.reshape(lhs.shape[0], k // 64, 2, 32), *extra, data)


def addressable(data) -> bool:
    """Whether the Q4_K kernel addresses all of `data`: Pallas Triton computes offsets in int32 up to 2**32
    bytes, signed, and in int64 beyond."""
    nbytes = data.size * jnp.dtype(data.dtype).itemsize
    return nbytes < 2**31 or nbytes > 2**32


def takes(m: int, rhs, row_groups) -> bool:
    """Whether `gmm`'s default runs `m` product rows on this kernel: their groups named (`row_groups`), at
    most `max_rows()` of them, and quantized weights with k-major codes. Float weights `[groups, k, n]` stay
    on the tensor-core kernel, which reads them faster than 8 columns (16 bytes) per k-row here."""
    if row_groups is not None and isinstance(rhs, Q4KExperts):
        return True  # no other implementation reads Q4_K rows in place
    return row_groups is not None and m <= max_rows() and isinstance(rhs, QuantizedWeights) and rhs.k_major


def refusal(rhs, group_sizes, row_groups) -> str | None:
    """Why this kernel cannot run a call (None: it can): it needs each row's group named and k-major codes."""
    if group_sizes is not None or row_groups is None:
        return "the matrix-vector kernel takes row_groups, not group_sizes"
    if isinstance(rhs, QuantizedWeights) and not rhs.k_major:
        return (
            "the matrix-vector kernel reads quantized codes stored k-major (QuantizedWeights.with_k_major())"
        )
    return None


@functools.partial(jax.jit, static_argnames=("swiglu", "preferred_element_type", "config", "interpret"))
def _gemv(
    lhs, rhs, row_groups, lhs_index, *, swiglu: bool, preferred_element_type, config: Config | None, interpret
):
    m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
    k = lhs.shape[1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bs = config or default_config()
    quantized = isinstance(rhs, QuantizedWeights)
    if quantized or isinstance(rhs, Q4KExperts):
        rhs.check()
    if quantized and not rhs.k_major:
        raise ValueError(
            "the matrix-vector kernel reads quantized codes stored k-major (QuantizedWeights.with_k_major())"
        )
    groups, k_rhs, n_rhs = rhs.shape
    if k_rhs != k:
        raise ValueError(f"lhs.shape={lhs.shape} and rhs.shape={tuple(rhs.shape)} disagree on k")
    reference.check_groups(None, row_groups, m, groups)
    n_out = n_rhs // 2 if swiglu else n_rhs
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if isinstance(rhs, Q4KExperts):
        return _gemv_q4_k(
            lhs, rhs, row_groups, lhs_index, n_out, out_dtype, swiglu=swiglu, bs=bs, interpret=interpret
        )
    bits = rhs.bits if quantized else None
    bs = dataclasses.replace(bs, block_n=min(bs.block_n, pl.next_power_of_2(n_out)))
    if quantized:
        qb = rhs.block_size
        k_rows = k // 2 if bits == 4 else k
        block_k = min(bs.block_k, pl.next_power_of_2(k_rows))
        while block_k > qb and k_rows % block_k:
            block_k //= 2
        if block_k % qb or k_rows % block_k:
            raise ValueError(
                f"block_k={bs.block_k}: no multiple of the quantization block {qb} divides the "
                f"{k_rows} k-rows"
            )
        bs = dataclasses.replace(bs, block_k=block_k)
        # free reshapes: codes [groups, n, rows / 32, 32], lhs [m, k / 32, 32]
        weights = (rhs.values.reshape(groups, n_rhs, -1, qb), rhs.scales) + (
            () if rhs.offsets is None else (rhs.offsets,)
        )
        lhs = lhs.reshape(lhs.shape[0], k // qb, qb)
    else:
        qb = 0
        block_k = min(bs.block_k, max(16, pl.next_power_of_2(k)))
        while block_k > 16 and k > block_k and k % block_k:  # the unrolled steps take no ragged last step
            block_k //= 2
        bs = dataclasses.replace(bs, block_k=block_k)
        weights = (rhs,)
    check_int32_offsets(lhs, *weights)
    extra = () if lhs_index is None else (lhs_index.astype(jnp.int32),)
    kernel = functools.partial(
        _kernel,
        k=k,
        n_out=n_out,
        groups=groups,
        bs=bs,
        swiglu=swiglu,
        bits=bits,
        quant_block=qb,
        gather=lhs_index is not None,
        fast_silu=swiglu and not interpret and lhs.dtype == jnp.bfloat16,
        asm=quantized and not interpret,
        int8_fma=quantized and rhs.half_precision_scales,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=(m, pl.cdiv(n_out, bs.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=NUM_STAGES),
        interpret=interpret,
        name="gemv_swiglu" if swiglu else "gemv",
    )(row_groups.astype(jnp.int32), lhs, *extra, *weights)


def gemv(
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
    """out[i] = lhs[lhs_index[i]] @ rhs[row_groups[i]] (`gmm` with `row_groups`), one matrix-vector product
    per row.

    Args:
      lhs: `[rows, k]` float32 / bfloat16.
      rhs: `[groups, k, n]` float array, or `QuantizedWeights` with k-major codes.
      group_sizes: must be None (the signature is shared with the other implementations).
      row_groups: `[m]` int32, each row's group; out of range: a zero row.
      lhs_index: optional `[m]` int32, the lhs row of each product row (clamped into range).
      preferred_element_type: output dtype; None = lhs.dtype.
      interpret: run in the Pallas interpreter; None = only when no GPU is present.
      config: `Config`; None = `default_config()`.

    Returns:
      `[m, n]`.

    Raises:
      NotImplementedError: group_sizes instead of row_groups, or quantized codes not stored k-major
        (`refusal`).
      ValueError: shapes that disagree, or an operand of 2**31 elements or more (Triton's offsets are int32).
    """
    if (why := refusal(rhs, group_sizes, row_groups)) is not None:
        raise NotImplementedError(why)
    return _gemv(
        lhs,
        rhs,
        row_groups,
        lhs_index,
        swiglu=False,
        preferred_element_type=preferred_element_type,
        config=config,
        interpret=interpret,
    )


def gemv_swiglu(
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
    """silu(x @ W_gate) * (x @ W_up) per row (`gmm_swiglu` with `row_groups`); arguments and errors as `gemv`.

    Returns:
      `[m, ffn]` for w_gate_up `[groups, k, 2 * ffn]`.
    """
    if (why := refusal(w_gate_up, group_sizes, row_groups)) is not None:
        raise NotImplementedError(why)
    return _gemv(
        lhs,
        w_gate_up,
        row_groups,
        lhs_index,
        swiglu=True,
        preferred_element_type=preferred_element_type,
        config=config,
        interpret=interpret,
    )

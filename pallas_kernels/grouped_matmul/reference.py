"""Pure-JAX grouped matmul: the oracle for every faster implementation.

Row i of lhs belongs to group g when starts[g] <= i < ends[g], with ends = cumsum(group_sizes) and
starts = ends - group_sizes (rows are sorted by group). Then
    out[i] = lhs[i] @ rhs[g]                     (gmm)
    out[i] = silu(lhs[i] @ Wg[g]) * (lhs[i] @ Wu[g]),  [Wg | Wu] = w_gate_up[g]   (gmm_swiglu)
and rows i >= sum(group_sizes) belong to no group and give zeros. Instead of group_sizes, `row_groups` may
give each row's group directly (rows in any order, as a decode step's few (token, expert) pairs come
unsorted); a value outside [0, groups) then gives a zero row.

It computes only each row's own group (m * k * n multiply-adds, not groups times that): rows are processed
in fixed-size batches, each row gathering its group's matrix. Everything is float32 at Precision.HIGHEST.
`jax.lax.ragged_dot` is not used: its CPU lowering (and XLA's GPU one in JAX 0.11.2) multiplies every row
by every group (it expands lhs to [groups, m, k]).
Source: megablox / tokamax `ragged_dot` semantics (group_sizes along the rows of lhs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.q4_k import Q4KExperts
from pallas_kernels.quantized import QuantizedWeights

_ROWS_PER_BATCH = 32  # rows multiplied together; bounds the gathered weights to 32 * k * n floats


def check_groups(group_sizes, row_groups, m: int, groups: int) -> None:
    """Validates the two ways to give rows their groups (every implementation calls it).

    Raises:
      ValueError: both or neither of group_sizes and row_groups, group_sizes not `[groups]`, or row_groups not
        `[m]` integers.
    """
    if (group_sizes is None) == (row_groups is None):
        raise ValueError(
            "give exactly one of group_sizes (rows sorted by group) and row_groups (each row's group)"
        )
    if group_sizes is not None and group_sizes.shape != (groups,):
        raise ValueError(f"group_sizes.shape={group_sizes.shape}, expected ({groups},)")
    if row_groups is not None and (
        row_groups.shape != (m,) or not jnp.issubdtype(row_groups.dtype, jnp.integer)
    ):
        raise ValueError(
            f"row_groups must be [{m}] integers (one group per row of the product), got "
            f"{row_groups.dtype} {row_groups.shape}"
        )


def groups_of_rows(group_sizes: jax.Array, m: int) -> jax.Array:
    """Group of each row, `[m]` int32; rows past sum(group_sizes) get `groups` (no group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _rowwise(
    lhs: jax.Array, rhs_f32: jax.Array, group_sizes: jax.Array | None, gid: jax.Array | None = None
) -> jax.Array:
    """out[i] = lhs[i] @ rhs[group(i)] in f32, zero for rows in no group. [m, k] x [g, k, n] -> [m, n].
    The groups come from group_sizes (sorted rows) or, when it is None, from gid `[m]` (any order)."""
    m, k = lhs.shape
    groups, _, n = rhs_f32.shape
    check_groups(group_sizes, gid, m, groups)
    gid = groups_of_rows(group_sizes, m) if gid is None else gid.astype(jnp.int32)  # [m]
    valid = (gid >= 0) & (gid < groups)
    pad = -m % _ROWS_PER_BATCH
    x = jnp.pad(lhs.astype(jnp.float32), ((0, pad), (0, 0))).reshape(-1, _ROWS_PER_BATCH, k)
    g = jnp.pad(jnp.clip(gid, 0, groups - 1), (0, pad)).reshape(-1, _ROWS_PER_BATCH)

    def batch(args):
        xb, gb = args  # [r, k], [r]
        return jnp.einsum("rk,rkn->rn", xb, rhs_f32[gb], precision=jax.lax.Precision.HIGHEST)

    out = jax.lax.map(batch, (x, g)).reshape(-1, n)[:m]  # [m, n]
    return jnp.where(valid[:, None], out, 0.0)


def _as_f32(rhs) -> jax.Array:
    return rhs.dequantize(jnp.float32) if isinstance(rhs, QuantizedWeights) else rhs.astype(jnp.float32)


def _products(lhs: jax.Array, rhs, group_sizes: jax.Array | None, gid: jax.Array | None) -> jax.Array:
    """`_rowwise` on any rhs: of `Q4KExperts` (whose rows may be a whole expert pool) only the rows' own
    groups are dequantized."""
    if not isinstance(rhs, Q4KExperts):
        return _rowwise(lhs, _as_f32(rhs), group_sizes, gid)
    m, groups = lhs.shape[0], rhs.shape[0]
    check_groups(group_sizes, gid, m, groups)
    gid = groups_of_rows(group_sizes, m) if gid is None else gid.astype(jnp.int32)
    w = rhs.take(jnp.clip(gid, 0, groups - 1)).dequantize(jnp.float32)  # [m, k, n]: row i's own matrix
    own = jnp.where((gid >= 0) & (gid < groups), jnp.arange(m, dtype=jnp.int32), m)
    return _rowwise(lhs, w, None, own)


def _gathered(lhs, lhs_index):
    return lhs if lhs_index is None else lhs[lhs_index]  # jnp's gather clamps out-of-range indices


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "interpret"))
def gmm_reference(
    lhs,
    rhs,
    group_sizes=None,
    *,
    row_groups=None,
    lhs_index=None,
    preferred_element_type=None,
    interpret=None,
) -> jax.Array:
    """Grouped matmul, float32 accumulation, only each row's own group.

    Args:
      lhs: `[m, k]` rows sorted by group, any float dtype (or any rows, gathered by lhs_index).
      rhs: `[groups, k, n]` float array, or QuantizedWeights (dequantized to float32 first), or `Q4KExperts`
        (the rows' groups dequantized).
      group_sizes: `[groups]` int32 on device, rows per group; sum may be < m. None when row_groups is given.
      row_groups: `[m]` int32, each row's group, rows in any order; outside [0, groups): a zero row.
      lhs_index: optional `[m]` int32: row i of the product is lhs[lhs_index[i]] (clamped into range).
      preferred_element_type: output dtype; None = lhs.dtype.
      interpret: ignored (the signature is shared with the kernels).

    Returns:
      `[m, n]`; rows past sum(group_sizes), or of no group, are zero.

    Raises:
      ValueError: both or neither of group_sizes and row_groups.
    """
    del interpret
    out_dtype = preferred_element_type or lhs.dtype
    return _products(_gathered(lhs, lhs_index), rhs, group_sizes, row_groups).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "interpret"))
def gmm_swiglu_reference(
    lhs,
    w_gate_up,
    group_sizes=None,
    *,
    row_groups=None,
    lhs_index=None,
    preferred_element_type=None,
    interpret=None,
) -> jax.Array:
    """silu(x @ W_gate) * (x @ W_up) per row's group, float32 throughout.

    Args:
      lhs: `[m, k]` rows sorted by group (or any rows, gathered by lhs_index).
      w_gate_up: `[groups, k, 2 * ffn]` (gate = [..., :ffn], up = [..., ffn:]), QuantizedWeights or
        `Q4KExperts`.
      group_sizes: `[groups]` int32, or None when row_groups is given.
      row_groups: `[m]` int32, as in `gmm_reference`.
      lhs_index: optional `[m]` int32, as in `gmm_reference`.
      preferred_element_type: output dtype; None = lhs.dtype.
      interpret: ignored.

    Returns:
      `[m, ffn]`; rows past sum(group_sizes), or of no group, are zero.

    Raises:
      ValueError: both or neither of group_sizes and row_groups.
    """
    del interpret
    out_dtype = preferred_element_type or lhs.dtype
    h = _products(_gathered(lhs, lhs_index), w_gate_up, group_sizes, row_groups)  # [m, 2 * ffn]
    gate, up = jnp.split(h, 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(out_dtype)

"""Grouped matmul for MoE experts: the one public entry point per operation, with `implementation=`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import pallas_gemv, pallas_triton, reference
from pallas_kernels.quantized import QuantizedWeights

Implementation = Literal["auto", "reference", "pallas"]


def _pallas(gemv: Callable[..., jax.Array], tiled: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The Pallas kernel for a call: the matrix-vector kernel for a few rows with their groups named (decode;
    `pallas_gemv.takes`), else the tensor-core kernel."""
    def fn(lhs, rhs, group_sizes=None, *, row_groups=None, lhs_index=None, **kwargs):
        m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
        if pallas_gemv.takes(m, rhs, row_groups):
            return gemv(lhs, rhs, row_groups=row_groups, lhs_index=lhs_index, **kwargs)
        return tiled(lhs, rhs, group_sizes, row_groups=row_groups, lhs_index=lhs_index, **kwargs)
    return fn


_GMM: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.gmm_reference,
    "pallas": _pallas(pallas_gemv.gemv_pallas, pallas_triton.gmm_pallas),
}
_GMM_SWIGLU: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.gmm_swiglu_reference,
    "pallas": _pallas(pallas_gemv.gemv_swiglu_pallas, pallas_triton.gmm_swiglu_pallas),
}


def _pick(table: dict[str, Callable[..., jax.Array]], implementation: str | None) -> Callable[..., jax.Array]:
    if implementation in (None, "auto"):
        implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
    if implementation not in table:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {sorted(table)}")
    return table[implementation]


def _check(lhs, rhs, group_sizes, name: str, lhs_index, row_groups) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [m, k], got shape {lhs.shape}")
    if lhs_index is not None and (lhs_index.ndim != 1 or not jnp.issubdtype(lhs_index.dtype, jnp.integer)):
        raise ValueError(f"lhs_index must be [m] integers, got {lhs_index.dtype} {lhs_index.shape}")
    if isinstance(rhs, QuantizedWeights):
        rhs.check()
    elif rhs.ndim != 3:
        raise ValueError(f"{name} must be [groups, k, n], got shape {rhs.shape}")
    groups, k, _ = rhs.shape
    if k != lhs.shape[1]:
        raise ValueError(f"lhs.shape={lhs.shape} and {name}.shape={tuple(rhs.shape)} disagree on k")
    reference.check_groups(group_sizes, row_groups, lhs.shape[0] if lhs_index is None else lhs_index.shape[0],
                           groups)


def gmm(lhs: jax.Array, rhs: jax.Array | QuantizedWeights, group_sizes: jax.Array | None = None, *,
        row_groups: jax.Array | None = None, lhs_index: jax.Array | None = None, preferred_element_type=None,
        implementation: Implementation | None = "auto", interpret: bool | None = None) -> jax.Array:
    """Grouped matmul: each row of lhs times the matrix of its group.

    out[i] = lhs[i] @ rhs[g] for starts[g] <= i < ends[g] (ends = cumsum(group_sizes)); rows at or past
    sum(group_sizes) belong to no group and come out zero (the MoE drops padding tokens this way).
    Or, with `row_groups` instead of group_sizes, out[i] = lhs[i] @ rhs[row_groups[i]], rows in any order:
    what a decode step's few (token, expert) pairs need, with no sort (llama.cpp's `mul_mat_id`); each row is
    then its own work item, so a group's weights are read once per row (use it for a few rows only); up to
    `pallas_gemv.MAX_ROWS` rows the Pallas implementation runs them as matrix-vector products (`pallas_gemv`).
    Accumulation is float32.

    Args:
      lhs: `[m, k]` (tokens * top_k rows, sorted by expert), float32/bfloat16/float16.
      rhs: `[groups, k, n]` float array (experts, hidden, ffn), or a `QuantizedWeights` of that shape
        (int8 Q8_0 or 4-bit; the kernel dequantizes tiles in registers).
      group_sizes: `[groups]` int32 on device, rows per group, sum <= m. Never read on the host.
      row_groups: instead of group_sizes, `[m]` int32 on device: the group of each row of the product (any
        order); a value outside [0, groups) gives a zero row.
      lhs_index: optional `[m]` int32: row i of the product is lhs[lhs_index[i]] (lhs then has any number
        of rows; out-of-range indices are clamped, as by jnp's gather). The MoE dispatch passes
        sorted-copy -> token, so the kernel gathers token rows itself and the [m, k] sorted copy of the
        activations never reaches memory.
      preferred_element_type: output dtype; None = lhs.dtype.
      implementation: "reference" (pure JAX, float32, Precision.HIGHEST; the oracle) or "pallas"
        (Pallas Triton kernel; interpreter when no GPU). "auto" (or None) = "pallas" on GPU, "reference"
        elsewhere.
      interpret: Pallas only: run the kernel in the interpreter; None = only when no GPU is present.

    Returns:
      `[m, n]` in preferred_element_type (or lhs.dtype); m = len(lhs_index) when given.

    Raises:
      ValueError: unknown implementation, shapes that disagree, both or neither of group_sizes and
        row_groups, or (Pallas) an operand of 2**31 elements or more (the Triton kernel's offsets are int32).

    Source: megablox `gmm` / tokamax `ragged_dot` semantics; docs/benchmarks_gmm.md for speed.
    """
    fn = _pick(_GMM, implementation)
    _check(lhs, rhs, group_sizes, "rhs", lhs_index, row_groups)
    return fn(lhs, rhs, group_sizes, row_groups=row_groups, lhs_index=lhs_index,
              preferred_element_type=preferred_element_type, interpret=interpret)


def gmm_swiglu(lhs: jax.Array, w_gate_up: jax.Array | QuantizedWeights, group_sizes: jax.Array | None = None, *,
               row_groups: jax.Array | None = None, lhs_index: jax.Array | None = None, preferred_element_type=None,
               implementation: Implementation | None = "auto", interpret: bool | None = None) -> jax.Array:
    """Fused expert up-projection: silu(x @ W_gate) * (x @ W_up) per row's group.

    The Pallas kernel keeps both projections in registers and never writes the [m, 2 * ffn] intermediate.

    Args:
      lhs: `[m, k]` rows sorted by group.
      w_gate_up: `[groups, k, 2 * ffn]`; `[..., :ffn]` is the gate projection, `[..., ffn:]` the up
        projection; float array or QuantizedWeights.
      group_sizes: `[groups]` int32 on device, sum <= m.
      row_groups: instead of group_sizes, each row's group, as in `gmm`.
      lhs_index: as in `gmm` (the gather of the MoE dispatch, fused).
      preferred_element_type: output dtype; None = lhs.dtype.
      implementation: as in `gmm`.
      interpret: as in `gmm`.

    Returns:
      `[m, ffn]`; rows past sum(group_sizes), or of no group, are zero.

    Raises:
      ValueError: unknown implementation, shapes that disagree, both or neither of group_sizes and
        row_groups, or an odd number of columns.

    Source: SwiGLU, Shazeer 2020 (arXiv:2002.05202); Qwen3-MoE expert MLP.
    """
    fn = _pick(_GMM_SWIGLU, implementation)
    _check(lhs, w_gate_up, group_sizes, "w_gate_up", lhs_index, row_groups)
    if w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up has {w_gate_up.shape[2]} columns; expected 2 * ffn")
    return fn(lhs, w_gate_up, group_sizes, row_groups=row_groups, lhs_index=lhs_index,
              preferred_element_type=preferred_element_type, interpret=interpret)

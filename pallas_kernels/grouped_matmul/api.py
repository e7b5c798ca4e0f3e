"""Grouped matmul for MoE experts: the one public entry point per operation, with `implementation=`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.grouped_matmul import pallas_gemv, pallas_triton, reference
from pallas_kernels.q4_k import Q4KExperts
from pallas_kernels.quantized import QuantizedWeights

Implementation = Literal["reference", "triton", "gemv"]

_GMM: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.gmm_reference,
    "triton": pallas_triton.gmm_triton,
    "gemv": pallas_gemv.gemv,
}
_GMM_SWIGLU: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.gmm_swiglu_reference,
    "triton": pallas_triton.gmm_swiglu_triton,
    "gemv": pallas_gemv.gemv_swiglu,
}


def default_implementation(lhs, rhs, *, row_groups=None, lhs_index=None) -> Implementation:
    """The best implementation for this call on the running backend: on a GPU the matrix-vector kernel for a
    few rows with their groups named (decode; `pallas_gemv.takes`), else the tensor-core kernel; "reference"
    off GPU."""
    if jax.default_backend() != "gpu":
        return "reference"
    m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
    return "gemv" if pallas_gemv.takes(m, rhs, row_groups) else "triton"


def _run(
    table: dict[str, Callable[..., jax.Array]], implementation, lhs, rhs, group_sizes, **kwargs
) -> jax.Array:
    """Runs the named implementation, or the first of a sequence that does not raise NotImplementedError."""
    if implementation is None:
        implementation = default_implementation(
            lhs, rhs, row_groups=kwargs["row_groups"], lhs_index=kwargs["lhs_index"]
        )
    names = dispatch.implementation_names(implementation, table)
    return dispatch.first_accepted(names, lambda name: table[name](lhs, rhs, group_sizes, **kwargs))


def _check(lhs, rhs, group_sizes, name: str, lhs_index, row_groups) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [m, k], got shape {lhs.shape}")
    if lhs_index is not None and (lhs_index.ndim != 1 or not jnp.issubdtype(lhs_index.dtype, jnp.integer)):
        raise ValueError(f"lhs_index must be [m] integers, got {lhs_index.dtype} {lhs_index.shape}")
    if isinstance(rhs, (QuantizedWeights, Q4KExperts)):
        rhs.check()
    elif rhs.ndim != 3:
        raise ValueError(f"{name} must be [groups, k, n], got shape {rhs.shape}")
    groups, k, _ = rhs.shape
    if k != lhs.shape[1]:
        raise ValueError(f"lhs.shape={lhs.shape} and {name}.shape={tuple(rhs.shape)} disagree on k")
    reference.check_groups(
        group_sizes, row_groups, lhs.shape[0] if lhs_index is None else lhs_index.shape[0], groups
    )


def gmm(
    lhs: jax.Array,
    rhs: jax.Array | QuantizedWeights,
    group_sizes: jax.Array | None = None,
    *,
    row_groups: jax.Array | None = None,
    lhs_index: jax.Array | None = None,
    preferred_element_type=None,
    implementation: Implementation | Sequence[Implementation] | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped matmul: each row of lhs times the matrix of its group.

    out[i] = lhs[i] @ rhs[g] for starts[g] <= i < ends[g] (ends = cumsum(group_sizes)); rows at or past
    sum(group_sizes) belong to no group and come out zero (the MoE drops padding tokens this way).
    Or, with `row_groups` instead of group_sizes, out[i] = lhs[i] @ rhs[row_groups[i]], rows in any order:
    what a decode step's few (token, expert) pairs need, with no sort (llama.cpp's `mul_mat_id`); each row is
    then its own work item, so a group's weights are read once per row (use it for a few rows only); the
    default runs a few such rows as matrix-vector products ("gemv").
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
      implementation: "reference" (pure JAX, float32, Precision.HIGHEST; the oracle), "triton" (the Pallas
        Triton tensor-core kernel, `pallas_triton`) or "gemv" (Pallas Triton matrix-vector products for rows
        with `row_groups`, `pallas_gemv`; refuses group_sizes and codes not stored k-major); the kernels run
        in the interpreter when no GPU is present. A sequence: the first that does not refuse. None: the best
        for the call on this backend (`default_implementation`).
      interpret: kernels only: run in the Pallas interpreter; None = only when no GPU is present.

    Returns:
      `[m, n]` in preferred_element_type (or lhs.dtype); m = len(lhs_index) when given.

    Raises:
      ValueError: unknown implementation, shapes that disagree, both or neither of group_sizes and
        row_groups, or (kernels) an operand of 2**31 elements or more (the Triton kernels' offsets are int32).
      NotImplementedError: the implementation (or every one of a sequence) refuses the call.

    Source: megablox `gmm` / tokamax `ragged_dot` semantics.
    """
    _check(lhs, rhs, group_sizes, "rhs", lhs_index, row_groups)
    return _run(
        _GMM,
        implementation,
        lhs,
        rhs,
        group_sizes,
        row_groups=row_groups,
        lhs_index=lhs_index,
        preferred_element_type=preferred_element_type,
        interpret=interpret,
    )


def gmm_swiglu(
    lhs: jax.Array,
    w_gate_up: jax.Array | QuantizedWeights,
    group_sizes: jax.Array | None = None,
    *,
    row_groups: jax.Array | None = None,
    lhs_index: jax.Array | None = None,
    preferred_element_type=None,
    implementation: Implementation | Sequence[Implementation] | None = None,
    interpret: bool | None = None,
) -> jax.Array:
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
      NotImplementedError: as in `gmm`.

    Source: SwiGLU, Shazeer 2020 (arXiv:2002.05202); Qwen3-MoE expert MLP.
    """
    _check(lhs, w_gate_up, group_sizes, "w_gate_up", lhs_index, row_groups)
    if w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up has {w_gate_up.shape[2]} columns; expected 2 * ffn")
    return _run(
        _GMM_SWIGLU,
        implementation,
        lhs,
        w_gate_up,
        group_sizes,
        row_groups=row_groups,
        lhs_index=lhs_index,
        preferred_element_type=preferred_element_type,
        interpret=interpret,
    )

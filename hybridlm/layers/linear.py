"""Projections by a weight matrix, with decode's single row kept a matrix product on GPUs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import gmm
from pallas_kernels.quantized import QuantizedWeights

# Rows a single-row product is padded to (the tensor cores' smallest tile height).
SINGLE_ROW_PAD = 8

# Up to this many rows a kept quantized matrix runs through the grouped matmul (one row: the matrix-vector
# kernel; more: one group of the tensor-core kernel, which reads the weights once for all rows); more rows (a
# prefill chunk) multiply its dequantized bfloat16 copy, where the product's compute outweighs one pass over
# the weights.
QUANTIZED_GMM_MAX_ROWS = 64


def linear(x: jax.Array, w) -> jax.Array:
    """x @ w: [..., k] x [k, n] -> [..., n] in the dtype of the product (as `x @ w`).

    When x holds a single row (a one-token decode step) and w more than one column, the row is padded with
    zero rows to `SINGLE_ROW_PAD` and the product's first row taken. XLA's GPU compiler rewrites a
    vector-matrix product as a broadcast multiply and a reduction and often writes the whole [k, n] product to
    memory before reducing it; as a matrix product it runs faster. The padding rows are zero and rows of a
    matrix product do not mix, so the result is the product's (up to the summation order the compiler picks).

    `w` may be a `QuantizedWeights` [1, k, n] (a GGUF file's own blocks, kept by `load(...,
    keep_quantized="all")`), read at its bytes (Q8_0: 1.06 a weight against bfloat16's 2): up to
    `QUANTIZED_GMM_MAX_ROWS` rows through the grouped matmul (`quantized_matmul`), more through its
    dequantized copy; the result is then in x's dtype.
    """
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantizedWeights):
        if rows > QUANTIZED_GMM_MAX_ROWS:
            return x @ w.dequantize(x.dtype)[0]
        return quantized_matmul(x, w, x.dtype)
    if rows != 1 or w.shape[-1] == 1:
        return x @ w
    padded = jnp.pad(x.reshape(1, x.shape[-1]), ((0, SINGLE_ROW_PAD - 1), (0, 0)))
    return (padded @ w)[:1].reshape(*x.shape[:-1], w.shape[-1])


def head_matmul(x: jax.Array, w, implementation=None, interpret: bool | None = None) -> jax.Array:
    """x @ w for an lm head: [..., hidden] x [hidden, vocab] -> [..., vocab] float32.

    `w` is a float array `[hidden, vocab]`, or a `QuantizedWeights` `[1, hidden, vocab]` (the GGUF file's own
    8-bit blocks, kept by `load(..., keep_quantized="experts+head")`): its 1.06 bytes a weight against
    bfloat16's 2 halve what a decode step reads for the head (~1 GB in bfloat16 at Qwen3.5's 248 320 tokens).
    One row runs as a matrix-vector product ("gemv" on a GPU: float32 products of the exact dequantized
    weights), several rows as one group of the grouped matmul, which reads the weights once for all rows (on a
    GPU its tensor-core tiles take bfloat16 rows with the weights rounded to bfloat16, as a bfloat16 head
    holds them). Both accumulate in float32. `implementation`, `interpret`: as `gmm`'s (None: the best for the
    call on this backend, interpreted off a GPU).

    Raises:
      ValueError (a quantized w) or TypeError (a float w): x's last dim is not w's hidden dim.
    """
    if not isinstance(w, QuantizedWeights):
        return (x @ w.astype(x.dtype)).astype(jnp.float32)
    return quantized_matmul(x, w, jnp.float32, implementation, interpret)


def quantized_matmul(x: jax.Array, w: QuantizedWeights, out_dtype, implementation=None, interpret=None):
    """x @ w for a `QuantizedWeights` w [1, k, n] as one group of the grouped matmul: [..., k] -> [..., n] in
    `out_dtype`, accumulated in float32. One row runs as a matrix-vector product ("gemv" on a GPU: float32
    products of the exact dequantized weights), several rows as one group, whose weights are read once for
    all rows (on a GPU the tensor-core tiles round them to bfloat16). `implementation`, `interpret`: as
    `gmm`'s."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, k)
    if rows == 1:
        groups = {"row_groups": jnp.zeros((1,), jnp.int32)}
    else:
        groups = {"group_sizes": jnp.full((1,), rows, jnp.int32)}
    kw = {"preferred_element_type": out_dtype, "implementation": implementation, "interpret": interpret}
    out = gmm(flat, w, **groups, **kw)
    return out.reshape(*lead, w.shape[-1])

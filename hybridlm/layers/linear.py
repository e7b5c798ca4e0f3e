"""Projections by a weight matrix, with decode's single row kept a matrix product on GPUs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Rows a single-row product is padded to (the tensor cores' smallest tile height).
SINGLE_ROW_PAD = 8


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w: [..., k] x [k, n] -> [..., n] in the dtype of the product (as `x @ w`).

    When x holds a single row (a one-token decode step) and w more than one column, the row is padded with
    zero rows to `SINGLE_ROW_PAD` and the product's first row taken. XLA's GPU compiler rewrites a
    vector-matrix product as a broadcast multiply and a reduction and often writes the whole [k, n] product to
    memory before reducing it; as a matrix product it runs faster. The padding rows are zero and rows of a
    matrix product do not mix, so the result is the product's (up to the summation order the compiler picks).
    """
    rows = math.prod(x.shape[:-1])
    if rows != 1 or w.shape[-1] == 1:
        return x @ w
    padded = jnp.pad(x.reshape(1, x.shape[-1]), ((0, SINGLE_ROW_PAD - 1), (0, 0)))
    return (padded @ w)[:1].reshape(*x.shape[:-1], w.shape[-1])

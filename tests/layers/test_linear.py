"""`linear`: decode's single row padded to a matrix product, the same values as x @ w."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_finite

from hybridlm.layers.linear import SINGLE_ROW_PAD, linear


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 64), (64,), (3, 1, 64), (2, 5, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_equals_matmul(shape, dtype):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (64, 48), jnp.float32) / 8).astype(dtype)
    got = jax.jit(linear)(x, w)
    want = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert got.shape == shape[:-1] + (48,) and got.dtype == (x @ w).dtype
    assert_finite(got)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)


def test_single_row_is_padded_and_vectors_are_not():
    x, w = jnp.ones((1, 1, 16)), jnp.ones((16, 4))
    assert f"f32[{SINGLE_ROW_PAD},16]" in jax.jit(linear).lower(x, w).as_text(dialect="hlo")
    one_column = jax.jit(linear).lower(x, jnp.ones((16, 1))).as_text(dialect="hlo")
    assert f"[{SINGLE_ROW_PAD},16]" not in one_column  # a dot of two vectors stays one

"""`linear`: decode's single row padded to a matrix product, the same values as x @ w. `head_matmul`: a kept
Q8_0 lm head gives the product of its dequantized weights, through either kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support
from support import assert_finite

from hybridlm.layers.linear import QUANTIZED_GMM_MAX_ROWS, SINGLE_ROW_PAD, head_matmul, linear
from pallas_kernels.quantized import QuantizedWeights, quantize_int8


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


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 5, 64)])
@pytest.mark.parametrize("implementation", [None, "gemv", "triton"])
def test_quantized_head_is_the_product_of_its_weights(shape, implementation):
    """One row through the matrix-vector kernel, several as one GMM group (both interpreted here), or the
    reference: the float32 product of the dequantized head (bfloat16 weights in the tensor-core tiles)."""
    rows = np.prod(shape[:-1])
    if (implementation == "gemv") != (rows == 1) and implementation is not None:
        pytest.skip("the matrix-vector kernel takes one row; the tensor-core kernel the rest")
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16)
    head = quantize_int8(jax.random.normal(kw, (1, 64, 96), jnp.float32) / 8)
    got = head_matmul(x, head, implementation)
    want = jnp.matmul(x.astype(jnp.float32), head.dequantize()[0], precision="highest")
    assert got.shape == shape[:-1] + (96,) and got.dtype == jnp.float32
    assert_finite(got)
    tol = 2e-2 if implementation == "triton" else 1e-4  # the tensor-core tiles round weights to bfloat16
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


def abstract_q8_0(k: int, n: int) -> QuantizedWeights:
    """A Q8_0 matrix [1, k, n] as the loader keeps it, of shapes only (k-major int8 codes, float16 scales)."""
    return QuantizedWeights(
        values=jax.ShapeDtypeStruct((1, n, k), jnp.int8),
        scales=jax.ShapeDtypeStruct((1, k // 32, n), jnp.float16),
        bits=8,
        block_size=32,
        k_major=True,
    )


@pytest.mark.parametrize(("rows", "implementation", "kernel"), [(1, "gemv", "gemv"), (4, "triton", "gmm")])
def test_quantized_head_lowers_for_cuda_at_qwen35_shape(rows, implementation, kernel):
    """Qwen3.5 / 3.6's head [2048, 248 320] as Q8_0 through Pallas' Triton lowering for an H100 (abstract:
    nothing is compiled or allocated here)."""
    hidden, vocab = 2048, 248_320
    head = abstract_q8_0(hidden, vocab)
    x = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    text = support.lowered_for_h100(head_matmul, x, head, implementation=implementation, interpret=False)
    assert f'name = "{kernel}"' in text  # the Pallas kernel's name in the Triton call


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 5, 64), (3, 40, 64)])
def test_kept_quantized_projection_is_the_product_of_its_weights(shape):
    """`linear` on a kept `QuantizedWeights` [1, k, n] (keep_quantized="all"): one row or a few through the
    grouped matmul, a prefill chunk (past QUANTIZED_GMM_MAX_ROWS) through the dequantized matrix; the
    product of the dequantized weights in x's dtype either way."""
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, shape, jnp.float32)
    w = quantize_int8(jax.random.normal(kw, (1, 64, 48), jnp.float32) / 8)
    got = jax.jit(linear)(x, w)
    want = jnp.matmul(x, w.dequantize()[0], precision="highest")
    assert got.shape == shape[:-1] + (48,) and got.dtype == x.dtype
    assert_finite(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 64, 512])
@pytest.mark.parametrize("kn", [(2048, 8192), (2048, 32), (4096, 2048), (512, 2048)])
def test_kept_quantized_projections_lower_for_cuda_at_qwen35_shapes(rows, kn, monkeypatch):
    """The 35B model's projection shapes as Q8_0 (qkv_proj, beta_proj, out_proj, the shared down) through
    `linear` lowered for an H100 at a decode step, a verify, a DDTree and a prefill chunk (abstract: nothing
    is compiled or allocated here)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels `gmm` picks on a GPU
    k, n = kn
    w = abstract_q8_0(k, n)
    text = support.lowered_for_h100(linear, jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), w)
    kernel = "gemv" if rows == 1 else "gmm" if rows <= QUANTIZED_GMM_MAX_ROWS else None
    assert (f'name = "{kernel}"' in text) if kernel else ("tt.func" not in text)

"""The matrix-vector grouped matmul (`pallas_gemv`, decode's few rows with their groups named) against float64
numpy.

The kernel runs in the Pallas interpreter on CPU; its PTX dequantization is checked by lowering for an sm_90
GPU (on a GPU, `python -m pytest tests/pallas_kernels` runs it compiled).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support
from test_grouped_matmul import TOLERANCE, as_float, assert_close, numpy_row_groups

from pallas_kernels.grouped_matmul import gmm, gmm_swiglu, pallas_gemv
from pallas_kernels.quantized import quantize_int4, quantize_int8

GROUPS, K, N = 6, 128, 80  # n = 80: the last 8- and 16-column tiles are partly masked


def make(weights: str, dtype, *, k: int = K, seed: int = 0):
    """(tokens [2, k], rhs [GROUPS, k, 2N] (a gate_up), its float64 values, row groups [8], token of each
    row)."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((GROUPS, k, 2 * N), np.float32) / np.sqrt(k))
    rhs = {
        "float": lambda: w.astype(dtype),
        "int8": lambda: quantize_int8(w),
        "int4": lambda: quantize_int4(w),
        # GGUF Q6_K kept quantized: a float32 scale per 16 elements
        "int8_b16": lambda: quantize_int8(w, block_size=16, scale_dtype=jnp.float32),
        # GGUF Q5_1 / Q5_K kept quantized: an offset per block too
        "int8_offsets": lambda: quantize_int8(w, offsets=True),
    }[weights]()
    dense = as_float(rhs) if weights == "float" else np.asarray(rhs.dequantize(jnp.float32))
    tokens = jnp.asarray(rng.standard_normal((2, k), np.float32), dtype)
    groups = np.array([3, 0, 5, 3, -1, 2, GROUPS, 1], np.int32)  # a repeat, and two rows of no group
    index = np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int32)
    return tokens, rhs, dense, groups, index


CASES = [
    ("float", jnp.float32),
    ("float", jnp.bfloat16),
    ("int8", jnp.bfloat16),
    ("int4", jnp.bfloat16),
    ("int8_b16", jnp.bfloat16),
    ("int8_offsets", jnp.bfloat16),
]
IDS = ["f32", "bf16", "int8", "int4", "int8_b16", "int8_offsets"]


def kernel_names(fn, *args, **kwargs) -> set[str]:
    """The names in the jaxpr of fn(*args, **kwargs): its pallas_call equations name their kernels."""
    return set(re.findall(r"name=(\w+)", str(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args))))


@pytest.mark.parametrize("weights,dtype", CASES[2:], ids=IDS[2:])
def test_decode_rows_take_the_gemv_kernel_and_match_numpy(weights, dtype):
    tokens, rhs, dense, groups, index = make(weights, dtype)
    x = as_float(tokens)[index]
    kw = {"row_groups": jnp.asarray(groups), "lhs_index": jnp.asarray(index), "implementation": "gemv"}
    h = gmm_swiglu(tokens, rhs, **kw)
    assert h.shape == (8, N) and h.dtype == dtype
    assert_close(h, numpy_row_groups(x, dense, groups, swiglu=True), dtype, "gemv_swiglu")
    y = gmm(tokens, rhs, **kw)
    assert_close(y, numpy_row_groups(x, dense, groups), dtype, "gemv")
    for out in (h, y):  # rows of no group are zeros
        assert not np.asarray(out[4:5], np.float32).any() and not np.asarray(out[6:7], np.float32).any()
    assert {"gemv_swiglu"} <= kernel_names(
        gmm_swiglu, tokens, rhs, **kw
    ) and "gmm_swiglu" not in kernel_names(gmm_swiglu, tokens, rhs, **kw)
    assert {"gemv"} <= kernel_names(gmm, tokens, rhs, **kw) and "gmm" not in kernel_names(
        gmm, tokens, rhs, **kw
    )


@pytest.mark.parametrize("weights,dtype", CASES, ids=IDS)
def test_gemv_tile_shapes(weights, dtype):
    # Column tiles that overhang n, one k step or several, and (float weights) a k no block divides.
    k = 96 if weights == "float" else K
    tokens, rhs, dense, groups, index = make(weights, dtype, k=k, seed=1)
    x = as_float(tokens)[index]
    want = numpy_row_groups(x, dense, groups)
    for bs in (
        pallas_gemv.Config(block_n=16, block_k=64),
        pallas_gemv.Config(block_n=32, block_k=32, num_warps=2),
    ):
        y = pallas_gemv.gemv(
            tokens,
            rhs,
            row_groups=jnp.asarray(groups),
            lhs_index=jnp.asarray(index),
            config=bs,
            preferred_element_type=jnp.float32,
        )
        assert y.dtype == jnp.float32
        # float32 weights and accumulation: the bf16 tolerance only for bf16 inputs rounded before the oracle
        atol, rtol = TOLERANCE[jnp.float32] if dtype == jnp.float32 else (1e-4, 1e-4)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=atol, rtol=rtol, err_msg=str(bs))


def test_which_calls_take_the_gemv_kernel():
    w = jnp.zeros((GROUPS, K, N), jnp.float32)
    rows = jnp.zeros((8,), jnp.int32)
    assert pallas_gemv.takes(8, quantize_int8(w), rows) and pallas_gemv.takes(8, quantize_int4(w), rows)
    assert not pallas_gemv.takes(8, w, rows)  # float weights: the tensor-core kernel reads faster
    assert not pallas_gemv.takes(8, quantize_int8(w), None)  # group sizes: prefill's kernel
    assert not pallas_gemv.takes(
        pallas_gemv.MAX_ROWS + 1, quantize_int8(w), jnp.zeros((pallas_gemv.MAX_ROWS + 1,), jnp.int32)
    )
    assert not pallas_gemv.takes(8, quantize_int8(w).with_k_major(False), rows)  # codes [groups, k, n]


def test_gemv_errors():
    tokens, rhs, _, groups, index = make("int8", jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="k-major"):
        pallas_gemv.gemv(
            tokens, rhs.with_k_major(False), row_groups=jnp.asarray(groups), lhs_index=jnp.asarray(index)
        )
    with pytest.raises(ValueError, match="disagree on k"):
        pallas_gemv.gemv(tokens[:, :64], rhs, row_groups=jnp.asarray(groups), lhs_index=jnp.asarray(index))
    with pytest.raises(ValueError, match="row_groups"):
        pallas_gemv.gemv(tokens, rhs, row_groups=jnp.asarray(groups[:5]), lhs_index=jnp.asarray(index))
    big = jax.ShapeDtypeStruct((1025, 2048, 1024), jnp.bfloat16)  # 2.15e9 elements: wrapped int32 offsets
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.eval_shape(
            lambda a, b, g: pallas_gemv.gemv(a, b, row_groups=g),
            jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
            big,
            jax.ShapeDtypeStruct((8,), jnp.int32),
        )


@pytest.mark.parametrize("weights", ["int8", "int4", "int8_offsets"])
def test_gemv_dequantizes_by_ptx_in_float32(weights):
    # Lowered for an H100 (not compiled here): the codes go through the tensor-core kernel's PTX with four
    # float32 results (no bf16 rounding of the weights, no int-to-float instruction); int8 with its one-fma
    # form.
    bits = 4 if weights == "int4" else 8
    tokens, rhs, _, groups, index = make(weights, jnp.bfloat16)
    text = support.lowered_for_h100(
        pallas_gemv.gemv_swiglu,
        tokens,
        rhs,
        row_groups=jnp.asarray(groups),
        lhs_index=jnp.asarray(index),
        interpret=False,
    )
    assert "mov.b32 $0, f0; mov.b32 $1, f1; mov.b32 $2, f2; mov.b32 $3, f3;" in text
    assert "cvt.rn.bf16x2.f32" not in text and "fma.rn.f32" in text
    assert ("0x47000000" in text) == (bits == 8) and ("0x4B000000" in text) == (bits == 4)

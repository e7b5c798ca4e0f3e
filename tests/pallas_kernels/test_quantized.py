"""QuantizedWeights: layout, dequantization, quantization error, pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized import QuantizedWeights, common_format, quantize_int4, quantize_int8, reencode


def random_weights(shape=(3, 128, 24), seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * 0.05


def test_int8_is_q8_0():
    w = random_weights()
    q = quantize_int8(w)
    assert q.k_major and q.values.dtype == jnp.int8 and q.values.shape == (3, 24, 128)  # [groups, n, k]
    assert q.shape == w.shape and q.scales.shape == (3, 128 // 32, 24) and q.offsets is None
    values = np.asarray(q.with_k_major(False).values)  # [groups, k, n]
    np.testing.assert_array_equal(values, np.swapaxes(np.asarray(q.values), 1, 2))
    # value = scale * q, with one scale per 32 consecutive k-rows of each column
    s = np.repeat(np.asarray(q.scales, np.float32), 32, axis=1)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), s * values.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q.with_k_major(False).dequantize()), np.asarray(q.dequantize()))
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    assert (err <= s / 2 * 1.01 + 1e-7).all(), "rounding error above half a step"
    assert np.abs(values).max() == 127


def test_int4_split_half_packing():
    w = random_weights()
    q = quantize_int4(w)
    groups, k, n = w.shape
    assert q.k_major and q.values.dtype == jnp.uint8 and q.values.shape == (groups, n, k // 2)
    kn = quantize_int4(w, k_major=False)
    assert not kn.k_major and kn.values.shape == (groups, k // 2, n)
    np.testing.assert_array_equal(np.asarray(q.with_k_major(False).values), np.asarray(kn.values))
    packed = np.asarray(kn.values)
    codes = np.asarray(q.codes())
    np.testing.assert_array_equal(codes[:, : k // 2], packed & 0xF)  # low nibble: rows [0, k/2)
    np.testing.assert_array_equal(codes[:, k // 2 :], packed >> 4)  # high nibble: rows [k/2, k)
    s = np.repeat(np.asarray(q.scales, np.float32), 32, axis=1)
    o = np.repeat(np.asarray(q.offsets, np.float32), 32, axis=1)
    np.testing.assert_allclose(np.asarray(q.dequantize()), s * codes + o, rtol=1e-6, atol=1e-7)
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    assert (err <= s / 2 * 1.05 + 1e-3 * np.abs(o) + 1e-6).all()


def test_q4_0_as_scale_and_offset():
    # GGUF Q4_0: value = d * (q - 8)  ->  scale = d, offset = -8 d.
    g, k, n = 2, 64, 8
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (g, k, n)).astype(np.uint8)
    d = rng.random((g, k // 32, n)).astype(np.float16)
    packed = q[:, : k // 2] | (q[:, k // 2 :] << 4)
    qw = QuantizedWeights(
        values=jnp.asarray(packed), scales=jnp.asarray(d), offsets=jnp.asarray(-8 * d), bits=4, block_size=32
    )
    qw.check()
    want = np.repeat(d.astype(np.float32), 32, axis=1) * (q.astype(np.float32) - 8)
    np.testing.assert_allclose(np.asarray(qw.dequantize()), want, rtol=1e-3, atol=1e-3)


def test_sizes():
    w = random_weights((4, 256, 64))
    q8, q4 = quantize_int8(w), quantize_int4(w)
    assert q8.shape == q4.shape == (4, 256, 64)
    assert q8.bytes_per_param == pytest.approx(1 + 2 / 32)  # int8 + one f16 scale per 32
    assert q4.bytes_per_param == pytest.approx(0.5 + 4 / 32)  # 4 bits + f16 scale and offset per 32
    assert q8.nbytes == 4 * 256 * 64 + 4 * 8 * 64 * 2


def test_pytree_and_jit():
    q = quantize_int4(random_weights())
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.bits == 4 and back.block_size == 32
    out = jax.jit(lambda x: x.dequantize(jnp.bfloat16))(q)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    q8 = quantize_int8(random_weights())
    assert len(jax.tree_util.tree_leaves(q8)) == 2  # offsets=None is an empty subtree


def test_check_rejects_bad_layouts():
    q = quantize_int8(random_weights(), k_major=False)
    with pytest.raises(ValueError, match="k=24 must be a multiple of 32"):  # k-major values read as [g, k, n]
        QuantizedWeights(values=quantize_int8(random_weights()).values, scales=q.scales, bits=8).check()
    with pytest.raises(ValueError, match="scales.shape"):
        QuantizedWeights(values=q.values, scales=q.scales[:, :2], bits=8).check()
    with pytest.raises(ValueError, match="offsets"):
        QuantizedWeights(values=q.values.astype(jnp.uint8)[:, :64], scales=q.scales, bits=4).check()
    with pytest.raises(ValueError, match="bits"):
        QuantizedWeights(values=q.values, scales=q.scales, bits=3).check()
    with pytest.raises(ValueError, match="multiple of 2 \\* block_size=64"):
        quantize_int4(random_weights((1, 96, 8)))


def test_common_format_and_reencode_are_exact():
    """Q4_K-like (4-bit, float32 per 32), Q6_K-like (int8, float32 per 16) and Q8_0 (int8, float16 per 32)
    weights in one format: int8 with float32 scales and offsets per 16, each dequantizing to its own weights
    bit for bit."""
    w = random_weights((2, 64, 8))
    formats = [
        quantize_int4(w, scale_dtype=jnp.float32),
        quantize_int8(w, block_size=16, scale_dtype=jnp.float32),
        quantize_int8(w),
        quantize_int8(w, offsets=True),
    ]
    wide = common_format(formats)
    assert (wide.bits, wide.block_size, wide.scales.dtype, wide.offsets is not None, wide.k_major) == (
        8,
        16,
        jnp.float32,
        True,
        True,
    )
    for q in formats:
        r = reencode(q, wide)
        assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), r) == jax.tree_util.tree_map(
            lambda a: (a.shape, a.dtype), wide
        )
        np.testing.assert_array_equal(
            np.asarray(r.dequantize(jnp.float32)), np.asarray(q.dequantize(jnp.float32))
        )
    four = common_format(formats[:1] * 2)  # one format: itself
    assert (four.bits, four.block_size) == (4, 32) and reencode(formats[0], four).values is formats[0].values
    floats = common_format(
        [formats[0], jnp.zeros((2, 64, 8), jnp.bfloat16)]
    )  # with float weights: the float dtype
    assert floats.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(reencode(formats[0], floats)), np.asarray(formats[0].dequantize(jnp.bfloat16))
    )
    with pytest.raises(ValueError, match="8-bit codes in a 4-bit format; blocks of 16 in blocks of 32"):
        reencode(formats[1], four)
    with pytest.raises(ValueError, match="float weights cannot be re-encoded"):
        reencode(w, wide)
    with pytest.raises(ValueError, match="different shapes"):
        common_format([formats[0], quantize_int4(random_weights((2, 128, 8)))])

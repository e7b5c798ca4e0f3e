"""Layer pieces against direct (slow, obvious) formulations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import assert_finite

import hybridlm
from hybridlm.layers import gated_attention
from hybridlm.layers import moe as moe_lib
from hybridlm.layers.gated_attention import cached_attention
from hybridlm.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetState,
    causal_depthwise_conv,
    conv_history_after,
)
from hybridlm.layers.moe import dispatch, route_top_k, routed_experts
from hybridlm.layers.norms import gated_rms_norm, rms_norm
from hybridlm.layers.rope import apply_partial_rope, rope_cos_sin
from hybridlm.state import KVCache
from pallas_kernels.quantized import quantize_int4, quantize_int8

rng = np.random.default_rng(0)


def test_rms_norms():
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    normed = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), normed * (1 + w), rtol=1e-5)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6, zero_centered=False), normed * w, rtol=1e-5)
    z = rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(gated_rms_norm(x, z, w, 1e-6), w * normed * z / (1 + np.exp(-z)), rtol=1e-5)


def test_partial_rope_rotates_pairs_i_and_i_plus_half():
    head_dim, rotary_dim, theta = 16, 8, 1e7
    x = rng.standard_normal((1, 5, 2, head_dim)).astype(np.float32)
    pos = np.arange(3, 8)
    cos, sin = rope_cos_sin(jnp.asarray(pos), rotary_dim, theta)
    got = np.asarray(apply_partial_rope(jnp.asarray(x), cos, sin))
    want = x.copy()
    for i in range(rotary_dim // 2):
        ang = pos * theta ** (-2 * i / rotary_dim)
        a, b = x[..., i], x[..., i + rotary_dim // 2]
        want[..., i] = a * np.cos(ang)[None, :, None] - b * np.sin(ang)[None, :, None]
        want[..., i + rotary_dim // 2] = b * np.cos(ang)[None, :, None] + a * np.sin(ang)[None, :, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        got[..., rotary_dim:], x[..., rotary_dim:]
    )  # dims past rotary_dim untouched


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 9])
def test_causal_conv_with_history_equals_conv_of_concatenation(seq):
    channels, kernel = 6, 4
    x = rng.standard_normal((2, seq, channels)).astype(np.float32)
    w = rng.standard_normal((kernel, channels)).astype(np.float32)
    history = rng.standard_normal((2, kernel - 1, channels)).astype(np.float32)
    for h in (np.zeros_like(history), history):
        got = causal_depthwise_conv(x, w, h)
        padded = np.concatenate([h, x], 1)
        direct = sum(padded[:, j : j + seq] * w[j] for j in range(kernel))
        np.testing.assert_allclose(got, direct / (1 + np.exp(-direct)), rtol=1e-5, atol=1e-6)
    if seq > 5:  # a chunk boundary: the tail with the head's last inputs as history
        whole = causal_depthwise_conv(x, w, history)
        tail = causal_depthwise_conv(x[:, 5:], w, x[:, 5 - (kernel - 1) : 5])
        np.testing.assert_allclose(tail, whole[:, 5:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 9])
def test_conv_history_after_is_a_window_of_the_concatenation(seq):
    """Every num_valid in 0..seq, static and traced: rows [num_valid, num_valid + 3) of concat(history, x)."""
    rng = np.random.default_rng(seq)
    history = rng.standard_normal((2, 3, 5)).astype(np.float32)
    x = rng.standard_normal((2, seq, 5)).astype(np.float32)
    window = np.concatenate([history, x], axis=1)
    traced = jax.jit(conv_history_after)
    for num_valid in range(seq + 1):
        want = window[:, num_valid : num_valid + 3]
        np.testing.assert_array_equal(np.asarray(conv_history_after(history, x, num_valid)), want)
        np.testing.assert_array_equal(np.asarray(traced(history, x, jnp.int32(num_valid))), want)


def test_routing_softmax_topk_renormalised():
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    w, ids = route_top_k(jnp.asarray(logits), 3)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_ids = np.argsort(-p, -1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    top = np.take_along_axis(p, want_ids, -1)
    np.testing.assert_allclose(np.asarray(w), top / top.sum(-1, keepdims=True), rtol=1e-5)


# sort=False: the copies in (token, slot) order with each row's expert named (decode's path, the default up to
# moe.UNSORTED_MAX_ROWS copies); True: sorted by expert (dispatch), as longer chunks run.
@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("with_padding", [False, True])
def test_routed_experts_match_per_token_loop(with_padding, sort, implementation):
    tokens, hidden, ffn, experts, top_k = 13, 16, 16, 5, 2
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    gate_up = rng.standard_normal((experts, hidden, 2 * ffn)).astype(np.float32)
    down = rng.standard_normal((experts, ffn, hidden)).astype(np.float32)
    w, ids = route_top_k(jnp.asarray(rng.standard_normal((tokens, experts)).astype(np.float32)), top_k)
    valid = np.arange(tokens) < (9 if with_padding else tokens)
    got = np.asarray(
        routed_experts(
            jnp.asarray(x),
            w,
            ids,
            jnp.asarray(gate_up),
            jnp.asarray(down),
            valid=jnp.asarray(valid),
            implementation=implementation,
            sort=sort,
        )
    )
    assert_finite(got)
    want = np.zeros_like(x)
    for t in range(tokens):
        if not valid[t]:
            continue
        for j in range(top_k):
            e = int(ids[t, j])
            h = x[t] @ gate_up[e]
            want[t] += float(w[t, j]) * ((h[:ffn] / (1 + np.exp(-h[:ffn])) * h[ffn:]) @ down[e])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    d = dispatch(ids, experts, jnp.asarray(valid))
    assert int(d.group_sizes.sum()) == valid.sum() * top_k


# A decode step of one token with quantized experts: 8 (token, expert) rows, which the Pallas products run as
# matrix-vector kernels (`pallas_gemv.takes`), against the per-token loop on the dequantized weights.
@pytest.mark.parametrize("implementation", ["reference", "gemv"])
@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
def test_routed_experts_decode_step_quantized(quantize, implementation):
    hidden, ffn, experts, top_k = 64, 64, 12, 8
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    gate_up = quantize(jnp.asarray(rng.standard_normal((experts, hidden, 2 * ffn)).astype(np.float32) / 8))
    down = quantize(jnp.asarray(rng.standard_normal((experts, ffn, hidden)).astype(np.float32) / 8))
    w, ids = route_top_k(jnp.asarray(rng.standard_normal((1, experts)).astype(np.float32)), top_k)
    got = np.asarray(routed_experts(jnp.asarray(x), w, ids, gate_up, down, implementation=implementation))
    assert_finite(got)
    gu, dn = np.asarray(gate_up.dequantize()), np.asarray(down.dequantize())
    want = np.zeros_like(x)
    for j in range(top_k):
        e = int(ids[0, j])
        h = x[0] @ gu[e]
        want[0] += float(w[0, j]) * ((h[:ffn] / (1 + np.exp(-h[:ffn])) * h[ffn:]) @ dn[e])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["argmax", "rank"])
def test_top_k_by_method_is_lax_top_k(method):
    rng = np.random.default_rng(3)
    x = rng.random((64, 256)).astype(np.float32)
    x[0, [3, 9, 200]] = 0.5  # ties: the lower index first, as lax.top_k
    x[1, :] = 0.25  # a row of equal values
    x[2, -8:] = 1.0
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), 8)
    got_v, got_i = getattr(moe_lib, f"top_k_by_{method}")(jnp.asarray(x), 8)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    assert got_i.dtype == jnp.int32


@pytest.mark.parametrize("tokens", [40, 3])
def test_route_top_k_same_every_way(monkeypatch, tokens):
    logits = jax.random.normal(jax.random.key(0), (tokens, 256))
    monkeypatch.setattr(moe_lib, "RANK_TOP_K_MAX_TOKENS", 0)
    want = route_top_k(logits, 8)  # jax.lax.top_k
    for name, value in (("ARGMAX_TOP_K_MIN_TOKENS", 1), ("RANK_TOP_K_MAX_TOKENS", 64)):
        monkeypatch.setattr(moe_lib, name, value)
        got = route_top_k(logits, 8)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seq", [16, 8, 1])
@pytest.mark.parametrize("unrolled", [True, False])
@pytest.mark.parametrize("start", [0, 8, 13, 24, 100])
def test_cached_attention_matches_masked_softmax(start, unrolled, seq, monkeypatch):
    # unrolled: a static block loop whose blocks past `start` are empty (the cuDNN path); else the loop with a
    # traced trip count (the XLA path). seq=16 unrolled: 8 blocks of its length, beyond MAX_UNROLLED_BLOCKS,
    # merged into 4 of 32. seq=8 and 1 (a verify, decode): the whole cache is one block.
    if unrolled:
        monkeypatch.setattr(gated_attention, "MAX_UNROLLED_BLOCKS", 4)
    batch, heads, kv_heads, hd, capacity = 1, 4, 2, 16, 128
    k0 = jax.random.key(start)
    q, k, v = (
        jax.random.normal(jax.random.fold_in(k0, i), (batch, seq, h, hd))
        for i, h in enumerate((heads, kv_heads, kv_heads))
    )
    cache = KVCache(
        *(jax.random.normal(jax.random.fold_in(k0, 9 + i), (batch, capacity, kv_heads, hd)) for i in range(2))
    )
    attend = jax.jit(lambda *a: cached_attention(*a, static_blocks=unrolled))
    got = np.asarray(attend(q, k, v, cache, jnp.int32(start)))
    assert np.isfinite(got).all()
    keys = np.concatenate([np.asarray(cache.key)[:, :start], np.asarray(k)], 1)
    values = np.concatenate([np.asarray(cache.value)[:, :start], np.asarray(v)], 1)
    keys, values = np.repeat(keys, heads // kv_heads, 2), np.repeat(values, heads // kv_heads, 2)
    scores = np.einsum("bthd,bshd->bhts", np.asarray(q), keys) / np.sqrt(hd)
    mask = np.arange(start + seq)[None, :] <= (start + np.arange(seq))[:, None]
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), values)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "seq,implementation,want", [(1, None, "xla"), (1, "cudnn", "cudnn"), (4, None, "xla"), (16, None, None)]
)
def test_cached_attention_decode_implementation(seq, implementation, want, monkeypatch):
    # Decode (one query) and a speculative verify (a few) with no implementation named attend through
    # DECODE_IMPLEMENTATION (XLA: repeatable bit for bit on a GPU, where cuDNN's one-query kernel was not); a
    # named one is kept, and prefill chunks (16 queries or more) keep the default.
    seen = []
    real = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kwargs):
        seen.append(implementation)
        return real(*args, implementation=None if implementation == "cudnn" else implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q, k, v = (jnp.ones((1, seq, h, 16)) for h in (4, 2, 2))
    cache = KVCache(jnp.ones((1, 32, 2, 16)), jnp.ones((1, 32, 2, 16)))
    out = cached_attention(q, k, v, cache, jnp.int32(8), implementation=implementation)
    assert np.isfinite(np.asarray(out)).all() and seen and set(seen) == {want}


def test_gdn_layer_decode_step_pallas_equals_reference():
    """A decode step (seq = 1) of the Gated DeltaNet layer with gdn_implementation="triton" (the fused Pallas
    step, interpreter on the CPU) against the pure-JAX step, from a non-zero state."""
    config = hybridlm.get_config("tiny")
    layer = GatedDeltaNet(config.replace(gdn_implementation="reference"), rngs=nnx.Rngs(0))
    g = config.gdn
    r = np.random.default_rng(5)
    x = jnp.asarray(r.normal(size=(2, 1, config.hidden_dim)), jnp.float32)
    state = GatedDeltaNetState(
        conv=jnp.asarray(r.normal(size=(2, g.conv_kernel - 1, g.conv_dim)), jnp.float32),
        recurrent=jnp.asarray(r.normal(size=(2, g.num_v_heads, g.key_dim, g.value_dim)) * 0.1, jnp.float32),
    )
    want_out, want_state = layer(x, state)
    layer.config = config.replace(gdn_implementation="triton")
    got_out, got_state = layer(x, state)
    assert np.isfinite(np.asarray(got_out)).all()
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(got_state.recurrent), np.asarray(want_state.recurrent), atol=1e-5, rtol=1e-4
    )

"""The MTP module (hybridlm.mtp): draft step vs a plain-JAX re-implementation of docs/mtp.md §2, and its
weights through HF -> load_hf_mtp -> save_gguf -> load_gguf_mtp bit for bit at f32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import hybridlm
from hybridlm.checkpoints.gguf import GGUFError, load_gguf, load_gguf_mtp, save_gguf
from hybridlm.checkpoints.hf import CheckpointError, load_hf, load_hf_mtp
from hybridlm.config import TINY
from hybridlm.layers.rope import apply_partial_rope, rope_cos_sin
from hybridlm.loading import load_mtp
from hybridlm.mtp import MTPModule, draft_step, init_mtp_cache, init_random_mtp
from pallas_kernels.quantized import QuantizedWeights
from tests.support import K256, assert_finite

SRC = Path(__file__).parent / "fixtures" / "hf" / "qwen35moe_text"
CONFIG = TINY.replace(vocab_size=512, num_layers=4, mtp_layers=1)


def _params(module) -> dict[tuple, np.ndarray]:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


# ---------------------------------------------------------------------------------------------------------
# plain-JAX reference of the draft step (docs/mtp.md §2; spec §3, §5, §6)
# ---------------------------------------------------------------------------------------------------------
def _norm(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def _ref_attention(p, x, config, start):
    a, (b, t, _) = config.attention, x.shape
    qg = (x @ p["q_proj"]).reshape(b, t, a.num_heads, 2 * a.head_dim)
    q, gate = qg[..., : a.head_dim], qg[..., a.head_dim :]
    k = (x @ p["k_proj"]).reshape(b, t, a.num_kv_heads, a.head_dim)
    v = (x @ p["v_proj"]).reshape(b, t, a.num_kv_heads, a.head_dim)
    q, k = _norm(q, p["q_norm"], config.rms_norm_eps), _norm(k, p["k_norm"], config.rms_norm_eps)
    cos, sin = rope_cos_sin(start + jnp.arange(t), a.rotary_dim, a.rope_theta)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    rep = a.num_heads // a.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(a.head_dim)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, -1)
    return (out * jax.nn.sigmoid(gate.reshape(b, t, -1))) @ p["o_proj"]


def _ref_moe(p, u, config):
    m = config.moe
    probs = jax.nn.softmax(u @ p["router"], -1)
    weights, ids = jax.lax.top_k(probs, m.top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    dense = jnp.zeros(probs.shape).at[
        jnp.arange(probs.shape[0])[:, None, None], jnp.arange(probs.shape[1])[None, :, None], ids
    ]
    dense = dense.set(weights)  # [b, t, experts], zero off the top-k

    def swiglu(x, gate_up, down):
        h = x @ gate_up
        f = h.shape[-1] // 2
        return (jax.nn.silu(h[..., :f]) * h[..., f:]) @ down

    routed = jnp.einsum(
        "bte,bteh->bth",
        dense,
        jax.vmap(lambda g, d: swiglu(u, g, d), out_axes=2)(p["experts_gate_up"], p["experts_down"]),
    )
    shared = (
        swiglu(u, p["shared_gate_up"], p["shared_down"])
        * jax.nn.sigmoid(u @ p["shared_token_gate"])[..., None]
    )
    return routed + shared


def _reference_draft(mtp_params, embed, head, ids, hidden, config, start=0):
    p = {".".join(map(str, k)): jnp.asarray(v) for k, v in mtp_params.items()}
    eps = config.rms_norm_eps
    e = _norm(embed[ids], p["pre_fc_norm_embedding.scale"], eps)
    g = _norm(hidden, p["pre_fc_norm_hidden.scale"], eps)
    x = jnp.concatenate([e, g], -1) @ p["fc"]
    attn = {k.split(".")[-1]: v for k, v in p.items() if k.startswith("layers.0.mixer.")}
    ffn = {k.split(".")[-1]: v for k, v in p.items() if k.startswith("layers.0.ffn.")}
    h = x + _ref_attention(attn, _norm(x, p["layers.0.input_norm.scale"], eps), config, start)
    y = h + _ref_moe(ffn, _norm(h, p["layers.0.post_norm.scale"], eps), config)
    return y, _norm(y, p["norm.scale"], eps) @ head


def test_draft_step_matches_the_equations():
    model = hybridlm.init_random(CONFIG, seed=1)
    mtp = init_random_mtp(CONFIG, seed=2)
    ids = jax.random.randint(jax.random.key(3), (2, 5), 0, CONFIG.vocab_size)
    hidden = jax.random.normal(jax.random.key(4), (2, 5, CONFIG.hidden_dim))
    y, logits, cache = draft_step(mtp, model, ids, hidden)
    assert cache is None and y.shape == hidden.shape and logits.shape == (2, 5, CONFIG.vocab_size)
    assert_finite(logits, "draft logits")
    ref_y, ref_logits = _reference_draft(
        _params(mtp), model.embed[...], model.head_weight(), ids, hidden, CONFIG
    )
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=2e-5, atol=2e-5)


def test_cached_draft_steps_equal_one_chunk():
    """Steps one position at a time through the MTP KV cache give the chunk's hidden states and logits."""
    model = hybridlm.init_random(CONFIG, seed=1)
    mtp = init_random_mtp(CONFIG, seed=2)
    ids = jax.random.randint(jax.random.key(5), (1, 4), 0, CONFIG.vocab_size)
    hidden = jax.random.normal(jax.random.key(6), (1, 4, CONFIG.hidden_dim))
    y, logits, _ = draft_step(mtp, model, ids, hidden)
    cache = init_mtp_cache(CONFIG, 1, 8)[0]
    for i in range(4):
        y_i, logits_i, cache = draft_step(mtp, model, ids[:, i : i + 1], hidden[:, i : i + 1], cache, i)
        assert_finite(logits_i, "cached draft logits")
        np.testing.assert_allclose(np.asarray(y_i[:, 0]), np.asarray(y[:, i]), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(logits_i[:, 0]), np.asarray(logits[:, i]), rtol=2e-5, atol=2e-5)


def test_mtp_needs_layers():
    with pytest.raises(ValueError, match="mtp_layers"):
        MTPModule(CONFIG.replace(mtp_layers=0), rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------------------------
# loading: HF mtp.* -> MTPModule -> GGUF nextn blocks -> MTPModule
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_with_mtp(tmp_path_factory):
    """The qwen35moe_text fixture plus random `mtp.*` tensors (a full-attention layer's shapes)."""
    directory = tmp_path_factory.mktemp("hf_mtp")
    for f in SRC.iterdir():
        if f.name != "expected.npz" and f.is_file():
            shutil.copy(f, directory / f.name)
    config = json.loads((SRC / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(SRC / "model.safetensors")
    trunk = hybridlm.ModelConfig.from_hf(SRC)
    full = f"model.layers.{trunk.layer_types.index('full_attention')}."
    rng = np.random.default_rng(0)
    hidden = trunk.hidden_dim
    for name, value in list(tensors.items()):
        if name.startswith(full):
            noise = rng.standard_normal(value.shape).astype(np.float32) * 0.1
            tensors["mtp.layers.0." + name[len(full) :]] = value + noise
    fc = rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)
    tensors["mtp.fc.weight"] = fc.astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = rng.standard_normal(hidden).astype(np.float32) * 0.1
    save_file(tensors, directory / "model.safetensors")
    return directory, tensors


def test_hf_mtp_weights_load_and_draft(hf_with_mtp):
    directory, tensors = hf_with_mtp
    model = load_hf(directory, progress=False)  # the trunk load still skips mtp.*
    mtp = load_mtp(directory)
    assert model.config.mtp_layers == 1 and mtp.config == model.config
    np.testing.assert_array_equal(np.asarray(mtp.fc[...]), tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(mtp.norm.scale[...]), tensors["mtp.norm.weight"])
    np.testing.assert_array_equal(
        np.asarray(mtp.layers[0].mixer.q_proj[...]), tensors["mtp.layers.0.self_attn.q_proj.weight"].T
    )
    ids = jnp.array([[1, 5, 9]], jnp.int32)
    hidden = jax.random.normal(jax.random.key(0), (1, 3, model.config.hidden_dim))
    _, logits, _ = draft_step(mtp, model, ids, hidden)
    assert logits.shape == (1, 3, model.config.vocab_size)
    assert_finite(logits, "draft logits")


def test_mtp_weights_round_trip_through_gguf(hf_with_mtp, tmp_path):
    directory, _ = hf_with_mtp
    model, mtp = load_hf(directory, progress=False), load_hf_mtp(directory)
    path = tmp_path / "with_mtp.gguf"
    save_gguf(model, path, "f32", mtp=mtp)
    back = load_mtp(path)
    assert back.config.layer_types == mtp.config.layer_types and back.config.mtp_layers == 1
    want, got = _params(mtp), _params(back)
    assert want.keys() == got.keys()
    for key in want:
        # zero-centred norms travel as 1 + w (GGUF's convention): 1 + w is what the model multiplies by,
        # and it comes back bit for bit (fl(1 + w) - 1 is exact for |w| <= 1/2, Sterbenz)
        one = np.float32(1.0) if key[-1] in ("scale", "q_norm", "k_norm") else np.float32(0.0)
        np.testing.assert_array_equal(got[key] + one, want[key] + one, err_msg=".".join(map(str, key)))
    trunk = load_gguf(path, progress=False)  # the trunk loads as before, the MTP block skipped
    assert trunk.config.num_layers == model.config.num_layers and trunk.config.mtp_layers == 1
    np.testing.assert_array_equal(np.asarray(trunk.embed[...]), np.asarray(model.embed[...]))


def test_missing_mtp_weights_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no MTP weights"):
        load_hf_mtp(SRC)
    path = tmp_path / "plain.gguf"
    save_gguf(hybridlm.init_random(CONFIG.replace(mtp_layers=0), seed=0), path, "f32")
    with pytest.raises(GGUFError, match="no MTP block"):
        load_gguf_mtp(path)


def test_two_mtp_layers_round_trip_through_gguf(tmp_path):
    """Each MTP block holds its layer and a copy of eh_proj and the nextn norms (llama.cpp's converter)."""
    config = CONFIG.replace(mtp_layers=2)
    mtp = init_random_mtp(config, seed=3)
    path = tmp_path / "two.gguf"
    save_gguf(hybridlm.init_random(config, seed=0), path, "f32", mtp=mtp)
    back = load_gguf_mtp(path)
    assert back.config.mtp_layers == 2 and back.config.num_layers == config.num_layers
    want, got = _params(mtp), _params(back)
    for key in want:
        one = np.float32(1.0) if key[-1] in ("scale", "q_norm", "k_norm") else np.float32(0.0)
        np.testing.assert_array_equal(got[key] + one, want[key] + one, err_msg=".".join(map(str, key)))


@pytest.mark.parametrize(
    "tensor_type, bits, keep", [("q4_k", 4, "experts"), ("q8_0", 8, "experts"), ("q8_0", 8, "all")]
)
def test_kept_quantized_mtp_experts_draft_as_dequantized(tmp_path, tensor_type, bits, keep):
    """keep_quantized="experts" keeps the MTP layer's routed experts as the file's exact QuantizedWeights
    (Q4_K: the raw-block path; Q8_0: the repacking path), "all" its projections too, and a draft step gives
    the dequantized load's output. K256: rows of 256, so Q4_K does not fall back."""
    config = K256.replace(mtp_layers=1)
    model = hybridlm.init_random(config, seed=4)
    path = tmp_path / f"mtp-{tensor_type}.gguf"
    save_gguf(model, path, tensor_type, mtp=init_random_mtp(config, seed=5))
    dense = load_mtp(path, dtype=jnp.float32)
    kept = load_mtp(path, dtype=jnp.float32, keep_quantized=keep)
    attention = kept.layers[0].mixer
    projections = [kept.fc, attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    assert all(isinstance(p.get_value(), QuantizedWeights) == (keep == "all") for p in projections)
    for name in ("experts_gate_up", "experts_down"):
        qw = getattr(kept.layers[0].ffn, name).get_value()
        dense_w = getattr(dense.layers[0].ffn, name).get_value()
        assert isinstance(qw, QuantizedWeights) and qw.bits == bits and qw.shape == dense_w.shape
        assert not isinstance(dense_w, QuantizedWeights)
        np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32)), np.asarray(dense_w))
    trunk = load_gguf(path, dtype=jnp.float32, progress=False)
    ids = jax.random.randint(jax.random.key(7), (2, 6), 0, config.vocab_size)
    hidden = jax.random.normal(jax.random.key(8), (2, 6, config.hidden_dim))
    y_dense, logits_dense, _ = draft_step(dense, trunk, ids, hidden)
    y_kept, logits_kept, _ = draft_step(kept, trunk, ids, hidden)
    assert_finite(logits_kept, "kept draft logits")
    # same weights, only the summation order may differ
    np.testing.assert_allclose(np.asarray(y_kept), np.asarray(y_dense), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits_kept), np.asarray(logits_dense), rtol=1e-4, atol=1e-4)


def test_keep_quantized_is_checked(hf_with_mtp, tmp_path):
    directory, _ = hf_with_mtp
    with pytest.raises(ValueError, match="GGUF files only"):
        load_mtp(directory, keep_quantized="experts")
    path = tmp_path / "m.gguf"
    save_gguf(hybridlm.init_random(CONFIG, seed=0), path, "f32", mtp=init_random_mtp(CONFIG, seed=1))
    with pytest.raises(ValueError, match="keep_quantized='everything'"):
        load_gguf_mtp(path, keep_quantized="everything")

"""The DFlash draft model (hybridlm.dflash): YaRN against HF transformers, the cached forward against z-lab's
reference model and against the plain-JAX oracle, the config reader, and HF / GGUF loading round trips.

Fixtures: tests/fixtures/hf/yarn.npz and tests/fixtures/hf/dflash_tiny, written by
tests/fixtures/make_dflash_fixtures.py (HF transformers 5.23.0 and z-lab's dflash/model.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from hybridlm.checkpoints.gguf_dflash import dflash_config_from_gguf, load_gguf_dflash, save_dflash_gguf
from hybridlm.checkpoints.gguf_header import GGUFError, read_header
from hybridlm.checkpoints.hf import CheckpointError
from hybridlm.config import TINY
from hybridlm.dflash import (
    DFlashConfig,
    DFlashDraft,
    block_input_ids,
    build_target_layer_ids,
    dflash_reference,
    init_dflash_cache,
    init_random_dflash,
)
from hybridlm.layers.rope import YarnScaling, rope_cos_sin
from hybridlm.loading import dflash_config, load_dflash
from tests.support import FIXTURES, assert_finite

HF = FIXTURES / "hf"
TINY_DRAFT = HF / "dflash_tiny"
TARGET = TINY.replace(vocab_size=512, num_layers=8)  # a target for the random drafts
# (atol, rtol) of float32 comparisons: the cached forward against the oracle and against HF's torch run
# (different summation orders over O(1) activations and |logits| < 4)
ATOL, RTOL = 2e-5, 2e-5

# z-lab/Qwen3.5-35B-A3B-DFlash and the April revision of z-lab/Qwen3.6-35B-A3B-DFlash (transformers 4.x keys)
ZLAB_35B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "type": "yarn",
    },
    "block_size": 16,
    "num_target_layers": 40,
    "layer_types": ["full_attention"] * 8,
    "use_sliding_window": False,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]},
}


def _params(module) -> dict[tuple, np.ndarray]:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@nnx.jit
def _context(draft, features, cache, start, num_new):
    return draft.context(features, cache, start, num_new)


@nnx.jit
def _draft(draft, block_embeddings, cache, start, head_weight):
    return draft.draft(block_embeddings, cache, start, head_weight)


_reference = nnx.jit(dflash_reference)


def _pad(rows: np.ndarray, width: int) -> jax.Array:
    """rows [batch, n, feature] zero-padded to [batch, width, feature]: one compiled context program."""
    out = np.zeros((rows.shape[0], width, rows.shape[2]), np.float32)
    out[:, : rows.shape[1]] = rows
    return jnp.asarray(out)


# ---------------------------------------------------------------------------------------------------------
# YaRN
# ---------------------------------------------------------------------------------------------------------
YARN = np.load(HF / "yarn.npz")
YARN_VARIANTS = sorted({k.split(".")[0] for k in YARN.files})


@pytest.mark.parametrize("name", YARN_VARIANTS)
def test_yarn_matches_hf(name):
    """Frequencies bit for bit and the attention factor exactly (HF `_compute_yarn_parameters`); cos / sin of
    positions up to 200 000 within float32 rounding of the cosine (HF `Qwen3RotaryEmbedding.forward`)."""
    cfg = json.loads(str(YARN[f"{name}.config"]))
    params = cfg["rope_parameters"]
    rotary_dim = int(cfg["head_dim"] * params.get("partial_rotary_factor", 1.0))
    scaling = YarnScaling.from_hf(params, max_position_embeddings=cfg["max_position_embeddings"])
    np.testing.assert_array_equal(
        scaling.inv_freq(rotary_dim, params["rope_theta"]), YARN[f"{name}.inv_freq"]
    )
    assert scaling.cos_sin_scale() == float(YARN[f"{name}.attention_factor"])
    cos, sin = rope_cos_sin(jnp.asarray(YARN[f"{name}.positions"]), rotary_dim, params["rope_theta"], scaling)
    assert_finite(cos, "cos")
    half = rotary_dim // 2
    for got, want in ((cos, YARN[f"{name}.cos"]), (sin, YARN[f"{name}.sin"])):
        np.testing.assert_array_equal(want[:, half:], want[:, :half])  # HF repeats the halves
        np.testing.assert_allclose(np.asarray(got), want[:, :half], atol=3e-7, rtol=0)


def test_yarn_defaults_follow_hf():
    s = YarnScaling.from_hf({"factor": None, "beta_fast": 0}, max_position_embeddings=8192)
    assert (s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow) == (1.0, 8192, 32.0, 1.0)
    assert s.cos_sin_scale() == 1.0  # factor 1: no attention scaling
    top = YarnScaling.from_hf(
        {"factor": 4.0, "original_max_position_embeddings": 2048},
        max_position_embeddings=8192,
        original_max_position_embeddings=1024,  # a top-level key wins, as HF's standardize_rope_params has it
    )
    assert top.original_max_position_embeddings == 1024
    assert YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0).cos_sin_scale() == (
        0.1 * np.log(4.0) + 1.0
    )  # mscale without mscale_all_dim is ignored (HF)
    with pytest.raises(ValueError, match="factor"):
        YarnScaling.from_hf({"beta_fast": 32}, max_position_embeddings=8192)


# ---------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------
def test_target_layer_ids_as_the_reference_builds_them():
    assert build_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)  # the published 35B-A3B drafts' ids
    assert build_target_layer_ids(8, 2) == (1, 5)
    assert build_target_layer_ids(40, 1) == (20,)
    with pytest.raises(ValueError, match="num_target_layers >= 4"):
        build_target_layer_ids(3, 2)


def test_config_of_the_published_draft():
    c = DFlashConfig.from_hf(ZLAB_35B)
    assert (c.hidden_dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim) == (
        2048,
        8,
        32,
        4,
        128,
        6144,
    )
    assert c.target_layer_ids == (1, 10, 19, 28, 37) and c.feature_dim == 5 * 2048
    assert (c.mask_token_id, c.block_size, c.num_target_layers, c.rope_theta) == (248070, 16, 40, 1e7)
    assert c.rope_scaling == YarnScaling(factor=64.0, original_max_position_embeddings=4096)
    c.check_target(TINY.replace(name="qwen3.6-35b-a3b", hidden_dim=2048, num_layers=40))
    # transformers 5 layout (rope_parameters, block_size inside dflash_config), default target layers
    data = {k: v for k, v in ZLAB_35B.items() if k not in ("rope_theta", "rope_scaling", "block_size")}
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7}
    data["dflash_config"] = {"mask_token_id": 7, "block_size": 8}
    c5 = DFlashConfig.from_hf(data)
    assert (
        c5.rope_scaling is None
        and c5.block_size == 8
        and c5.target_layer_ids == build_target_layer_ids(40, 8)
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"head_dim": None}, "lacks required key"),
        ({"layer_types": ["sliding_attention"] + ["full_attention"] * 7}, "sliding-window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "selector_rank": 256}},
            "selector_rank",
        ),
        ({"dflash_config": {"target_layer_ids": [1, 10]}}, "mask_token_id"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type"),
        (
            {"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 40]}},
            "reach past num_target_layers",
        ),
        ({"dflash_config": {"mask_token_id": 248320, "target_layer_ids": [1]}}, "outside the vocabulary"),
    ],
    ids=["missing", "sliding", "bias", "act", "variant", "no-mask", "rope", "ids", "mask-range"],
)
def test_config_refusals_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_hf({**ZLAB_35B, **change})


def test_a_draft_for_another_target_is_refused_in_one_message():
    c = DFlashConfig.tiny_for(TARGET)
    other = TARGET.replace(name="other", hidden_dim=32, vocab_size=256, num_layers=4)
    with pytest.raises(ValueError) as info:
        c.check_target(other)
    message = str(info.value)
    for part in (
        "hidden size 64 != the target's 32",
        "vocab_size 512",
        "target_layer_ids [5]",
        "num_target_layers 8",
    ):
        assert part in message


# ---------------------------------------------------------------------------------------------------------
# the forward: z-lab's reference (HF fixture), and the oracle
# ---------------------------------------------------------------------------------------------------------
def test_cached_drafts_match_the_zlab_reference():
    """Four drafts with the KV cache, as `dflash_generate` runs them (new context rows 7, 3, 1, 6), give
    z-lab's hidden states and logits; the no-cache oracle over the whole context does too."""
    draft = load_dflash(TINY_DRAFT)
    expected = np.load(TINY_DRAFT / "expected.npz")
    embed, head = jnp.asarray(expected["embed"]), jnp.asarray(expected["lm_head"]).T
    batch = expected["features_0"].shape[0]
    cache = init_dflash_cache(draft.config, batch, 32)
    seen = []
    for i, (start, rows) in enumerate(expected["iterations"]):
        features = expected[f"features_{i}"]
        seen.append(features)
        cache = _context(draft, _pad(features, 8), cache, jnp.int32(start), jnp.int32(rows))
        block = embed[expected[f"block_ids_{i}"]]
        hidden, logits = _draft(draft, block, cache, jnp.int32(start + rows), head)
        assert_finite(logits, f"draft {i} logits")
        np.testing.assert_allclose(np.asarray(hidden), expected[f"hidden_{i}"], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(logits), expected[f"logits_{i}"], atol=ATOL, rtol=RTOL)
        _, ref_logits = _reference(draft, np.concatenate(seen, 1), block, head)
        np.testing.assert_allclose(np.asarray(ref_logits), expected[f"logits_{i}"], atol=ATOL, rtol=RTOL)


def test_cached_drafts_equal_the_oracle():
    """Appending context rows (padded to one static width) and drafting, again and again, equals the oracle
    on the whole context each time; a draft reads no context row past `start`."""
    config = DFlashConfig.tiny_for(TARGET)
    draft = init_random_dflash(config, seed=3)
    rng = np.random.default_rng(4)
    features = rng.standard_normal((2, 40, config.feature_dim)).astype(np.float32)
    embed = jnp.asarray(rng.standard_normal((TARGET.vocab_size, TARGET.hidden_dim)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((TARGET.hidden_dim, TARGET.vocab_size)) / 8, jnp.float32)
    cache = init_dflash_cache(config, 2, 64)
    start = 0
    for rows in (13, 1, config.block_size):  # a prompt, a rejected block, an accepted one
        cache = _context(
            draft, _pad(features[:, start : start + rows], 16), cache, jnp.int32(start), jnp.int32(rows)
        )
        start += rows
        block = embed[block_input_ids(jnp.asarray(rng.integers(0, 500, 2)), config)]
        hidden, logits = _draft(draft, block, cache, jnp.int32(start), head)
        assert_finite(logits, "draft logits")
        ref_hidden, ref_logits = _reference(draft, features[:, :start], block, head)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=ATOL, rtol=RTOL)
    assert np.all(np.asarray(cache[0].key)[:, start:] == 0)  # padding rows were never written


def test_context_refuses_what_does_not_fit():
    config = DFlashConfig.tiny_for(TARGET)
    draft = init_random_dflash(config, seed=0)
    cache = init_dflash_cache(config, 1, 8)
    with pytest.raises(ValueError, match="capacity 8"):
        draft.context(jnp.zeros((1, 4, config.feature_dim)), cache, 6, 4)
    with pytest.raises(ValueError, match="features must be"):
        draft.context(jnp.zeros((1, 4, config.hidden_dim)), cache, 0, 4)


# ---------------------------------------------------------------------------------------------------------
# loading: HF directory and GGUF
# ---------------------------------------------------------------------------------------------------------
def _hf_tensors(draft: DFlashDraft, prefix: str = "") -> dict[str, np.ndarray]:
    """The draft's weights under the published z-lab names (torch [out, in] layout), written out by hand."""
    p = {".".join(map(str, k)): v for k, v in _params(draft).items()}
    out = {
        "fc.weight": p["fc"].T,
        "hidden_norm.weight": p["hidden_norm.scale"],
        "norm.weight": p["norm.scale"],
    }
    for i in range(draft.config.num_layers):
        ours, hf = f"layers.{i}.", f"layers.{i}."
        ffn = draft.config.ffn_dim
        out |= {
            hf + "input_layernorm.weight": p[ours + "input_norm.scale"],
            hf + "post_attention_layernorm.weight": p[ours + "post_norm.scale"],
            hf + "self_attn.q_norm.weight": p[ours + "q_norm"],
            hf + "self_attn.k_norm.weight": p[ours + "k_norm"],
            hf + "mlp.gate_proj.weight": p[ours + "gate_up"][:, :ffn].T,
            hf + "mlp.up_proj.weight": p[ours + "gate_up"][:, ffn:].T,
            hf + "mlp.down_proj.weight": p[ours + "down"].T,
        }
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{hf}self_attn.{proj}.weight"] = p[ours + proj].T
    return {prefix + k: np.ascontiguousarray(v) for k, v in out.items()}


def _hf_config(c: DFlashConfig) -> dict:
    """A z-lab config.json (transformers 4.x keys, as the published April drafts) for `c`."""
    return {
        **ZLAB_35B,
        "hidden_size": c.hidden_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.ffn_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": c.rope_scaling.factor,
            "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings,
        },
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "layer_types": ["full_attention"] * c.num_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "_name_or_path": c.name,
    }


@pytest.fixture(scope="module")
def random_draft():
    return init_random_dflash(DFlashConfig.tiny_for(TARGET), seed=5)


@pytest.mark.parametrize("prefix", ["", "model."])
def test_hf_round_trip(tmp_path, random_draft, prefix):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(random_draft.config)))
    save_file(_hf_tensors(random_draft, prefix), tmp_path / "model.safetensors")
    back = load_dflash(tmp_path, TARGET)
    assert back.config == random_draft.config
    want, got = _params(random_draft), _params(back)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=".".join(map(str, key)))


def test_hf_checkpoint_faults_are_named(tmp_path, random_draft):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(random_draft.config)))
    tensors = _hf_tensors(random_draft)
    save_file({**tensors, "extra.weight": np.zeros(3, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_dflash(tmp_path)
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_dflash(tmp_path)
    with pytest.raises(ValueError, match="does not fit target"):  # refused from config.json alone
        load_dflash(tmp_path, TARGET.replace(hidden_dim=32))


def test_gguf_round_trip(tmp_path, random_draft):
    """F32: every weight and the config come back exactly; the keys and array types are those Lucebox's
    loader reads."""
    path = tmp_path / "draft.gguf"
    save_dflash_gguf(random_draft, path)
    header = read_header(path)
    arch = "qwen35-dflash-draft"
    assert header.metadata["general.architecture"][1] == arch
    ids_type, ids = header.metadata[f"{arch}.dflash.target_layer_ids"][1]
    assert ids_type.name == "INT32" and ids == list(random_draft.config.target_layer_ids)
    assert header.metadata[f"{arch}.dflash.n_target_layers"][1] == len(ids)
    assert {
        "dflash.fc.weight",
        "dflash.hidden_norm.weight",
        "output_norm.weight",
        "blk.1.ffn_norm.weight",
    } <= set(header.tensors)
    back = load_dflash(path, TARGET)
    assert back.config == random_draft.config
    want, got = _params(random_draft), _params(back)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=".".join(map(str, key)))


def test_gguf_q8_0_and_mscale(tmp_path, random_draft):
    """Q8_0 matrices (norms stay F32) dequantize close to the weights; a resolved mscale attention factor
    travels as llama.cpp's attn_factor multiplier."""
    scaling = YarnScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707)
    draft = init_random_dflash(random_draft.config.replace(rope_scaling=scaling), seed=1)
    path = tmp_path / "q8.gguf"
    save_dflash_gguf(draft, path, "q8_0")
    config = dflash_config_from_gguf(read_header(path))
    assert config.rope_scaling.cos_sin_scale() == pytest.approx(scaling.cos_sin_scale(), rel=1e-7)
    back = load_gguf_dflash(path, dtype=jnp.float32)  # None would pick bfloat16 for a quantized file
    want, got = _params(draft), _params(back)
    np.testing.assert_array_equal(got[("norm", "scale")], want[("norm", "scale")])
    for key in want:
        assert_finite(got[key], ".".join(map(str, key)))
        np.testing.assert_allclose(got[key], want[key], atol=0.02 * np.abs(want[key]).max(), rtol=0)


def test_gguf_without_target_layers_is_refused(tmp_path, random_draft):
    import gguf

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35-dflash-draft")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="target_layer_ids is missing"):
        dflash_config(path)


def test_fixture_directory_is_an_hf_checkpoint(tmp_path):
    """The z-lab fixture's config.json (transformers 5 keys) reads as the draft it is; a copy with a
    sliding-window layer is refused before any tensor is read."""
    c = dflash_config(TINY_DRAFT)
    assert c.target_layer_ids == (1, 5) and c.block_size == 6 and c.rope_scaling.factor == 8.0
    shutil.copytree(TINY_DRAFT, tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    data["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="sliding-window"):
        load_dflash(Path(tmp_path / "d"))

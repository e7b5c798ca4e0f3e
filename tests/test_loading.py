"""HF checkpoint loading: layouts and clear errors for broken checkpoints."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support import FIXTURES

import hybridlm
from hybridlm.checkpoints.hf import CheckpointError

SRC = FIXTURES / "hf" / "qwen35moe_text"


@pytest.fixture
def checkpoint(tmp_path):
    """A writable copy of the text-only fixture: (directory, tensors)."""
    shutil.copy(SRC / "config.json", tmp_path / "config.json")
    return tmp_path, load_file(SRC / "model.safetensors")


def test_text_and_full_layouts_load_the_same_weights(hf_models):
    text, _ = hf_models["qwen35moe_text"]
    full, _ = hf_models["qwen35moe_full"]
    assert text.embed[...].shape == full.embed[...].shape == (384, 64)


def test_fused_expert_layout_loads_like_per_expert(checkpoint, hf_models):
    """transformers 5 keeps experts fused in memory ([E, 2F, H] / [E, H, F]); checkpoints may store either."""
    directory, tensors = checkpoint
    for i in range(8):
        p = f"model.layers.{i}.mlp.experts."
        gate = np.stack([tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(8)])
        up = np.stack([tensors.pop(f"{p}{e}.up_proj.weight") for e in range(8)])
        tensors[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(tensors, directory / "model.safetensors")
    fused = hybridlm.load(directory, dtype=jnp.float32)
    reference, expected = hf_models["qwen35moe_text"]
    ids = jnp.asarray(expected["input_ids"][:1, :8])
    np.testing.assert_array_equal(np.asarray(fused(ids)), np.asarray(reference(ids)))


def test_missing_tensor_is_named(checkpoint):
    directory, tensors = checkpoint
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.linear_attn\.A_log"):
        hybridlm.load(directory)


def test_misshaped_tensor_is_named(checkpoint):
    directory, tensors = checkpoint
    tensors["model.layers.3.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*expected \(64, 64\)"):
        hybridlm.load(directory)


def test_unexpected_tensor_is_named(checkpoint):
    directory, tensors = checkpoint
    tensors["model.layers.0.mlp.bias"] = np.zeros((4,), np.float32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.bias"):
        hybridlm.load(directory)


def test_unknown_model_type_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        hybridlm.load(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'"):
        hybridlm.load(tmp_path)
    shutil.copy(SRC / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        hybridlm.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        hybridlm.load(tmp_path)


def test_bf16_checkpoint_loads_as_bf16(checkpoint):
    import ml_dtypes

    directory, tensors = checkpoint
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, directory / "model.safetensors")
    model = hybridlm.load(directory)
    assert model.embed[...].dtype == jnp.bfloat16
    assert model.layers[0].mixer.log_decay_rate[...].dtype == jnp.float32

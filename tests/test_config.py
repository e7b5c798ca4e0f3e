"""ModelConfig presets, validation and HF config.json parsing."""

import json

import pytest
from support import FIXTURES

import hybridlm
from hybridlm.config import AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig, config_from_hf


def test_presets_have_published_dimensions():
    q35 = hybridlm.get_config("qwen3.5-35b-a3b")
    assert (q35.vocab_size, q35.hidden_dim, q35.num_layers) == (248_320, 2048, 40)
    assert q35.layer_types.count("full_attention") == 10 and q35.layer_types[3] == "full_attention"
    assert (q35.moe.num_experts, q35.moe.top_k, q35.moe.expert_ffn_dim, q35.moe.shared_ffn_dim) == (
        256,
        8,
        512,
        512,
    )
    assert (q35.gdn.num_k_heads, q35.gdn.num_v_heads, q35.gdn.conv_dim) == (16, 32, 8192)
    assert (q35.attention.num_heads, q35.attention.num_kv_heads, q35.attention.rotary_dim) == (16, 2, 64)
    assert hybridlm.get_config("qwen3.6-35b-a3b").replace(name="x") == q35.replace(name="x")
    nxt = hybridlm.get_config("qwen3-next-80b-a3b")
    assert (nxt.vocab_size, nxt.num_layers, nxt.moe.num_experts, nxt.moe.top_k) == (151_936, 48, 512, 10)
    # ~35 B parameters of which ~32 B in experts (anchors.md)
    assert 34e9 < q35.num_params() < 36.5e9
    assert abs(q35.num_params(experts_only=True) - 32.2e9) < 0.1e9
    tiny = hybridlm.get_config("tiny")
    assert tiny.vocab_size == 248_320 and tiny.layer_types == q35.layer_types[:8]


def test_unknown_preset_lists_known_ones():
    with pytest.raises(KeyError, match="qwen3.5-35b-a3b"):
        hybridlm.get_config("qwen4")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GatedDeltaNetConfig(num_k_heads=3, num_v_heads=32), "not a multiple of key heads"),
        (lambda: AttentionConfig(num_heads=16, num_kv_heads=3), "not a multiple of num_kv_heads"),
        (lambda: AttentionConfig(head_dim=256, mrope_sections=(11, 11, 11)), "must sum to"),
        (lambda: MoEConfig(num_experts=4, top_k=8), "exceeds num_experts"),
        (lambda: ModelConfig(vocab_size=10, hidden_dim=8, num_layers=0), "num_layers"),
        (lambda: ModelConfig(vocab_size=10, hidden_dim=8, num_layers=2, dense_ffn_dim=16), "exactly one of"),
        (
            lambda: ModelConfig(
                vocab_size=10, hidden_dim=8, num_layers=2, explicit_layer_types=("mamba", "x")
            ),
            "unknown layer types",
        ),
    ],
)
def test_validation_errors_name_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "name, model_type",
    [("qwen35moe_text", "qwen3_5_moe_text"), ("qwen35moe_full", "qwen3_5_moe"), ("qwen3next", "qwen3_next")],
)
def test_from_hf_reads_fixture_configs(name, model_type):
    cfg = ModelConfig.from_hf(FIXTURES / "hf" / name)
    assert json.loads((FIXTURES / "hf" / name / "config.json").read_text())["model_type"] == model_type
    assert (cfg.hidden_dim, cfg.num_layers, cfg.vocab_size) == (64, 8, 384)
    assert cfg.attention.rope_theta == 1e7 and cfg.attention.rotary_dim == 8
    assert cfg.gdn.num_v_heads == 4 and cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    assert cfg.layer_types[3] == cfg.layer_types[7] == "full_attention"


def test_from_hf_rejects_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_hf(tmp_path / "missing")


def test_from_hf_names_missing_key():
    data = json.loads((FIXTURES / "hf" / "qwen3next" / "config.json").read_text())
    del data["linear_num_value_heads"]
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        config_from_hf(data)

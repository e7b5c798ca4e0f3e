"""Model configuration: nested frozen dataclasses, the named presets, and reading HF `config.json`.

Dimension names used throughout hybridlm (docs/conventions.md): batch, seq, tokens (= batch*seq flattened),
hidden, k_heads, v_heads, key_dim, value_dim, chunk_size, experts, top_k, ffn.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Literal

LayerType = Literal["linear_attention", "full_attention"]
LAYER_TYPES: tuple[str, ...] = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Gated full-attention layer (GQA, q/k RMSNorm, partial RoPE, sigmoid output gate; spec §5)."""

    num_heads: int = 16  # query heads
    num_kv_heads: int = 2  # key/value heads; query head h reads kv head h // (num_heads // num_kv_heads)
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25  # RoPE on the first head_dim * factor dims of each head
    # Interleaved M-RoPE sections (Qwen3.5); for text-only input it equals 1-D RoPE. None: plain RoPE.
    mrope_sections: tuple[int, ...] | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"attention sizes must be positive: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary dim head_dim*partial_rotary_factor={self.rotary_dim} must be even and in "
                f"(0, head_dim={self.head_dim}]"
            )
        if self.mrope_sections is not None and sum(self.mrope_sections) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_sections={self.mrope_sections} must sum to rotary_dim/2={self.rotary_dim // 2}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet (linear-attention) layer (spec §4)."""

    num_k_heads: int = 16  # q/k heads; v-head h reads k-head h // (num_v_heads // num_k_heads)
    num_v_heads: int = 32
    key_dim: int = 128  # per head
    value_dim: int = 128  # per head
    conv_kernel: int = 4  # causal depthwise conv width, in tokens

    @property
    def conv_dim(self) -> int:
        """Channels of the convolved [q | k | v] projection."""
        return 2 * self.num_k_heads * self.key_dim + self.num_v_heads * self.value_dim

    def __post_init__(self):
        if min(self.num_k_heads, self.num_v_heads, self.key_dim, self.value_dim, self.conv_kernel) <= 0:
            raise ValueError(f"Gated DeltaNet sizes must be positive: {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"value heads num_v_heads={self.num_v_heads} is not a multiple of key heads "
                f"num_k_heads={self.num_k_heads}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sparse MoE: softmax top-k routing, SwiGLU experts, one sigmoid-gated shared expert (spec §6)."""

    num_experts: int = 256
    top_k: int = 8
    expert_ffn_dim: int = 512
    shared_ffn_dim: int = 512
    normalize_top_k: bool = True  # renormalise the top-k probabilities to sum to 1

    def __post_init__(self):
        if min(self.num_experts, self.top_k, self.expert_ffn_dim) <= 0 or self.shared_ffn_dim < 0:
            raise ValueError(f"MoE sizes must be positive: {self}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid model.

    Every `full_attention_interval`-th layer is gated full attention, the others Gated DeltaNet; every layer
    ends in the sparse MoE (`moe`) or, for dense variants, a SwiGLU MLP of width `dense_ffn_dim`.
    """

    name: str = "custom"
    vocab_size: int
    hidden_dim: int
    num_layers: int
    full_attention_interval: int = 4
    explicit_layer_types: tuple[str, ...] | None = None  # overrides the interval pattern when set
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    attention: AttentionConfig = AttentionConfig()
    gdn: GatedDeltaNetConfig = GatedDeltaNetConfig()
    moe: MoEConfig | None = MoEConfig()
    dense_ffn_dim: int | None = None  # dense SwiGLU MLP instead of MoE (GGUF arch qwen35)
    # Multi-token-prediction layers the checkpoint carries (`hybridlm.mtp`); 0: none. HybridLM ignores it.
    mtp_layers: int = 0
    # Kernel choice per op: None picks the fast kernel on GPU and the pure-JAX path elsewhere.
    # "reference" | "chunked" | "triton" | "mosaic"; decode: "triton", "mosaic" and None (on GPU, few
    # sequences) take the fused Triton step, the rest the JAX one
    gdn_implementation: str | None = None
    moe_implementation: str | None = None  # grouped matmul: "reference" | "triton" | "gemv"
    # None (cuDNN on GPU for bf16/fp16 chunks, XLA for decode's one query and on CPU) | "xla" | "cudnn"
    attention_implementation: str | None = None

    def __post_init__(self):
        for field in ("vocab_size", "hidden_dim", "num_layers", "full_attention_interval"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)} must be positive")
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers={self.mtp_layers} must be >= 0")
        if (self.moe is None) == (self.dense_ffn_dim is None):
            raise ValueError(
                "exactly one of moe and dense_ffn_dim must be set "
                f"(got moe={self.moe}, dense_ffn_dim={self.dense_ffn_dim})"
            )
        if self.explicit_layer_types is not None:
            if len(self.explicit_layer_types) != self.num_layers:
                raise ValueError(
                    f"explicit_layer_types has {len(self.explicit_layer_types)} entries for "
                    f"num_layers={self.num_layers}"
                )
            unknown = set(self.explicit_layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)}; known: {LAYER_TYPES}")

    @property
    def layer_types(self) -> tuple[str, ...]:
        if self.explicit_layer_types is not None:
            return self.explicit_layer_types
        return tuple(
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_layers)
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        return get_config(name)

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> ModelConfig:
        """Reads an HF `config.json` (a file, or a checkpoint directory holding one); see `config_from_hf`."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        return config_from_hf(data)

    # ----- sizes -----
    def num_params(self, *, experts_only: bool = False) -> int:
        """Parameter count (embedding and lm head included; MTP excluded)."""
        h, g, a = self.hidden_dim, self.gdn, self.attention
        moe = self.moe
        ffn = (moe.num_experts * 3 * h * moe.expert_ffn_dim) if moe else 0
        if experts_only:
            return ffn * self.num_layers
        ffn += (moe.num_experts * h + 3 * h * moe.shared_ffn_dim + h) if moe else 3 * h * self.dense_ffn_dim
        gdn = (
            h * g.conv_dim
            + 2 * h * g.num_v_heads * g.value_dim
            + 2 * h * g.num_v_heads
            + g.conv_kernel * g.conv_dim
            + 2 * g.num_v_heads
            + g.value_dim
        )
        attn = (
            h * a.num_heads * a.head_dim * 2
            + 2 * h * a.num_kv_heads * a.head_dim
            + a.num_heads * a.head_dim * h
            + 2 * a.head_dim
        )
        layers = sum((gdn if t == "linear_attention" else attn) + ffn + 2 * h for t in self.layer_types)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + head


QWEN35_35B_A3B = ModelConfig(
    name="qwen3.5-35b-a3b",
    vocab_size=248_320,
    hidden_dim=2048,
    num_layers=40,
    attention=AttentionConfig(mrope_sections=(11, 11, 10)),
    mtp_layers=1,  # config.json `mtp_num_hidden_layers: 1`; llama.cpp's GGUF keeps it as block 40
)
QWEN36_35B_A3B = dataclasses.replace(QWEN35_35B_A3B, name="qwen3.6-35b-a3b")  # same architecture and shapes
QWEN3_NEXT_80B_A3B = dataclasses.replace(
    QWEN35_35B_A3B,
    name="qwen3-next-80b-a3b",
    vocab_size=151_936,
    num_layers=48,
    attention=AttentionConfig(mrope_sections=None),
    moe=MoEConfig(num_experts=512, top_k=10, expert_ffn_dim=512, shared_ffn_dim=512),
    mtp_layers=0,  # llama.cpp's qwen3next converter drops the checkpoint's mtp.* tensors
)
# Same architecture and the full Qwen3.5/3.6 vocabulary (so real text tokenizes into it), small everything
# else.
TINY = ModelConfig(
    name="tiny",
    vocab_size=248_320,
    hidden_dim=64,
    num_layers=8,
    max_position_embeddings=32_768,
    attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, mrope_sections=(2, 1, 1)),
    gdn=GatedDeltaNetConfig(num_k_heads=2, num_v_heads=4, key_dim=32, value_dim=32),
    moe=MoEConfig(num_experts=16, top_k=4, expert_ffn_dim=64, shared_ffn_dim=64),
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3.5-35b-a3b": QWEN35_35B_A3B,
    "qwen3.6-35b-a3b": QWEN36_35B_A3B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "tiny": TINY,
}


def get_config(name: str, **overrides) -> ModelConfig:
    """Returns preset `name` with top-level fields replaced by `overrides`.

    Raises:
      KeyError: unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# ----------------------------------------------------------------------------------------------------------
# HF config.json
# ----------------------------------------------------------------------------------------------------------
SUPPORTED_HF_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_text")


def _rope_fields(cfg: dict) -> tuple[float, float, tuple[int, ...] | None]:
    """(rope_theta, partial_rotary_factor, mrope_sections) from transformers 4.x or 5.x keys."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ValueError(f"unsupported rope_type {rope_type!r} (only default RoPE / M-RoPE are implemented)")
    sections = params.get("mrope_section")
    return float(theta), float(factor), tuple(int(s) for s in sections) if sections else None


def config_from_hf(data: dict) -> ModelConfig:
    """Builds a `ModelConfig` from the parsed HF `config.json` of a supported checkpoint.

    Supports `qwen3_5_moe` (nested `text_config`), `qwen3_5_moe_text`, `qwen3_next`, and the dense `qwen3_5`
    / `qwen3_5_text`.

    Raises:
      ValueError: unknown `model_type`, a missing required key, or inconsistent sizes.
    """
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {list(SUPPORTED_HF_MODEL_TYPES)}"
        )
    cfg = data.get("text_config", data) if model_type in ("qwen3_5_moe", "qwen3_5") else data

    def req(key):
        if key not in cfg:
            raise ValueError(f"config.json ({model_type}) lacks required key {key!r}")
        return cfg[key]

    theta, factor, sections = _rope_fields(cfg)
    num_layers = int(req("num_hidden_layers"))
    layer_types = cfg.get("layer_types")
    is_moe = model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    if model_type == "qwen3_next":
        sparse_step = cfg.get("decoder_sparse_step", 1)
        if sparse_step != 1 or cfg.get("mlp_only_layers"):
            raise ValueError(
                "qwen3_next with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported"
            )
    moe = None
    if is_moe:
        moe = MoEConfig(
            num_experts=int(req("num_experts")),
            top_k=int(req("num_experts_per_tok")),
            expert_ffn_dim=int(req("moe_intermediate_size")),
            shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size", 0)),
            normalize_top_k=bool(cfg.get("norm_topk_prob", True)),
        )
    return ModelConfig(
        name=cfg.get("_name_or_path") or model_type,
        vocab_size=int(req("vocab_size")),
        hidden_dim=int(req("hidden_size")),
        num_layers=num_layers,
        full_attention_interval=int(cfg.get("full_attention_interval", 4)),
        explicit_layer_types=tuple(layer_types) if layer_types else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32_768)),
        attention=AttentionConfig(
            num_heads=int(req("num_attention_heads")),
            num_kv_heads=int(req("num_key_value_heads")),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
            rope_theta=theta,
            partial_rotary_factor=factor,
            mrope_sections=sections if model_type != "qwen3_next" else None,
        ),
        gdn=GatedDeltaNetConfig(
            num_k_heads=int(req("linear_num_key_heads")),
            num_v_heads=int(req("linear_num_value_heads")),
            key_dim=int(req("linear_key_head_dim")),
            value_dim=int(req("linear_value_head_dim")),
            conv_kernel=int(req("linear_conv_kernel_dim")),
        ),
        moe=moe,
        dense_ffn_dim=None if is_moe else int(req("intermediate_size")),
        mtp_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0),
    )

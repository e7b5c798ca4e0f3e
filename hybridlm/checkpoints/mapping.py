"""The one table between hybridlm parameter paths and checkpoint tensor names, with the transforms between them.

A `ParamSource` says, for one parameter of `HybridLM` (its nnx path), which HF tensors it is built from and how
(transpose, stacking per-expert tensors, un-grouping Qwen3-Next's fused projections). Loaders read only the
tensors a parameter needs, one parameter at a time. Checkpoint names appear only in this module (and gguf.py
for GGUF names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from hybridlm.config import ModelConfig

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class ParamSource:
    path: Path                                   # nnx path in HybridLM, e.g. ("layers", 0, "mixer", "qkv_proj")
    tensors: tuple[str, ...]                     # checkpoint tensor names read (in this order)
    build: Callable[..., np.ndarray]             # f(*arrays) -> parameter array in hybridlm layout


def _t(x):
    return np.ascontiguousarray(x.T)


def _same(x):
    return x


def ungroup_qkvz(w: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next `in_proj_qkvz` [out, hidden], grouped per k-head as [q_g | k_g | v_g (r heads) | z_g (r heads)],
    -> (flat [Q | K | V] rows [conv_dim, hidden], z rows [v_heads*value_dim, hidden]) in natural head order.

    Source: HF `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`; spec §4.1.
    """
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    per = 2 * g.key_dim + 2 * r * g.value_dim
    w = w.reshape(g.num_k_heads, per, -1)
    q = w[:, :g.key_dim]
    k = w[:, g.key_dim:2 * g.key_dim]
    v = w[:, 2 * g.key_dim:2 * g.key_dim + r * g.value_dim]
    z = w[:, 2 * g.key_dim + r * g.value_dim:]
    flat = lambda x: x.reshape(-1, x.shape[-1])
    return np.concatenate([flat(q), flat(k), flat(v)], axis=0), flat(z)


def ungroup_ba(w: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next `in_proj_ba` [2*v_heads, hidden], grouped per k-head as [b (r) | a (r)] -> (b rows, a rows)."""
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    w = w.reshape(g.num_k_heads, 2 * r, -1)
    return w[:, :r].reshape(g.num_v_heads, -1), w[:, r:].reshape(g.num_v_heads, -1)


def hf_sources(config: ModelConfig, names: set[str], *, prefix: str) -> Iterator[ParamSource]:
    """Every parameter of a `HybridLM(config)` with the HF tensors it comes from.

    Args:
      config: the model's configuration.
      names: tensor names present in the checkpoint (chooses fused vs split and per-expert vs stacked layouts).
      prefix: the text model's prefix, "model." or "model.language_model.".
    """
    yield ParamSource(("embed",), (f"{prefix}embed_tokens.weight",), _same)
    yield ParamSource(("final_norm", "scale"), (f"{prefix}norm.weight",), _same)
    if not config.tie_word_embeddings:
        yield ParamSource(("lm_head",), ("lm_head.weight",), _t)
    for i, layer_type in enumerate(config.layer_types):
        hf = f"{prefix}layers.{i}."
        ours: Path = ("layers", i)
        yield ParamSource(ours + ("input_norm", "scale"), (hf + "input_layernorm.weight",), _same)
        yield ParamSource(ours + ("post_norm", "scale"), (hf + "post_attention_layernorm.weight",), _same)
        if layer_type == "linear_attention":
            yield from _gdn_sources(config, names, hf + "linear_attn.", ours + ("mixer",))
        else:
            a = hf + "self_attn."
            m = ours + ("mixer",)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield ParamSource(m + (proj,), (a + proj + ".weight",), _t)
            yield ParamSource(m + ("q_norm",), (a + "q_norm.weight",), _same)
            yield ParamSource(m + ("k_norm",), (a + "k_norm.weight",), _same)
        yield from _ffn_sources(config, names, hf + "mlp.", ours + ("ffn",))


def _gdn_sources(config, names, hf, m) -> Iterator[ParamSource]:
    if hf + "in_proj_qkvz.weight" in names:   # Qwen3-Next fused, grouped per k-head
        qkvz = (hf + "in_proj_qkvz.weight",)
        ba = (hf + "in_proj_ba.weight",)
        yield ParamSource(m + ("qkv_proj",), qkvz, lambda w: _t(ungroup_qkvz(w, config)[0]))
        yield ParamSource(m + ("output_gate_proj",), qkvz, lambda w: _t(ungroup_qkvz(w, config)[1]))
        yield ParamSource(m + ("beta_proj",), ba, lambda w: _t(ungroup_ba(w, config)[0]))
        yield ParamSource(m + ("decay_proj",), ba, lambda w: _t(ungroup_ba(w, config)[1]))
    else:
        yield ParamSource(m + ("qkv_proj",), (hf + "in_proj_qkv.weight",), _t)
        yield ParamSource(m + ("output_gate_proj",), (hf + "in_proj_z.weight",), _t)
        yield ParamSource(m + ("beta_proj",), (hf + "in_proj_b.weight",), _t)
        yield ParamSource(m + ("decay_proj",), (hf + "in_proj_a.weight",), _t)
    yield ParamSource(m + ("conv_weight",), (hf + "conv1d.weight",), lambda w: _t(w.reshape(w.shape[0], -1)))
    yield ParamSource(m + ("log_decay_rate",), (hf + "A_log",), _same)
    yield ParamSource(m + ("delta_time_bias",), (hf + "dt_bias",), _same)
    yield ParamSource(m + ("output_norm",), (hf + "norm.weight",), _same)
    yield ParamSource(m + ("out_proj",), (hf + "out_proj.weight",), _t)


def _ffn_sources(config, names, hf, f) -> Iterator[ParamSource]:
    if config.moe is None:
        yield ParamSource(f + ("gate_up",), (hf + "gate_proj.weight", hf + "up_proj.weight"),
                          lambda g, u: _t(np.concatenate([g, u], axis=0)))
        yield ParamSource(f + ("down",), (hf + "down_proj.weight",), _t)
        return
    e = config.moe.num_experts
    yield ParamSource(f + ("router",), (hf + "gate.weight",), _t)
    if hf + "experts.gate_up_proj" in names:   # transformers 5.x fused layout [E, 2F, H] / [E, H, F]
        yield ParamSource(f + ("experts_gate_up",), (hf + "experts.gate_up_proj",),
                          lambda w: np.ascontiguousarray(w.transpose(0, 2, 1)))
        yield ParamSource(f + ("experts_down",), (hf + "experts.down_proj",),
                          lambda w: np.ascontiguousarray(w.transpose(0, 2, 1)))
    else:   # per-expert Linear weights [F, H] / [H, F]
        gate_up = tuple(hf + f"experts.{j}.{p}.weight" for j in range(e) for p in ("gate_proj", "up_proj"))
        yield ParamSource(f + ("experts_gate_up",), gate_up, lambda *ws: np.stack(
            [np.concatenate([ws[2 * j], ws[2 * j + 1]], axis=0).T for j in range(len(ws) // 2)]))
        down = tuple(hf + f"experts.{j}.down_proj.weight" for j in range(e))
        yield ParamSource(f + ("experts_down",), down, lambda *ws: np.stack([w.T for w in ws]))
    s = hf + "shared_expert."
    yield ParamSource(f + ("shared_gate_up",), (s + "gate_proj.weight", s + "up_proj.weight"),
                      lambda g, u: _t(np.concatenate([g, u], axis=0)))
    yield ParamSource(f + ("shared_down",), (s + "down_proj.weight",), _t)
    yield ParamSource(f + ("shared_token_gate",), (hf + "shared_expert_gate.weight",), lambda w: w.reshape(-1))


# Tensors a text-only model never reads.
IGNORED_HF_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")

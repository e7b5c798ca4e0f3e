"""The one table between hybridlm parameter paths and checkpoint tensor names,
with the transforms between them.

A `ParamSource` says, for one parameter of `HybridLM` (its nnx path), which HF tensors it is built from and
how (transpose, stacking per-expert tensors, un-grouping Qwen3-Next's fused projections). Loaders read only
the tensors a parameter needs, one parameter at a time. A `GGUFSource` does the same for llama.cpp GGUF names,
in both directions (the converter's transform for `save_gguf`, its inverse for loading). Checkpoint names
appear only in this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from hybridlm.config import ModelConfig

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class ParamSource:
    path: Path  # nnx path in HybridLM, e.g. ("layers", 0, "mixer", "qkv_proj")
    tensors: tuple[str, ...]  # checkpoint tensor names read (in this order)
    build: Callable[..., np.ndarray]  # f(*arrays) -> parameter array in hybridlm layout


def _xp(x):
    """numpy for host arrays, jax.numpy for device ones: the GGUF transforms run where the tensor is."""
    return np if isinstance(x, np.ndarray) else jnp


def _t(x):
    return np.ascontiguousarray(x.T) if isinstance(x, np.ndarray) else x.T


def _same(x):
    return x


def ungroup_qkvz(w: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next `in_proj_qkvz` [out, hidden], grouped per k-head as
    [q_g | k_g | v_g (r heads) | z_g (r heads)], -> (flat [Q | K | V] rows [conv_dim, hidden],
    z rows [v_heads*value_dim, hidden]) in natural head order.

    Source: HF `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`; spec §4.1.
    """
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    per = 2 * g.key_dim + 2 * r * g.value_dim
    w = w.reshape(g.num_k_heads, per, -1)
    q = w[:, : g.key_dim]
    k = w[:, g.key_dim : 2 * g.key_dim]
    v = w[:, 2 * g.key_dim : 2 * g.key_dim + r * g.value_dim]
    z = w[:, 2 * g.key_dim + r * g.value_dim :]
    flat = lambda x: x.reshape(-1, x.shape[-1])
    return _xp(w).concatenate([flat(q), flat(k), flat(v)], axis=0), flat(z)


def ungroup_ba(w: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next `in_proj_ba` [2*v_heads, hidden], grouped per k-head as [b (r) | a (r)]
    -> (b rows, a rows)."""
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    w = w.reshape(g.num_k_heads, 2 * r, -1)
    return w[:, :r].reshape(g.num_v_heads, -1), w[:, r:].reshape(g.num_v_heads, -1)


def hf_sources(config: ModelConfig, names: set[str], *, prefix: str) -> Iterator[ParamSource]:
    """Every parameter of a `HybridLM(config)` with the HF tensors it comes from.

    Args:
      config: the model's configuration.
      names: tensor names present in the checkpoint (chooses fused vs split and per-expert vs stacked
        layouts).
      prefix: the text model's prefix, "model." or "model.language_model.".
    """
    yield ParamSource(("embed",), (f"{prefix}embed_tokens.weight",), _same)
    yield ParamSource(("final_norm", "scale"), (f"{prefix}norm.weight",), _same)
    if not config.tie_word_embeddings:
        yield ParamSource(("lm_head",), ("lm_head.weight",), _t)
    for i, layer_type in enumerate(config.layer_types):
        yield from hf_layer_sources(config, names, f"{prefix}layers.{i}.", ("layers", i), layer_type)


def hf_layer_sources(config: ModelConfig, names: set[str], hf: str, ours: Path, layer_type: str):
    """The parameters of one `DecoderLayer` at nnx path `ours` from HF tensors named `hf` + ... (e.g.
    "model.layers.3." or "mtp.layers.0.")."""
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


def mtp_hf_sources(config: ModelConfig, names: set[str], *, prefix: str = "mtp.") -> Iterator[ParamSource]:
    """Every parameter of an `hybridlm.mtp.MTPModule(config)` with the HF `mtp.*` tensors it comes from
    (docs/mtp.md §3); prefix "mtp." or "model.mtp."."""
    yield ParamSource(("fc",), (f"{prefix}fc.weight",), _t)
    for ours, hf in (
        ("pre_fc_norm_embedding", "pre_fc_norm_embedding"),
        ("pre_fc_norm_hidden", "pre_fc_norm_hidden"),
        ("norm", "norm"),
    ):
        yield ParamSource((ours, "scale"), (f"{prefix}{hf}.weight",), _same)
    for j in range(config.mtp_layers):
        yield from hf_layer_sources(config, names, f"{prefix}layers.{j}.", ("layers", j), "full_attention")


def _gdn_sources(config, names, hf, m) -> Iterator[ParamSource]:
    if hf + "in_proj_qkvz.weight" in names:  # Qwen3-Next fused, grouped per k-head
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
        yield ParamSource(
            f + ("gate_up",),
            (hf + "gate_proj.weight", hf + "up_proj.weight"),
            lambda g, u: _t(_xp(g).concatenate([g, u], axis=0)),
        )
        yield ParamSource(f + ("down",), (hf + "down_proj.weight",), _t)
        return
    e = config.moe.num_experts
    yield ParamSource(f + ("router",), (hf + "gate.weight",), _t)
    if hf + "experts.gate_up_proj" in names:  # transformers 5.x fused layout [E, 2F, H] / [E, H, F]
        yield ParamSource(
            f + ("experts_gate_up",),
            (hf + "experts.gate_up_proj",),
            _experts_t,
        )
        yield ParamSource(
            f + ("experts_down",),
            (hf + "experts.down_proj",),
            _experts_t,
        )
    else:  # per-expert Linear weights [F, H] / [H, F]
        gate_up = tuple(hf + f"experts.{j}.{p}.weight" for j in range(e) for p in ("gate_proj", "up_proj"))
        yield ParamSource(
            f + ("experts_gate_up",),
            gate_up,
            lambda *ws: _xp(ws[0]).stack(
                [_xp(ws[0]).concatenate([ws[2 * j], ws[2 * j + 1]], axis=0).T for j in range(len(ws) // 2)]
            ),
        )
        down = tuple(hf + f"experts.{j}.down_proj.weight" for j in range(e))
        yield ParamSource(f + ("experts_down",), down, lambda *ws: _xp(ws[0]).stack([w.T for w in ws]))
    s = hf + "shared_expert."
    yield ParamSource(
        f + ("shared_gate_up",),
        (s + "gate_proj.weight", s + "up_proj.weight"),
        lambda g, u: _t(_xp(g).concatenate([g, u], axis=0)),
    )
    yield ParamSource(f + ("shared_down",), (s + "down_proj.weight",), _t)
    yield ParamSource(
        f + ("shared_token_gate",), (hf + "shared_expert_gate.weight",), lambda w: w.reshape(-1)
    )


# Tensors a text-only model never reads.
IGNORED_HF_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def dflash_hf_sources(num_layers: int, *, prefix: str = "") -> Iterator[ParamSource]:
    """Every parameter of an `hybridlm.dflash.DFlashDraft` of `num_layers` layers with the z-lab checkpoint
    tensor it comes from (docs/dflash.md §4): `fc`, `hidden_norm`, `norm` and `layers.{i}.*` of a Qwen3
    decoder layer, prefix "" (as published) or "model."."""
    yield ParamSource(("fc",), (f"{prefix}fc.weight",), _t)
    yield ParamSource(("hidden_norm", "scale"), (f"{prefix}hidden_norm.weight",), _same)
    yield ParamSource(("norm", "scale"), (f"{prefix}norm.weight",), _same)
    for i in range(num_layers):
        hf, ours = f"{prefix}layers.{i}.", ("layers", i)
        yield ParamSource(ours + ("input_norm", "scale"), (hf + "input_layernorm.weight",), _same)
        yield ParamSource(ours + ("post_norm", "scale"), (hf + "post_attention_layernorm.weight",), _same)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield ParamSource(ours + (proj,), (f"{hf}self_attn.{proj}.weight",), _t)
        yield ParamSource(ours + ("q_norm",), (hf + "self_attn.q_norm.weight",), _same)
        yield ParamSource(ours + ("k_norm",), (hf + "self_attn.k_norm.weight",), _same)
        yield ParamSource(
            ours + ("gate_up",),
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            lambda g, u: _t(_xp(g).concatenate([g, u], axis=0)),
        )
        yield ParamSource(ours + ("down",), (hf + "mlp.down_proj.weight",), _t)


# ----------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp) names: the converter's transforms and their inverses (spec §10)
# ----------------------------------------------------------------------------------------------------------
# Arrays on the GGUF side are numpy-order (the reverse of ggml's `ne`), i.e. torch layout: a matrix is
# [out, in], an expert tensor is [experts, out, in].


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """One row of the GGUF table: parameters <-> GGUF tensors, with the converter's transform both ways.

    Most rows are one parameter <-> one tensor; gate/up halves make one parameter from two tensors, and
    Qwen3-Next's `ssm_ba` makes two parameters from one tensor.
    """

    params: tuple[Path, ...]  # nnx paths in HybridLM
    tensors: tuple[str, ...]  # GGUF tensor names
    load: Callable[..., tuple[np.ndarray, ...]]  # f(*tensors) -> params (hybridlm layout)
    save: (
        Callable[..., tuple[np.ndarray, ...]] | None
    )  # f(*params) -> tensors; None: read-only (legacy layout)
    f32: bool = False  # the converter always writes these in F32
    experts: bool = False  # routed-expert weights (`keep_quantized="experts"`)


def v_head_order(config: ModelConfig, arch: str) -> np.ndarray | None:
    """GGUF v-head j holds HF v-head `order[j]` (Qwen3.5 tiled order, spec §10.2); None: no reorder."""
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    if arch == "qwen3next" or r == 1:
        return None
    j = np.arange(g.num_v_heads)
    return (j % g.num_k_heads) * r + j // g.num_k_heads


def _head_index(order: np.ndarray, head_size: int) -> np.ndarray:
    """Row index for per-head blocks of `head_size` rows: x[_head_index] permutes whole heads."""
    return (order[:, None] * head_size + np.arange(head_size)[None, :]).reshape(-1)


def _permuter(order: np.ndarray | None, head_size: int, start: int = 0):
    """(to_gguf, from_gguf) functions reordering v-head blocks along axis 0, after the first `start` rows."""
    if order is None:
        return _same, _same
    fwd = _head_index(order, head_size)
    inv = np.argsort(fwd)

    def apply(idx):
        def f(x):
            return _xp(x).concatenate([x[:start], x[start:][idx]], axis=0) if start else x[idx]

        return f

    return apply(fwd), apply(inv)


def group_ba(b: np.ndarray, a: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Inverse of `ungroup_ba`: b, a rows [v_heads, hidden] -> Qwen3-Next grouped [b (r) | a (r)]
    per k-head."""
    g = config.gdn
    r = g.num_v_heads // g.num_k_heads
    grouped = np.concatenate([b.reshape(g.num_k_heads, r, -1), a.reshape(g.num_k_heads, r, -1)], axis=1)
    return grouped.reshape(2 * g.num_v_heads, -1)


def ssm_a_from_a_log(a_log: np.ndarray) -> np.ndarray:
    """ssm_a = -exp(A_log) in float32, with XLA's exp (the one the model uses),
    so that loading gets A_log back."""
    import jax.numpy as jnp

    return -np.asarray(jnp.exp(jnp.asarray(a_log, jnp.float32)))


def a_log_from_ssm_a(ssm_a: np.ndarray) -> np.ndarray:
    """A_log = log(-ssm_a) in float32, nudged by up to 2 ulps so that `jnp.exp(A_log) == -ssm_a` exactly.

    The model computes -exp(A_log) with XLA's float32 exp; the nudge makes it reproduce the file's ssm_a bit
    for bit (on the backend that loads), so an F32 GGUF round trip gives the same decays as the original
    weights.

    Raises:
      ValueError: ssm_a has a value >= 0 or not finite (a decay rate must be negative).
    """
    import jax.numpy as jnp

    target = -np.asarray(ssm_a, np.float32)
    if not (np.isfinite(target).all() and (target > 0).all()):
        raise ValueError(
            f"ssm_a must be finite and negative, got values in [{-target.max()}, {-target.min()}]"
        )
    x = np.log(target.astype(np.float64)).astype(np.float32)
    best, done = x.copy(), np.asarray(jnp.exp(x)) == target
    for step in (1, -1, 2, -2):
        cand = x
        for _ in range(abs(step)):
            cand = np.nextafter(cand, np.float32(np.inf if step > 0 else -np.inf))
        hit = ~done & (np.asarray(jnp.exp(cand)) == target)
        best, done = np.where(hit, cand, best), done | hit
    return best


def _one(f):
    """Wraps a one-array function to return a 1-tuple (GGUFSource load/save return tuples)."""
    return lambda *xs: (f(*xs),)


def _gate_up_split(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[hidden, 2*ffn] -> (gate [ffn, hidden], up [ffn, hidden]) torch layout."""
    f = w.shape[-1] // 2
    return _t(w[:, :f]), _t(w[:, f:])


def _experts_t(w: np.ndarray) -> np.ndarray:
    return (
        np.ascontiguousarray(np.swapaxes(w, -1, -2)) if isinstance(w, np.ndarray) else jnp.swapaxes(w, -1, -2)
    )


def gguf_sources(config: ModelConfig, arch: str, names: set[str] | None = None) -> Iterator[GGUFSource]:
    """Every parameter of a `HybridLM(config)` with the GGUF tensors of architecture `arch` it comes from.

    Args:
      config: the model's configuration.
      arch: "qwen35moe", "qwen35" or "qwen3next" (chooses the V-head reorder and the GDN tensor layout).
      names: tensor names in the file (chooses split vs fused experts, legacy `ssm_in`); None: what
        `save_gguf` writes (llama.cpp's current converter).
    """
    names = set() if names is None else names
    yield GGUFSource((("embed",),), ("token_embd.weight",), _one(_same), _one(_same))
    yield _gguf_norm(("final_norm", "scale"), "output_norm.weight")
    if not config.tie_word_embeddings:
        yield GGUFSource((("lm_head",),), ("output.weight",), _one(_t), _one(_t))
    for i, layer_type in enumerate(config.layer_types):
        yield from gguf_layer_sources(config, arch, names, f"blk.{i}.", ("layers", i), layer_type)


_PLUS1, _MINUS1 = (lambda x: x + 1.0), (lambda x: x - 1.0)  # zero-centred norms: GGUF stores 1 + w


def _gguf_norm(param: Path, name: str) -> GGUFSource:
    return GGUFSource((param,), (name,), _one(_MINUS1), _one(_PLUS1), f32=True)


def gguf_layer_sources(
    config: ModelConfig, arch: str, names: set[str], b: str, ours: Path, layer_type: str
) -> Iterator[GGUFSource]:
    """The parameters of one `DecoderLayer` at nnx path `ours` from GGUF block `b` (e.g. "blk.3.")."""
    yield _gguf_norm(ours + ("input_norm", "scale"), b + "attn_norm.weight")
    yield _gguf_norm(ours + ("post_norm", "scale"), b + "post_attention_norm.weight")
    m = ours + ("mixer",)
    if layer_type == "linear_attention":
        yield from _gguf_gdn(config, arch, names, b, m)
    else:
        for proj, name in (
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
            ("o_proj", "attn_output"),
        ):
            yield GGUFSource((m + (proj,),), (b + name + ".weight",), _one(_t), _one(_t))
        yield _gguf_norm(m + ("q_norm",), b + "attn_q_norm.weight")
        yield _gguf_norm(m + ("k_norm",), b + "attn_k_norm.weight")
    yield from _gguf_ffn(config, names, b, ours + ("ffn",))


def mtp_gguf_sources(config: ModelConfig, arch: str, names: set[str] | None = None) -> Iterator[GGUFSource]:
    """Every parameter of an `hybridlm.mtp.MTPModule(config)` with llama.cpp's nextn tensors: MTP layer j is
    block `config.num_layers + j` (docs/mtp.md §3). The converter repeats eh_proj and the three nextn norms
    in every MTP block (one copy of each in the module), so they are written to, and read from, each block."""
    names = set() if names is None else names
    for j in range(config.mtp_layers):
        b = f"blk.{config.num_layers + j}."
        yield GGUFSource((("fc",),), (b + "nextn.eh_proj.weight",), _one(_t), _one(_t))
        yield _gguf_norm(("pre_fc_norm_embedding", "scale"), b + "nextn.enorm.weight")
        yield _gguf_norm(("pre_fc_norm_hidden", "scale"), b + "nextn.hnorm.weight")
        yield _gguf_norm(("norm", "scale"), b + "nextn.shared_head_norm.weight")
        yield from gguf_layer_sources(config, arch, names, b, ("layers", j), "full_attention")


# The DFlash draft's GGUF architecture: Lucebox's (`convert_dflash_to_gguf.py`, `gguf_draft_loader.cpp`).
DFLASH_GGUF_ARCH = "qwen35-dflash-draft"


def dflash_gguf_sources(num_layers: int, names: set[str] | None = None) -> Iterator[GGUFSource]:
    """Every parameter of an `hybridlm.dflash.DFlashDraft` with the tensors of a `DFLASH_GGUF_ARCH` file
    (docs/dflash.md §4): `dflash.fc`, `dflash.hidden_norm`, `output_norm`, `blk.{i}.*` in llama.cpp's Qwen3
    names. Norms are plain RMSNorm weights, stored as they are (no +1) and in F32. A file whose layers name
    the post-attention norm `post_attention_norm` (Lucebox reads either) is read too; `save` writes
    `ffn_norm`."""
    names = set() if names is None else names

    def plain_norm(param: Path, name: str) -> GGUFSource:
        return GGUFSource((param,), (name,), _one(_same), _one(_same), f32=True)

    yield GGUFSource((("fc",),), ("dflash.fc.weight",), _one(_t), _one(_t))
    yield plain_norm(("hidden_norm", "scale"), "dflash.hidden_norm.weight")
    yield plain_norm(("norm", "scale"), "output_norm.weight")
    concat_t = lambda g, u: _t(_xp(g).concatenate([g, u], axis=0))
    for i in range(num_layers):
        b, ours = f"blk.{i}.", ("layers", i)
        post = b + (
            "post_attention_norm.weight" if b + "post_attention_norm.weight" in names else "ffn_norm.weight"
        )
        yield plain_norm(ours + ("input_norm", "scale"), b + "attn_norm.weight")
        yield plain_norm(ours + ("post_norm", "scale"), post)
        for proj, name in (
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
            ("o_proj", "attn_output"),
        ):
            yield GGUFSource((ours + (proj,),), (b + name + ".weight",), _one(_t), _one(_t))
        yield plain_norm(ours + ("q_norm",), b + "attn_q_norm.weight")
        yield plain_norm(ours + ("k_norm",), b + "attn_k_norm.weight")
        yield GGUFSource(
            (ours + ("gate_up",),),
            (b + "ffn_gate.weight", b + "ffn_up.weight"),
            _one(concat_t),
            _gate_up_split,
        )
        yield GGUFSource((ours + ("down",),), (b + "ffn_down.weight",), _one(_t), _one(_t))


def _gguf_gdn(config, arch, names, b, m) -> Iterator[GGUFSource]:
    g = config.gdn
    order = v_head_order(config, arch)
    key_rows = 2 * g.num_k_heads * g.key_dim
    qkv_to, qkv_from = _permuter(order, g.value_dim, start=key_rows)  # V rows/channels of [Q | K | V]
    val_to, val_from = _permuter(order, g.value_dim)  # z rows, out_proj columns
    head_to, head_from = _permuter(order, 1)  # per-v-head vectors
    if arch == "qwen3next" and b + "ssm_in.weight" in names:  # legacy: fused qkvz, grouped per k-head
        yield GGUFSource(
            (m + ("qkv_proj",), m + ("output_gate_proj",)),
            (b + "ssm_in.weight",),
            lambda w: tuple(_t(x) for x in ungroup_qkvz(w, config)),
            None,
        )
    else:
        yield GGUFSource(
            (m + ("qkv_proj",),),
            (b + "attn_qkv.weight",),
            _one(lambda w: _t(qkv_from(w))),
            _one(lambda w: qkv_to(_t(w))),
        )
        yield GGUFSource(
            (m + ("output_gate_proj",),),
            (b + "attn_gate.weight",),
            _one(lambda w: _t(val_from(w))),
            _one(lambda w: val_to(_t(w))),
        )
    if arch == "qwen3next":
        yield GGUFSource(
            (m + ("beta_proj",), m + ("decay_proj",)),
            (b + "ssm_ba.weight",),
            lambda w: tuple(_t(x) for x in ungroup_ba(w, config)),
            lambda bw, aw: (group_ba(_t(bw), _t(aw), config),),
        )
    else:
        yield GGUFSource(
            (m + ("beta_proj",),),
            (b + "ssm_beta.weight",),
            _one(lambda w: _t(head_from(w))),
            _one(lambda w: head_to(_t(w))),
        )
        yield GGUFSource(
            (m + ("decay_proj",),),
            (b + "ssm_alpha.weight",),
            _one(lambda w: _t(head_from(w))),
            _one(lambda w: head_to(_t(w))),
        )
    # ssm_a = -exp(A_log); our log_decay_rate is A_log.
    yield GGUFSource(
        (m + ("log_decay_rate",),),
        (b + "ssm_a",),
        _one(lambda a: a_log_from_ssm_a(head_from(a))),
        _one(lambda x: head_to(ssm_a_from_a_log(x))),
        f32=True,
    )
    yield GGUFSource(
        (m + ("delta_time_bias",),), (b + "ssm_dt.bias",), _one(head_from), _one(head_to), f32=True
    )
    # conv: ours [kernel, channels]; GGUF numpy [channels, kernel] (ne [kernel, channels]).
    yield GGUFSource(
        (m + ("conv_weight",),),
        (b + "ssm_conv1d.weight",),
        _one(lambda w: _t(qkv_from(w.reshape(w.shape[0], -1)))),
        _one(lambda w: qkv_to(_t(w))),
        f32=True,
    )
    yield GGUFSource((m + ("output_norm",),), (b + "ssm_norm.weight",), _one(_same), _one(_same), f32=True)
    # out_proj: ours [v_heads*value_dim, hidden] = torch columns; reorder our rows.
    yield GGUFSource(
        (m + ("out_proj",),),
        (b + "ssm_out.weight",),
        _one(lambda w: val_from(_t(w))),
        _one(lambda w: _t(val_to(w))),
    )


def _gguf_ffn(config, names, b, f) -> Iterator[GGUFSource]:
    # gate, up [ffn, hidden] -> [hidden, 2*ffn]
    concat_t = lambda g, u: _t(_xp(g).concatenate([g, u], axis=0))
    if config.moe is None:
        yield GGUFSource(
            (f + ("gate_up",),), (b + "ffn_gate.weight", b + "ffn_up.weight"), _one(concat_t), _gate_up_split
        )
        yield GGUFSource((f + ("down",),), (b + "ffn_down.weight",), _one(_t), _one(_t))
        return
    yield GGUFSource((f + ("router",),), (b + "ffn_gate_inp.weight",), _one(_t), _one(_t), f32=True)
    if b + "ffn_gate_up_exps.weight" in names:  # fused variant: [experts, 2*ffn, hidden], gate rows first
        yield GGUFSource(
            (f + ("experts_gate_up",),),
            (b + "ffn_gate_up_exps.weight",),
            _one(_experts_t),
            _one(_experts_t),
            experts=True,
        )
    else:
        e_ffn = config.moe.expert_ffn_dim
        yield GGUFSource(
            (f + ("experts_gate_up",),),
            (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"),
            _one(lambda g, u: _experts_t(_xp(g).concatenate([g, u], axis=1))),
            lambda w: (_experts_t(w[..., :e_ffn]), _experts_t(w[..., e_ffn:])),
            experts=True,
        )
    yield GGUFSource(
        (f + ("experts_down",),),
        (b + "ffn_down_exps.weight",),
        _one(_experts_t),
        _one(_experts_t),
        experts=True,
    )
    yield GGUFSource(
        (f + ("shared_gate_up",),),
        (b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"),
        _one(concat_t),
        _gate_up_split,
    )
    yield GGUFSource((f + ("shared_down",),), (b + "ffn_down_shexp.weight",), _one(_t), _one(_t))
    # torch [1, hidden] squeezed by the converter to 1-D [hidden] (older files: ne [hidden, 1]).
    yield GGUFSource(
        (f + ("shared_token_gate",),),
        (b + "ffn_gate_inp_shexp.weight",),
        _one(lambda w: w.reshape(-1)),
        _one(_same),
        f32=True,
    )

"""DFlash block-diffusion draft model (z-lab, arXiv:2602.06036): one parallel forward drafts a token block.

The draft reads hidden features of several target layers and reuses the target's embedding and lm head
(docs/dflash.md §2):

    c      = N_hid(concat_L(h_L) W_fc)        # context rows: target layer outputs -> [ctx, hidden]
    x      = E[t_last, mask, ..., mask]       # the block of block_size tokens at positions start .. start+B-1
    per draft layer:
      u    = N_in(x)
      q    = RoPE(N_q(u W_q))                 # block positions
      k, v = RoPE(N_k([c; u] W_k)), [c; u] W_v    # context positions 0 .. start-1, then the block's
      x    = x + softmax(q k^T / sqrt(head_dim)) v W_o   # non-causal: every query sees every key
      x    = x + SwiGLU(N_post(x))
    logits = N_out(x)[1:] W_lm                # block position i predicts the token at start + i

N are plain RMSNorms (y = w * x / rms(x), Qwen3's, not the target's 1 + w); RoPE is YaRN-scaled where the
config says so. The context K/V of every layer depend on c alone, so `DFlashDraft.context` writes them into a
fixed-capacity KV cache per layer once; `DFlashDraft.draft` recomputes the block's K/V every time.
Source: z-lab dflash/model.py (`DFlashDraftModel.forward`, `Qwen3DFlashAttention.forward`, `dflash_generate`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridlm.layers.linear import head_matmul, linear
from hybridlm.layers.moe import swiglu
from hybridlm.layers.norms import PlainRMSNorm, rms_norm
from hybridlm.layers.rope import YarnScaling, apply_partial_rope, rope_cos_sin
from hybridlm.state import KVCache
from pallas_kernels.quantized import QuantizedWeights

# dflash_config keys this implementation reads; any other names a variant (DFlash2's convolution and
# selector, Domino, attention sinks, ...) that it lacks.
_KNOWN_DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "mask_token", "block_size", "num_target_layers")
_REQUIRED_HF_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


# The mask token of z-lab's Qwen3.5 / 3.6 drafts (a reserved special token of their 248 320-token vocabulary).
PUBLISHED_MASK_TOKEN_ID = 248070


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs feed a draft of `num_draft_layers` layers when the config names none:
    the middle layer for one draft layer, else evenly from layer 1 to num_target_layers - 3 (Python's
    round, half to even). Source: z-lab dflash/model.py `build_target_layer_ids`.

    Raises:
      ValueError: counts below 1, or fewer than 4 target layers for several draft layers.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"layer counts must be positive: target {num_target_layers}, draft {num_draft_layers}"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"default target_layer_ids need num_target_layers >= 4, got {num_target_layers}")
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """A DFlash draft model (a Qwen3 decoder without embedding or head) and how it reads the target."""

    name: str = "dflash"
    hidden_dim: int  # equals the target's hidden size
    num_layers: int  # draft decoder layers
    num_heads: int
    num_kv_heads: int  # query head h reads kv head h // (num_heads // num_kv_heads)
    head_dim: int
    ffn_dim: int  # SwiGLU width (HF intermediate_size)
    vocab_size: int  # equals the target's
    target_layer_ids: tuple[
        int, ...
    ]  # target layers whose outputs (HF hidden_states[L + 1]) are the features
    mask_token_id: int  # fills block positions 1 .. block_size - 1
    num_target_layers: int | None = None  # the target's layer count the draft was trained for
    block_size: int = 16  # tokens per block: the last accepted token and block_size - 1 drafts
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e4
    rope_scaling: YarnScaling | None = None  # None: plain RoPE over the whole head
    max_position_embeddings: int = 32_768
    # None: cuDNN on a GPU for bf16 / fp16, else XLA (`jax.nn.dot_product_attention` implementations)
    attention_implementation: str | None = None

    def __post_init__(self):
        sizes = ("hidden_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "vocab_size")
        bad = [f"{f}={getattr(self, f)}" for f in sizes if getattr(self, f) <= 0]
        if bad:
            raise ValueError(f"DFlash sizes must be positive: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates half-split pairs)")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids={self.target_layer_ids} must be non-empty and >= 0")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids={list(self.target_layer_ids)} reach past num_target_layers="
                f"{self.num_target_layers}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (one known token and a draft)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def feature_dim(self) -> int:
        """Width of one context row: len(target_layer_ids) * hidden_dim."""
        return len(self.target_layer_ids) * self.hidden_dim

    def replace(self, **changes) -> DFlashConfig:
        return dataclasses.replace(self, **changes)

    def check_target(self, target) -> None:
        """Refuses a target (`ModelConfig`) this draft cannot read.

        Raises:
          ValueError: one message naming every mismatch: hidden size, vocabulary, target_layer_ids outside the
            target's layers, or a num_target_layers other than the target's layer count.
        """
        problems = []
        if self.hidden_dim != target.hidden_dim:
            problems.append(f"hidden size {self.hidden_dim} != the target's {target.hidden_dim}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {target.vocab_size}")
        outside = [i for i in self.target_layer_ids if i >= target.num_layers]
        if outside:
            problems.append(
                f"target_layer_ids {outside} are not layers of the {target.num_layers}-layer target"
            )
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            problems.append(
                f"num_target_layers {self.num_target_layers} != the target's {target.num_layers} layers"
            )
        if problems:
            raise ValueError(
                f"DFlash draft {self.name!r} does not fit target {target.name!r}: " + "; ".join(problems)
            )

    @classmethod
    def from_hf(cls, data: dict) -> DFlashConfig:
        """From a z-lab DFlash `config.json` (a Qwen3Config plus block_size, num_target_layers and
        dflash_config {target_layer_ids, mask_token_id}); RoPE from `rope_parameters` (transformers 5) or
        `rope_theta` + `rope_scaling` (4.x), "default" or "yarn". block_size and num_target_layers may also
        sit in dflash_config; target_layer_ids default to `build_target_layer_ids`.

        Raises:
          ValueError: a missing key (HF would fall back to Qwen3-8B's sizes; this refuses), a mask token id
            absent, a feature this implementation lacks (sliding-window layers, attention bias, another
            activation, partial rotary, another rope type, extra dflash_config keys), or bad values; the
            message names the key.
        """
        missing = [k for k in _REQUIRED_HF_KEYS if data.get(k) is None]
        if missing:
            raise ValueError(f"DFlash config.json lacks required key(s) {missing}")
        dflash = data.get("dflash_config") or {}
        unknown = sorted(set(dflash) - set(_KNOWN_DFLASH_KEYS))
        if unknown:
            raise ValueError(
                f"dflash_config key(s) {unknown} name a DFlash variant this implementation lacks; "
                f"it reads {list(_KNOWN_DFLASH_KEYS)}"
            )
        if data.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported (the DFlash drafts have no biases)")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={data['hidden_act']!r} is not supported; only 'silu'")
        layer_types = data.get("layer_types") or ()
        if data.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"sliding-window draft layers (layer_types={list(layer_types)}, use_sliding_window="
                f"{data.get('use_sliding_window')}) are not supported; only full_attention"
            )
        mask = dflash.get("mask_token_id", data.get("mask_token_id"))
        if mask is None:
            raise ValueError("DFlash config.json lacks dflash_config.mask_token_id")
        num_layers = int(data["num_hidden_layers"])
        num_target = dflash.get("num_target_layers", data.get("num_target_layers"))
        ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        if ids is None:
            if num_target is None:
                raise ValueError(
                    "DFlash config.json has neither dflash_config.target_layer_ids nor num_target_layers"
                )
            ids = build_target_layer_ids(int(num_target), num_layers)
        max_positions = int(data.get("max_position_embeddings", 32_768))
        theta, scaling = _hf_rope(data, max_positions)
        return cls(
            name=str(data.get("_name_or_path") or "dflash"),
            hidden_dim=int(data["hidden_size"]),
            num_layers=num_layers,
            num_heads=int(data["num_attention_heads"]),
            num_kv_heads=int(data["num_key_value_heads"]),
            head_dim=int(data["head_dim"]),
            ffn_dim=int(data["intermediate_size"]),
            vocab_size=int(data["vocab_size"]),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(mask),
            num_target_layers=None if num_target is None else int(num_target),
            block_size=int(dflash.get("block_size", data.get("block_size", 16))),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
        )

    @classmethod
    def for_target(cls, target) -> DFlashConfig:
        """The shape of z-lab's published drafts for the Qwen3.5 / 3.6 35B-A3B models (their April revision:
        8 layers of 32 heads, 4 kv heads of 128 dims, FFN 3 x hidden, 5 target layers, blocks of 16, YaRN
        factor 64 over 4 096 positions, theta 1e7), for `target` (a `ModelConfig`): random drafts of the real
        size for benchmarks and `--random-weights`. A target narrower than the draft's 32 x 128 attention
        (the `tiny` preset) gets `tiny_for`'s draft with blocks of 16."""
        if target.hidden_dim < 32 * 128 // 2:
            return cls.tiny_for(target, block_size=16)
        return cls(
            name=f"dflash-for-{target.name}",
            hidden_dim=target.hidden_dim,
            num_layers=8,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            ffn_dim=3 * target.hidden_dim,
            vocab_size=target.vocab_size,
            target_layer_ids=build_target_layer_ids(target.num_layers, 5),
            mask_token_id=min(PUBLISHED_MASK_TOKEN_ID, target.vocab_size - 1),
            num_target_layers=target.num_layers,
            block_size=16,
            rope_theta=1e7,
            rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096),
            max_position_embeddings=target.max_position_embeddings,
        )

    @classmethod
    def tiny_for(cls, target, *, num_layers: int = 2, block_size: int = 8) -> DFlashConfig:
        """A small draft for `target` (a `ModelConfig`), for tests: the target's hidden size and vocabulary,
        `num_layers` layers of 4 heads (2 kv heads) of 16 dims, default target layers, YaRN with a short
        original context (64 positions, factor 8) so that short test sequences cross its correction ramp."""
        return cls(
            name=f"dflash-for-{target.name}",
            hidden_dim=target.hidden_dim,
            num_layers=num_layers,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            ffn_dim=2 * target.hidden_dim,
            vocab_size=target.vocab_size,
            target_layer_ids=build_target_layer_ids(target.num_layers, num_layers),
            mask_token_id=target.vocab_size - 1,
            num_target_layers=target.num_layers,
            block_size=block_size,
            rope_theta=1e4,
            rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=64),
            max_position_embeddings=target.max_position_embeddings,
        )


def _hf_rope(data: dict, max_positions: int) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from an HF config dict, as transformers reads it."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", data.get("rope_theta", 1e4)))
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"partial_rotary_factor={partial} is not supported by the DFlash draft (RoPE on all dims)"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"rope_type={rope_type!r} is not supported; 'default' or 'yarn'")
    return theta, YarnScaling.from_hf(
        params,
        max_position_embeddings=max_positions,
        original_max_position_embeddings=data.get("original_max_position_embeddings"),
    )


# ----------------------------------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------------------------------
class DFlashLayer(nnx.Module):
    """One draft decoder layer: plain-RMSNorm pre-norm attention over [context; block] keys, then SwiGLU."""

    def __init__(self, config: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        h, d, f, eps = config.hidden_dim, config.head_dim, config.ffn_dim, config.rms_norm_eps
        self.config = config
        normal = nnx.initializers.normal(h**-0.5)
        self.input_norm = PlainRMSNorm(h, eps, dtype=dtype)
        self.q_proj = nnx.Param(normal(rngs.params(), (h, config.num_heads * d), dtype))  # [hidden, heads*d]
        self.k_proj = nnx.Param(normal(rngs.params(), (h, config.num_kv_heads * d), dtype))  # [hidden, kv*d]
        self.v_proj = nnx.Param(normal(rngs.params(), (h, config.num_kv_heads * d), dtype))  # [hidden, kv*d]
        self.o_proj = nnx.Param(normal(rngs.params(), (config.num_heads * d, h), dtype))  # [heads*d, hidden]
        self.q_norm = nnx.Param(jnp.ones((d,), dtype))  # [head_dim], plain RMSNorm weight
        self.k_norm = nnx.Param(jnp.ones((d,), dtype))  # [head_dim]
        self.post_norm = PlainRMSNorm(h, eps, dtype=dtype)
        self.gate_up = nnx.Param(normal(rngs.params(), (h, 2 * f), dtype))  # [hidden, 2*ffn], gate first
        self.down = nnx.Param(nnx.initializers.normal(f**-0.5)(rngs.params(), (f, h), dtype))  # [ffn, hidden]

    def _heads(self, x: jax.Array, proj, heads: int) -> jax.Array:
        """x [batch, seq, hidden] @ proj -> [batch, seq, heads, head_dim]."""
        return linear(x, proj[...]).reshape(*x.shape[:2], heads, self.config.head_dim)

    def keys_values(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (k_norm, then RoPE at cos/sin's positions) and values of rows x [batch, seq, hidden]: each
        [batch, seq, kv_heads, head_dim] in x.dtype."""
        c = self.config
        k = rms_norm(
            self._heads(x, self.k_proj, c.num_kv_heads), self.k_norm[...], c.rms_norm_eps, zero_centered=False
        )
        return apply_partial_rope(k, cos, sin), self._heads(x, self.v_proj, c.num_kv_heads)

    def __call__(self, x: jax.Array, cache: KVCache, start, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """The block x [batch, block, hidden] at positions start .. start + block - 1 (cos, sin [block,
        head_dim/2]) attending to the context keys cache[:, :start] and to its own: [batch, block, hidden]."""
        c = self.config
        u = self.input_norm(x)
        q = rms_norm(
            self._heads(u, self.q_proj, c.num_heads), self.q_norm[...], c.rms_norm_eps, zero_centered=False
        )
        q = apply_partial_rope(q, cos, sin)
        k, v = self.keys_values(u, cos, sin)
        out = context_block_attention(q, cache, start, k, v, c.attention_implementation)
        x = x + linear(out.reshape(*x.shape[:2], -1), self.o_proj[...])
        return x + swiglu(self.post_norm(x), self.gate_up[...], self.down[...])


def _attend(q, k, v, kv_lengths, implementation):
    """(out [batch, q, heads, d] float32, logsumexp [batch, q, heads] float32) of softmax(q k^T / sqrt(d)) v,
    keys at or past kv_lengths [batch] masked (None: none)."""
    if implementation is None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        implementation = "cudnn"
    out, lse = jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=kv_lengths, implementation=implementation, return_residual=True
    )
    lse = lse if lse.shape == q.shape[:3] else jnp.swapaxes(lse, 1, 2)  # BTN or BNT depending on backend
    return out.astype(jnp.float32), lse.astype(jnp.float32)


def context_block_attention(q, cache: KVCache, start, k, v, implementation=None) -> jax.Array:
    """Non-causal attention of block queries to the cached context and to the block's own keys.

    One softmax over both key sets, merged by their log-sum-exps, so the cache is read where it lies
    (never concatenated with the block).

    Args:
      q: [batch, block, heads, head_dim], after q_norm and RoPE.
      cache: context keys and values [batch, capacity, kv_heads, head_dim]; entries [0, start) valid.
      start: int32 scalar, the context length (may be traced; 0: no context).
      k, v: the block's keys and values [batch, block, kv_heads, head_dim].
      implementation: `jax.nn.dot_product_attention`'s; None: cuDNN on a GPU for bf16 / fp16, else XLA.

    Returns:
      [batch, block, heads, head_dim] in q.dtype.
    """
    batch = q.shape[0]
    lengths = jnp.full((batch,), start, jnp.int32)
    out_ctx, lse_ctx = _attend(
        q, cache.key.astype(q.dtype), cache.value.astype(q.dtype), lengths, implementation
    )
    out_blk, lse_blk = _attend(q, k, v, None, implementation)
    live = jnp.asarray(start) > 0  # with no context the masked softmax is meaningless: weigh it 0
    lse_ctx = jnp.where(live, lse_ctx, -jnp.inf)
    out_ctx = jnp.where(live, out_ctx, 0.0)
    lse = jnp.logaddexp(lse_ctx, lse_blk)
    out = out_ctx * jnp.exp(lse_ctx - lse)[..., None] + out_blk * jnp.exp(lse_blk - lse)[..., None]
    return out.astype(q.dtype)


class DFlashDraft(nnx.Module):
    """The DFlash draft: `fc` and `hidden_norm` over the target's features, `config.num_layers` decoder layers
    and the output `norm`. Embedding and lm head are the target's.

    Use: `context(features, cache, start, num_new)` writes the context K/V of the rows accepted since the last
    draft (the prompt's at first); `draft(block_embeddings, cache, start, head_weight)` drafts the block at
    `start` (the context length). As in the reference, only context entries persist in the cache.
    """

    def __init__(self, config: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        h = config.hidden_dim
        self.config = config
        self.dtype = dtype
        self.fc = nnx.Param(
            nnx.initializers.normal(config.feature_dim**-0.5)(rngs.params(), (config.feature_dim, h), dtype)
        )  # [taps*hidden, hidden]
        self.hidden_norm = PlainRMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List(
            [DFlashLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.norm = PlainRMSNorm(h, config.rms_norm_eps, dtype=dtype)

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE (YaRN where configured) cos, sin [..., seq, head_dim / 2] float32 at `positions`."""
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)

    def context(self, features: jax.Array, cache: list[KVCache], start, num_new=None) -> list[KVCache]:
        """Writes the context K/V of new context rows into every layer's cache.

        Args:
          features: [batch, rows, feature_dim]: the target layers' outputs (`target_layer_ids` order,
            concatenated) of the tokens at positions start .. start + rows - 1, any float dtype.
          cache: one `KVCache` [batch, capacity, kv_heads, head_dim] per draft layer holding the context at
            [0, start) (`init_dflash_cache`).
          start: int32 scalar, position of the first row (may be traced).
          num_new: rows that are real (int32 scalar, may be traced; None: all); rows past it (padding to a
            static shape) are not written.

        Returns:
          The caches holding the context at [0, start + num_new).

        Raises:
          ValueError: features not [batch, rows, feature_dim], a cache per layer missing, or (host-side ints)
            start + num_new past the capacity (traced values are not checked: rows past it are dropped).
        """
        c = self.config
        if features.ndim != 3 or features.shape[-1] != c.feature_dim:
            raise ValueError(f"features must be [batch, rows, {c.feature_dim}], got {features.shape}")
        if len(cache) != c.num_layers:
            raise ValueError(f"need one KV cache per draft layer ({c.num_layers}), got {len(cache)}")
        rows = features.shape[1]
        num_new = rows if num_new is None else num_new
        capacity = cache[0].capacity
        if isinstance(start, int) and isinstance(num_new, int) and start + num_new > capacity:
            raise ValueError(
                f"context rows up to {start + num_new} exceed the DFlash cache capacity {capacity}"
            )
        ctx = self.hidden_norm(linear(features.astype(self.dtype), self.fc[...]))  # [batch, rows, hidden]
        i = jnp.arange(rows, dtype=jnp.int32)
        cos, sin = self.cos_sin(start + i)
        index = jnp.where(i < num_new, start + i, capacity)  # padding rows: an index past the end, dropped
        out = []
        for layer, kv in zip(self.layers, cache, strict=True):
            k, v = layer.keys_values(ctx, cos, sin)
            out.append(
                KVCache(
                    key=kv.key.at[:, index].set(k.astype(kv.key.dtype), mode="drop"),
                    value=kv.value.at[:, index].set(v.astype(kv.value.dtype), mode="drop"),
                )
            )
        return out

    def draft(
        self, block_embeddings: jax.Array, cache: list[KVCache], start, head_weight: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One parallel forward over the block.

        Args:
          block_embeddings: [batch, block_size, hidden]: the target's embedding of [last token, mask, ...,
            mask] (`block_input_ids`).
          cache: the layers' caches holding the context at [0, start) (`context`).
          start: int32 scalar, the block's first position = the context length (may be traced).
          head_weight: the target's lm head [hidden, vocab] (`HybridLM.head_weight()`).

        Returns:
          (hidden [batch, block_size, hidden] after the final norm, in the parameter dtype; logits
          [batch, block_size - 1, vocab] float32 of block positions 1 .., predicting the tokens at
          start + 1 ..).
        """
        cos, sin = self.cos_sin(start + jnp.arange(block_embeddings.shape[1], dtype=jnp.int32))
        x = block_embeddings.astype(self.dtype)
        for layer, kv in zip(self.layers, cache, strict=True):
            x = layer(x, kv, start, cos, sin)
        hidden = self.norm(x)
        return hidden, head_matmul(hidden[:, 1:], head_weight)


def block_input_ids(last_token: jax.Array, config: DFlashConfig) -> jax.Array:
    """[last token, mask, ..., mask]: last_token [batch] int -> [batch, block_size] int32."""
    last = jnp.asarray(last_token, jnp.int32)
    ids = jnp.full((last.shape[0], config.block_size), config.mask_token_id, jnp.int32)
    return ids.at[:, 0].set(last)


def draft_step(draft: DFlashDraft, model, features, last_token, cache, ctx_start, num_new=None):
    """`context` then `draft` with the embedding and lm head of `model` (a `HybridLM`): features of the rows
    at ctx_start .. (num_new of them), then the block [last_token, mask, ...] at ctx_start + num_new.

    Returns:
      (hidden, logits [batch, block_size - 1, vocab] float32, the new caches); see `DFlashDraft.draft`.
    """
    num_new = features.shape[1] if num_new is None else num_new
    cache = draft.context(features, cache, ctx_start, num_new)
    ids = block_input_ids(last_token, draft.config)
    hidden, logits = draft.draft(model.embed[...][ids], cache, ctx_start + num_new, model.head_weight())
    return hidden, logits, cache


def init_dflash_cache(config: DFlashConfig, batch: int, capacity: int, dtype=jnp.float32) -> list[KVCache]:
    """Zero KV caches [batch, capacity, kv_heads, head_dim], one per draft layer; capacity: the longest
    context (prompt plus accepted tokens) the draft will see."""
    shape = (batch, capacity, config.num_kv_heads, config.head_dim)
    return [
        KVCache(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype)) for _ in range(config.num_layers)
    ]


def init_random_dflash(config: DFlashConfig, seed: int = 0, *, dtype=jnp.float32) -> DFlashDraft:
    """A draft with random weights: norms 1 + N(0, 0.1) (plain w), matrices N(0, 1 / fan_in)."""
    abstract = nnx.eval_shape(lambda: DFlashDraft(config, dtype=dtype, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(seed + 11)
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        value = var.get_value()
        shape, k = tuple(value.shape), jax.random.fold_in(key, i)
        if len(shape) == 1:
            drawn = 1.0 + 0.1 * jax.random.normal(k, shape)
        else:
            drawn = jax.random.normal(k, shape) / np.sqrt(shape[0])
        var.set_value(drawn.astype(value.dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------------------
def dflash_reference(
    draft: DFlashDraft, features, block_embeddings, head_weight
) -> tuple[jax.Array, jax.Array]:
    """The DFlash equations written out, float32, no cache: the whole context at positions 0 .. ctx - 1,
    the block at ctx .. ctx + block - 1. The oracle for `DFlashDraft.context` + `draft`.

    Args:
      draft: the module whose weights and config are used.
      features: [batch, ctx, feature_dim], ctx >= 1.
      block_embeddings: [batch, block, hidden].
      head_weight: [hidden, vocab].

    Returns:
      (hidden [batch, block, hidden] after the final norm, logits [batch, block - 1, vocab]), float32.
    """
    c = draft.config
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    norm = lambda x, w: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * f32(w)
    ctx_len, block = features.shape[1], block_embeddings.shape[1]
    cos, sin = rope_cos_sin(jnp.arange(ctx_len + block), c.head_dim, c.rope_theta, c.rope_scaling)
    cos, sin = jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)  # [ctx + block, head_dim]

    def rope(x, pos):  # x [b, t, heads, d]; NeoX rotate-half
        half = c.head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos[pos][:, None] + rotated * sin[pos][:, None]

    ctx = norm(f32(features) @ f32(draft.fc[...]), draft.hidden_norm.scale[...])
    x = f32(block_embeddings)
    groups = c.num_heads // c.num_kv_heads
    for layer in draft.layers:
        u = norm(x, layer.input_norm.scale[...])
        rows = jnp.concatenate([ctx, u], axis=1)  # [b, ctx + block, hidden]: keys and values read both
        q = norm((u @ f32(layer.q_proj[...])).reshape(*u.shape[:2], c.num_heads, -1), layer.q_norm[...])
        k = norm(
            (rows @ f32(layer.k_proj[...])).reshape(*rows.shape[:2], c.num_kv_heads, -1), layer.k_norm[...]
        )
        v = (rows @ f32(layer.v_proj[...])).reshape(*rows.shape[:2], c.num_kv_heads, -1)
        q, k = rope(q, jnp.arange(ctx_len, ctx_len + block)), rope(k, jnp.arange(ctx_len + block))
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)  # no mask: non-causal
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(*x.shape[:2], -1)
        x = x + out @ f32(layer.o_proj[...])
        g = norm(x, layer.post_norm.scale[...]) @ f32(layer.gate_up[...])
        x = x + (jax.nn.silu(g[..., : c.ffn_dim]) * g[..., c.ffn_dim :]) @ f32(layer.down[...])
    hidden = norm(x, draft.norm.scale[...])
    if isinstance(head_weight, QuantizedWeights):
        head_weight = head_weight.dequantize()[0]
    return hidden, hidden[:, 1:] @ f32(head_weight)

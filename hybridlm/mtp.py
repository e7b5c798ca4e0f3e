"""Multi-token prediction (MTP) module of Qwen3.5 / Qwen3.6 / Qwen3-Next: the drafter of speculative decoding.

One draft step for input position i (docs/mtp.md §2):

    x = concat([N(E[t_{i+1}]; w_pre_fc_norm_embedding), N(h_i; w_pre_fc_norm_hidden)]) W_fc   # [2H] -> [H]
    y = DecoderLayer_full_attention(x)              # own KV cache, own sparse MoE + shared expert
    logits = N(y; w_norm) W_lm                      # E and W_lm shared with the trunk

h_i is the trunk's last hidden state before the final norm at step 1, then the previous step's y.
Source: vLLM `Qwen3_5MultiTokenPredictor.forward` (qwen3_5_mtp.py); llama.cpp `build_mtp_head`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybridlm.config import ModelConfig
from hybridlm.layers.linear import linear
from hybridlm.layers.norms import RMSNorm
from hybridlm.model import DecoderLayer, head_logits, random_param_jax
from hybridlm.state import KVCache


class MTPModule(nnx.Module):
    """The MTP head: input norms, the [2H -> H] fusion `fc`, `config.mtp_layers` full-attention decoder
    layers (MoE + shared expert, as the trunk's) and the output norm. Embedding and lm head are the trunk's.

    Raises:
      ValueError: config.mtp_layers is 0.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if config.mtp_layers <= 0:
            raise ValueError(f"MTPModule needs config.mtp_layers >= 1, got {config.mtp_layers}")
        h, eps = config.hidden_dim, config.rms_norm_eps
        self.config = config
        self.pre_fc_norm_embedding = RMSNorm(h, eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, dtype=dtype)
        init = nnx.initializers.normal((2 * h) ** -0.5)
        self.fc = nnx.Param(init(rngs.params(), (2 * h, h), dtype))  # [2*hidden (embedding | hidden), hidden]
        self.layers = nnx.List(
            [DecoderLayer(config, "full_attention", dtype=dtype, rngs=rngs) for _ in range(config.mtp_layers)]
        )
        self.norm = RMSNorm(h, eps, dtype=dtype)

    def fuse(self, token_embeddings: jax.Array, hidden: jax.Array) -> jax.Array:
        """concat([N_e(emb), N_h(hidden)]) @ fc: [batch, seq, hidden] twice -> [batch, seq, hidden]."""
        e = self.pre_fc_norm_embedding(token_embeddings)
        g = self.pre_fc_norm_hidden(hidden)
        return linear(jnp.concatenate([e, g], axis=-1), self.fc.get_value())

    def draft_step(
        self,
        token_ids: jax.Array,
        hidden: jax.Array,
        embed: jax.Array,
        head_weight: jax.Array,
        cache: KVCache | None = None,
        start: jax.Array | int = 0,
        depth: int = 0,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """One MTP step over a chunk of positions.

        Args:
          token_ids: [batch, seq] int32, t_{i+1} for each input position i.
          hidden: [batch, seq, hidden], h_i: the trunk's pre-final-norm state, or a previous step's output.
          embed: the trunk's embedding [vocab, hidden] (`HybridLM.embed`).
          head_weight: the trunk's lm head [hidden, vocab] (`HybridLM.head_weight()`).
          cache: this MTP layer's KV cache holding positions [0, start); None: the chunk starts at 0.
          start: absolute position of the chunk's first entry (int32 scalar, may be traced).
          depth: which MTP layer (vLLM: draft step index modulo mtp_layers); static.

        Returns:
          (hidden_out [batch, seq, hidden] pre-norm, in the parameter dtype; logits [batch, seq, vocab]
          float32 predicting t_{i+2}; the cache with this chunk written at [start, start + seq)).
        """
        x = self.fuse(embed[token_ids], hidden.astype(embed.dtype))
        y, cache = self.layers[depth % len(self.layers)](x, cache, start)
        return y, head_logits(self.norm, head_weight, y), cache


def draft_step(mtp: MTPModule, model, token_ids, hidden, cache=None, start=0, depth: int = 0):
    """`MTPModule.draft_step` with the embedding and lm head of `model` (a `HybridLM`); see there."""
    return mtp.draft_step(token_ids, hidden, model.embed[...], model.head_weight(), cache, start, depth)


def init_mtp_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> list[KVCache]:
    """Zero KV caches [batch, capacity, kv_heads, head_dim], one per MTP layer."""
    shape = (batch, capacity, config.attention.num_kv_heads, config.attention.head_dim)
    return [
        KVCache(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype)) for _ in range(config.mtp_layers)
    ]


def init_random_mtp(config: ModelConfig, seed: int = 0, *, dtype=jnp.float32) -> MTPModule:
    """An MTP module with random weights drawn by role as `hybridlm.init_random` draws the trunk's.

    Raises:
      ValueError: config.mtp_layers is 0.
    """
    abstract = nnx.eval_shape(lambda: MTPModule(config, dtype=dtype, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(seed + 7)
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        value = var.get_value()
        if hasattr(value, "shape"):
            shape = tuple(value.shape)
            var.set_value(random_param_jax(path[-1], jax.random.fold_in(key, i), shape, value.dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))

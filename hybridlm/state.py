"""Decode-time state carried between prefill chunks and decode steps (spec §8)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GatedDeltaNetState:
    """State of one Gated DeltaNet layer for a batch of sequences."""

    conv: jax.Array  # [batch, conv_kernel - 1, conv_dim]: last pre-conv [q|k|v] inputs, oldest first
    recurrent: (
        jax.Array
    )  # [batch, v_heads, key_dim, value_dim] float32: the delta-rule state S (HF/FLA layout)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys (after q/k-norm and RoPE) and raw values of one attention layer, written at absolute positions."""

    key: jax.Array  # [batch, capacity, kv_heads, head_dim]
    value: jax.Array  # [batch, capacity, kv_heads, head_dim]

    @property
    def capacity(self) -> int:
        return self.key.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeKV:
    """An attention layer after a token-tree verify (`GatedAttention.verify_tree`): the cache as it was and
    the nodes' keys and values, not yet written (siblings share a position; the commit writes the accepted
    path's, `engine.tree_verify.commit_tree`)."""

    cache: KVCache  # holding positions [0, start), start the root's position
    key: jax.Array  # [batch, nodes, kv_heads, head_dim]: after q/k-norm and RoPE at start + depth
    value: jax.Array  # [batch, nodes, kv_heads, head_dim]


LayerState = GatedDeltaNetState | KVCache


def init_layer_states(config, batch: int, capacity: int, dtype=jnp.float32) -> list[LayerState]:
    """Zero states for every layer of `config`.

    Args:
      config: a `ModelConfig`.
      batch: sequences decoded together.
      capacity: KV-cache length in tokens (prompt, padded to whole chunks, plus tokens to generate).
      dtype: activation dtype of the conv state and KV cache; the recurrent state is always float32.

    Returns:
      One `GatedDeltaNetState` or `KVCache` per layer, in layer order.
    """
    return _init_layer_states(config, batch, capacity, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_layer_states(config, batch: int, capacity: int, dtype) -> list[LayerState]:
    # One program for every layer's zeros: created eagerly one by one, a 40-layer model's 80 arrays cost a
    # noticeable host dispatch at the start of each prefill.
    g, a = config.gdn, config.attention
    states: list[LayerState] = []
    for layer_type in config.layer_types:
        if layer_type == "linear_attention":
            states.append(
                GatedDeltaNetState(
                    conv=jnp.zeros((batch, g.conv_kernel - 1, g.conv_dim), dtype),
                    recurrent=jnp.zeros((batch, g.num_v_heads, g.key_dim, g.value_dim), jnp.float32),
                )
            )
        else:
            shape = (batch, capacity, a.num_kv_heads, a.head_dim)
            states.append(KVCache(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype)))
    return states


def state_nbytes(states: list[LayerState]) -> int:
    """Bytes held by the states (recurrent + conv + KV cache)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(states))

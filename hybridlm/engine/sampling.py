"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("top_k",))
def sample(logits: jax.Array, key: jax.Array, *, temperature: float | jax.Array = 0.0, top_k: int = 0,
           top_p: float | jax.Array = 1.0) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: [batch, vocab] float32.
      key: PRNG key.
      temperature: 0 means greedy (argmax); otherwise logits are divided by it.
      top_k: keep only the k most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).

    Returns:
      [batch] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    sorted_logits = jnp.sort(scaled, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # smallest logit still inside the nucleus: tokens before it have cumulative mass < top_p
    cutoff_index = jnp.sum(cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)

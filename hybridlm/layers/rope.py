"""Partial rotary position embedding, NeoX half-split, as used by Qwen3.5 / Qwen3-Next attention (spec §5.4).

Qwen3.5 uses interleaved M-RoPE (sections [11, 11, 10] over the 32 frequencies): every frequency takes its
angle from one of the temporal/height/width position streams. For text-only input the three streams are
equal, so M-RoPE reduces exactly to the 1-D rotation implemented here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, float32.

    Args:
      positions: [seq] or [batch, seq] absolute token positions (int).
      rotary_dim: rotated dims per head (head_dim * partial_rotary_factor), even.
      theta: RoPE base (rope_theta).

    Returns:
      cos, sin: [..., seq, rotary_dim // 2] float32, angle_i = pos * theta^(-2i / rotary_dim).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., seq, rotary_dim/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first rotary_dim dims of each head (pairs i, i + rotary_dim/2); the rest pass through.

    Args:
      x: [batch, seq, heads, head_dim].
      cos, sin: [seq, rotary_dim // 2] or [batch, seq, rotary_dim // 2] float32.

    Returns:
      [batch, seq, heads, head_dim] in x.dtype.
    """
    half = cos.shape[-1]
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)  # [b, t, 1, half]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

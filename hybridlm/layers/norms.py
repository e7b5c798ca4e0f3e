"""RMSNorm variants used by the hybrid models (spec §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = True) -> jax.Array:
    """RMS normalisation over the last axis, computed in float32, cast back to x.dtype.

    y = x / sqrt(mean(x^2) + eps) * (1 + w)   (zero_centered, every HF Qwen3.5/Next norm but the GDN output)
    y = x / sqrt(mean(x^2) + eps) * w         (plain)
    Source: HF `Qwen3_5MoeRMSNorm.forward`; spec §3.

    Args:
      x: [..., dim] any float dtype.
      weight: [dim].
      eps: added to the mean square.
      zero_centered: use (1 + w) instead of w.
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (y * (1.0 + w if zero_centered else w)).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated RMSNorm of the Gated DeltaNet output: w * norm(x) * silu(gate); norm first, then gate.

    Source: HF `Qwen3_5MoeRMSNormGated.forward` (plain w, not 1 + w); spec §3.

    Args:
      x, gate: [..., value_dim] (x.dtype is the output dtype).
      weight: [value_dim].
    """
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = weight.astype(jnp.float32) * normed.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm, y = norm(x) * (1 + scale); `scale` starts at 0 like HF's."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.zeros((dim,), dtype))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class PlainRMSNorm(nnx.Module):
    """Plain RMSNorm, y = norm(x) * scale; `scale` starts at 1 like HF's `Qwen3RMSNorm` (the DFlash draft's).

    HF rounds norm(x) to x.dtype before the multiply; this rounds once, after it (equal in float32)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, zero_centered=False)

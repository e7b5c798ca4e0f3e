"""Partial rotary position embedding, NeoX half-split, as used by Qwen3.5 / Qwen3-Next attention (spec §5.4),
and YaRN-scaled frequencies (the DFlash draft model, docs/dflash.md §3).

Qwen3.5 uses interleaved M-RoPE (sections [11, 11, 10] over the 32 frequencies): every frequency takes its
angle from one of the temporal/height/width position streams. For text-only input the three streams are
equal, so M-RoPE reduces exactly to the 1-D rotation implemented here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN RoPE scaling: HF `rope_parameters` (or legacy `rope_scaling`) with rope_type "yarn".

    Source: Peng et al., "YaRN", arXiv:2309.00071; HF transformers 5.23 `_compute_yarn_parameters`
    (the same formulas as 4.57.1, the version z-lab's DFlash reference pins).
    """

    factor: float  # context extension factor s; interpolated frequencies are divided by it
    original_max_position_embeddings: int  # the pretraining context L
    beta_fast: float = 32.0  # rotations per L above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations per L below which a frequency is interpolated
    mscale: float | None = None  # with mscale_all_dim: attention factor m(s, mscale) / m(s, mscale_all_dim)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # multiplies cos and sin; None: derived from factor (and mscales)
    truncate: bool = True  # floor / ceil the correction range to whole dims

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"YaRN factor={self.factor} must be positive")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"YaRN original_max_position_embeddings={self.original_max_position_embeddings} must be "
                "positive"
            )
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(f"YaRN beta_fast={self.beta_fast}, beta_slow={self.beta_slow} must be positive")

    @classmethod
    def from_hf(
        cls,
        params: dict,
        *,
        max_position_embeddings: int,
        original_max_position_embeddings: int | None = None,
    ) -> YarnScaling:
        """From an HF yarn parameter dict, with HF's defaults: `factor` None means max_position_embeddings /
        original_max_position_embeddings; a missing original length is max_position_embeddings (HF
        `standardize_rope_params`), and a top-level config key `original_max_position_embeddings`, passed as
        `original_max_position_embeddings`, wins over the dict's; beta_fast / beta_slow that are 0 or missing
        are 32 / 1.

        Raises:
          ValueError: no `factor` key, or values out of range (naming the key).
        """
        if "factor" not in params:
            raise ValueError(f"yarn rope parameters lack 'factor': {params}")
        original = original_max_position_embeddings or params.get(
            "original_max_position_embeddings", max_position_embeddings
        )
        factor = params["factor"]
        if factor is None:
            factor = max_position_embeddings / original
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    def cos_sin_scale(self) -> float:
        """The attention factor that multiplies cos and sin: `attention_factor`, else
        m(s, mscale) / m(s, mscale_all_dim) when both mscales are set (non-zero), else m(s, 1), with
        m(s, a) = 0.1 a ln(s) + 1 for s > 1 and 1 otherwise."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m(scale, a=1.0):
            return 1.0 if scale <= 1 else 0.1 * a * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim))
        return m(self.factor)

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] float32, on the host:

            p_i = theta^(2i / d);  r(i) = clip((i - lo) / (hi - lo), 0, 1)
            inv_freq_i = (1 / (s p_i)) r(i) + (1 / p_i) (1 - r(i))
            lo, hi = d ln(L / (2 pi beta)) / (2 ln theta) for beta = beta_fast, beta_slow
                     (floor, ceil when truncated), clamped to [0, d - 1]; hi += 0.001 when equal

        The float32 steps follow HF's torch ops one by one (p_i correctly rounded), so the frequencies are
        HF's bit for bit (tests/test_dflash.py)."""
        d, L = rotary_dim, self.original_max_position_embeddings

        def correction_dim(rotations):
            return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001  # HF's guard against a zero-width ramp
        f32 = np.float32
        exponent = (np.arange(0, d, 2).astype(f32) / f32(d)).astype(np.float64)
        pos_freqs = (np.float64(theta) ** exponent).astype(f32)
        extrapolated = f32(1.0) / pos_freqs
        interpolated = f32(1.0) / (f32(self.factor) * pos_freqs)
        ramp = np.clip((np.arange(d // 2, dtype=f32) - f32(lo)) / f32(hi - lo), f32(0), f32(1))
        keep = f32(1) - ramp  # weight of the extrapolated (unscaled) frequency
        return (interpolated * (f32(1) - keep) + extrapolated * keep).astype(f32)


def rope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float, scaling: YarnScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, float32.

    Args:
      positions: [seq] or [batch, seq] absolute token positions (int).
      rotary_dim: rotated dims per head (head_dim * partial_rotary_factor), even.
      theta: RoPE base (rope_theta).
      scaling: None: plain RoPE; a `YarnScaling`: YaRN's frequencies, cos and sin times its attention factor
        (HF `Qwen3RotaryEmbedding.forward`).

    Returns:
      cos, sin: [..., seq, rotary_dim // 2] float32, angle_i = pos * inv_freq_i; plain inv_freq_i =
      theta^(-2i / rotary_dim).
    """
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., seq, rotary_dim/2]
        return jnp.cos(angles), jnp.sin(angles)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(scaling.inv_freq(rotary_dim, theta))
    scale = jnp.float32(scaling.cos_sin_scale())
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


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

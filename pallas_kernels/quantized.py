"""Block-quantized expert weights for the grouped matmul (GGUF Q8_0 / Q5_0 / Q6_K / Q4_0 / Q4_1 / Q4_K compatible).

A `QuantizedWeights` stands in for a float rhs `[groups, k, n]` (k = the input dim, n = the output dim).
Quantization blocks are `block_size` (32) consecutive elements along k, as in GGUF, which also quantizes
along the input dim. Per block and output column there is one scale (and, for 4 bits, one offset):

- bits=8: `values` int8 `[groups, k, n]`; value = scale * q. This is GGUF Q8_0 exactly; Q5_0 (codes q - 16)
  and Q6_K (block_size 16, float32 scales d * sc) too.
- bits=4: `values` uint8 `[groups, k // 2, n]`, two 4-bit codes per byte in the "split-half" layout along k:
  the low nibble of byte row r holds k-row r, the high nibble holds k-row r + k/2. A kernel then multiplies
  `lhs[:, :k/2]` by the low nibbles and `lhs[:, k/2:]` by the high nibbles with no interleaving shuffle,
  and one byte-tile load feeds two tensor-core dots. q is unsigned in [0, 15]; value = scale * q + offset.
  GGUF Q4_0 is offset = -8 * scale; Q4_1 is (scale, offset) = (d, m); Q4_K per 32-block is
  scale = d * sc, offset = -dmin * m (the super-block's 6-bit sub-scales folded in by the loader).
  Requires k % (2 * block_size) == 0, so that both halves split into whole blocks.

`scales` and `offsets` are `[groups, k // block_size, n]` in float16, bfloat16 or float32.

With `k_major=True` (what `quantize_int8`, `quantize_int4` and the GGUF loader produce) `values` is stored
transposed, `[groups, n, k]` (bits=8) or `[groups, n, k // 2]` (bits=4, the same split-half bytes): each
output column's codes are contiguous along k, as in GGUF's own rows. The grouped-matmul kernel then reads
four consecutive k-codes per 32-bit shared-memory load in the tensor-core operand layout (rather than one
byte per load) and dequantizes them by one PTX block (H100, 2026-11-25, docs/benchmarks_gmm.md: weight-read
bound 1.1-1.2x faster, prefill sizes 0.98-1.2x).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["QuantizedWeights", "quantize_int4", "quantize_int8", "quantize_like"]


@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """Block-quantized stand-in for a float array `[groups, k, n]` (a JAX pytree).

    Attributes:
      values: bits=8: int8 `[groups, k, n]`; bits=4: uint8 `[groups, k // 2, n]`, split-half packed
        (low nibble = k-row r, high nibble = k-row r + k/2), codes in [0, 15]; the last two dims swapped
        when `k_major`.
      scales: `[groups, k // block_size, n]`, float16/bfloat16/float32.
      offsets: None for bits=8; `[groups, k // block_size, n]` like `scales` for bits=4.
      bits: 8 or 4 (static pytree metadata).
      block_size: elements per quantization block along k (static; 32 in GGUF).
      k_major: `values` stored `[groups, n, rows]` instead of `[groups, rows, n]` (static; see the module
        docstring).
    """

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array | None = None
    bits: int = dataclasses.field(default=8, metadata={"static": True})
    block_size: int = dataclasses.field(default=32, metadata={"static": True})
    k_major: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(groups, k, n)` of the float array this stands for."""
        groups, a, b = self.values.shape
        rows, n = (b, a) if self.k_major else (a, b)
        return (groups, rows * 2 if self.bits == 4 else rows, n)

    def _values_kn(self) -> jax.Array:
        return jnp.swapaxes(self.values, 1, 2) if self.k_major else self.values

    def with_k_major(self, k_major: bool = True) -> QuantizedWeights:
        """The same weights with `values` stored `[groups, n, rows]` (k_major) or `[groups, rows, n]`."""
        if k_major == self.k_major:
            return self
        return dataclasses.replace(self, values=jnp.swapaxes(self.values, 1, 2), k_major=k_major)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def nbytes(self) -> int:
        """Bytes of values + scales + offsets in memory."""
        arrays = [self.values, self.scales] + ([] if self.offsets is None else [self.offsets])
        return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays))

    @property
    def half_precision_scales(self) -> bool:
        """Whether the scales are float16 / bfloat16 (at most 11 significant bits): then (2**15 + 128) * scale is
        exact in float32, which the kernels' one-fma int8 dequantization needs (`pallas_triton._dequantize_asm`)."""
        return jnp.dtype(self.scales.dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

    @property
    def bytes_per_param(self) -> float:
        """`nbytes` per represented weight (bf16 = 2.0; int8 with f16 scales = 1.0625)."""
        return self.nbytes / math.prod(self.shape)

    def check(self) -> None:
        """Validates dtypes and shapes.

        Raises:
          ValueError: bits not in {4, 8}, wrong dtypes, or shapes that disagree.
        """
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits}; supported: 4, 8")
        groups, k, n = self.shape
        bs = self.block_size
        want_dtype = jnp.int8 if self.bits == 8 else jnp.uint8
        if self.values.dtype != want_dtype:
            raise ValueError(f"bits={self.bits} needs values of dtype {jnp.dtype(want_dtype).name}, "
                             f"got {self.values.dtype}")
        if k % (bs * (2 if self.bits == 4 else 1)):
            raise ValueError(f"k={k} must be a multiple of {bs * (2 if self.bits == 4 else 1)} "
                             f"(block_size={bs}, bits={self.bits})")
        want = (groups, k // bs, n)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"scales.shape={tuple(self.scales.shape)}, expected {want}")
        if self.bits == 4:
            if self.offsets is None or tuple(self.offsets.shape) != want:
                raise ValueError(f"bits=4 needs offsets of shape {want}, got "
                                 f"{None if self.offsets is None else tuple(self.offsets.shape)}")
        elif self.offsets is not None:
            raise ValueError("bits=8 (Q8_0) takes no offsets")

    def codes(self) -> jax.Array:
        """Unpacked integer codes `[groups, k, n]` int32 (int8 range, or [0, 15] for bits=4)."""
        if self.bits == 8:
            return self._values_kn().astype(jnp.int32)
        v = self._values_kn().astype(jnp.int32)
        return jnp.concatenate([v & 0xF, v >> 4], axis=1)  # split-half: rows [0, k/2) then [k/2, k)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weights `[groups, k, n]` in `dtype` (pure JAX; the oracle for the kernels)."""
        groups, k, n = self.shape
        bs = self.block_size
        q = self.codes().astype(jnp.float32).reshape(groups, k // bs, bs, n)
        w = q * self.scales.astype(jnp.float32)[:, :, None, :]
        if self.offsets is not None:
            w = w + self.offsets.astype(jnp.float32)[:, :, None, :]
        return w.reshape(groups, k, n).astype(dtype)


jax.tree_util.register_dataclass(QuantizedWeights)


def _blocks(w: jax.Array, block_size: int) -> jax.Array:
    groups, k, n = w.shape
    if k % block_size:
        raise ValueError(f"k={k} is not a multiple of block_size={block_size}")
    return w.astype(jnp.float32).reshape(groups, k // block_size, block_size, n)


@functools.partial(jax.jit, static_argnames=("block_size", "scale_dtype", "k_major"))
def quantize_int8(w: jax.Array, block_size: int = 32, scale_dtype=jnp.float16, k_major: bool = True
                  ) -> QuantizedWeights:
    """Symmetric 8-bit quantization along k (GGUF Q8_0: scale = max|w| / 127 per block).

    Args:
      w: float `[groups, k, n]`, k a multiple of `block_size`.
      block_size: elements per block along k.
      scale_dtype: dtype of the stored scales (GGUF stores float16).
      k_major: store `values` `[groups, n, k]` (the kernel's fast layout) rather than `[groups, k, n]`.

    Returns:
      QuantizedWeights with bits=8.
    """
    wb = _blocks(w, block_size)                                       # [g, k/bs, bs, n]
    scale = (jnp.max(jnp.abs(wb), axis=2) / 127.0).astype(scale_dtype)  # [g, k/bs, n]
    s = scale.astype(jnp.float32)[:, :, None, :]
    q = jnp.clip(jnp.round(wb / jnp.where(s == 0, 1.0, s)), -127, 127).astype(jnp.int8)
    return QuantizedWeights(values=q.reshape(w.shape), scales=scale, offsets=None, bits=8,
                            block_size=block_size).with_k_major(k_major)


@functools.partial(jax.jit, static_argnames=("block_size", "scale_dtype", "k_major"))
def quantize_int4(w: jax.Array, block_size: int = 32, scale_dtype=jnp.float16, k_major: bool = True
                  ) -> QuantizedWeights:
    """Asymmetric 4-bit quantization along k (GGUF Q4_1 style: value = scale * q + offset, q in [0, 15]).

    Args:
      w: float `[groups, k, n]`, k a multiple of 2 * `block_size`.
      block_size: elements per block along k.
      scale_dtype: dtype of the stored scales and offsets.
      k_major: store `values` `[groups, n, k // 2]` (the kernel's fast layout) rather than `[groups, k // 2, n]`.

    Returns:
      QuantizedWeights with bits=4, values packed split-half (see module docstring).

    Raises:
      ValueError: if k is not a multiple of 2 * block_size.
    """
    groups, k, n = w.shape
    if k % (2 * block_size):
        raise ValueError(f"k={k} must be a multiple of 2 * block_size={2 * block_size} for 4-bit packing")
    wb = _blocks(w, block_size)
    lo, hi = jnp.min(wb, axis=2), jnp.max(wb, axis=2)
    scale = ((hi - lo) / 15.0).astype(scale_dtype)
    offset = lo.astype(scale_dtype)
    s = scale.astype(jnp.float32)[:, :, None, :]
    q = jnp.round((wb - offset.astype(jnp.float32)[:, :, None, :]) / jnp.where(s == 0, 1.0, s))
    q = jnp.clip(q, 0, 15).astype(jnp.uint8).reshape(groups, k, n)
    packed = q[:, : k // 2] | (q[:, k // 2:] << 4)                   # [g, k/2, n]
    return QuantizedWeights(values=packed, scales=scale, offsets=offset, bits=4,
                            block_size=block_size).with_k_major(k_major)


def quantize_like(w, template):
    """`w` ([groups, k, n] float array or `QuantizedWeights`) in the storage format of `template`.

    A `QuantizedWeights` template: the same bits, block_size, scale dtype and k_major, from `w`'s float values
    (`quantize_int8` / `quantize_int4`; `w` itself when it already has that format). An array template: `w`'s
    float values in its dtype. The template's group and shape are not used (a [1, ...] slot serves).

    Not exact unless `w` already has the format: e.g. Q6_K weights requantized to 4 bits get 4-bit rounding.
    """
    if isinstance(w, QuantizedWeights):
        if isinstance(template, QuantizedWeights) and _format(w) == _format(template):
            return w
        w = w.dequantize(jnp.float32)
    if not isinstance(template, QuantizedWeights):
        return jnp.asarray(w).astype(template.dtype)
    quantize = quantize_int8 if template.bits == 8 else quantize_int4
    return quantize(jnp.asarray(w, jnp.float32), block_size=template.block_size,
                    scale_dtype=jnp.dtype(template.scales.dtype), k_major=template.k_major)


def _format(q: QuantizedWeights) -> tuple:
    return (q.bits, q.block_size, q.k_major, jnp.dtype(q.scales.dtype),
            None if q.offsets is None else jnp.dtype(q.offsets.dtype))

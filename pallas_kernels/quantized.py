"""Block-quantized expert weights for the grouped matmul (GGUF Q8_0 / Q5_0 / Q6_K / Q4_0 / Q4_1 / Q4_K).

A `QuantizedWeights` stands in for a float rhs `[groups, k, n]` (k = the input dim, n = the output dim).
Quantization blocks are `block_size` (32) consecutive elements along k, as in GGUF, which also quantizes
along the input dim. Per block and output column there is one scale (and, for 4 bits, one offset):

- bits=8: `values` int8 `[groups, k, n]`; value = scale * q (+ offset, where `offsets` is given). This is GGUF
  Q8_0 exactly; Q5_0 (codes q - 16) and Q6_K (block_size 16, float32 scales d * sc) too, and with offsets Q5_1
  (codes in [0, 31], offset m) and Q5_K (scale d * sc, offset -dmin * m, float32).
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
byte per load) and dequantizes them by one PTX block.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["QuantizedWeights", "common_format", "quantize_int4", "quantize_int8", "quantize_like", "reencode"]


@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """Block-quantized stand-in for a float array `[groups, k, n]` (a JAX pytree).

    Attributes:
      values: bits=8: int8 `[groups, k, n]`; bits=4: uint8 `[groups, k // 2, n]`, split-half packed
        (low nibble = k-row r, high nibble = k-row r + k/2), codes in [0, 15]; the last two dims swapped
        when `k_major`.
      scales: `[groups, k // block_size, n]`, float16/bfloat16/float32.
      offsets: `[groups, k // block_size, n]` like `scales`: required for bits=4, optional for bits=8.
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
        """Whether the scales are float16 / bfloat16 (at most 11 significant bits): then (2**15 + 128) * scale
        is exact in float32, which the kernels' one-fma int8 dequantization needs
        (`grouped_matmul.common.dequantize_asm`)."""
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
            raise ValueError(
                f"bits={self.bits} needs values of dtype {jnp.dtype(want_dtype).name}, "
                f"got {self.values.dtype}"
            )
        if k % (bs * (2 if self.bits == 4 else 1)):
            raise ValueError(
                f"k={k} must be a multiple of {bs * (2 if self.bits == 4 else 1)} "
                f"(block_size={bs}, bits={self.bits})"
            )
        want = (groups, k // bs, n)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"scales.shape={tuple(self.scales.shape)}, expected {want}")
        if self.bits == 4 and self.offsets is None:
            raise ValueError(f"bits=4 needs offsets of shape {want}, got None")
        if self.offsets is not None and tuple(self.offsets.shape) != want:
            raise ValueError(f"offsets.shape={tuple(self.offsets.shape)}, expected {want}")

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


@functools.partial(jax.jit, static_argnames=("block_size", "scale_dtype", "k_major", "offsets"))
def quantize_int8(
    w: jax.Array, block_size: int = 32, scale_dtype=jnp.float16, k_major: bool = True, offsets: bool = False
) -> QuantizedWeights:
    """8-bit quantization along k: symmetric (GGUF Q8_0: scale = max|w| / 127 per block), or with `offsets`
    asymmetric (scale = (max - min) / 255, offset = min + 128 scale, codes in [-128, 127]).

    Args:
      w: float `[groups, k, n]`, k a multiple of `block_size`.
      block_size: elements per block along k.
      scale_dtype: dtype of the stored scales (and offsets; GGUF stores float16).
      k_major: store `values` `[groups, n, k]` (the kernel's fast layout) rather than `[groups, k, n]`.
      offsets: the asymmetric form (the layout GGUF Q5_1 / Q5_K experts are kept in).

    Returns:
      QuantizedWeights with bits=8.
    """
    wb = _blocks(w, block_size)  # [g, k/bs, bs, n]
    if offsets:
        lo, hi = jnp.min(wb, axis=2), jnp.max(wb, axis=2)
        scale = ((hi - lo) / 255.0).astype(scale_dtype)
        offset = (lo + 128.0 * scale.astype(jnp.float32)).astype(scale_dtype)
        s, o = scale.astype(jnp.float32)[:, :, None, :], offset.astype(jnp.float32)[:, :, None, :]
        q = jnp.clip(jnp.round((wb - o) / jnp.where(s == 0, 1.0, s)), -128, 127).astype(jnp.int8)
    else:
        scale = (jnp.max(jnp.abs(wb), axis=2) / 127.0).astype(scale_dtype)  # [g, k/bs, n]
        offset = None
        s = scale.astype(jnp.float32)[:, :, None, :]
        q = jnp.clip(jnp.round(wb / jnp.where(s == 0, 1.0, s)), -127, 127).astype(jnp.int8)
    return QuantizedWeights(
        values=q.reshape(w.shape), scales=scale, offsets=offset, bits=8, block_size=block_size
    ).with_k_major(k_major)


@functools.partial(jax.jit, static_argnames=("block_size", "scale_dtype", "k_major"))
def quantize_int4(
    w: jax.Array, block_size: int = 32, scale_dtype=jnp.float16, k_major: bool = True
) -> QuantizedWeights:
    """Asymmetric 4-bit quantization along k (GGUF Q4_1 style: value = scale * q + offset, q in [0, 15]).

    Args:
      w: float `[groups, k, n]`, k a multiple of 2 * `block_size`.
      block_size: elements per block along k.
      scale_dtype: dtype of the stored scales and offsets.
      k_major: store `values` `[groups, n, k // 2]` (the kernel's fast layout) rather than `[groups, k // 2,
        n]`.

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
    packed = q[:, : k // 2] | (q[:, k // 2 :] << 4)  # [g, k/2, n]
    return QuantizedWeights(
        values=packed, scales=scale, offsets=offset, bits=4, block_size=block_size
    ).with_k_major(k_major)


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
    kw = {
        "block_size": template.block_size,
        "scale_dtype": jnp.dtype(template.scales.dtype),
        "k_major": template.k_major,
    }
    if template.bits == 8:
        return quantize_int8(jnp.asarray(w, jnp.float32), offsets=template.offsets is not None, **kw)
    return quantize_int4(jnp.asarray(w, jnp.float32), **kw)


def _format(q: QuantizedWeights) -> tuple:
    return (
        q.bits,
        q.block_size,
        q.k_major,
        jnp.dtype(q.scales.dtype),
        None if q.offsets is None else jnp.dtype(q.offsets.dtype),
    )


def common_format(formats):
    """The narrowest storage format that holds each of `formats` exactly (`reencode`), as a template: a
    `QuantizedWeights` whose leaves are `jax.ShapeDtypeStruct`s, or a `jax.ShapeDtypeStruct` for float
    weights.

    Args:
      formats: `QuantizedWeights` and/or float arrays (or their ShapeDtypeStruct stand-ins), all of one
        `[groups, k, n]` shape.

    Raises:
      ValueError: formats of different shapes, or blocks with no common refinement.

    Quantized ones only: 8 bits if any is 8-bit (4-bit codes fit int8), the smallest block, the widest scale
    dtype (float16 with bfloat16 gives float32), offsets if any has them or any is 4-bit; k-major if any is.
    With
    any float format: the widest float dtype (quantized weights are then dequantized into it, which rounds
    them to it as a dense load does).
    """
    formats = list(formats)
    shapes = {tuple(f.shape) for f in formats}
    if len(shapes) != 1:
        raise ValueError(f"weights of different shapes {sorted(shapes)} have no common format")
    floats = [f for f in formats if not isinstance(f, QuantizedWeights)]
    groups, k, n = formats[0].shape
    if floats:
        return jax.ShapeDtypeStruct((groups, k, n), jnp.result_type(*[f.dtype for f in floats]))
    bits = 8 if any(f.bits == 8 for f in formats) else 4
    block = min(f.block_size for f in formats)
    if any(f.block_size % block for f in formats):
        raise ValueError(
            f"quantization blocks {sorted({f.block_size for f in formats})} have no common refinement"
        )
    dtype = jnp.result_type(
        *[f.scales.dtype for f in formats], *[f.offsets.dtype for f in formats if f.offsets is not None]
    )
    offsets = bits == 4 or any(f.offsets is not None or f.bits == 4 for f in formats)
    k_major = any(f.k_major for f in formats)
    rows = k // 2 if bits == 4 else k
    values = jax.ShapeDtypeStruct(
        (groups, n, rows) if k_major else (groups, rows, n), jnp.int8 if bits == 8 else jnp.uint8
    )
    blocks = jax.ShapeDtypeStruct((groups, k // block, n), dtype)
    return QuantizedWeights(
        values=values,
        scales=blocks,
        offsets=blocks if offsets else None,
        bits=bits,
        block_size=block,
        k_major=k_major,
    )


def reencode(w, template):
    """`w` (`QuantizedWeights` or float array) stored in the format of `template` (e.g. from `common_format`)
    with the same values: codes widened (4-bit to int8), scales and offsets repeated to a smaller block and
    cast to a wider dtype, zero offsets where `w` has none. Dequantizing gives `w`'s float32 weights bit for
    bit. A
    float template: `w` dequantized into its dtype (a rounding where that dtype is narrower than float32).

    Raises:
      ValueError: a format that cannot hold `w` exactly (fewer bits, a block that does not divide `w`'s, a
        narrower scale dtype, no offsets where `w` has them, or quantized from float weights).
    """
    if not isinstance(template, QuantizedWeights):
        w = w.dequantize(jnp.float32) if isinstance(w, QuantizedWeights) else jnp.asarray(w)
        return w.astype(template.dtype)
    if not isinstance(w, QuantizedWeights):
        raise ValueError(
            "float weights cannot be re-encoded as quantized ones exactly (quantize_like rounds them)"
        )  # noqa: TRY004
    dtype = jnp.dtype(template.scales.dtype)
    problems = [
        why
        for bad, why in (
            (w.bits > template.bits, f"{w.bits}-bit codes in a {template.bits}-bit format"),
            (
                w.block_size % template.block_size,
                f"blocks of {w.block_size} in blocks of {template.block_size}",
            ),
            (jnp.result_type(w.scales.dtype, dtype) != dtype, f"{w.scales.dtype} scales as {dtype}"),
            (w.offsets is not None and template.offsets is None, "offsets in a format without them"),
        )
        if bad
    ]
    if problems:
        raise ValueError(f"cannot re-encode exactly: {'; '.join(problems)}")
    repeat = w.block_size // template.block_size

    def widen(a):  # [g, k / b, n] -> [g, k / b', n]
        return jnp.repeat(a, repeat, axis=1).astype(dtype)

    scales = widen(w.scales)
    offsets = None
    if template.offsets is not None:
        offsets = widen(w.offsets) if w.offsets is not None else jnp.zeros_like(scales)
    values = w.values if w.bits == template.bits else w.codes().astype(jnp.int8)  # [g, k, n] (4 -> 8 bits)
    out = QuantizedWeights(
        values=values,
        scales=scales,
        offsets=offsets,
        bits=template.bits,
        block_size=template.block_size,
        k_major=w.k_major if w.bits == template.bits else False,
    ).with_k_major(template.k_major)
    out.check()
    return out

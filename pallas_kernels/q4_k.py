"""GGUF Q4_K weights as the kernels read them: expanded into `QuantizedWeights`, or in the file's own blocks.

A Q4_K tensor row of k values is k / 256 super-blocks of 144 bytes (ggml `block_q4_K`): d and dmin
(float16), 12 bytes packing eight 6-bit sub-block scales sc and mins m (`get_scale_min_k4`), then 128 bytes of
4-bit codes q in four groups of 32 bytes, group i holding sub-block 2i in its low nibbles and sub-block 2i + 1
in its high nibbles. Value j of sub-block s is d * sc[s] * q - dmin * m[s].

- `q4_k_to_quantized` expands blocks into the kernels' 4-bit `QuantizedWeights` (split-half codes, float32
  scale d * sc and offset -dmin * m per 32 values): 6 bits a weight, for the tensor-core grouped matmul.
- `Q4KExperts` names the blocks where they lie, in rows of packed experts (the offload pool, a held layer,
  rows copied from host memory), so that the matrix-vector kernel (`grouped_matmul.pallas_gemv`) reads each
  routed expert's 4.5 bits a weight in place: no gather, no expansion.

Source: ggml `ggml-common.h` (block_q4_K) and `ggml-quants.c` (`dequantize_row_q4_K`, `get_scale_min_k4`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.quantized import QuantizedWeights

__all__ = ["Q4KExperts", "Q4_K_BYTES", "QK_K", "q4_k_to_quantized"]

QK_K = 256  # values a super-block
Q4_K_BYTES = 144  # bytes a super-block: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of codes


def q4_k_to_quantized(raw: jax.Array, k: int) -> QuantizedWeights:
    """Q4_K blocks uint8 [n, out, k // 256 * 144] -> k-major 4-bit `QuantizedWeights` [n, k, out] with float32
    scale d*sc and offset -dmin*m per 32 (traceable; what `gguf_quants.to_quantized_weights` computes on the
    host, exactly: the products of an 11-bit float16 mantissa and a 6-bit integer are exact in float32).

    Raises:
      ValueError: k not a multiple of 256, or `raw` of another row size."""
    n, out, row = raw.shape
    if k % QK_K or row != k // QK_K * Q4_K_BYTES:
        raise ValueError(f"Q4_K rows of {row} bytes do not hold k={k} (a multiple of 256) values")
    nb = k // QK_K
    b = raw.reshape(n, out, nb, Q4_K_BYTES)
    dd = jax.lax.bitcast_convert_type(b[..., :4].reshape(n, out, nb, 2, 2), jnp.float16)
    d, dmin = dd[..., 0].astype(jnp.float32), dd[..., 1].astype(jnp.float32)  # [n, out, nb]
    s = b[..., 4:16].astype(jnp.int32)  # get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-7
    lo_sc, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo_sc & 0x3F, (mix & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)  # [n, out, nb, 8]
    m = jnp.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    scales = (d[..., None] * sc.astype(jnp.float32)).reshape(n, out, nb * 8)
    offsets = (-(dmin[..., None] * m.astype(jnp.float32))).reshape(n, out, nb * 8)
    qs = b[..., 16:].reshape(n, out, nb, 4, 1, 32)  # sub-blocks 2i (low nibbles) and 2i+1 (high) share 32
    codes = ((qs >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)) & 0x0F).reshape(n, out, k)
    half = k // 2
    values = codes[..., :half] | (codes[..., half:] << 4)  # split-half packing along k
    return QuantizedWeights(
        values=values.astype(jnp.uint8),
        scales=jnp.swapaxes(scales, 1, 2),
        offsets=jnp.swapaxes(offsets, 1, 2),
        bits=4,
        block_size=32,
        k_major=True,
    )


@dataclasses.dataclass(frozen=True)
class Q4KExperts:
    """Stand-in for float weights `[groups, k, n]` held as GGUF Q4_K blocks in rows of bytes (a JAX pytree).

    Group g's weights are the n Q4_K rows (output columns) that start at byte `offset` of `data[g]`, each
    k // 256 super-blocks of 144 bytes, column c at `offset + c * k // 256 * 144`: the layout of a GGUF Q4_K
    tensor [n, k] (an expert's gate and up tensors concatenated along n give a fused gate_up). A row of
    `data` may hold several such parameters back to back (`offload.expert_cache.ExpertLayout`), so the
    offload pool itself serves as `data`, its slots as the groups.

    Attributes:
      data: uint8 `[groups, row_bytes]`, row_bytes a multiple of 144.
      offset: byte offset of this parameter in a row, a multiple of 144 (static).
      k: input dim, a multiple of 256 (static).
      n: output dim (static).
    """

    data: jax.Array
    offset: int = dataclasses.field(metadata={"static": True})
    k: int = dataclasses.field(metadata={"static": True})
    n: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(groups, k, n)` of the float array this stands for."""
        return (self.data.shape[0], self.k, self.n)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def row_bytes(self) -> int:
        """Bytes of one output column (a Q4_K row)."""
        return self.k // QK_K * Q4_K_BYTES

    def check(self) -> None:
        """Validates dtype, shapes and alignment.

        Raises:
          ValueError: data not uint8 [groups, bytes], k not a multiple of 256, an offset off the 144-byte
            super-blocks, or a parameter past the end of the rows.
        """
        if self.data.dtype != jnp.uint8 or self.data.ndim != 2:
            raise ValueError(
                f"Q4_K rows must be uint8 [groups, bytes], got {self.data.dtype} {self.data.shape}"
            )
        if self.k % QK_K:
            raise ValueError(f"k={self.k}: Q4_K needs a multiple of {QK_K}")
        if self.offset % Q4_K_BYTES or self.data.shape[1] % Q4_K_BYTES:
            raise ValueError(
                f"offset {self.offset} and rows of {self.data.shape[1]} bytes must be whole "
                f"{Q4_K_BYTES}-byte super-blocks"
            )
        if self.offset + self.n * self.row_bytes > self.data.shape[1]:
            raise ValueError(
                f"{self.n} Q4_K rows of {self.row_bytes} bytes from byte {self.offset} pass the end of "
                f"rows of {self.data.shape[1]} bytes"
            )

    def blocks(self) -> jax.Array:
        """This parameter's bytes, uint8 `[groups, n, k // 256 * 144]` (a slice: a copy of the rows)."""
        end = self.offset + self.n * self.row_bytes
        return self.data[:, self.offset : end].reshape(self.data.shape[0], self.n, self.row_bytes)

    def take(self, groups: jax.Array) -> Q4KExperts:
        """The groups `groups` [m] int32 (traceable; clamped into range, as jnp's gather)."""
        return dataclasses.replace(self, data=self.data[groups])

    def to_quantized(self) -> QuantizedWeights:
        """The same weights as the kernels' 4-bit `QuantizedWeights` (`q4_k_to_quantized`)."""
        return q4_k_to_quantized(self.blocks(), self.k)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weights `[groups, k, n]` in `dtype` (pure JAX; the oracle for the kernels)."""
        return self.to_quantized().dequantize(dtype)


jax.tree_util.register_dataclass(Q4KExperts)

"""GGUF tensor types: vectorised dequantization, a Q4_K quantizer, and raw GGUF blocks -> `QuantizedWeights`.

Dequantization goes through `gguf.quants.dequantize` (the gguf package's numpy reference) for every type it
implements; Q8_K, which it lacks, is done here (value = d * q, d float32 per 256-block; the block's int16 bsums
are only used by llama.cpp's dot products). Quantization for `save_gguf` uses `gguf.quants.quantize` (BF16,
Q8_0, Q5_0, ...) plus `quantize_q4_k` below, since the gguf package cannot produce Q4_K.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pallas_kernels.quantized import QuantizedWeights

T = GGMLQuantizationType
QK_K = 256

# Every type `load` dequantizes (all that published Q4_K_M / Q5_K_M / Q6_K / Q8_0 / IQ4 files use).
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
                   T.Q8_K, T.IQ4_NL, T.IQ4_XS)
# Types whose per-32 blocks map exactly onto `QuantizedWeights` (keep_quantized="experts").
KEEPABLE_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw tensor data as `gguf.GGUFReader` gives it -> float32 numpy array (numpy shape = reversed ne).

    Args:
      data: F32/F16: typed array in numpy shape; other types: uint8 `[..., rows, bytes_per_row]`.
      qtype: one of `SUPPORTED_TYPES`.
    """
    if qtype == T.F32:
        return np.asarray(data, np.float32)
    if qtype == T.F16:
        return np.asarray(data).astype(np.float32)
    with np.errstate(all="ignore"):   # inf/nan scales in a file give inf/nan weights, not warnings
        if qtype == T.Q8_K:
            return dequantize_q8_k(data)
        return quants.dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)


def dequantize_q8_k(data: np.ndarray) -> np.ndarray:
    """Q8_K: per 256-block float32 d, int8 q[256], int16 bsums[16] (292 bytes); value = d * q."""
    data = np.asarray(data, np.uint8)
    _, type_size = GGML_QUANT_SIZES[T.Q8_K]
    blocks = data.reshape(-1, type_size)
    d = blocks[:, :4].copy().view(np.float32)                     # [n, 1]
    q = blocks[:, 4:4 + QK_K].view(np.int8).astype(np.float32)     # [n, 256]
    out = d * q
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_size * QK_K)


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 numpy array -> raw GGUF bytes (uint8 `[..., rows, bytes_per_row]`); ne0 must fit the block."""
    if qtype == T.Q4_K:
        return quantize_q4_k(data)
    return quants.quantize(np.asarray(data, np.float32), qtype)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K quantization (256-value super-blocks of 8 sub-blocks of 32; value = d*sc_j*q - dmin*m_j).

    A simple vectorised version of ggml's `quantize_row_q4_K_ref` without its iterative scale search: per
    sub-block min (clipped at 0) and range / 15, sub-scales and mins quantized to 6 bits against the
    super-block's float16 d and dmin, then codes rounded against the quantized scales.
    """
    data = np.asarray(data, np.float32)
    if data.shape[-1] % QK_K:
        raise ValueError(f"Q4_K needs the last dim to be a multiple of {QK_K}, got shape {data.shape}")
    x = data.reshape(-1, 8, 32)                                        # [n, sub-block, 32]
    mn = np.minimum(x.min(axis=-1), 0.0)                              # [n, 8]
    scale = (x.max(axis=-1) - mn) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)               # [n]
    dmin = ((-mn).max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(scale / df), 0).clip(0, 63).astype(np.uint8)     # [n, 8]
        m = np.where(dminf > 0, np.round(-mn / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.round((x + (dminf * m)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(-1, 4, 2, 32)                                       # sub-blocks (2i, 2i+1) share 32 bytes
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs],
                            axis=1)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // QK_K * 144)


# ----------------------------------------------------------------------------------------------------------
# raw GGUF expert blocks -> QuantizedWeights
# ----------------------------------------------------------------------------------------------------------
def _block_codes(raw: np.ndarray, qtype: GGMLQuantizationType):
    """raw uint8 [experts, out, blocks * type_size] -> (codes [experts, out, k] uint8/int8,
    scales [experts, out, k/32], offsets [experts, out, k/32] or None), exactly (value = scale*q + offset)."""
    e, rows, _ = raw.shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(e, rows, -1, type_size)
    f16 = lambda x: np.ascontiguousarray(x).view(np.float16)[..., 0]   # [..., 2] bytes -> [...]
    if qtype == T.Q8_0:
        codes = b[..., 2:].view(np.int8).reshape(e, rows, -1)
        return codes, f16(b[..., :2]), None
    if qtype in (T.Q4_0, T.Q4_1):
        head = 2 if qtype == T.Q4_0 else 4
        qs = b[..., head:]                                                  # [e, rows, nb, 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(e, rows, -1)   # elements 0..15, 16..31
        d = f16(b[..., :2])
        offset = (d * np.float16(-8)) if qtype == T.Q4_0 else f16(b[..., 2:4])      # exact in float16
        return codes, d, offset
    if qtype == T.Q4_K:
        d = f16(b[..., :2]).astype(np.float32)[..., None]                  # [e, rows, nb, 1]
        dmin = f16(b[..., 2:4]).astype(np.float32)[..., None]
        nb = b.shape[2]
        sc, m = quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(e, rows, nb, 8).astype(np.float32)
        m = m.reshape(e, rows, nb, 8).astype(np.float32)
        qs = b[..., 16:].reshape(e, rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        codes = (qs & 0x0F).reshape(e, rows, -1)                            # sub-block 2i low, 2i+1 high
        # d*sc and dmin*m are exact in float32 (11-bit mantissa times a 6-bit integer).
        return codes, (d * sc).reshape(e, rows, -1), (-(dmin * m)).reshape(e, rows, -1)
    raise ValueError(f"{qtype.name} cannot be kept quantized; keepable: {[t.name for t in KEEPABLE_TYPES]}")


def can_keep(qtype: GGMLQuantizationType, k: int) -> bool:
    """Whether an expert tensor of this type with input dim k becomes a `QuantizedWeights` exactly."""
    if qtype not in KEEPABLE_TYPES:
        return False
    return k % 32 == 0 if qtype == T.Q8_0 else k % 64 == 0   # 4-bit split-half packing needs two whole halves


def to_quantized_weights(raws: list[tuple[np.ndarray, GGMLQuantizationType]]) -> QuantizedWeights:
    """GGUF expert tensors (raw uint8 [experts, out, bytes], numpy order) -> one k-major `QuantizedWeights`
    [experts, k, sum(out)] (the tensors concatenated along the output dim, e.g. gate then up).

    Q8_0 -> bits=8 with its float16 scales (exact, 1.0625 bytes/param); Q4_0 / Q4_1 -> bits=4 with float16
    scale and offset (exact, 0.625 bytes/param); Q4_K -> bits=4 with float32 d*sc and -dmin*m per 32-block
    (exact, 0.75 bytes/param; float16 would round d*sc). All tensors must be 8-bit, or all 4-bit.
    """
    parts = [_block_codes(np.asarray(raw, np.uint8), qtype) for raw, qtype in raws]
    bits = {8 if qtype == T.Q8_0 else 4 for _, qtype in raws}
    if len(bits) != 1:
        raise ValueError("cannot concatenate 8-bit and 4-bit expert tensors")
    bits = bits.pop()
    scale_dtype = np.result_type(*[p[1].dtype for p in parts])
    t = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))          # [e, out, k] -> [e, k, out]
    codes = np.concatenate([p[0] for p in parts], axis=1)              # [e, n, k]: k_major, as GGUF stores them
    scales = np.concatenate([t(p[1]).astype(scale_dtype) for p in parts], axis=2)
    offsets = None
    if bits == 4:
        offsets = np.concatenate([t(p[2]).astype(scale_dtype) for p in parts], axis=2)
        half = codes.shape[2] // 2
        codes = codes[:, :, :half] | (codes[:, :, half:] << 4)        # split-half packing along k
    qw = QuantizedWeights(values=jnp.asarray(codes), scales=jnp.asarray(scales),
                          offsets=None if offsets is None else jnp.asarray(offsets), bits=bits, block_size=32,
                          k_major=True)
    qw.check()
    return qw

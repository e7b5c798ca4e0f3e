"""GGUF tensor types: vectorised dequantization, K-quant quantizers,
and raw GGUF blocks -> `QuantizedWeights`.

Dequantization goes through `gguf.quants.dequantize` (the gguf package's numpy reference) for every type it
implements; Q8_K, which it lacks, is done here (value = d * q, d float32 per 256-block; the block's int16
bsums are only used by llama.cpp's dot products). Quantization for `save_gguf` uses `gguf.quants.quantize`
(BF16, Q8_0, Q5_0, ...) plus `quantize_q4_k`, `quantize_q5_k` and `quantize_q6_k` below, since the gguf
package cannot produce K-quants.
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
SUPPORTED_TYPES = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.Q8_K,
    T.IQ4_NL,
    T.IQ4_XS,
)
# Types whose blocks map exactly onto `QuantizedWeights` (keep_quantized="experts"), with the bits and the
# quantization block (elements along k sharing a scale) they become.
KEEPABLE_TYPES = (T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.Q4_0, T.Q4_1, T.Q4_K)
KEPT_BITS = {
    T.Q8_0: 8,
    T.Q5_0: 8,
    T.Q5_1: 8,
    T.Q5_K: 8,
    T.Q6_K: 8,
    T.IQ4_NL: 8,
    T.IQ4_XS: 8,
    T.Q4_0: 4,
    T.Q4_1: 4,
    T.Q4_K: 4,
}
KEPT_BLOCK = {
    T.Q8_0: 32,
    T.Q5_0: 32,
    T.Q5_1: 32,
    T.Q5_K: 32,
    T.Q6_K: 16,
    T.IQ4_NL: 32,
    T.IQ4_XS: 32,
    T.Q4_0: 32,
    T.Q4_1: 32,
    T.Q4_K: 32,
}
IQ4_VALUES = np.array(quants.IQ4_NL.kvalues, np.int8)  # the non-linear 4-bit grid of IQ4_NL / IQ4_XS


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
    with np.errstate(all="ignore"):  # inf/nan scales in a file give inf/nan weights, not warnings
        if qtype == T.Q8_K:
            return dequantize_q8_k(data)
        return quants.dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)


def dequantize_q8_k(data: np.ndarray) -> np.ndarray:
    """Q8_K: per 256-block float32 d, int8 q[256], int16 bsums[16] (292 bytes); value = d * q."""
    data = np.asarray(data, np.uint8)
    _, type_size = GGML_QUANT_SIZES[T.Q8_K]
    blocks = data.reshape(-1, type_size)
    d = blocks[:, :4].copy().view(np.float32)  # [n, 1]
    q = blocks[:, 4 : 4 + QK_K].view(np.int8).astype(np.float32)  # [n, 256]
    out = d * q
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_size * QK_K)


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 numpy array -> raw GGUF bytes (uint8 `[..., rows, bytes_per_row]`); ne0 must fit the block."""
    if qtype == T.Q4_K:
        return quantize_q4_k(data)
    if qtype == T.Q5_K:
        return quantize_q5_k(data)
    if qtype == T.Q6_K:
        return quantize_q6_k(data)
    return quants.quantize(np.asarray(data, np.float32), qtype)


def _k_quant_with_mins(data: np.ndarray, qtype: GGMLQuantizationType, levels: int):
    """The scales and codes shared by Q4_K (levels 15) and Q5_K (31): 256-value super-blocks of 8 sub-blocks
    of 32, value = d*sc_j*q - dmin*m_j. A simple vectorised version of ggml's `quantize_row_q{4,5}_K_ref`
    without its iterative scale search: per sub-block min (clipped at 0) and range / levels, sub-scales and
    mins quantized to 6 bits against the super-block's float16 d and dmin, then codes rounded against the
    quantized scales.

    Returns (head uint8 [n, 16]: d, dmin and the 12 packed 6-bit scales and mins; codes uint8 [n, 8, 32]).
    """
    data = np.asarray(data, np.float32)
    if data.shape[-1] % QK_K:
        raise ValueError(
            f"{qtype.name} needs the last dim to be a multiple of {QK_K}, got shape {data.shape}"
        )
    x = data.reshape(-1, 8, 32)  # [n, sub-block, 32]
    mn = np.minimum(x.min(axis=-1), 0.0)  # [n, 8]
    scale = (x.max(axis=-1) - mn) / levels
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # [n]
    dmin = ((-mn).max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(scale / df), 0).clip(0, 63).astype(np.uint8)  # [n, 8]
        m = np.where(dminf > 0, np.round(-mn / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = (
            np.where(step > 0, np.round((x + (dminf * m)[..., None]) / step), 0)
            .clip(0, levels)
            .astype(np.uint8)
        )
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    head = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales], axis=1
    )
    return head, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """codes [n, 8, 32] -> [n, 128] bytes: sub-blocks (2i, 2i+1) share 32 bytes, low and high nibble."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K quantization (256-value super-blocks of 8 sub-blocks of 32; value = d*sc_j*q - dmin*m_j, q in
    [0, 15]; `_k_quant_with_mins`). Layout (144 bytes): d, dmin, scales[12], qs[128]."""
    head, q = _k_quant_with_mins(data, T.Q4_K, 15)
    blocks = np.concatenate([head, _low_nibbles(q)], axis=1)
    return blocks.reshape(*np.shape(data)[:-1], np.shape(data)[-1] // QK_K * 144)


def quantize_q5_k(data: np.ndarray) -> np.ndarray:
    """Q5_K quantization (as Q4_K with q in [0, 31]; `_k_quant_with_mins`). Layout (176 bytes): d, dmin,
    scales[12], qh[32] (bit j of byte l: the fifth bit of element l of sub-block j), qs[128] (low 4 bits)."""
    head, q = _k_quant_with_mins(data, T.Q5_K, 31)
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)  # [n, 32]
    blocks = np.concatenate([head, qh.astype(np.uint8), _low_nibbles(q)], axis=1)
    return blocks.reshape(*np.shape(data)[:-1], np.shape(data)[-1] // QK_K * 176)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K quantization (256-value super-blocks of 16 sub-blocks of 16; value = d*sc_j*q, q in [-32, 31]).

    A simple vectorised version of ggml's `quantize_row_q6_K_ref` without its iterative scale search: each
    sub-block's scale maps its value of largest magnitude to -32, the int8 sub-scales are quantized against
    the super-block's float16 d (the largest scale maps to -128), then codes are rounded against the quantized
    scales.
    Layout (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16], d float16.
    """
    data = np.asarray(data, np.float32)
    if data.shape[-1] % QK_K:
        raise ValueError(f"Q6_K needs the last dim to be a multiple of {QK_K}, got shape {data.shape}")
    x = data.reshape(-1, 16, 16)  # [n, sub-block, 16]
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]  # signed, [n, 16]
    scale = peak / -32.0
    top = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[:, None], axis=-1)  # [n, 1]
    d = (top / -128.0).astype(np.float16)  # [n, 1]
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df != 0, np.round(scale / df), 0).clip(-128, 127).astype(np.int8)  # [n, 16]
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.round(x / step), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, quarter, 32]
    ql = np.concatenate(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)],
        axis=-1,
    )  # [n, 2, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // QK_K * 210)


# ----------------------------------------------------------------------------------------------------------
# raw GGUF expert blocks -> QuantizedWeights
# ----------------------------------------------------------------------------------------------------------
def _block_codes(raw: np.ndarray, qtype: GGMLQuantizationType):
    """raw uint8 [experts, out, blocks * type_size] -> (codes [experts, out, k] uint8/int8,
    scales [experts, out, k / KEPT_BLOCK[qtype]], offsets like scales or None), exactly
    (value = scale*q + offset, each product and sum rounded as `gguf.quants.dequantize` rounds it)."""
    e, rows, _ = raw.shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(e, rows, -1, type_size)
    nb = b.shape[2]
    f16 = lambda x: np.ascontiguousarray(x).view(np.float16)[..., 0]  # [..., 2] bytes -> [...]
    if qtype == T.Q8_0:
        codes = b[..., 2:].view(np.int8).reshape(e, rows, -1)
        return codes, f16(b[..., :2]), None
    if qtype in (T.Q5_0, T.Q5_1):  # d, (Q5_1: m,) qh (32 high bits), qs[16]; d*(q-16) or d*q + m
        head = 2 if qtype == T.Q5_0 else 4
        qh = np.ascontiguousarray(b[..., head : head + 4]).view(np.uint32)  # [e, rows, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [e, rows, nb, 32]
        qs = b[..., head + 4 :]
        q = (np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high << 4)).astype(np.int16)  # [0, 31]
        if qtype == T.Q5_0:
            return (q - 16).astype(np.int8).reshape(e, rows, -1), f16(b[..., :2]), None
        return q.astype(np.int8).reshape(e, rows, -1), f16(b[..., :2]), f16(b[..., 2:4])
    if qtype == T.Q5_K:  # d, dmin, scales[12], qh[32], qs[128]; d*sc*q - dmin*m
        ql = b[..., 48:].reshape(e, rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(e, rows, nb, 8, 32)  # sub-block 2i low, 2i+1 high
        qh = b[..., 16:48].reshape(e, rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        codes = (ql | ((qh & 0x01) << 4)).astype(np.int8).reshape(e, rows, -1)  # [0, 31]
        return (codes, *_k_scales_and_offsets(b))
    if qtype == T.Q6_K:  # ql[128], qh[64], sc int8[16], d
        ql = b[..., :128].reshape(e, rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(e, rows, nb, 2, 4, 32)  # quarters: low 0-31, 32-63, high ...
        qh = b[..., 128:192].reshape(e, rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (ql | ((qh & 0x03) << 4)).astype(np.int16) - 32
        codes = q.astype(np.int8).reshape(e, rows, -1)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [e, rows, nb, 16]
        d = f16(b[..., 208:210]).astype(np.float32)[..., None]
        # d*sc is exact in float32 (11-bit mantissa times an 8-bit integer); q * (d*sc) as gguf computes it.
        return codes, (d * sc).reshape(e, rows, -1), None
    if qtype == T.IQ4_NL:  # d, qs[16]: d * grid[q] (the grid value is the int8 code)
        qs = b[..., 2:]
        codes = IQ4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].reshape(e, rows, -1)
        return codes, f16(b[..., :2]), None
    if qtype == T.IQ4_XS:  # d, scales_h (u16), scales_l[4], qs[128]: d*(ls-32) * grid[q]
        d = f16(b[..., :2]).astype(np.float32)[..., None]  # [e, rows, nb, 1]
        high = np.ascontiguousarray(b[..., 2:4]).view(np.uint16) >> (
            2 * np.arange(8, dtype=np.uint16)
        )  # [.., 8]
        low = (b[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(e, rows, nb, 8) & 0x0F
        ls = (low | ((high & 0x03).astype(np.uint8) << 4)).astype(np.float32) - 32  # [e, rows, nb, 8]
        qs = b[..., 8:].reshape(e, rows, nb, 8, 16)
        codes = IQ4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].reshape(e, rows, -1)
        # d * (ls - 32) is exact in float32 (11-bit mantissa times a 6-bit integer)
        return codes, (d * ls).reshape(e, rows, -1), None
    if qtype in (T.Q4_0, T.Q4_1):
        head = 2 if qtype == T.Q4_0 else 4
        qs = b[..., head:]  # [e, rows, nb, 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(e, rows, -1)  # elements 0..15, 16..31
        d = f16(b[..., :2])
        offset = (d * np.float16(-8)) if qtype == T.Q4_0 else f16(b[..., 2:4])  # exact in float16
        return codes, d, offset
    if qtype == T.Q4_K:
        qs = b[..., 16:].reshape(e, rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        codes = (qs & 0x0F).reshape(e, rows, -1)  # sub-block 2i low, 2i+1 high
        return (codes, *_k_scales_and_offsets(b))
    raise ValueError(f"{qtype.name} cannot be kept quantized; keepable: {[t.name for t in KEEPABLE_TYPES]}")


def _k_scales_and_offsets(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks [e, rows, nb, type_size] (d, dmin, 12 bytes of 6-bit scales and mins first)
    -> (scales d*sc, offsets -dmin*m), float32 [e, rows, nb * 8]: exact (11-bit mantissas times 6-bit
    integers), so that d*sc*q - dmin*m == q*scale + offset as gguf computes it."""
    e, rows, nb, _ = b.shape
    d, dmin = (
        np.ascontiguousarray(b[..., i : i + 2]).view(np.float16).astype(np.float32) for i in (0, 2)
    )  # [.., 1]
    sc, m = (
        x.reshape(e, rows, nb, 8).astype(np.float32)
        for x in quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    )
    return (d * sc).reshape(e, rows, -1), (-(dmin * m)).reshape(e, rows, -1)


def can_keep(qtype: GGMLQuantizationType, k: int) -> bool:
    """Whether an expert tensor of this type with input dim k becomes a `QuantizedWeights` exactly."""
    if qtype not in KEEPABLE_TYPES:
        return False
    return k % (KEPT_BLOCK[qtype] * (2 if KEPT_BITS[qtype] == 4 else 1)) == 0  # 4-bit: two whole halves


def to_quantized_weights(
    raws: list[tuple[np.ndarray, GGMLQuantizationType]],
    *,
    n_order: np.ndarray | None = None,
    k_order: np.ndarray | None = None,
) -> QuantizedWeights:
    """GGUF expert tensors (raw uint8 [experts, out, bytes], numpy order) -> one k-major `QuantizedWeights`
    [experts, k, sum(out)] (the tensors concatenated along the output dim, e.g. gate then up).

    `n_order` (int [n']): the output columns kept, in this order (indices into the concatenated outputs);
    `k_order` (int [k]): a reordering of the input dim that moves whole quantization blocks (a loader's
    head reorder); both None: the file's order.

    All exact (`dequantize` equals `gguf.quants.dequantize` bit for bit):
    - Q8_0 -> bits=8 with its float16 scales per 32 (1.0625 bytes/param);
    - Q5_0 -> bits=8, codes q - 16 in [-16, 15], float16 scales per 32 (1.0625 bytes/param, file 0.6875);
    - Q6_K -> bits=8, codes in [-32, 31], float32 d*sc per 16 (1.25 bytes/param, file 0.8203; float16 would
      round d*sc). llama.cpp's Q4_K_M and Q5_K_M files store some layers' ffn_down experts as Q6_K;
    - Q5_1 -> bits=8 with offsets, codes in [0, 31], float16 d and m per 32 (1.125 bytes/param, file 0.75);
    - Q5_K -> bits=8 with offsets, codes in [0, 31], float32 d*sc and -dmin*m per 32 (1.25 bytes/param, file
      0.6875);
    - IQ4_NL / IQ4_XS -> bits=8, the codes being the non-linear grid's int8 values (`IQ4_VALUES`), float16 d /
      float32 d*(ls-32) per 32 (1.0625 / 1.125 bytes/param, file 0.5625 / 0.5313);
    - Q4_0 / Q4_1 -> bits=4 with float16 scale and offset per 32 (0.625 bytes/param);
    - Q4_K -> bits=4 with float32 d*sc and -dmin*m per 32 (0.75 bytes/param).
    Tensors of one call must all become 8-bit or all 4-bit; with different blocks (Q6_K beside Q8_0), the
    scales are repeated to the smallest block, and an 8-bit tensor without offsets beside one with them gets
    zero offsets (still exact).

    Raises:
      ValueError: a type not in KEEPABLE_TYPES, 8-bit and 4-bit tensors together, or a k_order that splits
        a quantization block.
    """
    for _, qtype in raws:
        if qtype not in KEEPABLE_TYPES:
            raise ValueError(
                f"{qtype.name} cannot be kept quantized; keepable: {[t.name for t in KEEPABLE_TYPES]}"
            )
    parts = [_block_codes(np.asarray(raw, np.uint8), qtype) for raw, qtype in raws]
    bits = {KEPT_BITS[qtype] for _, qtype in raws}
    if len(bits) != 1:
        raise ValueError(
            "cannot concatenate 8-bit and 4-bit expert tensors: " + ", ".join(qtype.name for _, qtype in raws)
        )
    bits = bits.pop()
    block = min(KEPT_BLOCK[qtype] for _, qtype in raws)
    scale_dtype = np.result_type(*[p[1].dtype for p in parts])
    if any(p[2] is not None for p in parts):  # an 8-bit tensor with offsets beside one without: zero offsets
        parts = [p if p[2] is not None else (p[0], p[1], np.zeros_like(p[1])) for p in parts]
    t = lambda x, qtype: np.ascontiguousarray(
        np.swapaxes(np.repeat(x, KEPT_BLOCK[qtype] // block, axis=-1), 1, 2)
    ).astype(scale_dtype)  # [e, out, kb] -> [e, kb, out]
    codes = np.concatenate([p[0] for p in parts], axis=1)  # [e, n, k]: k_major, as GGUF stores them
    scales = np.concatenate([t(p[1], qtype) for p, (_, qtype) in zip(parts, raws, strict=False)], axis=2)
    offsets = None
    if parts[0][2] is not None:
        offsets = np.concatenate([t(p[2], qtype) for p, (_, qtype) in zip(parts, raws, strict=False)], axis=2)
    if n_order is not None or k_order is not None:
        n_order = np.arange(codes.shape[1]) if n_order is None else np.asarray(n_order)
        k_order = np.arange(codes.shape[2]) if k_order is None else np.asarray(k_order)
        blocks = k_order.reshape(-1, block)
        whole = (blocks[:, 0] % block == 0).all() and (blocks == blocks[:, :1] + np.arange(block)).all()
        if not whole:
            raise ValueError(f"k_order moves parts of {block}-element quantization blocks")
        codes = codes[:, n_order][:, :, k_order]
        kb = blocks[:, 0] // block
        scales = scales[:, kb][:, :, n_order]
        offsets = None if offsets is None else offsets[:, kb][:, :, n_order]
    if bits == 4:
        half = codes.shape[2] // 2
        codes = codes[:, :, :half] | (codes[:, :, half:] << 4)  # split-half packing along k
    qw = QuantizedWeights(
        values=jnp.asarray(codes),
        scales=jnp.asarray(scales),
        offsets=None if offsets is None else jnp.asarray(offsets),
        bits=bits,
        block_size=block,
        k_major=True,
    )
    qw.check()
    return qw

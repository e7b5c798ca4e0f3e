"""GGUF tensors read with `pread` and decoded on the JAX device: the fast loading path.

A tensor's bytes go from the file (page cache) into one host buffer per tensor and straight to the device,
where F32 / F16 / BF16 / Q8_0 are dequantized and Q4_K routed experts become `QuantizedWeights` by integer
and exact float32 operations (the same values as the numpy path, `gguf_quants`). Reading with `pread` rather
than a memory map keeps the file's pages out of the process's resident set.
Block layouts: ggml `ggml-common.h` (block_q8_0, block_q4_K) and `get_scale_min_k4`.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridlm.checkpoints.gguf_header import TensorInfo
from pallas_kernels.q4_k import Q4_K_BYTES, q4_k_to_quantized
from pallas_kernels.quantized import QuantizedWeights

__all__ = [
    "DEVICE_TYPES",
    "Q4KBlocks",
    "dequantize_on_device",
    "q4_k_to_quantized",
    "read_exact",
    "read_tensor",
    "scales_finite",
    "to_device",
]

T = GGMLQuantizationType
DEVICE_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0)  # dequantized by `dequantize_on_device`


def read_exact(fd: int, offset: int, nbytes: int, what: str) -> np.ndarray:
    """`nbytes` bytes of the file at `offset`, uint8 [nbytes], read with `os.preadv` (no memory map, so no
    file pages in the process's resident set).

    Raises:
      OSError: the read failed or returned fewer bytes (a file shorter than its header says)."""
    buf = np.empty(nbytes, np.uint8)
    view, done = memoryview(buf), 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{what}: read {done} of {nbytes} bytes (file changed?)")
        done += got
    return buf


def read_tensor(fd: int, info: TensorInfo) -> np.ndarray:
    """A GGUF tensor's bytes, uint8 [nbytes] (`read_exact`).

    Raises:
      OSError: the read failed or returned fewer bytes than the tensor table promises."""
    return read_exact(fd, info.offset, info.nbytes, f"tensor {info.name!r}")


# The largest single host -> device copy: the runtime stages each in pinned memory, which grows to its size.
COPY_SLICE = 64 * 2**20


def to_device(array: np.ndarray) -> jax.Array:
    """A host array on the default device, copied in slices of at most `COPY_SLICE` bytes (waits for the
    copies, so that the host buffer may be freed)."""
    flat = array.reshape(-1)
    step = max(1, COPY_SLICE // max(1, array.dtype.itemsize))
    pieces = [jax.device_put(flat[i : i + step]) for i in range(0, flat.size, step)] or [jax.device_put(flat)]
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return jax.block_until_ready(out.reshape(array.shape))


def host_view(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """`raw` bytes as `gguf.GGUFReader` presents the tensor: F32/F16 typed in numpy shape, other types uint8
    [..., rows, bytes_per_row] (what `gguf_quants.dequantize` takes). No copy."""
    if info.type == T.F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.type == T.F16:
        return raw.view(np.float16).reshape(info.shape)
    block, type_size = GGML_QUANT_SIZES[info.type]
    return raw.reshape(*info.shape[:-1], info.ne[0] // block * type_size)


@functools.partial(jax.jit, static_argnames=("qtype", "shape"))
def _dequantize(raw: jax.Array, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> jax.Array:
    if qtype == T.F32:
        return jax.lax.bitcast_convert_type(raw.reshape(-1, 4), jnp.float32).reshape(shape)
    if qtype in (T.F16, T.BF16):
        half = jnp.float16 if qtype == T.F16 else jnp.bfloat16
        return jax.lax.bitcast_convert_type(raw.reshape(-1, 2), half).astype(jnp.float32).reshape(shape)
    blocks = raw.reshape(-1, 34)  # Q8_0: float16 d, int8 q[32]; value = d * q, as gguf computes it
    d = jax.lax.bitcast_convert_type(blocks[:, :2], jnp.float16).astype(jnp.float32)
    q = jax.lax.bitcast_convert_type(blocks[:, 2:], jnp.int8).astype(jnp.float32)
    return (q * d[:, None]).reshape(shape)


def dequantize_on_device(raw: np.ndarray | jax.Array, info: TensorInfo) -> jax.Array:
    """A tensor of a `DEVICE_TYPES` type, from its bytes uint8 [nbytes] to float32 on the default device in
    numpy shape (reversed ne); bit for bit what `gguf_quants.dequantize` gives (one exact or one rounded
    product a value)."""
    return _dequantize(jnp.asarray(raw), info.type, info.shape)


@dataclasses.dataclass(frozen=True)
class Q4KBlocks:
    """Routed-expert weights kept as the file's own Q4_K blocks, 4.5 bits a weight.

    Attributes:
      data: uint8 [experts, out, k // 256 * 144] (numpy on the host or a device array): each output row's
        super-blocks in file order; several GGUF tensors (gate, up) concatenated along `out`.
      k: the input dim (a multiple of 256).
    """

    data: np.ndarray | jax.Array
    k: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(experts, k, out)` of the weights the blocks stand for (as `QuantizedWeights.shape`)."""
        return (self.data.shape[0], self.k, self.data.shape[1])

    def to_quantized(self) -> QuantizedWeights:
        """The `QuantizedWeights` the kernels read (`q4_k_to_quantized`), on the device."""
        return _q4_k_to_quantized_jit(jnp.asarray(self.data), self.k)


_q4_k_to_quantized_jit = jax.jit(q4_k_to_quantized, static_argnums=1)


@jax.jit
def scales_finite(raw: jax.Array) -> jax.Array:
    """Whether every Q4_K block of `raw` (uint8 [..., blocks * 144]) has finite float16 d and dmin."""
    head = raw.reshape(-1, Q4_K_BYTES)[:, :4].reshape(-1, 2, 2)
    return jnp.isfinite(jax.lax.bitcast_convert_type(head, jnp.float16)).all()

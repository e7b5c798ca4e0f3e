"""A CUDA quantized grouped matmul (`gmm_dequant.cu`) called from JAX through the XLA FFI: an experiment that
measures how fast the weight-read-bound MoE case can run on Hopper outside Pallas (docs/benchmarks_gmm.md).

Not part of the library: `hybridlm` and `pallas_kernels` never import it. It needs nvcc and a CUDA GPU;
`build()` compiles the shared library (about 20 s) and `gmm_dequant` runs it.

    from cuda_gmm import build, repack, gmm_dequant
    build()                                   # once per process
    packed = repack(rhs)                      # rhs: QuantizedWeights, once (like a weight load)
    out = gmm_dequant(lhs, packed, group_sizes)   # lhs [m, k] bf16 sorted by group -> [m, n] bf16
    gu = repack(w_gate_up, swiglu=True)       # [groups, k, 2 ffn] -> silu(x W_gate) * (x W_up), [m, ffn]
    fast = repack(rhs, arith="bf16")          # 4-bit: bf16-pair arithmetic, not bit-exact (Packed.arith)

Limits: bf16 lhs; float16 scales (the kernel's exact dequantization needs at most 11 significant bits);
quantization blocks of 32; k a multiple of 64 (of 64 k_sub for a configuration's k_sub), n a multiple of 128.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import QuantizedWeights

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "gmm_dequant.cu")
LIBRARY = os.path.join(HERE, "build", "libgmm_dequant.so")
BN, BK, THREADS = 128, 64, 256
TARGETS = {4: "hybridlm_gmm_q4", 8: "hybridlm_gmm_q8"}
_registered = False


def build(nvcc: str | None = None, force: bool = False) -> str:
    """Compiles `gmm_dequant.cu` for sm_90a (Hopper), unless the library is newer than the source, and
    registers its two FFI targets with JAX. Returns the library's path.

    Raises:
      FileNotFoundError: no nvcc (looked for at $NVCC, /usr/local/cuda/bin/nvcc, then on PATH).
      RuntimeError: the compilation failed (with the end of nvcc's output).
    """
    global _registered
    stale = force or not os.path.exists(LIBRARY) or os.path.getmtime(LIBRARY) < os.path.getmtime(SOURCE)
    if stale:
        nvcc = nvcc or os.environ.get("NVCC") or next(
            (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), "nvcc")
        os.makedirs(os.path.dirname(LIBRARY), exist_ok=True)
        cmd = [nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--shared", "-Xcompiler",
               "-fPIC", "-cudart", "static", f"-I{jax.ffi.include_dir()}", "-diag-suppress", "128,177,940,2473",
               "-o", LIBRARY, SOURCE]
        try:
            run = subprocess.run(cmd, check=False, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"nvcc not found ({nvcc}); set $NVCC") from e
        if run.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE} (exit {run.returncode}):\n{run.stderr[-4000:]}")
    if not _registered:
        lib = ctypes.cdll.LoadLibrary(LIBRARY)
        jax.ffi.register_ffi_target(TARGETS[4], jax.ffi.pycapsule(lib.HybridlmGmmQ4), platform="CUDA")
        jax.ffi.register_ffi_target(TARGETS[8], jax.ffi.pycapsule(lib.HybridlmGmmQ8), platform="CUDA")
        _registered = True
    return LIBRARY


@dataclasses.dataclass(frozen=True)
class Packed:
    """Weights repacked for the kernel (a pytree).

    codes: uint32 `[groups, n/128, k/64, 256 threads, 4 or 8 words]`: thread t's words for a k-stage of 64,
      in the order of its `mma.m16n8k16` fragments (see `repack`).
    scales: float16 `[groups, n/128, k/64, 2 blocks, 128 columns]` (int8) or `[..., 128, 2]` (scale,
      offset) for 4 bits; the CTA's columns 16 warp + 8 nt + l8 stored in the order (warp, l8, nt), so that
      a thread's two columns are adjacent.
    bits: 4 or 8 (static).
    n: output columns (static).
    arith: "exact" (the weights of `QuantizedWeights.dequantize(bf16)` bit for bit) or, 4-bit only, "bf16":
      scales and offsets stored rounded to bf16, weights round_bf16(q * s + m) in bf16x2 arithmetic (the
      Pallas kernel's opt-in "asm_bf16"), codes laid out in bf16 pairs (static).
    swiglu: the columns are a `[groups, k, 2 ffn]` gate_up's, interleaved so that each warp's 16 are 8 gate
      columns and their 8 up columns; `gmm_dequant` then returns silu(x W_gate) * (x W_up), `[m, ffn]` (static).
    """

    codes: jax.Array
    scales: jax.Array
    bits: int = dataclasses.field(metadata={"static": True})
    n: int = dataclasses.field(metadata={"static": True})
    arith: str = dataclasses.field(default="exact", metadata={"static": True})
    swiglu: bool = dataclasses.field(default=False, metadata={"static": True})


jax.tree_util.register_dataclass(Packed)


@functools.partial(jax.jit, static_argnames=("arith",))
def _layout(rhs: QuantizedWeights, arith: str) -> tuple[jax.Array, jax.Array]:
    groups, k, n = rhs.shape
    q = rhs.codes()  # [g, k, n] int32
    # k = (ks, blk 2, sub 2, j 2, l4 4, e 2); n = (nb, warp 8, nt 2, l8 8); lane = 4 l8 + l4
    q = q.reshape(groups, k // BK, 2, 2, 2, 4, 2, n // BN, 8, 2, 8)
    if rhs.bits == 4:
        # -> (g, nb, ks, warp, l8, l4, blk, nt, sub, j, e)
        q = q.transpose(0, 7, 1, 8, 10, 5, 2, 9, 3, 4, 6).astype(jnp.uint32)
        if arith == "bf16":   # nibble position 4 (2 sub + j) + 16 e: a fragment register's pair 16 bits apart
            q = q.transpose(0, 1, 2, 3, 4, 5, 6, 7, 10, 8, 9)
        q = q.reshape(groups, n // BN, k // BK, THREADS, 4, 8)
        codes = jnp.sum(q << (4 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
        dtype = jnp.bfloat16 if arith == "bf16" else jnp.float16
        sc = jnp.stack([rhs.scales.astype(dtype), rhs.offsets.astype(dtype)], axis=-1)   # [g, k/32, n, 2]
        sc = sc.reshape(groups, k // BK, 2, n // BN, 8, 2, 8, 2).transpose(0, 3, 1, 2, 4, 6, 5, 7)
        sc = sc.reshape(groups, n // BN, k // BK, 2, BN, 2)
    else:
        # -> (g, nb, ks, warp, l8, l4, blk, sub, nt, j, e)
        q = q.transpose(0, 7, 1, 8, 10, 5, 2, 3, 9, 4, 6).astype(jnp.uint32) + 128
        q = q.reshape(groups, n // BN, k // BK, THREADS, 8, 4)
        codes = jnp.sum(q << (8 * jnp.arange(4, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
        sc = rhs.scales.reshape(groups, k // BK, 2, n // BN, 8, 2, 8).transpose(0, 3, 1, 2, 4, 6, 5)
        sc = sc.reshape(groups, n // BN, k // BK, 2, BN)
    return codes, sc


def interleave_gate_up(rhs: QuantizedWeights) -> QuantizedWeights:
    """`rhs` `[groups, k, 2 ffn]` (gate = columns [0, ffn), up = [ffn, 2 ffn)) with its columns reordered so that
    each 16 are 8 gate columns and the same 8 up columns: column 16 b + r is gate 8 b + r (r < 8), else up
    8 b + r - 8."""
    n = rhs.shape[2]
    c = np.arange(n)
    b, r = c // 16, c % 16
    perm = jnp.asarray(np.where(r < 8, 8 * b + r, n // 2 + 8 * b + r - 8))
    cols = 1 if rhs.k_major else 2
    return dataclasses.replace(
        rhs, values=jnp.take(rhs.values, perm, axis=cols), scales=jnp.take(rhs.scales, perm, axis=2),
        offsets=None if rhs.offsets is None else jnp.take(rhs.offsets, perm, axis=2))


def repack(rhs: QuantizedWeights, arith: str = "exact", swiglu: bool = False) -> Packed:
    """`rhs` (int8 or 4-bit, float16 scales, blocks of 32) in the kernel's layout (once, like a weight load);
    `arith`, `swiglu` as in `Packed` (swiglu: `rhs` is a gate_up `[groups, k, 2 ffn]`).

    Thread t = 32 warp + lane of a CTA owns columns 16 warp + 8 nt + lane // 4 (nt = 0, 1) and, in each
    k16 step, k offsets 8 j + 2 (lane % 4) + e (j, e = 0, 1): the mma B fragment (or, swapped, the A
    fragment of W^T). 4-bit: word (blk, nt) holds the 8 codes of the thread's column nt in quantization block
    blk of the stage, nibble 4 sub + 2 j + e for k offset 32 blk + 16 sub + 8 j + 2 (lane % 4) + e. int8: word
    (2 blk + sub, nt), byte 2 j + e, the code stored as u = q + 128.

    Raises:
      ValueError: scales not float16, blocks not 32, or k / n not multiples of 64 / 128; `arith` not "exact"
        or "bf16", or "bf16" for int8 codes.
    """
    _, k, n = rhs.shape
    if rhs.scales.dtype != jnp.float16 or rhs.block_size != 32 or k % BK or n % BN:
        raise ValueError(f"repack needs float16 scales, blocks of 32, k % {BK} == 0 and n % {BN} == 0; got "
                         f"{rhs.scales.dtype}, {rhs.block_size}, k={k}, n={n}")
    if arith not in ("exact", "bf16") or (arith == "bf16" and rhs.bits != 4):
        raise ValueError(f"arith={arith!r}: 'exact', or 'bf16' for 4-bit codes")
    codes, sc = _layout(interleave_gate_up(rhs) if swiglu else rhs, arith)
    return Packed(codes=codes, scales=sc, bits=rhs.bits, n=n, arith=arith, swiglu=swiglu)


# (m_tiles, stages, k_sub, swap) built into the library; the defaults were the fastest at m = 4096 (H100)
CONFIGS = [(2, 3, 4, 0), (2, 3, 4, 1), (4, 4, 2, 0), (4, 4, 2, 1), (5, 3, 2, 1), (4, 4, 1, 0), (4, 4, 1, 1),
           (2, 4, 2, 1)]
DEFAULTS = {4: (4, 4, 2, 1), 8: (4, 4, 1, 1)}


@functools.partial(jax.jit, static_argnames=("config",))
def gmm_dequant(lhs: jax.Array, packed: Packed, group_sizes: jax.Array, *,
                config: tuple[int, int, int, int] | None = None) -> jax.Array:
    """lhs `[m, k]` bf16 (rows sorted by group) times each group's dequantized weights: `[m, n]` bf16, or with
    `packed.swiglu` silu(x W_gate) * (x W_up) `[m, n / 2]` (from the f32 accumulators); rows after the last
    group zero.

    config: (m_tiles, stages, k_sub, swap) in `CONFIGS`, default `DEFAULTS[bits]`. m_tiles x 16 rows per pass
    over a group's weights; stages: pipeline depth; k_sub: k-blocks of 64 per stage; swap 1: out^T = W^T x^T,
    the rows padded to 8 instead of 16.

    Raises:
      ValueError: a configuration not in `CONFIGS`, or swiglu weights with a configuration without swap.
    """
    config = DEFAULTS[packed.bits] if config is None else config
    if config not in CONFIGS:
        raise ValueError(f"config {config} not built; built: {CONFIGS}")
    if packed.swiglu and not config[3]:
        raise ValueError(f"config {config}: the SwiGLU epilogue needs swap=1")
    m = lhs.shape[0]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])
    n_out = packed.n // 2 if packed.swiglu else packed.n
    call = jax.ffi.ffi_call(TARGETS[packed.bits], jax.ShapeDtypeStruct((m, n_out), jnp.bfloat16))
    names = ("m_tiles", "stages", "k_sub", "swap")
    return call(lhs.astype(jnp.bfloat16), packed.codes, packed.scales, offsets,
                arith=np.int64(packed.arith == "bf16"), swiglu=np.int64(packed.swiglu),
                **{name: np.int64(v) for name, v in zip(names, config, strict=True)})

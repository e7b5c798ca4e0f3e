"""CPU checks of the CUDA grouped-matmul experiment (`benchmarks/cuda_gmm`): its kernel runs only on a Hopper
GPU (`benchmarks/gmm_cuda.py` checks it there, bit for bit), so here what it rests on is checked against the
library's own quantized weights:

1. `repack`'s layout, read back with the kernel's index arithmetic (thread, word, nibble or byte -> k, column),
   for exact and bf16-pair arithmetic;
2. the kernel's dequantization arithmetic (a code placed in the mantissa of a power of two, then one
   subtraction and one fma, or one byte permute and one fma), emulated in numpy, against
   `QuantizedWeights.dequantize(bfloat16)` bit for bit, for every code value;
3. the gate / up column interleave that the SwiGLU epilogue reads;

and, where nvcc exists, that the source compiles for sm_90a.
"""

import importlib
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels.quantized import QuantizedWeights, quantize_int4, quantize_int8

support.load_benchmark("bench_io")  # puts benchmarks/ on sys.path
cuda_gmm = importlib.import_module("cuda_gmm")  # an import error fails the module, it does not skip it


def _unpack(packed, groups, k, n):
    """The kernel's view of `packed`: codes [groups, k, n] and scales (and offsets) [groups, k / 32, n]."""
    codes = np.asarray(packed.codes).astype(np.uint64)
    tid = np.arange(256)
    warp, lane = tid // 32, tid % 32
    q = np.full((groups, k, n), -999, np.int64)
    for blk in range(2):
        for sub in range(2):
            for nt in range(2):
                col = warp * 16 + nt * 8 + lane // 4                     # [256]
                for j in range(2):
                    for e in range(2):
                        kk = 32 * blk + 16 * sub + 8 * j + 2 * (lane % 4) + e   # within the k-block of 64
                        if packed.bits == 4:
                            word = codes[..., blk * 2 + nt]             # [g, nb, ks, 256]
                            pos = 4 * (2 * sub + j) + 16 * e if packed.arith == "bf16" else 4 * (4 * sub + 2 * j + e)
                            val = (word >> np.uint64(pos)) & np.uint64(0xF)
                            val = val.astype(np.int64)
                        else:
                            word = codes[..., (2 * blk + sub) * 2 + nt]
                            val = ((word >> np.uint64(8 * (2 * j + e))) & np.uint64(0xFF)).astype(np.int64) - 128
                        for nb in range(n // 128):
                            for ks in range(k // 64):
                                q[:, ks * 64 + kk, nb * 128 + col] = val[:, nb, ks, :]
    sc = np.asarray(packed.scales)
    c = np.arange(128)
    order = (c // 16) * 16 + (c % 8) * 2 + (c % 16) // 8   # column 16 warp + 8 nt + l8 -> stored (warp, l8, nt)
    sc = sc[..., order, :] if packed.bits == 4 else sc[..., order]
    # [g, nb, ks, blk, 128 (, 2)] -> [g, k / 32, n (, 2)]
    sc = np.moveaxis(sc, 1, 3)                              # [g, ks, blk, nb, 128 (, 2)]
    sc = sc.reshape(groups, k // 32, n, *sc.shape[5:])
    return q, sc


@pytest.mark.parametrize(("bits", "arith"), [(8, "exact"), (4, "exact"), (4, "bf16")])
def test_repack_is_what_the_kernel_reads(bits, arith):
    groups, k, n = 3, 128, 256
    w = jax.random.normal(jax.random.PRNGKey(bits), (groups, k, n), jnp.float32)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w)
    packed = cuda_gmm.repack(qw, arith)
    q, sc = _unpack(packed, groups, k, n)
    np.testing.assert_array_equal(q, np.asarray(qw.codes()))
    dtype = jnp.bfloat16 if arith == "bf16" else jnp.float16   # "bf16": stored rounded to bf16
    assert packed.scales.dtype == dtype
    if bits == 8:
        np.testing.assert_array_equal(sc, np.asarray(qw.scales))
    else:
        np.testing.assert_array_equal(sc[..., 0], np.asarray(qw.scales.astype(dtype)))
        np.testing.assert_array_equal(sc[..., 1], np.asarray(qw.offsets.astype(dtype)))


def _fmaf(a, b, c):
    """float32 fma: a * b + c rounded once (exact in float64 for these operands: a < 2**24 with few significant
    bits, b and c float16 / float32 values of nearby magnitude)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _bf16_bits(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).view(jnp.uint16))


def test_dequantization_arithmetic_is_exact():
    rng = np.random.default_rng(0)
    s = (np.abs(rng.standard_normal(4000)) * 0.02 + 1e-5).astype(np.float16)
    m = (-s.astype(np.float32) * rng.uniform(0, 15, 4000)).astype(np.float16)
    # 4-bit: nibble<P>: (code << P) | bits(2^(23 - P)) is 2^(23 - P) + q; subtract, then fma(q, s, m)
    for p in (0, 4, 8, 12, 16):
        for q in range(16):
            base = np.uint32((127 + 23 - p) << 23)
            f = (np.uint32(q << p) | base).view(np.float32) - np.float32(2.0 ** (23 - p))
            assert f == q
            got = _bf16_bits(_fmaf(f, s, m))
            # one k-row pair (split-half packed: both nibbles q), block_size 1: row 0 is q * s + m
            want = QuantizedWeights(values=jnp.full((1, 1, s.size), q | (q << 4), jnp.uint8),
                                    scales=jnp.asarray(np.stack([s, s]))[None],
                                    offsets=jnp.asarray(np.stack([m, m]))[None],
                                    bits=4, block_size=1).dequantize(jnp.bfloat16)
            np.testing.assert_array_equal(got, np.asarray(want[0, 0].view(jnp.uint16)))
    # int8: the byte permute builds 2^15 + (q + 128); fma(that, s, -(2^15 + 128) s) = q s
    for q in range(-128, 128):
        f = np.uint32(0x47000000 | ((q + 128) << 8)).view(np.float32)
        assert f == 2.0**15 + q + 128
        bias = (np.float32(-32896.0) * s.astype(np.float32)).astype(np.float32)
        got = _bf16_bits(_fmaf(f, s, bias))
        want = QuantizedWeights(values=jnp.full((1, 1, s.size), q, jnp.int8), scales=jnp.asarray(s)[None, None],
                                bits=8, block_size=1).dequantize(jnp.bfloat16)
        np.testing.assert_array_equal(got, np.asarray(want[0, 0].view(jnp.uint16)))


@pytest.mark.parametrize("k_major", [True, False])
def test_interleave_gate_up_pairs_each_gate_column_with_its_up_column(k_major):
    groups, k, ffn = 2, 64, 128
    w = jax.random.normal(jax.random.PRNGKey(1), (groups, k, 2 * ffn), jnp.float32)
    qw = quantize_int4(w, k_major=k_major)
    got = np.asarray(cuda_gmm.interleave_gate_up(qw).dequantize())
    want = np.asarray(qw.dequantize())
    for b in range(ffn // 8):   # every 16 columns: gate 8 b .. 8 b + 7, then up 8 b .. 8 b + 7
        np.testing.assert_array_equal(got[..., 16 * b:16 * b + 8], want[..., 8 * b:8 * b + 8])
        np.testing.assert_array_equal(got[..., 16 * b + 8:16 * b + 16], want[..., ffn + 8 * b:ffn + 8 * b + 8])


def test_repack_rejects_what_the_kernel_cannot_take():
    w = jnp.zeros((2, 64, 96), jnp.float32)
    with pytest.raises(ValueError, match="n % 128"):
        cuda_gmm.repack(quantize_int8(w))
    with pytest.raises(ValueError, match="float16 scales"):
        cuda_gmm.repack(quantize_int8(jnp.zeros((2, 64, 128)), scale_dtype=jnp.float32))
    with pytest.raises(ValueError, match="4-bit"):
        cuda_gmm.repack(quantize_int8(jnp.zeros((2, 64, 128))), "bf16")


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("NVCC") or shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")),
                    reason="no nvcc")
def test_kernel_source_compiles(tmp_path):
    """Every template instantiation through the front end, NVVM and ptxas to an sm_90a cubin, and the host code
    (the FFI handlers). The device code is compiled at -O0 (cicc and ptxas; `cuda_gmm.build` uses their default
    -O3): C++, template and inline-asm operand errors show at any level, and the optimisers took 27 of the
    32 s on 2 CPU cores (2026-11-27: 35 s wall at -O3, 16 s at -O0)."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, "-O1", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--shared", "-Xcompiler",
           "-fPIC", "-Xcicc", "-O0", "-Xptxas", "-O0", f"-I{jax.ffi.include_dir()}",
           "-diag-suppress", "128,177,940,2473", "-o", str(tmp_path / "gmm.so"), cuda_gmm.SOURCE]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "gmm.so").stat().st_size > 0

"""The Hopper quantized grouped matmul (`grouped_matmul.pallas_mosaic`): what it refuses, that it lowers for an
H100, and (where an sm_90 GPU is present) its outputs against the f32 reference.

Pallas' interpreter cannot run Mosaic GPU kernels with register operands, so on the CPU the kernel is lowered
for CUDA (layout inference and shape checks run) but not executed; the numerical checks run on an H100:
  JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/pallas_kernels/test_grouped_matmul_mosaic.py
and in `benchmarks/gmm_mosaic.py` (the same layouts, router-skewed m = 4096 and m below 32 rows, int8 and 4-bit,
gmm and gmm_swiglu: 64 checks passed on an H100 on 2026-11-25; with the wgmma-layout codes, 60 checks of every
dequantization path on five layouts passed on 2026-11-26, docs/results/2026-11-26_mosaic_checks.py). This file's
GPU tests passed on an H100 on 2026-11-26 (4 tests, 175 s: docs/results/2026-11-26_h100_pytest_gmm_mosaic_on_gpu_2153.txt)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels import gpu_limits
from pallas_kernels.grouped_matmul import pallas_mosaic, reference, workloads
from pallas_kernels.quantized import quantize_int4, quantize_int8

SMALL = workloads.Workload(name="mosaic_small", m=200, k=256, n=128, groups=8)
LAYOUTS = [
    SMALL,
    workloads.Workload(name="empty", m=96, k=128, n=64, groups=16, layout="empty_groups"),
    workloads.Workload(name="one", m=77, k=128, n=64, groups=4, layout="one_group"),
    workloads.Workload(name="partial", m=130, k=128, n=64, groups=8, layout="partial", routed_rows=97),
    workloads.Workload(name="padding", m=40, k=128, n=64, groups=4, layout="all_padding", routed_rows=0),
    workloads.Workload(name="first_last", m=57, k=128, n=64, groups=4, layout="first_last"),
    workloads.Workload(name="g512", m=300, k=128, n=64, groups=512),
]


def test_supported_names_the_reason():
    lhs = jnp.zeros((64, 256), jnp.bfloat16)
    w = jnp.zeros((4, 256, 128), jnp.float32)
    q8 = quantize_int8(w)
    assert pallas_mosaic.supported(lhs, q8, swiglu=False) is None
    assert pallas_mosaic.supported(lhs, quantize_int4(w), swiglu=True) is None
    assert "k-major" in pallas_mosaic.supported(lhs, w, swiglu=False)
    assert "k-major" in pallas_mosaic.supported(lhs, q8.with_k_major(False), swiglu=False)
    assert "bfloat16" in pallas_mosaic.supported(lhs.astype(jnp.float32), q8, swiglu=False)
    assert "lhs_index" in pallas_mosaic.supported(lhs, q8, swiglu=False, lhs_index=jnp.zeros((64,), jnp.int32))
    assert "multiple of 64" in pallas_mosaic.supported(lhs, quantize_int8(jnp.zeros((4, 256, 96))), swiglu=False)
    with pytest.raises(ValueError, match="gmm_mosaic: lhs dtype"):
        pallas_mosaic.gmm_mosaic(lhs.astype(jnp.float32), q8, jnp.full((4,), 16, jnp.int32))
    with pytest.raises(ValueError, match="dequant='f16'"):
        pallas_mosaic.gmm_mosaic(lhs, q8, jnp.full((4,), 16, jnp.int32), dequant="f16")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("wgmma_codes", [False, True])
def test_lowers_for_h100(bits, swiglu, wgmma_codes):
    lhs, rhs, gs = workloads.make_inputs(SMALL, weights="int8" if bits == 8 else "int4", swiglu=swiglu)
    codes = pallas_mosaic.permute_codes(rhs) if wgmma_codes else None
    text = support.lowered_for_h100(
        lambda a, b, g, c: pallas_mosaic.gmm_mosaic(a, b, g, swiglu=swiglu, wgmma_codes=c), lhs, rhs, gs, codes)
    assert "gmm_quantized_mosaic" in text


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_permute_codes_gives_each_thread_its_wgmma_registers(kind):
    """Thread T = 32 warp + lane of a warpgroup holds, in the wgmma A-operand register layout of a [64, 32] bf16
    block (PTX ISA, wgmma .m64nNk16 A fragments; 8 registers of 2 values), rows 16 warp + 8 h + lane // 4 and
    columns 8 c + 2 (lane % 4) + e; `permute_codes` must put exactly those codes in its 16 bytes, byte
    8 h + 4 (c // 2) + 2 (c % 2) + e (the kernel's register order)."""
    w = np.random.default_rng(0).standard_normal((3, 256, 128)).astype(np.float32)
    rhs = (quantize_int8 if kind == "int8" else quantize_int4)(jnp.asarray(w))
    values = np.asarray(rhs.values).view(np.int8)              # [g, n, code columns], k-major
    got = np.asarray(pallas_mosaic.permute_codes(rhs))
    g, n, kc = values.shape
    assert got.shape == (g, n // 64, kc // 32, 128, 16) and got.dtype == np.int8
    want = np.empty_like(got)
    for t in range(128):
        warp, lane = divmod(t, 32)
        for h in range(2):
            for c in range(4):
                for e in range(2):
                    row = 16 * warp + 8 * h + lane // 4
                    col = 8 * c + 2 * (lane % 4) + e
                    block = values.reshape(g, n // 64, 64, kc // 32, 32)[:, :, row, :, col]
                    want[:, :, :, t, 8 * h + 4 * (c // 2) + 2 * (c % 2) + e] = block
    np.testing.assert_array_equal(got, want)


def test_wgmma_codes_int8_by_one_fma():
    # one fma per code (2**15 + 128 + code), exact for float16 / bfloat16 scales; float32 scales are refused
    lhs, rhs, gs = workloads.make_inputs(SMALL, weights="int8")
    text = support.lowered_for_h100(lambda a, b, g, c: pallas_mosaic.gmm_mosaic(a, b, g, wgmma_codes=c),
                                    lhs, rhs, gs, pallas_mosaic.permute_codes(rhs))
    assert "0x47000000" in text and "fma.rn.f32" in text and "sub.rn.f32" not in text
    q = dataclasses.replace(rhs, scales=rhs.scales.astype(jnp.float32))
    with pytest.raises(ValueError, match="float16 or bfloat16 scales"):
        pallas_mosaic.gmm_mosaic(lhs, q, gs, wgmma_codes=pallas_mosaic.permute_codes(q))


def test_wgmma_codes_refused_in_a_wrong_shape():
    lhs, rhs, gs = workloads.make_inputs(SMALL, weights="int8")
    with pytest.raises(ValueError, match="permute_codes"):
        pallas_mosaic.gmm_mosaic(lhs, rhs, gs, wgmma_codes=rhs.values)
    with pytest.raises(ValueError, match="k-major"):
        pallas_mosaic.permute_codes(rhs.with_k_major(False))


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (Mosaic GPU wgmma)")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matches_reference_on_gpu(kind, swiglu):
    for w in LAYOUTS:
        lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
        ref = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
            lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
        codes = pallas_mosaic.permute_codes(rhs)
        for dequant in ("f32", "bf16", "wgmma"):
            got = pallas_mosaic.gmm_mosaic(lhs, rhs, gs, swiglu=swiglu, dequant="f32" if dequant == "wgmma" else dequant,
                                           wgmma_codes=codes if dequant == "wgmma" else None)
            support.assert_finite(got, f"gmm_mosaic {w.name} {dequant}")
            err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
            assert err <= 1e-2, (w.name, dequant, err)

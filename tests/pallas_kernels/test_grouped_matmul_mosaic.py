"""The Hopper quantized grouped matmul (`grouped_matmul.pallas_mosaic`): what it refuses, that it lowers for an
H100, that its tiles are put back into rows exactly, and (where an sm_90 GPU is present) its outputs against
the f32 reference.

Pallas' interpreter cannot run Mosaic GPU kernels with register operands, so on the CPU the kernel is lowered
for CUDA (layout inference and shape checks run) but not executed; the numerical checks run on an H100:
  JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/pallas_kernels/test_grouped_matmul_mosaic.py
and in `benchmarks/gmm_mosaic.py` (32 checks, all layouts below and more, passed on an H100 on 2026-11-25)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels import gpu_limits
from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, reference, workloads
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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("swiglu", [False, True])
def test_lowers_for_h100(bits, swiglu):
    lhs, rhs, gs = workloads.make_inputs(SMALL, weights="int8" if bits == 8 else "int4", swiglu=swiglu)
    text = support.lowered_for_h100(pallas_mosaic.gmm_mosaic, lhs, rhs, gs, swiglu=swiglu)
    assert "gmm_quantized_mosaic" in text


@pytest.mark.parametrize("w", LAYOUTS, ids=lambda w: w.name)
def test_rows_from_tiles_puts_every_row_back(w):
    # Tiles as the kernel writes them: item i's slot holds rows base_i + [0, ROWS) of the product (base_i its first
    # row rounded down to 8; rows past m read as zeros by TMA), whatever groups those rows belong to.
    gs = jnp.asarray(workloads.group_sizes_for(w))
    rng = np.random.default_rng(3)
    product = rng.standard_normal((w.m, w.n)).astype(np.float32)
    group, start, end = (np.asarray(a) for a in pallas_triton.make_schedule(gs, w.m, pallas_mosaic.OWN_ROWS))
    assert np.all(end - start <= pallas_mosaic.OWN_ROWS)
    padded = np.concatenate([product, np.zeros((pallas_mosaic.ROWS + 8, w.n), np.float32)])
    tiles = np.full((group.shape[0], w.n, pallas_mosaic.ROWS), np.nan, np.float32)
    for i, (g, s) in enumerate(zip(group, start)):
        if g <= w.groups:   # used items (unused ones are left unwritten: NaN must not leak)
            base = s - s % 8
            tiles[i] = padded[base:base + pallas_mosaic.ROWS].T
    got = np.asarray(pallas_mosaic.rows_from_tiles(jnp.asarray(tiles), jnp.asarray(group), jnp.asarray(start),
                                                   jnp.asarray(end), m=w.m, groups=w.groups))
    support.assert_finite(got, "rows")
    routed = int(np.sum(np.asarray(gs)))
    np.testing.assert_array_equal(got[:routed], product[:routed])
    np.testing.assert_array_equal(got[routed:], 0.0)


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (Mosaic GPU wgmma)")
@pytest.mark.parametrize("w", LAYOUTS, ids=lambda w: w.name)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matches_reference_on_gpu(w, kind, swiglu):
    lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
    ref = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
        lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
    got = pallas_mosaic.gmm_mosaic(lhs, rhs, gs, swiglu=swiglu)
    support.assert_finite(got, "gmm_mosaic")
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    assert err <= 1e-2, err

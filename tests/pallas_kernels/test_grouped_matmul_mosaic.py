"""The Hopper quantized grouped matmul (`grouped_matmul.pallas_mosaic`): what it refuses, that it lowers for an
H100, and (where an sm_90 GPU is present) its outputs against the f32 reference.

Pallas' interpreter cannot run Mosaic GPU kernels with register operands, so on the CPU the kernel is lowered
for CUDA (layout inference and shape checks run) but not executed; the numerical checks run on an H100:
  JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/pallas_kernels/test_grouped_matmul_mosaic.py
and in `benchmarks/gmm_mosaic.py` (the same layouts, router-skewed m = 4096 and m below 32 rows, int8 and 4-bit,
gmm and gmm_swiglu: 64 checks passed on an H100 on 2026-11-25)."""

import jax.numpy as jnp
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
def test_lowers_for_h100(bits, swiglu):
    lhs, rhs, gs = workloads.make_inputs(SMALL, weights="int8" if bits == 8 else "int4", swiglu=swiglu)
    text = support.lowered_for_h100(pallas_mosaic.gmm_mosaic, lhs, rhs, gs, swiglu=swiglu)
    assert "gmm_quantized_mosaic" in text


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (Mosaic GPU wgmma)")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matches_reference_on_gpu(kind, swiglu):
    for w in LAYOUTS:
        lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
        ref = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
            lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
        for dequant in ("f32", "bf16"):
            got = pallas_mosaic.gmm_mosaic(lhs, rhs, gs, swiglu=swiglu, dequant=dequant)
            support.assert_finite(got, f"gmm_mosaic {w.name} {dequant}")
            err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
            assert err <= 1e-2, (w.name, dequant, err)

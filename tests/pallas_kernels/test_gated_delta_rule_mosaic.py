"""The Hopper state pass (`pallas_mosaic`, Pallas Mosaic GPU): where it is chosen, what it refuses, and that
it lowers; its outputs against the f32 reference where an sm_90 GPU is present.

Pallas' GPU interpreter cannot run it (its wgmma takes no register operands), so on the CPU machine the
kernel is lowered for CUDA (Mosaic GPU's layout inference and shape checks run) but not executed; the
numerical checks run on an H100 / H200 (and in `benchmarks/gated_delta_rule.py --check`):
  JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/pallas_kernels/test_gated_delta_rule_mosaic.py
(all 10 passed on an H100 on 2026-11-25; tests/conftest.py otherwise pins JAX to the CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import pallas_mosaic, pallas_triton, reference, workloads

DIM128 = dataclasses.replace(workloads.TINY, name="dim128", seq=200, batch=2, key_dim=128, value_dim=128)
DEFAULT = pallas_triton.BlockSizes.get_default()
MOSAIC = dataclasses.replace(DEFAULT, state_kernel="mosaic")
REFUSAL_ARGS = {"interpret": False, "chunk_size": 64, "key_dim": 128, "value_dim": 128,
                    "compute_dtype": jnp.bfloat16}


def test_supported_shapes():
    assert pallas_mosaic.supported(chunk_size=64, key_dim=128, value_dim=128, compute_dtype=jnp.bfloat16) is None
    assert "chunk_size=32" in pallas_mosaic.supported(chunk_size=32, key_dim=128, value_dim=128,
                                                      compute_dtype=jnp.bfloat16)
    assert "value_dim=96" in pallas_mosaic.supported(chunk_size=64, key_dim=128, value_dim=96,
                                                     compute_dtype=jnp.bfloat16)
    assert "float32" in pallas_mosaic.supported(chunk_size=64, key_dim=128, value_dim=128,
                                                compute_dtype=jnp.float32)


def test_refusals_name_the_reason(monkeypatch):
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: True)
    wy = dataclasses.replace(MOSAIC, wy_in_state=True)
    assert pallas_triton.mosaic_refusal(wy, **REFUSAL_ARGS) is None
    cases = {
        "interpreter": {"interpret": True},
        "float32": {"compute_dtype": jnp.float32},
    }
    for words, change in cases.items():
        assert words in pallas_triton.mosaic_refusal(wy, **{**REFUSAL_ARGS, **change})
    for change in ({"wy_in_state": False}, {"fuse_output": False}, {"segments": 2},
                   {"fold_t_into_p": True}, {"prepare_kernel": "sub_blocks"}):
        assert "BlockSizes" in pallas_triton.mosaic_refusal(dataclasses.replace(wy, **change), **REFUSAL_ARGS)
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: False)
    assert "sm_90" in pallas_triton.mosaic_refusal(wy, **REFUSAL_ARGS)


def test_explicit_mosaic_refused_in_the_interpreter_and_auto_falls_back():
    inputs = workloads.make_inputs(DIM128, dtype=jnp.bfloat16, seed=2)
    with pytest.raises(ValueError, match="state_kernel='mosaic' does not take the Pallas interpreter"):
        pallas_triton.gated_delta_rule_pallas(**inputs, block_sizes=MOSAIC, interpret=True)
    with pytest.raises(ValueError, match="choose auto, triton or mosaic"):
        pallas_triton.gated_delta_rule_pallas(
            **inputs, block_sizes=dataclasses.replace(DEFAULT, state_kernel="cuda"), interpret=True)
    # "auto" (the default) in the interpreter is the Triton state pass, bit for bit
    triton = dataclasses.replace(DEFAULT, state_kernel="triton")
    small = workloads.make_inputs(dataclasses.replace(DIM128, seq=70, batch=1, v_heads=2, k_heads=1),
                                  dtype=jnp.bfloat16, seed=3)
    auto = pallas_triton.gated_delta_rule_pallas(**small, block_sizes=DEFAULT, interpret=True)
    explicit = pallas_triton.gated_delta_rule_pallas(**small, block_sizes=triton, interpret=True)
    for a, e in zip(auto, explicit, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


def test_kernel_lowers_for_cuda():
    """The walk kernel through Mosaic GPU's lowering (layout inference, wgmma shapes, shared memory within
    227 KiB) for an sm_90 target: two batch rows, and three packed sequences writing their output in place."""
    t, kh, vh, k, v = 256, 2, 4, 128, 128
    bf16, f32 = jnp.bfloat16, jnp.float32

    def args(b, rows, seq=t):  # q, k, v, T diag(beta), P, gamma, initial state
        return (jax.ShapeDtypeStruct((b, seq, kh, k), bf16), jax.ShapeDtypeStruct((b, seq, kh, k), bf16),
                jax.ShapeDtypeStruct((b, seq, vh, v), bf16), jax.ShapeDtypeStruct((b, seq, vh, 64), bf16),
                jax.ShapeDtypeStruct((b, seq, vh, 64), bf16), jax.ShapeDtypeStruct((b, vh, seq), f32),
                jax.ShapeDtypeStruct((rows, vh, k, v), f32))

    def lowered(*a, **kw):
        return pallas_mosaic.state_pass.trace(*a, scale=k**-0.5, **kw).lower(lowering_platforms=("cuda",)).as_text()

    assert "mosaic_gpu" in lowered(*args(2, 2))
    bounds = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert "mosaic_gpu" in lowered(*args(1, 3), bounds, bounds, out_seq=250)
    with pytest.raises(ValueError, match="seq=200 not a multiple of 64"):
        lowered(*args(2, 2, seq=200))
    with pytest.raises(ValueError, match="out_seq"):
        lowered(*args(1, 3), bounds, bounds)


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("seq,batch,seqlens", [(200, 2, None), (64, 1, None), (1000, 1, None),
                                               (330, 1, (70, 0, 64, 196))])
def test_matches_reference_on_hopper(seq, batch, seqlens):
    workload = dataclasses.replace(DIM128, seq=seq, batch=batch)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=5, seqlens=seqlens)
    as_f32 = {n: (x if x is None or n == "cu_seqlens" else jnp.asarray(x, jnp.float32)) for n, x in inputs.items()}
    want = reference.gated_delta_rule_reference(**as_f32)
    got = pallas_triton.gated_delta_rule_pallas(**inputs, block_sizes=MOSAIC)
    for name, g, w in zip(("output", "final_state"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        assert np.abs(g - w).max() / np.abs(w).max() <= 2e-2, name

"""The Hopper prepare (`pallas_mosaic_prepare`, Pallas Mosaic GPU; opt-in `BlockSizes.mosaic_prepare`): what it
refuses, that it lowers for an H100 alone and inside the packed own-grid call, and (on an sm_90 GPU) that its
T diag(beta) is the Triton whole-tile inverse's.

Pallas' GPU interpreter cannot run it (its wgmma takes no register operands): on the CPU it is lowered for
CUDA, not run; the numerical test runs on an H100 / H200, as `benchmarks/gdn_mosaic_prepare.py` does
(bit for bit the Triton prepare's T on an H100, 2026-11-25)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import pallas_mosaic_prepare, pallas_triton, workloads

BF16, F32 = jnp.bfloat16, jnp.float32


def shapes(seq=1000, t=1024, k_heads=2, group=2, key_dim=128, dtype=BF16):
    k = jax.ShapeDtypeStruct((1, seq, k_heads, key_dim), dtype)
    g = jax.ShapeDtypeStruct((1, k_heads * group, t), F32)
    return k, g, g


def test_supported_names_the_reason():
    ok = {"chunk_size": 64, "key_dim": 128, "group": 2, "dtype": BF16}
    assert pallas_mosaic_prepare.supported(**ok) is None
    for change, words in (({"chunk_size": 32}, "chunk_size=32"), ({"key_dim": 96}, "key_dim=96"),
                          ({"group": 3}, "3 v-heads per k-head"), ({"dtype": F32}, "float32")):
        assert words in pallas_mosaic_prepare.supported(**{**ok, **change})


@pytest.mark.parametrize("group,streams", [(2, 1), (2, 2), (1, 4)])
def test_lowers_for_cuda(group, streams):
    """Mosaic GPU's lowering (layout inference, wgmma shapes, shared memory) for an sm_90 target; a last
    partial chunk (1000 tokens in 16 chunks) and programs whose streams get fewer chunks than others."""
    text = support.lowered_for_h100(pallas_mosaic_prepare.prepare, *shapes(group=group), group=group,
                                    streams=streams, chunks_per_program=5)
    assert "mosaic_gpu" in text


def test_refuses_bad_shapes():
    prepare = pallas_mosaic_prepare.prepare
    with pytest.raises(ValueError, match="key_dim=96"):
        prepare.trace(*shapes(key_dim=96), group=2)
    with pytest.raises(ValueError, match="float32"):
        prepare.trace(*shapes(dtype=F32), group=2)
    with pytest.raises(ValueError, match="seq a positive multiple of 8"):
        prepare.trace(*shapes(seq=1001), group=2)
    with pytest.raises(ValueError, match="t a multiple of 64 >= seq"):
        prepare.trace(*shapes(seq=1000, t=960), group=2)
    with pytest.raises(ValueError, match=r"k_heads \* group"):
        prepare.trace(*shapes(), group=1)
    with pytest.raises(ValueError, match="warpgroups"):
        prepare.trace(*shapes(), group=2, streams=3)


def packed_args(seq=1000, k_heads=2, v_heads=4):
    return (jax.ShapeDtypeStruct((1, seq, k_heads, 128), BF16),) * 2 + (
        jax.ShapeDtypeStruct((1, seq, v_heads, 128), BF16), jax.ShapeDtypeStruct((1, seq, v_heads), F32),
        jax.ShapeDtypeStruct((1, seq, v_heads), F32))


def test_opt_in_on_the_packed_own_grid_call(monkeypatch):
    """`BlockSizes.mosaic_prepare=True`: the packed own-grid call is two Mosaic GPU kernels (prepare, walk) and
    no Triton prepare (the gates' transpose is the one Triton kernel); off (the default), the Triton prepare;
    where it does not apply, a ValueError naming why."""
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: True)
    cu = jnp.asarray([0, 300, 1000], jnp.int32)

    def lowered(block_sizes, args):
        return support.lowered_for_h100(lambda *a: pallas_triton.gated_delta_rule_pallas(
            *a, cu_seqlens=cu, interpret=False, block_sizes=block_sizes), *args)

    on = lowered(dataclasses.replace(pallas_triton.BlockSizes(), mosaic_prepare=True), packed_args())
    assert on.count("custom_call @mosaic_gpu") == 2 and on.count("xla.gpu.triton") == 1
    off = lowered(pallas_triton.BlockSizes(), packed_args())
    assert off.count("custom_call @mosaic_gpu") == 1 and off.count("xla.gpu.triton") == 2
    with pytest.raises(ValueError, match="mosaic_prepare=True needs .*P in the walk"):
        lowered(pallas_triton.BlockSizes(mosaic_prepare=True, p_in_walk=False), packed_args())
    with pytest.raises(ValueError, match="mosaic_prepare=True needs 3 v-heads per k-head"):
        lowered(pallas_triton.BlockSizes(mosaic_prepare=True), packed_args(k_heads=1, v_heads=3))


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("seqlens,streams", [((70, 0, 5, 3, 64, 858), 1), ((70, 0, 5, 3, 64, 858), 2),
                                             ((1000,), 1)])
def test_matches_the_triton_prepare_on_hopper(seqlens, streams):
    """T diag(beta) of packed sequences on their own grid (sequences starting inside chunks): the Triton
    prepare's with the whole-tile inverse (the same bf16 products), to float rounding."""
    workload = dataclasses.replace(workloads.TINY, seq=sum(seqlens), batch=1, seqlens=seqlens, key_dim=128,
                                   value_dim=128)
    bench = support.load_benchmark("gdn_mosaic_prepare")  # its gates and Triton T, as the own-grid path has them
    inputs, g, bt = bench.inputs_for(workload, seed=3)
    want, gamma = bench.triton_t(inputs, g, bt, group=2, inverse_slabs=False)
    got = pallas_mosaic_prepare.prepare(inputs["key"], gamma, bt, group=2, streams=streams, chunks_per_program=3)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    support.assert_finite(got, "T diag(beta)")
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()

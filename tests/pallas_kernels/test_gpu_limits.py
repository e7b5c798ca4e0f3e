"""Shared memory per block by compute capability (the tile-shape guards of both kernels use it)."""

import types

import jax

from pallas_kernels import gpu_limits


def _device(platform, cc=None):
    return types.SimpleNamespace(platform=platform, **({} if cc is None else {"compute_capability": cc}))


def test_shared_memory_limit_by_compute_capability():
    assert gpu_limits.shared_memory_limit(_device("gpu", "9.0")) == 227 * 1024  # H100 / H200
    assert gpu_limits.shared_memory_limit(_device("gpu", "8.0")) == 163 * 1024  # A100
    assert gpu_limits.shared_memory_limit(_device("gpu", "8.9")) == 99 * 1024  # Ada (RTX 4090, L4)
    assert gpu_limits.shared_memory_limit(_device("gpu")) == 99 * 1024  # unknown: the smallest
    assert gpu_limits.shared_memory_limit(_device("cpu")) is None
    if jax.default_backend() == "cpu":  # the CPU test machine
        assert gpu_limits.shared_memory_limit() is None


def test_is_hopper_only_for_sm90():
    assert gpu_limits.is_hopper(_device("gpu", "9.0"))
    for cc in ("8.0", "8.9", "10.0", "12.0"):  # no wgmma on Ampere, Ada or Blackwell
        assert not gpu_limits.is_hopper(_device("gpu", cc))
    assert not gpu_limits.is_hopper(_device("cpu"))


def test_sm_count_from_the_device_else_an_h100s():
    assert gpu_limits.sm_count(types.SimpleNamespace(platform="gpu", core_count=114)) == 114  # H100 PCIe
    assert gpu_limits.sm_count(_device("gpu")) == gpu_limits.SM_COUNT_DEFAULT == 132  # not reported
    assert gpu_limits.sm_count(types.SimpleNamespace(platform="cpu", core_count=2)) == 132  # CPU cores: no

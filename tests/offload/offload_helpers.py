"""Helpers shared by the offload tests (not fixtures)."""

import numpy as np

import hybridlm


def quantized_tiny(bits: int):
    """The tiny model with int8 or 4-bit `QuantizedWeights` experts."""
    return hybridlm.init_random(hybridlm.get_config("tiny"), 3, expert_format=f"int{bits}")


def assert_finite(x):
    x = np.asarray(x)
    assert np.isfinite(x).all(), "NaN/Inf in output"


def assert_stats_add_up(stats: dict, expert_bytes: int):
    for s in [stats] + stats.get("per_layer", []):
        assert s["hits"] + s["misses"] == s["lookups"], s
        transfers = s["misses"] - s["prefetch_used"] + s["prefetched"]
        assert s["bytes_h2d"] == transfers * expert_bytes, s
        assert 0 <= s["prefetch_used"] <= min(s["prefetched"], s["misses"]), s
        assert s["stall_s"] >= 0 and s["evictions"] >= 0

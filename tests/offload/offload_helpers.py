"""Helpers shared by the offload tests (not fixtures)."""

import jax.numpy as jnp
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


def assert_decode_matches(
    runner,
    base_runner,
    pre,
    ref,
    position: int,
    steps: int,
    *,
    exact: bool = True,
    atol: float = 1e-5,
    after_step=None,
) -> None:
    """`steps` greedy decode steps of `runner` from prefill `pre` and of the all-resident `base_runner` from
    `ref`, both fed the reference's tokens: finite logits equal to the reference's (bit for bit where `exact`,
    else within atol = rtol) at every step; `after_step(step)` runs after each."""
    logits, states, logits_ref, states_ref = pre.logits, pre.states, ref.logits, ref.states
    for step in range(steps):
        token = jnp.argmax(logits_ref, axis=-1).astype(jnp.int32)
        logits_ref, states_ref = hybridlm.decode_step(base_runner, token, states_ref, position + step)
        logits, states = hybridlm.decode_step(runner, token, states, position + step)
        assert_finite(logits)
        if exact:
            np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_ref))
        else:
            np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), atol=atol, rtol=atol)
        if after_step is not None:
            after_step(step)

"""Logits of hybridlm vs HF transformers 5.23 (an independent implementation) on small random checkpoints.

Fixtures: tests/fixtures/hf/*, written by tests/fixtures/make_hf_fixtures.py (all norms, gates, A_log, dt_bias
random; logit std 1; sequences of 37 and 70 tokens, crossing chunk boundaries of 16).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from support import FIXTURES, HF_FIXTURES, assert_finite

import hybridlm

MAX_ABS_LOGIT_ERROR = 1e-3  # fp32 on CPU; the bound


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_full_forward_matches_hf(hf_models, forward, name):
    model, expected = hf_models[name]
    logits = np.asarray(forward(model, jnp.asarray(expected["input_ids"])))
    assert_finite(logits, "logits")
    assert 0.8 < expected["logits"].std() < 1.25, "fixture logits should have std near 1"
    np.testing.assert_array_less(np.abs(logits - expected["logits"]).max(), MAX_ABS_LOGIT_ERROR)
    assert (logits.argmax(-1) == expected["logits"].argmax(-1)).all()


@pytest.mark.parametrize("name", HF_FIXTURES)
@pytest.mark.parametrize("chunk_size", [16, 64, 4096])
def test_chunked_prefill_matches_hf_last_token(hf_models, name, chunk_size):
    model, expected = hf_models[name]
    result = hybridlm.prefill(model, expected["input_ids"], chunk_size=chunk_size)
    assert_finite(result.logits, "prefill logits")
    want = expected["logits"][:, -1]
    assert np.abs(np.asarray(result.logits) - want).max() < MAX_ABS_LOGIT_ERROR
    assert (np.asarray(result.logits).argmax(-1) == want.argmax(-1)).all()


def test_long_sequence_and_decode_match_hf(hf_models):
    """Prefill 50 tokens in chunks of 16, then decode the remaining 20 one by one:
    every position matches HF."""
    model, _ = hf_models["qwen35moe_text"]
    expected = np.load(FIXTURES / "hf" / "qwen35moe_text" / "expected_long.npz")
    ids, want = expected["input_ids"], expected["logits"]
    runner = hybridlm.LayerwiseRunner(model)
    result = hybridlm.prefill(runner, ids[:, :50], chunk_size=16, max_new_tokens=20)
    errors = [np.abs(np.asarray(result.logits) - want[:, 49]).max()]
    states = result.states
    for pos in range(50, 70):
        logits, states = hybridlm.decode_step(runner, jnp.asarray(ids[:, pos]), states, pos)
        assert_finite(logits, f"decode logits at {pos}")
        errors.append(np.abs(np.asarray(logits) - want[:, pos]).max())
    assert max(errors) < MAX_ABS_LOGIT_ERROR, errors

"""Layer taps (the DFlash draft's features): chosen layers' outputs from chunked prefill, its per-phase
timing path and the speculative verify equal those layers' outputs in the model's plain layer loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybridlm
from hybridlm.config import TINY
from hybridlm.engine.runner import LayerwiseRunner
from hybridlm.engine.speculative import verify
from hybridlm.state import init_layer_states
from tests.support import assert_finite

CONFIG = TINY.replace(vocab_size=512, num_layers=4)
TAPS = (3, 0, 1)  # out of order, the last layer included: features follow this order
SEQ = 37  # chunk 16: two full chunks and a tail
# chunked prefill (WY-form delta rule, cached attention) against the full forward, float32, |h| ~ 1..3
ATOL = 2e-4


@pytest.fixture(scope="module")
def model():
    return hybridlm.init_random(CONFIG, seed=2)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, SEQ)).astype(np.int32)


@nnx.jit
def _layer_outputs(model, ids):
    """Every layer's output [layers, batch, seq, hidden] of `HybridLM.__call__`'s plain layer loop."""
    x = model.embed[...][ids]
    outputs = []
    for layer in model.layers:
        x, _ = layer(x)
        outputs.append(x)
    return jnp.stack(outputs)


@pytest.fixture(scope="module")
def outputs(model, prompt):
    outputs = np.asarray(_layer_outputs(model, jnp.asarray(prompt)))
    assert_finite(outputs, "layer outputs")
    return outputs


@pytest.fixture(scope="module")
def expected(outputs):
    return np.concatenate([outputs[i] for i in TAPS], axis=-1)  # [batch, seq, len(TAPS) * hidden]


@pytest.mark.parametrize("profile", [False, True], ids=["layer-groups", "per-phase"])
def test_prefill_taps_are_the_layers_outputs(model, prompt, outputs, expected, profile):
    runner = LayerwiseRunner(model)
    rows = []

    def on_chunk(x, start, num_valid, next_ids, capacity, features):
        assert features.shape == (2, 16, len(TAPS) * CONFIG.hidden_dim)
        rows.append(np.asarray(features)[:, :num_valid])

    result = hybridlm.prefill(runner, prompt, chunk_size=16, on_chunk=on_chunk, taps=TAPS, profile=profile)
    features = np.concatenate(rows, axis=1)
    assert_finite(features, "tapped features")
    np.testing.assert_allclose(features, expected, atol=ATOL, rtol=0)
    logits = np.asarray(model.logits(jnp.asarray(outputs[-1][:, -1])))  # the taps leave the result alone
    np.testing.assert_allclose(np.asarray(result.logits), logits, atol=ATOL, rtol=0)


def test_verify_taps_are_the_layers_outputs(model, prompt, expected):
    """A verify of the first 6 tokens from empty states: the forward over them, taps included."""
    states = init_layer_states(CONFIG, 1, 16)
    run = nnx.jit(lambda m, s, t: verify(m, s, t, 0, TAPS))
    hidden, _, features = run(model, states, jnp.asarray(prompt[:1, :6]))
    assert_finite(features, "verify features")
    np.testing.assert_allclose(np.asarray(features), expected[:1, :6], atol=ATOL, rtol=0)
    last = expected[:1, :6, : CONFIG.hidden_dim]  # TAPS[0] is the last layer
    np.testing.assert_allclose(np.asarray(hidden), last, atol=ATOL, rtol=0)


def test_taps_are_checked(model, prompt):
    runner = LayerwiseRunner(model)
    with pytest.raises(ValueError, match=r"tap layers \[4\]"):
        hybridlm.prefill(runner, prompt, chunk_size=16, on_chunk=lambda *a: None, taps=(1, 4))
    with pytest.raises(ValueError, match="need an on_chunk"):
        hybridlm.prefill(runner, prompt, chunk_size=16, taps=(1,))
    with pytest.raises(ValueError, match=r"tap layers \[-1\]"):
        verify(model, init_layer_states(CONFIG, 1, 16), jnp.zeros((1, 2), jnp.int32), 0, (-1,))

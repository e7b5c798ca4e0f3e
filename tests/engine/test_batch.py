"""Sequences at different positions decoded together (`engine.batch`): the same logits and tokens as alone."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_finite

import hybridlm
from hybridlm.engine.batch import DecodeBatcher, stack_rows, take_row

LENGTHS = (9, 20, 5)  # prompts of different lengths: rows at different positions
NEW = 6


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 248_320, (1, n)).astype(np.int32) for n in LENGTHS]


def test_decode_steps_with_one_position_a_row_equal_each_alone(tiny_runner, prompts):
    """Two steps, so that the second reads the keys the first wrote at each row's own position."""
    pres = [hybridlm.prefill(tiny_runner, p, chunk_size=16, max_new_tokens=8) for p in prompts]
    steps = np.array([[3, 77, 123_456], [5, 6, 7]], np.int32)  # [step, row]
    want = []
    for i, pre in enumerate(pres):
        states = jax.tree_util.tree_map(jnp.copy, take_row(pre.states, 0))  # decode_step donates its states
        for j, tokens in enumerate(steps):
            logits, states = hybridlm.decode_step(
                tiny_runner, jnp.asarray(tokens[i : i + 1]), states, pre.prompt_tokens + j
            )
        want.append(np.asarray(logits[0]))
    states = stack_rows([pre.states for pre in pres], capacity=64)
    positions = np.array([pre.prompt_tokens for pre in pres], np.int32)
    for j, tokens in enumerate(steps):
        logits, states = hybridlm.decode_step(tiny_runner, jnp.asarray(tokens), states, positions + j)
    assert_finite(logits)
    np.testing.assert_allclose(np.asarray(logits), np.stack(want), atol=1e-4, rtol=0)


def test_positions_checked(tiny_runner, prompts):
    pre = hybridlm.prefill(tiny_runner, prompts[0], chunk_size=16, max_new_tokens=4)
    with pytest.raises(ValueError, match="one per sequence"):
        hybridlm.decode_step(tiny_runner, jnp.asarray([1]), pre.states, np.array([9, 9], np.int32))
    with pytest.raises(ValueError, match="past the KV cache"):
        hybridlm.decode_step(tiny_runner, jnp.asarray([1]), pre.states, np.array([10_000], np.int32))


def _join(batcher, runner, prompt, **sampling):
    with batcher.lock:  # the batcher's thread may be decoding on the runner
        pre = hybridlm.prefill(runner, prompt, chunk_size=16, max_new_tokens=NEW)
    first = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    row = batcher.join(pre.states, pre.prompt_tokens, first, NEW - 1, stop_ids=[], **sampling)
    return np.asarray(first), row


def test_batcher_rows_joining_late_get_their_own_greedy_tokens(tiny_runner, prompts):
    want = [hybridlm.generate(tiny_runner, p, max_new_tokens=NEW, chunk_size=16).tokens[0] for p in prompts]
    batcher = DecodeBatcher(tiny_runner, threading.Lock(), block=4)
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    try:
        first0, row0 = _join(batcher, tiny_runner, prompts[0], **greedy)
        got0 = [first0, next(iter(row0))]  # one block of the first row alone
        joined = [_join(batcher, tiny_runner, p, **greedy) for p in prompts[1:]]
        got0 += list(row0)
        got = [np.concatenate(got0)] + [np.concatenate([f, *row]) for f, row in joined]
    finally:
        batcher.close(timeout=60)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"row {i}")
    assert batcher.rows() == 0


def test_batcher_cancel_and_stop_ids(tiny_runner, prompts):
    batcher = DecodeBatcher(tiny_runner, threading.Lock(), block=4)
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    try:
        want = hybridlm.generate(tiny_runner, prompts[1], max_new_tokens=NEW, chunk_size=16).tokens[0]
        with batcher.lock:
            pre = hybridlm.prefill(tiny_runner, prompts[1], chunk_size=16, max_new_tokens=NEW)
        first = jnp.asarray(want[:1])
        stop = int(want[3])  # the reply ends at its fourth token, included
        row = batcher.join(pre.states, pre.prompt_tokens, first, NEW - 1, stop_ids=[stop], **greedy)
        _, cancelled = _join(batcher, tiny_runner, prompts[0], **greedy)
        cancelled.cancel()
        assert list(cancelled) == []
        np.testing.assert_array_equal(np.concatenate(list(row)), want[1:4])
    finally:
        batcher.close(timeout=60)
    with pytest.raises(RuntimeError, match="closed"):
        _join(batcher, tiny_runner, prompts[0], **greedy)

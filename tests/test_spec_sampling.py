"""Speculative decoding's acceptance rule: the emitted tokens are distributed as plain sampling from the
target (chi-square tests on a small vocabulary), greedy verification is plain greedy decoding, and edge
inputs stay finite."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import MIN_P_VALUE, assert_finite, chi_square_p_value

from hybridlm.engine.sampling import sample
from hybridlm.engine.spec_sampling import accept_drafts, accept_greedy, filtered_probs

SAMPLES = 200_000


def _tables(rng, vocab: int, *, zeros: int):
    """[vocab + 1, vocab] float32 next-token tables (row vocab: the first token), `zeros` zeros a row."""
    weights = rng.uniform(0.3, 1.5, (vocab + 1, vocab))
    for row in range(vocab + 1):
        weights[row, rng.choice(vocab, zeros, replace=False)] = 0.0
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


def _markov_pair(vocab: int = 6, seed: int = 0):
    """Target p and drafter q as first-order Markov chains: p(x_t+1 | x_t) = table[x_t], row vocab for the
    first token. Each row of q has zeros where p has mass and the reverse; row 2 of q equals p's, row 3 of p
    is one-hot."""
    rng = np.random.default_rng(seed)
    p, q = _tables(rng, vocab, zeros=1), _tables(rng, vocab, zeros=2)
    q[2] = p[2]
    p[3] = np.eye(vocab, dtype=np.float32)[1]
    assert ((p > 0) & (q == 0)).any() and ((q > 0) & (p == 0)).any()
    return jnp.asarray(p), jnp.asarray(q)


def _speculate(p, q, previous, key, num_draft: int):
    """One speculative step after token `previous` [batch]: draft num_draft tokens from q, verify against p.
    Returns emitted [batch, num_draft + 1] (-1 past the emitted ones) and num_accepted [batch]."""
    keys = jax.random.split(key, num_draft + 1)
    contexts, drafts = [previous], []
    for i in range(num_draft):
        drafts.append(jax.random.categorical(keys[i], jnp.log(q[contexts[-1]])).astype(jnp.int32))
        contexts.append(drafts[-1])
    drafts = jnp.stack(drafts, axis=1)  # [batch, draft]
    contexts = jnp.stack(contexts, axis=1)  # [batch, draft + 1]
    num_accepted, next_token = accept_drafts(p[contexts], q[contexts[:, :-1]], drafts, keys[-1])
    position = jnp.arange(num_draft + 1)
    padded = jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1)
    emitted = jnp.where(position == num_accepted[:, None], next_token[:, None], padded)
    emitted = jnp.where(position > num_accepted[:, None], -1, emitted)
    return emitted, num_accepted


@functools.partial(jax.jit, static_argnames=("num_draft", "batch"))
def _first_two_tokens(p, q, key, *, num_draft: int, batch: int):
    """The first two tokens emitted by speculative decoding from the start row, over `batch` independent
    runs: a second step supplies the second token where the first emitted only one."""
    first_key, second_key = jax.random.split(key)
    start = jnp.full((batch,), p.shape[1], jnp.int32)
    emitted, num_accepted = _speculate(p, q, start, first_key, num_draft)
    again, _ = _speculate(p, q, emitted[:, 0], second_key, num_draft)
    second = jnp.where(num_accepted >= 1, emitted[:, 1], again[:, 0])
    return emitted[:, 0], second, num_accepted


@pytest.mark.parametrize("num_draft", [1, 3], ids=lambda k: f"k{k}")
def test_emitted_tokens_are_distributed_as_target_sampling(num_draft):
    p, q = _markov_pair()
    vocab = p.shape[1]
    first, second, num_accepted = _first_two_tokens(
        p, q, jax.random.key(num_draft), num_draft=num_draft, batch=SAMPLES
    )
    num_accepted = np.asarray(num_accepted)
    # every branch runs: rejection at each position and the bonus token
    assert set(np.unique(num_accepted)) == set(range(num_draft + 1))
    assert chi_square_p_value(first, p[vocab]) > MIN_P_VALUE
    joint = np.asarray(p[vocab])[:, None] * np.asarray(p[:vocab])  # p(x1) p(x2 | x1)
    assert chi_square_p_value(np.asarray(first) * vocab + np.asarray(second), joint.ravel()) > MIN_P_VALUE


def _random_probs(key, shape, vocab):
    return jax.nn.softmax(2.0 * jax.random.normal(key, (*shape, vocab)), axis=-1)


def test_drafts_from_the_target_itself_are_all_accepted():
    batch, num_draft, vocab = 4096, 4, 50
    logits = 3.0 * jax.random.normal(jax.random.key(1), (batch, num_draft + 1, vocab))
    p = filtered_probs(logits, 0.8, top_k=20, top_p=0.9)  # zeros outside the support, too
    drafts = jax.random.categorical(jax.random.key(2), jnp.log(p[:, :num_draft])).astype(jnp.int32)
    num_accepted, next_token = jax.jit(accept_drafts)(p, p[:, :num_draft], drafts, jax.random.key(3))
    np.testing.assert_array_equal(num_accepted, num_draft)
    bonus = np.asarray(p[np.arange(batch), num_draft, next_token])
    assert (bonus > 0).all()


def test_drafts_the_target_rules_out_are_all_rejected():
    batch, num_draft, vocab = SAMPLES // 4, 2, 6
    target = np.zeros((num_draft + 1, vocab), np.float32)
    target[:, 3:] = [0.5, 0.3, 0.2]
    draft = np.zeros((num_draft, vocab), np.float32)
    draft[:, :3] = [0.2, 0.3, 0.5]
    target = jnp.broadcast_to(jnp.asarray(target), (batch, num_draft + 1, vocab))
    draft = jnp.broadcast_to(jnp.asarray(draft), (batch, num_draft, vocab))
    drafts = jax.random.categorical(jax.random.key(4), jnp.log(draft)).astype(jnp.int32)
    num_accepted, next_token = jax.jit(accept_drafts)(target, draft, drafts, jax.random.key(5))
    np.testing.assert_array_equal(num_accepted, 0)
    assert chi_square_p_value(next_token, target[0, 0]) > MIN_P_VALUE  # the residual is p itself


def _logits_with_argmax(argmax, vocab):
    """[batch, positions, vocab] float32 logits whose argmax is `argmax` [batch, positions], tie-free."""
    noise = jax.random.uniform(jax.random.key(6), (*np.shape(argmax), vocab), maxval=0.5)
    return noise + jax.nn.one_hot(jnp.asarray(argmax), vocab)


def test_accept_greedy_hand_worked():
    argmax = [[1, 2, 3, 4], [0, 0, 0, 2], [4, 1, 1, 1], [2, 2, 0, 0]]
    drafts = jnp.array([[1, 2, 0], [0, 0, 0], [3, 1, 1], [2, 2, 0]], jnp.int32)
    num_accepted, next_token = jax.jit(accept_greedy)(_logits_with_argmax(argmax, 5), drafts)
    np.testing.assert_array_equal(num_accepted, [2, 3, 0, 3])  # rows 1 and 3: all accepted, bonus token
    np.testing.assert_array_equal(next_token, [3, 2, 4, 0])


def test_accept_greedy_ties_resolve_to_the_lowest_id_as_sample_does():
    logits = jnp.array([[[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 0.0, 0.0]]], jnp.float32)
    num_accepted, next_token = accept_greedy(logits, jnp.array([[1]], jnp.int32))
    assert (int(num_accepted[0]), int(next_token[0])) == (1, 0)
    assert int(sample(logits[:, 1], None)[0]) == 0


def test_accept_drafts_at_temperature_zero_is_accept_greedy():
    batch, num_draft, vocab = 512, 3, 7
    logits = jax.random.normal(jax.random.key(7), (batch, num_draft + 1, vocab))
    argmax = jnp.argmax(logits, axis=-1)[:, :num_draft]
    wrong = jax.random.randint(jax.random.key(8), argmax.shape, 0, vocab)
    keep = jax.random.bernoulli(jax.random.key(9), 0.7, argmax.shape)
    drafts = jnp.where(keep, argmax, wrong).astype(jnp.int32)
    target = filtered_probs(logits, jnp.asarray(0.0))  # a traced greedy temperature: one-hot rows
    draft = jax.nn.one_hot(drafts, vocab)  # a greedy drafter
    got = jax.jit(accept_drafts)(target, draft, drafts, jax.random.key(10))
    want = accept_greedy(logits, drafts)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _edge_cases(vocab=5):
    """(name, p [draft + 1, vocab], q [draft, vocab], drafts [draft], allowed num_accepted)."""
    eye = np.eye(vocab, dtype=np.float32)
    uniform = np.full((vocab,), 1 / vocab, np.float32)
    return [
        ("one-hot equal", eye[[2, 3, 4]], eye[[2, 3]], [2, 3], {2}),
        ("one-hot different", eye[[2, 3, 4]], eye[[1, 3]], [1, 3], {0}),
        ("equal", np.stack([uniform] * 3), np.stack([uniform] * 2), [0, 4], {2}),
        ("q and p zero at the draft", eye[[2, 3, 4]], eye[[2, 3]] * 0, [0, 0], {0}),
        # p a little below q everywhere: a rejection leaves an all-zero residual, drawn from p instead
        ("zero residual", np.stack([uniform * 0.99] * 3), np.stack([uniform] * 2), [1, 1], {0, 1, 2}),
    ]


@pytest.mark.parametrize("case", _edge_cases(), ids=lambda case: case[0])
def test_edge_inputs_give_valid_tokens(case):
    _, p, q, drafts, allowed = case
    batch = 2048

    def tile(x):
        return jnp.broadcast_to(jnp.asarray(x), (batch, *np.shape(x)))

    num_accepted, next_token = jax.jit(accept_drafts)(
        tile(p), tile(q), tile(np.int32(drafts)), jax.random.key(11)
    )
    assert_finite(num_accepted, "num_accepted")
    assert_finite(next_token, "next_token")
    num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
    assert set(np.unique(num_accepted)) <= allowed
    assert (np.asarray(p)[num_accepted, next_token] > 0).all()  # next token inside the target's support


def test_shapes_that_disagree_are_refused():
    p = jnp.full((2, 3, 5), 0.2)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_drafts(p, p[:, :2], jnp.zeros((2, 3), jnp.int32), jax.random.key(0))
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_greedy(p, jnp.zeros((2, 1), jnp.int32))


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.7, "top_k": 3},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 6, "top_p": 0.7},
        {"temperature": 1.0},
    ],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()),
)
def test_filtered_probs_is_what_sample_draws_from(settings):
    logits = jax.random.normal(jax.random.key(12), (8,)) * 1.5
    probs = filtered_probs(logits, **settings)
    assert_finite(probs, "probs")
    np.testing.assert_allclose(float(jnp.sum(probs)), 1.0, rtol=1e-6)
    tokens = sample(jnp.broadcast_to(logits, (SAMPLES, 8)), jax.random.key(13), **settings)
    assert set(np.unique(tokens)) == set(np.flatnonzero(probs))  # the same support
    assert chi_square_p_value(tokens, probs) > MIN_P_VALUE
    # traced settings, as a decode loop passes them, give the same distribution
    traced = {k: v if k == "top_k" else jnp.asarray(v) for k, v in settings.items()}
    jitted = jax.jit(filtered_probs, static_argnames="top_k")(logits, **traced)
    np.testing.assert_allclose(jitted, probs, rtol=1e-6, atol=1e-7)


def test_filtered_probs_at_temperature_zero_is_one_hot_at_samples_greedy_token():
    logits = jax.random.normal(jax.random.key(14), (3, 8))
    greedy = sample(logits, None)
    for temperature in (0.0, jnp.asarray(0.0)):
        np.testing.assert_array_equal(filtered_probs(logits, temperature), jax.nn.one_hot(greedy, 8))
    with pytest.raises(ValueError, match="temperature"):
        filtered_probs(logits, -1.0)

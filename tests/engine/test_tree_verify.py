"""Token-tree verification (DDTree's target side) on tiny float32 models of both architectures: a tree verify
gives every node the logits and states of a chain verify of its root path, the commit of a path leaves the
states a chain would, greedy tree rounds emit plain greedy decoding's tokens, the tree construction picks the
highest-scoring prefixes (against the paper's heap on the host and a brute-force enumeration), tree sampling
preserves the target distribution, and offloaded experts verify as resident ones.

Compilation is most of the time on the CPU: every model program here has one shape (a tree of NODES nodes, a
chain of DEPTH + 1 tokens, a KV cache of 32 positions), shared by every seed and path."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import MIN_P_VALUE, assert_finite, chi_square_p_value

import hybridlm
from hybridlm.engine.spec_sampling import accept_tree, accept_tree_greedy, follow_tree
from hybridlm.engine.tree import (
    ancestor_mask,
    build_tree,
    build_tree_from_top_k,
    build_tree_host,
    check_tree,
    draft_top_k,
)
from hybridlm.engine.tree_verify import commit_tree, tree_round
from hybridlm.state import GatedDeltaNetState, KVCache, TreeKV

CHUNK = 16
PROMPT = 9
NEW = 12
DEPTH = 3  # drafter positions: the tree's depth limit, as deep as the conv window (history used and not)
BUDGET = 16  # 17 nodes: 68 routed copies, past the MoE's unsorted and rank-top-k limits (the sorted path)
NODES = BUDGET + 1
ATOL = 2e-5
SAMPLES = 100_000  # tree-sampling draws for the chi-square tests

TINY_35 = hybridlm.get_config("tiny").replace(vocab_size=512, num_layers=4)
TINY_NEXT = TINY_35.replace(
    name="tiny-next", attention=dataclasses.replace(TINY_35.attention, mrope_sections=None)
)
ARCHS = {"qwen3.5": TINY_35, "qwen3-next": TINY_NEXT}


def _close(got, want, what, atol=ATOL):
    assert_finite(got, what)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=atol, err_msg=what)


# ---------------------------------------------------------------------------------------------------------
# jitted programs (one compilation per architecture, shared by every case)
# ---------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def tree_forward(target, args, states, tree, position):
    model = target.bind(args)
    hidden, tree_states = model.verify_tree(
        states, tree.tokens[None], tree.parents, tree.depth, position, tree.valid
    )
    return model.logits(hidden[0]), tree_states


@functools.partial(jax.jit, static_argnums=0)
def chain_forward(target, args, states, tokens, position):
    model = target.bind(args)
    hidden, chain_states = model.verify(states, tokens, position)
    return model.logits(hidden[0]), chain_states


@functools.partial(jax.jit, static_argnums=(0, 5))
def greedy_round(target, args, states, root, draft_logits, budget, position):
    return tree_round(target.bind(args), states, root, draft_logits, position, budget=budget)


build = jax.jit(build_tree, static_argnums=2)
commit = jax.jit(commit_tree)


@pytest.fixture(scope="module")
def cases():
    """(arch, seed) -> (runner, prompt [PROMPT] int32, prefill result, plain greedy tokens [NEW + DEPTH +
    1]), built once per key."""
    built: dict = {}

    def get(arch: str, seed: int):
        if (arch, seed) not in built:
            config = ARCHS[arch]
            runner = hybridlm.LayerwiseRunner(hybridlm.init_random(config, seed=seed))
            prompt = np.random.default_rng(seed).integers(0, config.vocab_size, PROMPT).astype(np.int32)
            plain = hybridlm.generate(runner, prompt, max_new_tokens=NEW + DEPTH + 1, chunk_size=CHUNK)
            pre = hybridlm.prefill(runner, prompt, chunk_size=CHUNK, max_new_tokens=NEW + DEPTH + 1)
            assert_finite(pre.logits, "prefill logits")
            built[arch, seed] = (runner, prompt, pre, np.asarray(plain.tokens[0]))
        return built[arch, seed]

    return get


def _draft_logits(seed: int, vocab: int, scale: float = 3.0) -> jax.Array:
    return jnp.asarray(scale * np.random.default_rng(seed).normal(size=(DEPTH, vocab)), jnp.float32)


def _root_path(parents: np.ndarray, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def _leaves(tree) -> list[int]:
    parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
    inner = set(parents[valid].tolist())
    return [i for i in range(tree.num_nodes) if valid[i] and i not in inner]


def _chain(runner, states, tokens, position):
    """Chain verify of `tokens` (padded to DEPTH + 1 with token 1: causal, so the padding changes nothing
    before it)."""
    padded = np.ones((1, DEPTH + 1), np.int32)
    padded[0, : len(tokens)] = tokens
    target, args = runner.speculative_target()
    return chain_forward(target, args, states, jnp.asarray(padded), jnp.int32(position))


# ---------------------------------------------------------------------------------------------------------
# tree verify == chain verify of each node's root path
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_tree_verify_equals_chain_verify_of_each_path(cases, arch):
    runner, prompt, pre, plain = cases(arch, 0)
    config = ARCHS[arch]
    tree = build(jnp.int32(plain[0]), _draft_logits(1, config.vocab_size), BUDGET)
    assert bool(np.all(tree.valid)) and int(np.max(tree.depth)) == DEPTH
    target, args = runner.speculative_target()
    logits, tree_states = tree_forward(target, args, pre.states, tree, jnp.int32(PROMPT))
    assert logits.shape == (NODES, config.vocab_size)
    assert_finite(logits, "tree logits")
    parents, tokens, depth = (np.asarray(a) for a in (tree.parents, tree.tokens, tree.depth))
    for leaf in _leaves(tree):
        path = _root_path(parents, leaf)
        chain_logits, chain_states = _chain(runner, pre.states, tokens[path], PROMPT)
        for d, node in enumerate(path):  # every node of the path is the chain's token d
            assert depth[node] == d
            _close(logits[node], chain_logits[d], f"logits of node {node} (depth {d})")
            for i, (tree_state, chain_state) in enumerate(zip(tree_states, chain_states, strict=True)):
                if isinstance(tree_state, TreeKV):  # the node's key and value, at its position
                    _close(tree_state.key[0, node], chain_state.key[0, PROMPT + d], f"layer {i} key {node}")
                    _close(tree_state.value[0, node], chain_state.value[0, PROMPT + d], f"layer {i} value")
                    continue
                _close(tree_state.conv[node], chain_state.conv[d], f"layer {i} conv slot of node {node}")
                _close(
                    tree_state.recurrent[node], chain_state.recurrent[d], f"layer {i} state of node {node}"
                )


# ---------------------------------------------------------------------------------------------------------
# commit: the states after a path are a chain's
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_commit_leaves_the_states_of_a_chain(cases, arch):
    runner, prompt, pre, plain = cases(arch, 0)
    config = ARCHS[arch]
    tree = build(jnp.int32(plain[0]), _draft_logits(2, config.vocab_size), BUDGET)
    target, args = runner.speculative_target()
    _, tree_states = tree_forward(target, args, pre.states, tree, jnp.int32(PROMPT))
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    deepest = max(_leaves(tree), key=lambda i: len(_root_path(parents, i)))
    full = _root_path(parents, deepest)
    nxt = np.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (DEPTH + 1,)), np.int32)
    for n in (0, 1, len(full) - 1):  # the root alone, one draft, the whole depth
        path = np.zeros(DEPTH + 1, np.int32)
        path[: n + 1] = full[: n + 1]
        committed = commit(tree_states, jnp.asarray(path), jnp.int32(n), jnp.int32(PROMPT))
        # the chain: verify the path's tokens, keep slot n (the cache holds rows past n: masked later)
        _, chain_states = _chain(runner, pre.states, tokens[path[: n + 1]], PROMPT)
        chained = [
            s if isinstance(s, KVCache) else jax.tree_util.tree_map(lambda a, n=n: a[n], s)
            for s in chain_states
        ]
        for i, (got, want, before) in enumerate(zip(committed, chained, pre.states, strict=True)):
            assert type(got) is type(before)
            if isinstance(got, GatedDeltaNetState):
                _close(got.conv, want.conv, f"layer {i} conv after {n} drafts")
                _close(got.recurrent, want.recurrent, f"layer {i} recurrent after {n} drafts")
                continue
            end = PROMPT + n + 1  # written: the path's rows; past them: the cache as before the tree
            _close(got.key[:, :end], want.key[:, :end], f"layer {i} keys after {n} drafts")
            _close(got.value[:, :end], want.value[:, :end], f"layer {i} values after {n} drafts")
            np.testing.assert_array_equal(got.key[:, end:], before.key[:, end:])
        # what comes next sees the same: a chain verify at the next position
        position = jnp.int32(PROMPT + n + 1)
        got, _ = chain_forward(target, args, committed, jnp.asarray(nxt[None]), position)
        want, _ = chain_forward(target, args, chained, jnp.asarray(nxt[None]), position)
        _close(got, want, f"next verify's logits after {n} drafts")


# ---------------------------------------------------------------------------------------------------------
# greedy rounds emit plain greedy decoding's tokens
# ---------------------------------------------------------------------------------------------------------
def _oracle_draft_logits(rng, reference, vocab):
    """Drafter logits whose true continuation `reference` [DEPTH] is, position by position, the top token,
    the second (another token on top), or absent."""
    logits = rng.normal(size=(DEPTH, vocab))
    for d, token in enumerate(reference):
        rank = rng.choice(3, p=[0.5, 0.3, 0.2])
        if rank == 1:
            logits[d, (token + 1 + rng.integers(vocab - 1)) % vocab] += 6.0
        if rank < 2:
            logits[d, token] += 6.0 if rank == 0 else 5.0
    return jnp.asarray(logits, jnp.float32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_rounds_equal_plain_decoding(cases, arch, seed):
    runner, prompt, pre, plain = cases(arch, seed)
    vocab = ARCHS[arch].vocab_size
    target, args = runner.speculative_target()
    rng = np.random.default_rng(10 + seed)
    out = [int(jnp.argmax(pre.logits[0]))]
    states, accepted, rounds, off_first_rank = pre.states, [], 0, 0
    while len(out) < NEW:
        reference = plain[len(out) : len(out) + DEPTH]
        draft = _oracle_draft_logits(rng, reference, vocab)
        position = PROMPT + len(out) - 1
        r = greedy_round(target, args, states, jnp.int32(out[-1]), draft, BUDGET, jnp.int32(position))
        count = int(r.count)
        assert 1 <= count <= DEPTH + 1
        out.extend(np.asarray(r.emitted[:count]).tolist())
        states, rounds = r.states, rounds + 1
        accepted.append(count - 1)
        ranks = (
            np.asarray(r.tree.tokens)[np.asarray(r.path)[1:count]]
            != np.asarray(draft.argmax(-1))[: count - 1]
        )
        off_first_rank += int(ranks.sum())
        assert_finite(r.path_hidden, "path hidden states")
    np.testing.assert_array_equal(out[:NEW], plain[:NEW])
    assert sum(accepted) > 0 and rounds < NEW - 1, accepted  # some drafts accepted
    assert min(accepted) < DEPTH, accepted  # ... and some rejected
    assert off_first_rank > 0, "no accepted draft came from a sibling of the drafter's first choice"


TOP_K = 3


@functools.partial(jax.jit, static_argnums=(0, 5))
def sampling_round(target, args, states, root, draft_logits, budget, position, key):
    model = target.bind(args)
    return tree_round(
        model, states, root, draft_logits, position, budget=budget, key=key, temperature=0.3, top_k=TOP_K
    )


def test_sampling_rounds_are_seeded_and_stay_in_the_top_k(cases):
    """Tree sampling through the model: a key gives one result; each emitted token is among the TOP_K most
    likely of the chain logits at its prefix (a low temperature and a drafter that mostly ranks the greedy
    tokens high, so that some drafts are accepted)."""
    runner, prompt, pre, plain = cases("qwen3.5", 0)
    target, args = runner.speculative_target()
    root, position = jnp.int32(plain[0]), jnp.int32(PROMPT)
    counts = []
    for seed in range(4):
        draft = _oracle_draft_logits(np.random.default_rng(seed), plain[1 : 1 + DEPTH], TINY_35.vocab_size)
        key = jax.random.key(seed)
        r = sampling_round(target, args, pre.states, root, draft, BUDGET, position, key)
        again = sampling_round(target, args, pre.states, root, draft, BUDGET, position, key)
        np.testing.assert_array_equal(r.emitted, again.emitted)
        count = int(r.count)
        emitted = np.asarray(r.emitted[:count])
        logits, _ = _chain(runner, pre.states, np.concatenate([[plain[0]], emitted[:-1]]), PROMPT)
        logits = np.asarray(logits)[:count]
        assert_finite(logits, "chain logits")
        kth = np.sort(logits, axis=-1)[:, -TOP_K]
        assert (logits[np.arange(count), emitted] >= kth).all(), (seed, emitted)
        counts.append(count)
    assert max(counts) > 1, counts


# ---------------------------------------------------------------------------------------------------------
# offloaded experts: a paged tree verify equals the resident one
# ---------------------------------------------------------------------------------------------------------
def test_offloaded_tree_verify_equals_resident(cases):
    """Experts paged with one host part a layer (a budget that leaves layers in host memory and in the pool):
    each distinct expert of the nodes' copies fetched once, or gathered from the pool."""
    from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner
    from hybridlm.offload.decode import IN_HOST, IN_POOL

    runner, prompt, pre, plain = cases("qwen3.5", 0)
    host = HostExperts.from_model(runner.model, parts=1)
    offloaded = OffloadedRunner(runner.model, OffloadConfig(expert_budget="2MiB"), host_experts=host)
    tree = build(jnp.int32(plain[0]), _draft_logits(4, TINY_35.vocab_size), BUDGET)
    want, want_states = tree_forward(*runner.speculative_target(), pre.states, tree, jnp.int32(PROMPT))
    target, args = offloaded.speculative_target()
    assert {IN_HOST, IN_POOL} <= set(target.sources)
    got, got_states = tree_forward(target, args, pre.states, tree, jnp.int32(PROMPT))
    _close(got, want, "offloaded tree logits")
    for i, (a, b) in enumerate(
        zip(jax.tree_util.tree_leaves(got_states), jax.tree_util.tree_leaves(want_states), strict=True)
    ):
        _close(a, b, f"offloaded tree state leaf {i}")


# ---------------------------------------------------------------------------------------------------------
# tree construction
# ---------------------------------------------------------------------------------------------------------
def _brute_force(top_lp: np.ndarray, top_ids: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The token paths of the `budget` best prefixes of the top-k product tree, best first: every prefix
    enumerated, its score summed left to right in float32 (as the heap does), sorted by (-score, ranks)."""
    depth_limit, k = top_lp.shape
    prefixes = []
    for d in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = np.float32(0.0)
            for i, r in enumerate(ranks):
                score = np.float32(score + top_lp[i, r])
            prefixes.append((-score, ranks))
    prefixes.sort()
    return [tuple(int(top_ids[i, r]) for i, r in enumerate(ranks)) for _, ranks in prefixes[:budget]]


def _token_paths(tree) -> list[tuple[int, ...]]:
    parents, tokens, valid = (np.asarray(a) for a in (tree.parents, tree.tokens, tree.valid))
    return [
        tuple(int(tokens[j]) for j in _root_path(parents, i)[1:]) for i in range(1, len(tokens)) if valid[i]
    ]


@pytest.mark.parametrize(
    ("vocab", "budget", "seed"),
    [(4, 12, 0), (4, 30, 1), (3, 60, 2)],  # a partial tree; most of it; more than the 39 prefixes of 3^1..3^3
    ids=["partial", "most", "padded"],
)
def test_tree_is_the_best_prefixes(vocab, budget, seed):
    logits = _draft_logits(seed, vocab, scale=1.5)
    tree = build(jnp.int32(7), logits, budget)
    for name in ("tokens", "parents", "depth", "score"):
        assert_finite(np.where(np.asarray(tree.valid), getattr(tree, name), 0), name)
    check_tree(np.asarray(tree.parents), np.asarray(tree.depth))
    total = sum(vocab**d for d in range(1, DEPTH + 1))
    valid = np.asarray(tree.valid)
    assert tree.num_nodes == budget + 1 and valid.sum() == 1 + min(budget, total)
    assert valid[: 1 + min(budget, total)].all()  # padding last
    top_lp, top_ids = (np.asarray(a) for a in draft_top_k(logits, min(budget, vocab)))
    assert _token_paths(tree) == _brute_force(top_lp, top_ids, budget)
    score = np.asarray(tree.score)[valid]
    assert score[0] == 0 and (np.diff(score[1:]) <= 0).all()  # popped best first
    host = build_tree_host(7, top_lp, top_ids, budget)  # the reference's heap
    for name, want in host.items():
        np.testing.assert_array_equal(np.asarray(getattr(tree, name)), want, err_msg=name)


def test_ties_break_as_the_reference_heap():
    """Uniform drafter distributions: every prefix of one depth ties; the heap's rank order decides."""
    top_lp = jnp.full((DEPTH, 3), np.log(1 / 3), jnp.float32)
    top_ids = jnp.asarray(np.tile([5, 2, 9], (DEPTH, 1)), jnp.int32)
    tree = jax.jit(build_tree_from_top_k, static_argnums=3)(jnp.int32(0), top_lp, top_ids, 10)
    host = build_tree_host(0, top_lp, top_ids, 10)
    for name, want in host.items():
        np.testing.assert_array_equal(np.asarray(getattr(tree, name)), want, err_msg=name)
    assert np.asarray(tree.depth).tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]  # breadth first


def test_ancestor_mask_and_tree_checks():
    parents = np.array([-1, 0, 0, 1, 3, 2, 0], np.int32)
    mask = np.asarray(ancestor_mask(jnp.asarray(parents)))
    for i in range(parents.size):
        np.testing.assert_array_equal(np.flatnonzero(mask[i]), sorted(_root_path(parents, i)))
    check_tree(parents, [0, 1, 1, 2, 3, 2, 1])
    with pytest.raises(ValueError, match="parents"):
        check_tree([-1, 0, 3, 1])  # a parent after its child
    with pytest.raises(ValueError, match="root"):
        check_tree([0, 0])
    with pytest.raises(ValueError, match="depth"):
        check_tree(parents, [0, 1, 1, 1, 3, 2, 1])
    root_only = build(jnp.int32(3), _draft_logits(0, 8), 0)
    assert np.asarray(root_only.tokens).tolist() == [3] and bool(root_only.valid[0])
    with pytest.raises(ValueError, match="budget"):
        build_tree(0, _draft_logits(0, 8), -1)


# ---------------------------------------------------------------------------------------------------------
# acceptance on a tree
# ---------------------------------------------------------------------------------------------------------
def test_follow_tree_hand_worked():
    #        0
    #      / | \
    #     1  2  3        tokens 4, 5, 6
    #     |     |
    #     4     5        tokens 7, 7
    #     |
    #     6 (invalid)    token 8
    tokens = jnp.array([9, 4, 5, 6, 7, 7, 8], jnp.int32)
    parents = jnp.array([-1, 0, 0, 0, 1, 3, 4], jnp.int32)
    valid = jnp.array([True] * 6 + [False])
    walk = jax.jit(follow_tree, static_argnums=4)
    cases = [  # target token per node -> (path, n, next)
        ([4, 7, 0, 0, 8, 0, 0], ([0, 1, 4, 0], 2, 8)),  # down to 4; 6 is padding: not a match
        ([6, 0, 0, 7, 0, 1, 0], ([0, 3, 5, 0], 2, 1)),  # a later sibling's branch
        ([3, 7, 0, 0, 0, 0, 0], ([0, 0, 0, 0], 0, 3)),  # no child carries it
        ([4, 2, 0, 0, 0, 0, 0], ([0, 1, 0, 0], 1, 2)),
    ]
    for target, (path, n, nxt) in cases:
        got = walk(jnp.asarray(target, jnp.int32), tokens, parents, valid, 3)
        assert (np.asarray(got[0]).tolist(), int(got[1]), int(got[2])) == (path, n, nxt), target
    logits = jax.nn.one_hot(jnp.asarray(cases[0][0]), 10) + 0.01 * jnp.arange(10)
    got = accept_tree_greedy(logits, tokens, parents, valid, 3)
    assert (int(got[1]), int(got[2])) == (2, 8)
    with pytest.raises(ValueError, match="target_logits"):
        accept_tree_greedy(logits[:3], tokens, parents, valid)


def _markov_tables(vocab: int, seed: int):
    """Target p as a first-order Markov chain (row vocab: the first token), a zero in each row."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.3, 1.5, (vocab + 1, vocab))
    for row in range(vocab + 1):
        weights[row, rng.integers(vocab)] = 0.0
    return jnp.asarray(weights / weights.sum(-1, keepdims=True), jnp.float32)


@functools.partial(jax.jit, static_argnames=("depth_limit",))
def _first_two_tokens(p, tree, keys, *, depth_limit):
    """The first two tokens that tree rounds emit from the start row, for each key [samples]: the tree is one
    drafter's (its tokens independent of the context, as a block drafter's), the target at node i is
    p[context of i]; a second round gives the second token where the first emitted one."""
    vocab = p.shape[1]

    def one_round(key, root_row):
        probs = p[tree.tokens].at[0].set(p[root_row])  # node i's context is its own token; the root's: row
        path, n, nxt = accept_tree(probs, tree.tokens, tree.parents, tree.valid, key, depth_limit)
        drafts = tree.tokens[path]
        return n, jnp.where(n >= 1, drafts[1], nxt), jnp.where(n >= 2, drafts[2], nxt)

    def sample(key):
        k1, k2 = jax.random.split(key)
        n, first, second = one_round(k1, vocab)
        _, again, _ = one_round(k2, first)
        return first, jnp.where(n >= 1, second, again), n

    return jax.vmap(sample)(keys)


def test_tree_sampling_preserves_the_target_distribution():
    vocab = 5
    p = _markov_tables(vocab, 0)
    tree = build(jnp.int32(0), _draft_logits(5, vocab, scale=1.0), 10)
    first, second, n = _first_two_tokens(
        p, tree, jax.random.split(jax.random.key(0), SAMPLES), depth_limit=DEPTH
    )
    n = np.asarray(n)
    assert set(np.unique(n)) == set(range(int(np.max(tree.depth)) + 1))  # every depth reached, and misses
    assert chi_square_p_value(first, p[vocab]) > MIN_P_VALUE
    joint = np.asarray(p[vocab])[:, None] * np.asarray(p[:vocab])  # p(x1) p(x2 | x1)
    assert chi_square_p_value(np.asarray(first) * vocab + np.asarray(second), joint.ravel()) > MIN_P_VALUE


def test_tree_sampling_at_one_hot_targets_is_greedy():
    vocab = 6
    tree = build(jnp.int32(0), _draft_logits(6, vocab), 12)
    logits = jax.random.normal(jax.random.key(1), (tree.num_nodes, vocab))
    logits = logits.at[1:, :].add(
        3.0 * jax.nn.one_hot(tree.tokens[jnp.minimum(jnp.arange(1, 13) + 1, 12)], vocab)
    )
    greedy = accept_tree_greedy(logits, tree.tokens, tree.parents, tree.valid, DEPTH)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, -1), vocab)
    for seed in range(4):
        got = accept_tree(one_hot, tree.tokens, tree.parents, tree.valid, jax.random.key(seed), DEPTH)
        for a, b in zip(got, greedy, strict=True):
            np.testing.assert_array_equal(a, b)

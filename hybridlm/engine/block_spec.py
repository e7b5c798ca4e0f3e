"""Block speculative decoding with a DFlash draft model: chain verify ("dflash") or a DDTree token tree
("ddtree").

One iteration, for the last emitted token t at position p (docs/dflash.md §5):

1. Context: the target-layer features of the tokens the last verify accepted (positions p - pending .. p - 1)
   go into the draft's context cache (`DFlashDraft.context`).
2. Draft: one parallel forward of the block [t, mask, ..., mask] at positions p .. p + B - 1 gives a
   distribution for each of the next B - 1 tokens (`DFlashDraft.draft`).
3. Verify:
   - "dflash": the drafts' argmax tokens d_1 .. d_{B-1} after t through the model in one forward
     (`speculative.verify`: Gated DeltaNet states kept per token); greedy acceptance of the longest agreeing
     prefix, or, sampling, one target draw per position followed while it equals the draft (lossless);
     rollback by choosing the state slot.
   - "ddtree": the `budget` most likely prefixes under the draft's per-position distributions as a token
     tree (`tree.build_tree`), verified in one forward with an ancestor-only mask and per-node Gated DeltaNet
     states (`tree_verify.verify_tree`); the accepted root path committed (`tree_verify.commit_tree`).
4. The accepted drafts and the target's next token are emitted; the target-layer features of the accepted
   positions (the verify returns them) become the next iteration's context rows.

Iterations run in one program per block of tokens (`block_spec_block`), batch 1. Oracle drafts (benchmarks):
the target's token at depth d is the draft's rank-r candidate there with probability alpha (1 - alpha)^r
(rank 0 the draft's top token), drawn per iteration; the tree is built from those calibrated rank
probabilities, so acceptance is a controlled input while drafting and verifying cost what they cost.
Sources: DFlash (z-lab, arXiv:2602.06036; `dflash_generate`); DDTree (Ringel, Romano, arXiv:2604.12989);
SpecInfer (Miao et al., arXiv:2305.09781) for tree attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hybridlm.dflash import block_input_ids
from hybridlm.engine import tree as tree_lib
from hybridlm.engine.phases import DEVICE_LOOP_OPTIONS, StaticGraph
from hybridlm.engine.sampling import BlockSampler
from hybridlm.engine.spec_sampling import (
    accept_greedy,
    accept_tree,
    accept_tree_greedy,
    filtered_probs,
    follow_tree,
)
from hybridlm.engine.speculative import iterate_until, loop_fields
from hybridlm.engine.tree_verify import commit_tree
from hybridlm.state import KVCache

METHODS = ("dflash", "ddtree")
# Draft positions the acceptance statistics count (a block of up to MAX_BLOCK tokens drafts MAX_BLOCK - 1).
MAX_BLOCK = 64
# Tree nodes besides the root when `tree_budget` is not given.
DEFAULT_TREE_BUDGET = 32


@dataclasses.dataclass(frozen=True)
class BlockSpecConfig:
    """The static part of a block speculative program (one compiled program per value).

    Args:
      method: "dflash" (chain verify of the block's argmax drafts) or "ddtree" (token-tree verify).
      block_size: B, the draft's block: B - 1 drafted positions per iteration.
      budget: tree nodes besides the root ("ddtree").
      sampler: the block's sampling settings (`BlockSampler`): greedy or lossless sampled acceptance.
      taps: the target layers whose outputs feed the draft's context (`DFlashConfig.target_layer_ids`).
      oracle: benchmarks: acceptance drawn at rate alpha by rank (module docstring) instead of read off the
        target (greedy only).
    """

    method: str
    block_size: int
    budget: int
    sampler: BlockSampler
    taps: tuple[int, ...]
    oracle: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockSpecState:
    """What one block speculative iteration hands the next (batch 1)."""

    token: jax.Array  # [1] int32: the last emitted token, at `position`, not yet fed to the model
    position: jax.Array  # int32 scalar
    states: list  # the model's layer states holding positions [0, position)
    draft_cache: list  # the draft's context KV caches, valid below position - pending
    pend_features: jax.Array  # [1, B, feature_dim]: target features of positions position - pending ..
    pending: jax.Array  # int32 scalar: valid rows of pend_features
    key: jax.Array  # PRNG key (sampling, oracle draws)
    finished: jax.Array  # [1] bool: a stop id was emitted
    stop_ids: jax.Array  # [n] int32 (-1: none)
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    tried: jax.Array  # [MAX_BLOCK] int32: iterations whose walk reached draft depth i
    passed: jax.Array  # [MAX_BLOCK] int32: ... and accepted the draft there
    iterations: jax.Array  # int32
    emitted: jax.Array  # int32: tokens emitted by the iterations so far
    alpha: jax.Array  # float32: oracle rate


def _oracle_ranks(key, alpha, depth_limit: int) -> jax.Array:
    """[depth_limit] int32: the rank of the target's token among the draft's candidates at each depth,
    geometric: rank r with probability alpha (1 - alpha)^r."""
    u = jax.random.uniform(key, (depth_limit,), minval=1e-12, maxval=1.0)
    r = jnp.floor(jnp.log(u) / jnp.log1p(-jnp.minimum(alpha, 1.0 - 1e-7)))
    return jnp.where(alpha >= 1.0, 0, jnp.minimum(r, 2**20)).astype(jnp.int32)


def _chain(cfg: BlockSpecConfig, model, s: BlockSpecState, draft_logits, accept_key):
    """The "dflash" verify of the block's argmax drafts: (n accepted, next token [1], emitted [1, B], the
    features [1, B, F] of positions p .. p + B - 1, the states after p + n)."""
    drafts = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)  # [1, L]; DFlash drafts greedily
    tokens = jnp.concatenate([s.token[:, None], drafts], axis=1)  # [1, B]
    hidden, states, features = model.verify(s.states, tokens, s.position, cfg.taps)
    logits = model.logits(hidden)  # [1, B, vocab]
    depth_limit = drafts.shape[1]
    if cfg.oracle:
        hit = _oracle_ranks(accept_key, s.alpha, depth_limit) == 0
        n = jnp.sum(jnp.cumprod(hit)).astype(jnp.int32)
        nxt = jnp.argmax(jnp.take(logits[0], n, axis=0)).astype(jnp.int32)
    elif cfg.sampler.greedy:
        n, nxt = accept_greedy(logits, drafts)
        n, nxt = n[0], nxt[0]
    else:
        probs = filtered_probs(logits[0], s.temperature, cfg.sampler.top_k, s.top_p)
        chain = jnp.arange(depth_limit + 1, dtype=jnp.int32) - 1
        _, n, nxt = accept_tree(
            probs, tokens[0], chain, jnp.ones((depth_limit + 1,), bool), accept_key, depth_limit
        )
    states = [
        jax.tree_util.tree_map(lambda a: a[n], st) if not isinstance(st, KVCache) else st for st in states
    ]
    emitted = jnp.where(jnp.arange(depth_limit + 1) < n, jnp.append(drafts[0], 0), 0)
    emitted = jnp.where(jnp.arange(depth_limit + 1) == n, nxt, emitted)
    return n, nxt, emitted[None], features, states


def _tree(cfg: BlockSpecConfig, model, s: BlockSpecState, draft_logits, accept_key):
    """The "ddtree" verify: as `_chain`, the features being those of the accepted root path's nodes."""
    depth_limit = draft_logits.shape[1]
    k = min(cfg.budget, draft_logits.shape[-1])
    top_lp, top_tokens = tree_lib.draft_top_k(draft_logits[0], k)
    ranks = None
    if cfg.oracle:  # the tree of a draft whose rank probabilities are the oracle's
        rank = jnp.arange(k, dtype=jnp.float32)
        alpha = jnp.clip(s.alpha, 1e-6, 1.0 - 1e-6)
        top_lp = jnp.broadcast_to(jnp.log(alpha) + rank * jnp.log1p(-alpha), top_lp.shape)
        ranks = _oracle_ranks(accept_key, s.alpha, depth_limit)
    tree = tree_lib.build_tree_from_top_k(s.token[0], top_lp, top_tokens, cfg.budget)
    hidden, tree_states, features = model.verify_tree(
        s.states, tree.tokens[None], tree.parents, tree.depth, s.position, tree.valid, cfg.taps
    )
    logits = model.logits(hidden[0])  # [nodes, vocab]
    if cfg.oracle:
        # the target's token after a node at depth d: the draft's candidate of the drawn rank at depth d
        wanted = jnp.take_along_axis(top_tokens, jnp.minimum(ranks, k - 1)[:, None], axis=1)[:, 0]
        wanted = jnp.where(ranks < k, wanted, -1)
        at_node = jnp.append(wanted, -1)[jnp.minimum(tree.depth, depth_limit)]
        path, n, _ = follow_tree(at_node, tree.tokens, tree.parents, tree.valid, depth_limit)
        nxt = jnp.argmax(logits[path[n]]).astype(jnp.int32)
    elif cfg.sampler.greedy:
        path, n, nxt = accept_tree_greedy(logits, tree.tokens, tree.parents, tree.valid, depth_limit)
    else:
        probs = filtered_probs(logits, s.temperature, cfg.sampler.top_k, s.top_p)
        path, n, nxt = accept_tree(probs, tree.tokens, tree.parents, tree.valid, accept_key, depth_limit)
    row = jnp.arange(depth_limit + 1)
    drafts = jnp.append(tree.tokens[path[1:]], 0)  # draft r is the node at path[r + 1]
    emitted = jnp.where(row < n, drafts, jnp.where(row == n, nxt, 0)).astype(jnp.int32)
    states = commit_tree(tree_states, path, n, s.position)
    return n, nxt, emitted[None], features[:, path], states


def iteration(cfg: BlockSpecConfig, model, draft, s: BlockSpecState):
    """One context-draft-verify-accept round: (next state, emitted tokens [1, B] valid up to count, count)."""
    key, accept_key = jax.random.split(s.key)
    cache = draft.context(s.pend_features, s.draft_cache, s.position - s.pending, s.pending)
    ids = block_input_ids(s.token, draft.config)  # [1, B]
    _, draft_logits = draft.draft(model.embed[ids], cache, s.position, model.head_weight)  # [1, B - 1, V]
    verify = _tree if cfg.method == "ddtree" else _chain
    n, nxt, emitted, features, states = verify(cfg, model, s, draft_logits, accept_key)
    depth_limit = draft_logits.shape[1]
    slot = jnp.arange(MAX_BLOCK)
    hit = jnp.any((emitted[..., None] == s.stop_ids) & (jnp.arange(depth_limit + 1) <= n)[None, :, None])
    new = dataclasses.replace(
        s,
        token=nxt.reshape(1),
        position=s.position + n + 1,
        states=states,
        draft_cache=cache,
        pend_features=features.astype(s.pend_features.dtype),
        pending=n + 1,
        key=key,
        finished=s.finished | hit,
        tried=s.tried + (slot < jnp.minimum(n + 1, depth_limit)),
        passed=s.passed + (slot < n),
        iterations=s.iterations + 1,
        emitted=s.emitted + n + 1,
    )
    return new, emitted, n + 1


@functools.partial(
    jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=6, compiler_options=DEVICE_LOOP_OPTIONS
)
def block_spec_block(
    cfg: BlockSpecConfig, target, draft_graph: StaticGraph, block: int, target_args, draft_leaves, s, limit
):
    """Block speculative iterations in one program until `s.emitted` reaches `limit` (at most `block`
    tokens past where it starts) or a stop id is emitted: (tokens [1, block + B] int32 valid up to count,
    count int32, the new `BlockSpecState`, (tried, passed) as arrays of their own)."""
    model, draft = target.bind(target_args), draft_graph.merge(draft_leaves)
    width = block + cfg.block_size
    out, count, s = iterate_until(lambda s: iteration(cfg, model, draft, s), s, limit, width)
    return out, count, s, (s.tried + 0, s.passed + 0)  # the counts apart: `s` is donated to the next block


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def draft_context(draft_graph: StaticGraph, draft_leaves, cache, features, start, num_new):
    """`DFlashDraft.context` as one program (a prefill chunk's rows)."""
    return draft_graph.merge(draft_leaves).context(features, cache, start, num_new)


def initial_state(
    pre, token, cache, block_size: int, feature_dim: int, dtype, key, stop_ids, temperature, top_p, alpha
) -> BlockSpecState:
    """The `BlockSpecState` after a prefill that put every prompt position into the draft's context and whose
    logits gave `token` [1]."""
    return BlockSpecState(
        **loop_fields(pre, token, key, stop_ids, temperature, top_p, alpha, MAX_BLOCK),
        draft_cache=cache,
        pend_features=jnp.zeros((1, block_size, feature_dim), dtype),
        pending=jnp.int32(0),
    )

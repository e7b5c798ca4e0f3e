"""MTP speculative decoding: the MTP module drafts k tokens, the model verifies all k + 1 in one forward.

One iteration, for the last sampled token t at position p (docs/mtp.md §2, §5):

1. The drafter first catches up on the pairs (t_{i+1}, h_i) it has not seen (the tokens accepted by the last
   verify with the model's own pre-final-norm hidden states h_i, at MTP positions i), then drafts
   d_1 .. d_k, step j >= 2 feeding back its own output.
2. Verify: [t, d_1 .. d_k] at positions p .. p + k through every layer in one forward: one sort-free MoE over
   the k + 1 tokens, attention over the KV cache, each Gated DeltaNet layer keeping its state after every
   token (`GatedDeltaNet.verify`).
3. Acceptance: greedy, the longest prefix of drafts equal to the model's argmax; sampling, speculative
   rejection sampling (`spec_sampling.accept_drafts`). n drafts accepted emit n + 1 tokens.
4. Rollback: each Gated DeltaNet state is its slot n (no recompute); KV entries past p + n are overwritten by
   later verifies before any query can see them (causal masks).

All of it, iterations included, runs in one program per block of tokens (`spec_block`). Batch 1.
Source: Leviathan et al. 2023 (arXiv:2211.17192); Chen et al. 2023 (arXiv:2302.01318); vLLM's MTP proposer
(`vllm/v1/spec_decode/eagle.py`) for the drafter's catch-up over accepted tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine import tree_verify
from hybridlm.engine.phases import DEVICE_LOOP_OPTIONS, StaticGraph, flat_layer
from hybridlm.engine.sampling import BlockSampler, filter_logits
from hybridlm.engine.spec_sampling import accept_drafts, accept_greedy
from hybridlm.model import check_taps, concat_taps, head_logits
from hybridlm.state import KVCache

# Draft lengths `draft_tokens="auto"` chooses from, and the largest `draft_tokens` accepted.
AUTO_DRAFT_TOKENS = (1, 2, 3, 4)
MAX_DRAFT_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """The static part of a speculative block (one compiled program per value).

    Args:
      draft_tokens: k, drafts per iteration (1 .. MAX_DRAFT_TOKENS).
      slots: width of the drafter's pending pairs, max draft tokens + 1 (the same for every k of a run, so
        that the carry keeps its shapes when k changes).
      sampler: the block's sampling settings (`BlockSampler`): greedy acceptance or rejection sampling.
      oracle: benchmarks: None; "reference", draft j is the reference token at its position with probability
        alpha, else another one; "coin", draft j counts as accepted with probability alpha (while the ones
        before it were), the verify's own tokens emitted: acceptance exact whatever the numerics, the text not
        the model's greedy text.
    """

    draft_tokens: int
    slots: int
    sampler: BlockSampler
    oracle: str | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """What one speculative iteration hands the next (batch 1)."""

    token: jax.Array  # [1] int32: the last emitted token, at `position`, not yet fed to the model
    position: jax.Array  # int32 scalar
    states: list  # the model's layer states holding positions [0, position)
    mtp_cache: list  # the drafter's KV caches, valid below position - pending
    pend_tokens: jax.Array  # [1, slots] int32: t_{i+1} of the pairs the drafter has not seen
    pend_hidden: jax.Array  # [1, slots, hidden]: h_i of those pairs (model's pre-final-norm states)
    pending: (
        jax.Array
    )  # int32 scalar: valid pairs (>= 1), at MTP positions position - pending .. position - 1
    key: jax.Array  # PRNG key (sampling, oracle draws)
    finished: jax.Array  # [1] bool: a stop id was emitted
    stop_ids: jax.Array  # [n] int32 (-1: none)
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    tried: jax.Array  # [MAX_DRAFT_TOKENS] int32: iterations that verified a draft at position i
    passed: jax.Array  # [MAX_DRAFT_TOKENS] int32: ... and accepted it
    iterations: jax.Array  # int32
    emitted: jax.Array  # int32: tokens emitted by the iterations so far
    reference: jax.Array  # [1, length] int32: oracle tokens by absolute position ([1, 1] without oracle)
    alpha: jax.Array  # float32: oracle acceptance probability


@dataclasses.dataclass(frozen=True)
class ResidentTarget:
    """The model to verify with, all weights on the device: `bind(leaves)` (the model's flat weights) gives
    its embedding table, lm head, multi-token forward (`verify`), token-tree forward (`verify_tree`) and
    logits."""

    graph: StaticGraph  # the whole model's graph with its weights' treedef (`phases.flat_layer`)

    def bind(self, leaves) -> _BoundModel:
        return _BoundModel(self.graph.merge(leaves))


class _BoundModel:
    def __init__(self, model):
        self.model = model
        self.embed = model.embed[...]  # [vocab, hidden]
        self.head_weight = model.head_weight()  # [hidden, vocab]

    def verify(self, states: list, tokens, position, taps: tuple[int, ...] = ()):
        return verify(self.model, states, tokens, position, taps)

    def verify_tree(self, states: list, tokens, parents, depth, position, valid=None, taps=()):
        return tree_verify.verify_tree(self.model, states, tokens, parents, depth, position, valid, taps)

    def logits(self, hidden):
        return self.model.logits(hidden)


def mtp_ingest(mtp, embed, cache: KVCache, token_ids, hidden, start, num_valid):
    """The drafter over pairs (token_ids[:, i], hidden[:, i]) at MTP positions start + i, i < num_valid, with
    the model's embedding table `embed` [vocab, hidden]: returns (its pre-norm outputs [batch, seq, hidden],
    the cache with them written)."""
    x = mtp.fuse(embed[token_ids], hidden.astype(embed.dtype))
    return mtp.layers[0](x, cache, start, num_valid)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def mtp_prefill(mtp_graph: StaticGraph, mtp_leaves, embed, cache, hidden, ids, start, n):
    """`mtp_ingest` over one prefill chunk (`prefill(on_chunk=...)`): the pairs (ids[:, i], hidden[:, i]) with
    ids the prompt shifted left by one; returns the new cache."""
    return mtp_ingest(mtp_graph.merge(mtp_leaves), embed, cache, ids, hidden, start, n)[1]


def _draft(cfg: SpecConfig, model, mtp, s: SpecState, key):
    """Drafts k tokens with the bound target `model`'s embedding and head: ([1, k] int32, draft logits
    [1, k, vocab] float32, the drafter's caches)."""
    head = model.head_weight
    base = s.position - s.pending
    y, cache = mtp_ingest(mtp, model.embed, s.mtp_cache[0], s.pend_tokens, s.pend_hidden, base, s.pending)
    y = jax.lax.dynamic_index_in_dim(y, s.pending - 1, axis=1, keepdims=False)  # [1, hidden]
    drafts, logits = [], []
    for j in range(cfg.draft_tokens):
        if j:  # step j + 1: the previous draft and the drafter's own output, at MTP position p + j - 1
            y, cache = mtp_ingest(
                mtp, model.embed, cache, drafts[-1][:, None], y[:, None], s.position + j - 1, 1
            )
            y = y[:, 0]
        lg = head_logits(mtp.norm, head, y)  # [1, vocab]
        key, sub = jax.random.split(key)
        token = cfg.sampler.pick(lg, sub, s.temperature, s.top_p)[0]
        if cfg.oracle == "reference":  # the reference token with probability alpha, else surely another one
            ref = s.reference[:, jnp.minimum(s.position + j + 1, s.reference.shape[1] - 1)]
            wrong = jnp.where(token == ref, (ref + 1) % lg.shape[-1], token)
            token = jnp.where(jax.random.uniform(jax.random.fold_in(sub, 1)) < s.alpha, ref, wrong)
        drafts.append(token)
        logits.append(lg)
    return jnp.stack(drafts, axis=1), jnp.stack(logits, axis=1), [cache, *s.mtp_cache[1:]]


def verify(model, states: list, tokens, position, taps: tuple[int, ...] = ()):
    """The model over tokens [1, seq] at positions position .. position + seq - 1 in one forward: (hidden
    [1, seq, hidden] before the final norm, states with a leading [seq] axis on Gated DeltaNet layers), and,
    when `taps` (layer indices) are given, the features [1, seq, len(taps) * hidden]: those layers' outputs
    concatenated in `taps` order (`model.concat_taps`; a DFlash draft's context rows).

    Raises:
      ValueError: a tap outside the model's layers."""
    taps = check_taps(taps, len(model.layers))
    x = model.embed[...][tokens]
    new_states, tapped = [], {}
    for i, (layer, state) in enumerate(zip(model.layers, states, strict=True)):
        x, state = layer.verify(x, state, position)
        new_states.append(state)
        if i in taps:
            tapped[i] = x
    return (x, new_states, concat_taps(tapped, taps)) if taps else (x, new_states)


def iteration(cfg: SpecConfig, model, mtp, s: SpecState) -> tuple[SpecState, jax.Array, jax.Array]:
    """One draft-verify-accept round: (next state, emitted tokens [1, slots] int32 valid up to count,
    count)."""
    key, draft_key, accept_key = jax.random.split(s.key, 3)
    drafts, draft_logits, mtp_cache = _draft(cfg, model, mtp, s, draft_key)
    hidden, states = model.verify(s.states, jnp.concatenate([s.token[:, None], drafts], axis=1), s.position)
    logits = model.logits(hidden)  # [1, k + 1, vocab]
    if cfg.oracle == "coin":
        coins = jax.random.uniform(accept_key, (cfg.draft_tokens,)) < s.alpha
        n = jnp.sum(jnp.cumprod(coins)).astype(jnp.int32)[None]
        drafts = jnp.argmax(logits[:, :-1], axis=-1).astype(jnp.int32)  # emitted as if they were drafted
        nxt = jnp.argmax(jnp.take(logits, n, axis=1)[:, 0], axis=-1).astype(jnp.int32)
    elif cfg.sampler.greedy:
        n, nxt = accept_greedy(logits, drafts)
    else:
        probs = functools.partial(_probs, cfg.sampler, s.temperature, s.top_p)
        n, nxt = accept_drafts(probs(logits), probs(draft_logits), drafts, accept_key)
    n = n[0]
    states = [
        jax.tree_util.tree_map(lambda a: a[n], st) if not isinstance(st, KVCache) else st for st in states
    ]
    idx = jnp.arange(cfg.slots)
    padded = jnp.zeros((1, cfg.slots), jnp.int32).at[:, : cfg.draft_tokens].set(drafts)
    emitted = jnp.where(idx < n, padded, jnp.where(idx == n, nxt[:, None], 0))
    hidden = jnp.zeros((1, cfg.slots, hidden.shape[-1]), hidden.dtype).at[:, : hidden.shape[1]].set(hidden)
    hit = jnp.any((emitted[..., None] == s.stop_ids) & (idx <= n)[None, :, None], axis=(1, 2))
    new = dataclasses.replace(
        s,
        token=nxt,
        position=s.position + n + 1,
        states=states,
        mtp_cache=mtp_cache,
        pend_tokens=emitted,
        pend_hidden=hidden,
        pending=n + 1,
        key=key,
        finished=s.finished | hit,
        tried=s.tried + (jnp.arange(MAX_DRAFT_TOKENS) < jnp.minimum(n + 1, cfg.draft_tokens)),
        passed=s.passed + (jnp.arange(MAX_DRAFT_TOKENS) < n),
        iterations=s.iterations + 1,
        emitted=s.emitted + n + 1,
    )
    return new, emitted, n + 1


def _probs(sampler: BlockSampler, temperature, top_p, logits):
    """The distribution `sampler` draws from, over logits [..., vocab] float32."""
    return jax.nn.softmax(
        filter_logits(logits, temperature, top_p, top_k=sampler.top_k, nucleus=sampler.nucleus), axis=-1
    )


@functools.partial(
    jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=6, compiler_options=DEVICE_LOOP_OPTIONS
)
def spec_block(
    cfg: SpecConfig, target, mtp_graph: StaticGraph, block: int, target_args, mtp_leaves, s, limit
):
    """Speculative iterations in one program until `s.emitted` reaches `limit` (at most `block` tokens past
    where it starts) or a stop id is emitted: (tokens [1, block + slots] int32 valid up to count, count int32,
    the new `SpecState`, (tried, passed) of it as arrays of their own)."""
    model, mtp = target.bind(target_args), mtp_graph.merge(mtp_leaves)
    out, count, s = iterate_until(lambda s: iteration(cfg, model, mtp, s), s, limit, block + cfg.slots)
    return out, count, s, (s.tried + 0, s.passed + 0)  # the counts apart: `s` is donated to the next block


def iterate_until(iterate, s, limit, width: int):
    """Speculative iterations `iterate(s) -> (s, emitted [1, w] int32, n)` in a `while_loop` until s.emitted
    reaches `limit` or a stop id was emitted (s.finished), their tokens packed into [1, width]: (tokens valid
    up to count, count int32, the last state). width: the block's tokens plus one iteration's w."""

    def cond(c):
        return (c[0].emitted < limit) & ~jnp.all(c[0].finished)

    def body(c):
        s, count, out = c
        s, emitted, n = iterate(s)
        return s, count + n, jax.lax.dynamic_update_slice_in_dim(out, emitted, count, axis=1)

    s, count, out = jax.lax.while_loop(cond, body, (s, jnp.int32(0), jnp.zeros((1, width), jnp.int32)))
    return out, count, s


def initial_state(
    pre, token, mtp_cache, last_hidden, slots: int, key, stop_ids, temperature, top_p, reference, alpha
) -> SpecState:
    """The `SpecState` after a prefill whose last hidden state is last_hidden [1, hidden] and whose logits
    gave `token` [1]."""
    hidden = jnp.zeros((1, slots, last_hidden.shape[-1]), last_hidden.dtype).at[:, 0].set(last_hidden)
    return SpecState(
        **loop_fields(pre, token, key, stop_ids, temperature, top_p, alpha, MAX_DRAFT_TOKENS),
        mtp_cache=mtp_cache,
        pend_tokens=jnp.zeros((1, slots), jnp.int32).at[:, 0].set(token),
        pend_hidden=hidden,
        pending=jnp.int32(1),
        reference=jnp.asarray(np.zeros((1, 1), np.int32) if reference is None else reference, jnp.int32),
    )


def loop_fields(pre, token, key, stop_ids, temperature, top_p, alpha, depths: int) -> dict:
    """The fields every speculative loop state starts with after a prefill whose logits gave `token` [1]:
    position and layer states, the PRNG key, stop ids ([n] int32, -1 for none) and whether `token` is one,
    the sampling settings, zero acceptance counts over `depths` draft positions, the oracle rate."""
    stop = np.asarray(stop_ids, np.int32).reshape(-1)
    stop = jnp.asarray(stop if stop.size else np.full((1,), -1, np.int32))
    return {
        "token": token,
        "position": jnp.int32(pre.prompt_tokens),
        "states": pre.states,
        "key": key,
        "finished": jnp.any(token[:, None] == stop[None, :], axis=1),
        "stop_ids": stop,
        "temperature": jnp.float32(temperature),
        "top_p": jnp.float32(top_p),
        "tried": jnp.zeros((depths,), jnp.int32),
        "passed": jnp.zeros((depths,), jnp.int32),
        "iterations": jnp.int32(0),
        "emitted": jnp.int32(0),
        "alpha": jnp.float32(alpha),
    }


# Relative cost of one more draft token in an iteration (drafter step + a verified token), against an
# iteration of one draft: `choose_draft_tokens` trades it against the expected extra tokens.
DRAFT_TOKEN_COST = 0.25


def choose_draft_tokens(tried, passed, choices=AUTO_DRAFT_TOKENS) -> int:
    """k of `choices` with the most expected tokens per unit of cost, from the acceptance counted so far per
    draft position (a position never reached takes the last estimate).

    Expected tokens of k drafts: 1 + sum_{j<=k} prod_{i<=j} a_i, a_i the acceptance at position i given the
    drafts before it were accepted; cost: 1 + DRAFT_TOKEN_COST * (k - 1)."""
    rates, last = [], 0.5
    for i in range(max(choices)):
        last = (passed[i] + last * 2) / (tried[i] + 2)  # the estimate so far weighs two iterations
        rates.append(last)
    best, best_rate = choices[0], -1.0
    for k in choices:
        tokens = 1 + sum(np.prod(rates[: j + 1]) for j in range(k))
        rate = tokens / (1 + DRAFT_TOKEN_COST * (k - 1))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def flat_mtp(mtp) -> tuple[StaticGraph, tuple]:
    """(graph, flat weights) of an `MTPModule`, its arrays committed (`runner.commit`)."""
    from flax import nnx

    from hybridlm.engine.runner import commit

    graphdef, params = nnx.split(mtp)
    return flat_layer(graphdef, commit(params))

"""`generate(..., speculative=...)`: the prompt prefilled with the drafter ingesting it, then blocks of
speculative iterations enqueued by one driver (`drive_blocks`).

- "mtp": the MTP module drafts (`hybridlm.engine.speculative.spec_block`), draft lengths chosen per block;
- "dflash" / "ddtree": a DFlash draft model drafts a block, verified as a chain or a token tree
  (`hybridlm.engine.block_spec.block_spec_block`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine import speculative as spec
from hybridlm.engine.generate import GenerateResult
from hybridlm.engine.prefill import prefill
from hybridlm.engine.runner import LayerwiseRunner, commit
from hybridlm.engine.sampling import BlockSampler
from hybridlm.mtp import init_mtp_cache


def check_speculative(
    runner, mtp, ids: np.ndarray, max_new_tokens: int, sampler, draft_tokens, oracle
) -> int:
    """Refuses what speculative decoding cannot run; returns the widest draft length it may use.

    Raises:
      ValueError: a batch of more than one sequence, a draft length outside [1, MAX_DRAFT_TOKENS] (or not
        "auto"), oracle drafts when sampling or malformed, an MTP module of another model, or no room past
        max_new_tokens for the last verify within max_position_embeddings.
    """
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence at a time; got a batch of {ids.shape[0]}")
    valid_k = isinstance(draft_tokens, int) and not isinstance(draft_tokens, bool)
    if draft_tokens != "auto" and not (valid_k and 1 <= draft_tokens <= spec.MAX_DRAFT_TOKENS):
        raise ValueError(
            f"draft_tokens={draft_tokens!r} must be 'auto' or an int in [1, {spec.MAX_DRAFT_TOKENS}]"
        )
    if oracle is not None:
        if not sampler.greedy:
            raise ValueError("oracle drafts are for greedy decoding (temperature 0)")
        alpha_ok = isinstance(oracle, tuple) and len(oracle) == 2 and isinstance(oracle[1], (int, float))
        if not (alpha_ok and 0 <= oracle[1] <= 1):
            raise ValueError(f"oracle_draft={oracle!r} must be (reference ids or None, alpha in [0, 1])")
        if oracle[0] is not None and np.size(oracle[0]) < ids.shape[-1] + max_new_tokens:
            raise ValueError(
                f"oracle_draft's reference holds {np.size(oracle[0])} tokens, fewer than the prompt's "
                f"{ids.shape[-1]} + max_new_tokens {max_new_tokens}"
            )
    c, m = runner.config, mtp.config
    if (m.hidden_dim, m.vocab_size) != (c.hidden_dim, c.vocab_size):
        raise ValueError(
            f"the mtp module (hidden {m.hidden_dim}, vocab {m.vocab_size}) does not belong to this model "
            f"(hidden {c.hidden_dim}, vocab {c.vocab_size})"
        )
    widest = max(spec.AUTO_DRAFT_TOKENS) if draft_tokens == "auto" else draft_tokens
    if ids.shape[-1] + max_new_tokens + 2 * (widest + 1) > c.max_position_embeddings:
        raise ValueError(
            f"prompt ({ids.shape[-1]}) + max_new_tokens ({max_new_tokens}) + the last verify's "
            f"{2 * (widest + 1)} positions exceed max_position_embeddings={c.max_position_embeddings}"
        )
    return widest


def prefill_with_drafter(runner, mtp, mtp_flat: tuple, ids: np.ndarray, chunk_size, max_new_tokens: int):
    """`prefill` with the drafter ingesting each chunk (`speculative.mtp_prefill`): (result, the drafter's
    KV cache, the last prompt position's hidden state [1, hidden])."""
    mtp_graph, mtp_leaves = mtp_flat
    seq = ids.shape[-1]
    found: dict = {}

    def on_chunk(x, start, num_valid, next_ids, capacity):
        cache = found.get("cache")
        if cache is None:
            cache = init_mtp_cache(mtp.config, 1, capacity, runner.model.dtype)[0]
        pairs = num_valid - 1 if start + num_valid == seq else num_valid  # the last waits for its token
        found["cache"] = spec.mtp_prefill(
            mtp_graph, mtp_leaves, runner.embed_table, cache, x, jnp.asarray(next_ids), start, pairs
        )
        found["last"] = x[:, num_valid - 1]

    pre = prefill(runner, ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens, on_chunk=on_chunk)
    return pre, found["cache"], found["last"]


def generate_speculative(
    runner: LayerwiseRunner,
    mtp,
    input_ids,
    *,
    max_new_tokens: int,
    sampler: BlockSampler,
    temperature,
    top_p,
    seed: int,
    stop_ids: np.ndarray,
    chunk_size,
    draft_tokens: int | str,
    oracle: tuple | None,
) -> GenerateResult:
    """`generate` with MTP speculative decoding (`hybridlm.engine.speculative`); see `generate`.

    Raises:
      ValueError: see `check_speculative`, and `prefill`'s errors.
    """
    ids = np.asarray(input_ids)
    auto = draft_tokens == "auto"
    slots = check_speculative(runner, mtp, ids, max_new_tokens, sampler, draft_tokens, oracle) + 1
    mtp_flat = spec.flat_mtp(mtp)
    # room past max_new_tokens for the last iteration's drafts
    pre, cache, last = prefill_with_drafter(
        runner, mtp, mtp_flat, ids, chunk_size, max_new_tokens + 2 * slots
    )
    token, key = sampler.pick(pre.logits, jax.random.key(seed), temperature, top_p)
    target = runner.speculative_target()  # after the prefill: an offloaded pool is set for decode
    mode = None if oracle is None else "coin" if oracle[0] is None else "reference"
    reference = np.asarray(oracle[0]).reshape(1, -1) if mode == "reference" else None
    alpha = oracle[1] if oracle is not None else 0.0
    s = spec.initial_state(
        pre, token, [cache], last, slots, key, stop_ids, temperature, top_p, reference, alpha
    )
    first = np.asarray(token)  # read before the state holding it is donated to the first block
    # The first programs compile (timed apart): one iteration of each draft length "auto" may pick, so that a
    # later change of length compiles nothing inside the timed blocks.
    warmup = list(spec.AUTO_DRAFT_TOKENS[::-1]) if auto else [draft_tokens]
    run = _Blocks(target, mtp_flat, sampler, slots, mode, commit(s))
    ks = iter(warmup)

    def enqueue(limit: int, warming: bool):
        if warming or not auto:
            k = next(ks) if warming else draft_tokens
        else:  # waits for the last block's counts
            k = spec.choose_draft_tokens(*(np.asarray(c) for c in run.counts))
        return run.block(k, limit)

    loop = drive_blocks(enqueue, max_new_tokens - 1, sampler.block, len(warmup), stop_ids)
    stats = {
        "method": "mtp",
        "draft_tokens": run.draft_used[-1] if run.draft_used else 0,
        "draft_tokens_per_block": run.draft_used,
        **acceptance_stats(run.state, run.counts, "acceptance_per_position"),
    }
    return speculative_result(first, pre, loop, max_new_tokens, stop_ids, stats)


class _Blocks:
    """The MTP blocks of one generate: each enqueued with its draft length; the acceptance counts kept on the
    device (read only when the host needs them)."""

    def __init__(self, target, mtp_flat, sampler, slots: int, mode, state):
        self.target, self.mtp_flat, self.sampler = target, mtp_flat, sampler
        self.slots, self.mode, self.state = slots, mode, state
        self.draft_used: list[int] = []
        self.counts = None  # (tried, passed) per draft position after the last block, on the device

    def block(self, k: int, limit: int):
        """Enqueues the next block of draft length k, emitting up to `limit` tokens in all: (tokens
        [1, block + slots], count)."""
        cfg = spec.SpecConfig(k, self.slots, self.sampler, self.mode)
        (target, args), (mtp_graph, mtp_leaves) = self.target, self.mtp_flat
        out, count, self.state, self.counts = spec.spec_block(
            cfg, target, mtp_graph, self.sampler.block, args, mtp_leaves, self.state, np.int32(limit)
        )
        self.draft_used.append(k)
        return out, count


class BlockLoop(NamedTuple):
    """What `drive_blocks` leaves: the blocks' (tokens, count) in order, how many of them the first timed
    step covers and its seconds, and the loop's start (`time.perf_counter`)."""

    parts: list
    first_parts: int
    first_step_s: float
    t0: float


def drive_blocks(enqueue, total: int, block: int, warmup: int, stop_ids: np.ndarray) -> BlockLoop:
    """Enqueues speculative blocks until `total` tokens are covered or a stop id was emitted.

    `enqueue(limit, warming)` enqueues one block that emits up to `limit` tokens in all and returns its
    (tokens [1, n], count) without waiting. The first `warmup` blocks run one iteration each (their programs
    compile; they form the first step, timed apart), the rest up to `block` tokens each. A block is read
    back only to see whether the one before it emitted nothing, i.e. a stop id came earlier.
    """
    parts: list = []
    limit, first_parts, first_step_s = 0, 0, None
    t0 = time.perf_counter()
    while limit < total:
        warming = len(parts) < warmup
        limit = min(total, limit + (1 if warming else block))
        parts.append(enqueue(limit, warming))
        if warming and len(parts) == warmup:
            jax.block_until_ready(parts[-1][0])
            first_parts, first_step_s = len(parts), time.perf_counter() - t0
        if stop_ids.size and len(parts) > 1 and int(parts[-2][1]) == 0:
            break
    if first_step_s is None:  # the total came within the warm-up: all of it counts as the first step
        first_parts, first_step_s = len(parts), time.perf_counter() - t0
    return BlockLoop(parts, first_parts, first_step_s, t0)


def acceptance_stats(state, counts, per: str) -> dict:
    """Iterations, mean accepted drafts and tokens an iteration of a loop state (its `iterations` and
    `emitted`), and the acceptance rate at each draft position or depth (key `per`) from counts = (tried,
    passed) per position, or None where no block ran (max_new_tokens = 1)."""
    tried, passed = (np.zeros(1), np.zeros(1)) if counts is None else (np.asarray(c) for c in counts)
    iterations, emitted = int(state.iterations), int(state.emitted)
    return {
        "iterations": iterations,
        "mean_accepted": float(passed.sum() / iterations) if iterations else 0.0,
        "tokens_per_iteration": float(emitted / iterations) if iterations else 0.0,
        per: [float(p / t) for p, t in zip(passed, tried, strict=True) if t],
    }


def speculative_result(first, pre, loop: BlockLoop, max_new_tokens: int, stop_ids, stats: dict):
    """The `GenerateResult` of a speculative run: the prefill's token `first` [1] then the blocks' tokens, and
    `stats` with the wall seconds an iteration (draft + verify + acceptance) from the timed blocks' rate."""
    tokens, stop_reason = _tokens(first, loop.parts, max_new_tokens, stop_ids)
    result = GenerateResult(
        tokens=tokens,
        prefill=pre,
        decode_s=time.perf_counter() - loop.t0,
        first_step_s=loop.first_step_s,
        stop_reason=stop_reason,
        speculative=stats,
        first_step_tokens=sum(int(c) for _, c in loop.parts[: loop.first_parts]),
    )
    timed = result.decode_tokens_per_s
    stats["iteration_s"] = stats["tokens_per_iteration"] / timed if timed and stats["iterations"] else 0.0
    return result


def _tokens(first, parts: list, max_new_tokens: int, stop_ids: np.ndarray) -> tuple[np.ndarray, str]:
    """The emitted tokens [1, n] (the prefill's `first` [1], then each block's), cut at max_new_tokens and
    after the first stop id, and the stop reason."""
    pieces = [first[:, None]] + [np.asarray(out)[:, : int(count)] for out, count in parts]
    tokens = np.concatenate(pieces, axis=1)[:, :max_new_tokens]
    if stop_ids.size:
        hit = np.isin(tokens, stop_ids)
        if hit.any():
            return tokens[:, : int(hit[0].argmax()) + 1], "eos"
    return tokens, "length"


def prefill_with_dflash(runner, draft, draft_flat: tuple, ids: np.ndarray, chunk_size, max_new_tokens: int):
    """`prefill` with the target-layer features of each chunk written into the DFlash draft's context cache
    (`block_spec.draft_context`): (result, the draft's caches holding every prompt position)."""
    from hybridlm.dflash import init_dflash_cache
    from hybridlm.engine import block_spec

    graph, leaves = draft_flat
    found: dict = {}

    def on_chunk(x, start, num_valid, next_ids, capacity, features):
        cache = found.get("cache")
        if cache is None:
            cache = init_dflash_cache(draft.config, 1, capacity, runner.model.dtype)
        found["cache"] = block_spec.draft_context(graph, leaves, cache, features, start, num_valid)

    taps = draft.config.target_layer_ids
    pre = prefill(
        runner, ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens, on_chunk=on_chunk, taps=taps
    )
    return pre, found["cache"]


def check_block_speculative(
    runner, draft, ids: np.ndarray, max_new_tokens: int, sampler, method, budget, oracle
):
    """Refuses what block speculative decoding cannot run.

    Raises:
      ValueError: a batch of more than one sequence, an unknown method, a tree budget below 1, a draft of
        another model (`DFlashConfig.check_target`), a block larger than `block_spec.MAX_BLOCK`, oracle drafts
        when sampling or malformed, or no room for the last verify within max_position_embeddings.
    """
    from hybridlm.engine import block_spec

    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence at a time; got a batch of {ids.shape[0]}")
    if method not in block_spec.METHODS:
        raise ValueError(f"unknown block speculative method {method!r}; choose from {block_spec.METHODS}")
    if not (isinstance(budget, int) and budget >= 1):
        raise ValueError(f"tree_budget={budget!r} must be an int >= 1")
    draft.config.check_target(runner.config)
    block = draft.config.block_size
    if not 2 <= block <= block_spec.MAX_BLOCK:
        raise ValueError(f"the draft's block_size={block} must lie in [2, {block_spec.MAX_BLOCK}]")
    if oracle is not None:
        if not sampler.greedy:
            raise ValueError("oracle drafts are for greedy decoding (temperature 0)")
        if not (isinstance(oracle, tuple) and len(oracle) == 2 and oracle[0] is None and 0 <= oracle[1] <= 1):
            raise ValueError(f"oracle_draft={oracle!r} must be (None, alpha in [0, 1]) for a DFlash draft")
    if ids.shape[-1] + max_new_tokens + 2 * block > runner.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({ids.shape[-1]}) + max_new_tokens ({max_new_tokens}) + the last verify's {2 * block} "
            f"positions exceed max_position_embeddings={runner.config.max_position_embeddings}"
        )


def generate_block_speculative(
    runner: LayerwiseRunner,
    draft,
    input_ids,
    *,
    method: str,
    max_new_tokens: int,
    sampler: BlockSampler,
    temperature,
    top_p,
    seed: int,
    stop_ids: np.ndarray,
    chunk_size,
    tree_budget: int,
    oracle: tuple | None,
) -> GenerateResult:
    """`generate` with a DFlash draft model (`hybridlm.engine.block_spec`): method "dflash" (chain verify of
    the drafted block) or "ddtree" (a token tree of `tree_budget` nodes besides the root); see `generate`.

    Raises:
      ValueError: see `check_block_speculative`, and `prefill`'s errors.
    """
    from flax import nnx

    from hybridlm.engine import block_spec
    from hybridlm.engine.phases import flat_layer

    ids = np.asarray(input_ids)
    check_block_speculative(runner, draft, ids, max_new_tokens, sampler, method, tree_budget, oracle)
    graphdef, params = nnx.split(draft)
    draft_flat = flat_layer(graphdef, commit(params))
    block = draft.config.block_size
    pre, cache = prefill_with_dflash(runner, draft, draft_flat, ids, chunk_size, max_new_tokens + 2 * block)
    token, key = sampler.pick(pre.logits, jax.random.key(seed), temperature, top_p)
    target = runner.speculative_target()
    s = block_spec.initial_state(
        pre,
        token,
        cache,
        block,
        draft.config.feature_dim,
        runner.model.dtype,
        key,
        stop_ids,
        temperature,
        top_p,
        0.0 if oracle is None else oracle[1],
    )
    cfg = block_spec.BlockSpecConfig(
        method, block, tree_budget, sampler, draft.config.target_layer_ids, oracle is not None
    )
    first = np.asarray(token)
    run = {"state": commit(s), "counts": None}  # the loop state and (tried, passed) after the last block
    (target_graph, target_args), (draft_graph, draft_leaves) = target, draft_flat

    def enqueue(limit: int, warming: bool):
        out, count, run["state"], run["counts"] = block_spec.block_spec_block(
            cfg,
            target_graph,
            draft_graph,
            sampler.block,
            target_args,
            draft_leaves,
            run["state"],
            np.int32(limit),
        )
        return out, count

    loop = drive_blocks(enqueue, max_new_tokens - 1, sampler.block, 1, stop_ids)
    stats = {
        "method": method,
        "block_size": block,
        "tree_budget": tree_budget if method == "ddtree" else None,
        **acceptance_stats(run["state"], run["counts"], "acceptance_per_depth"),
    }
    return speculative_result(first, pre, loop, max_new_tokens, stop_ids, stats)

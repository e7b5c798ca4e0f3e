"""Decode: one-token steps on the prefill state, and `generate` (prefill + sampling loop)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.prefill import DEFAULT_CHUNK_SIZE, PrefillResult, prefill
from hybridlm.engine.runner import LayerwiseRunner, commit
from hybridlm.engine.sampling import BlockSampler, block_carry
from hybridlm.model import HybridLM
from hybridlm.state import LayerState


def decode_step(
    runner: LayerwiseRunner, tokens: jax.Array, states: list[LayerState], position: int
) -> tuple[jax.Array, list[LayerState]]:
    """Feeds one token per sequence at absolute `position`.

    Args:
      runner: the model's `LayerwiseRunner`.
      tokens: [batch] int32.
      states: per-layer states holding positions [0, position) (consumed).
      position: absolute position of `tokens`; must be below the KV-cache capacity.

    Returns:
      logits [batch, vocab] float32 for the next position, and the new states.

    Raises:
      ValueError: tokens not one per sequence of the states, a position below 0 or at / past the KV cache's
        capacity, or token ids outside the vocabulary (values given on the host; values held on the device are
        not checked).
    """
    return runner.decode_step(tokens, states, position)


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray  # [batch, new_tokens] int32, up to the step where every row has produced a stop token
    prefill: PrefillResult
    decode_s: float  # seconds spent in the decode loop
    first_step_s: float = 0.0  # of which the first decode step's (it compiles the step on a first call)
    stop_reason: str = "length"  # "eos": every row produced a stop token; "length": max_new_tokens reached
    speculative: dict | None = None  # speculative decoding's statistics (acceptance per draft position, ...)
    first_step_tokens: int = 1  # tokens emitted by the first timed program (speculative: 1 + accepted drafts)

    @property
    def decode_tokens_per_s(self) -> float:
        """batch * tokens / second of the decode steps after the first (whose compilation would otherwise
        count; with a single step, that step)."""
        n = self.tokens.shape[1] - 1  # decode steps: the first token comes from the prefill logits
        seconds = self.decode_s
        if n > self.first_step_tokens and self.decode_s > self.first_step_s > 0:
            n, seconds = n - self.first_step_tokens, self.decode_s - self.first_step_s
        return self.tokens.shape[0] * n / seconds if n > 0 and seconds > 0 else 0.0


# Decode steps per program after the first (`LayerwiseRunner.decode_block`): enough that the host's enqueue of
# one whole-model program (milliseconds: it passes every weight) is spread over many tokens, few enough that a
# stop id wastes little and streamed text arrives in small bursts.
DECODE_BLOCK = 16


def generate(
    model: HybridLM | LayerwiseRunner,
    input_ids,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    chunk_size: int | str = DEFAULT_CHUNK_SIZE,
    decode_block: int = DECODE_BLOCK,
    speculative: str | None = None,
    mtp=None,
    draft_tokens: int | str = "auto",
    oracle_draft: tuple | None = None,
) -> GenerateResult:
    """Prefills the prompt, then samples `max_new_tokens` tokens, the decode steps run in blocks of up to
    `decode_block` steps per program with each sampled token fed back on the device.

    Args:
      model: a `HybridLM` or its `LayerwiseRunner`.
      input_ids: [batch, seq] or [seq] prompt token ids.
      max_new_tokens: tokens to generate (>= 1).
      temperature: 0 for greedy decoding; otherwise sampling temperature.
      top_k: sample among the k most likely tokens (0: no limit).
      top_p: nucleus sampling mass (1.0: no limit).
      seed: PRNG seed for sampling.
      eos_token_id: stop token id(s): generation ends once every sequence has produced one of them (a row
        that finished earlier goes on sampling until then; cut it at its first stop token). None: never.
      chunk_size: prefill chunk size in tokens, or "auto" (`hybridlm.planning.choose_chunk_size`).
      decode_block: decode steps per program (>= 1); the tokens are the same for every value.
      speculative: None, or "mtp": the MTP module `mtp` drafts `draft_tokens` tokens and the model verifies
        them in one forward (`hybridlm.engine.speculative`); greedy output equals plain decoding's, sampled
        output has its distribution. One sequence (batch 1); resident or offloaded experts.
      mtp: the `MTPModule` (`hybridlm.loading.load_mtp`), for speculative="mtp".
      draft_tokens: drafts per iteration, an int in [1, 8] or "auto" (1-4, chosen from the acceptance so far).
      oracle_draft: benchmarks only, greedy only: (reference [prompt + new] token ids by position, alpha),
        each draft the reference's token with probability alpha, else another one; or (None, alpha), each
        draft accepted with probability alpha and the verify's own tokens emitted (acceptance exact, not the
        text).

    Raises:
      ValueError: max_new_tokens or decode_block < 1, sampling settings out of range
        (`sampling.check_sampling`), or a bad prompt (see `prefill`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not (isinstance(decode_block, int) and decode_block >= 1):
        raise ValueError(f"decode_block={decode_block!r} must be an int >= 1")
    sampler = BlockSampler.of(decode_block, temperature, top_k, top_p)  # checks them before the prefill
    stop_ids = np.array([] if eos_token_id is None else np.ravel(eos_token_id), np.int64)
    runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
    if speculative is not None:
        if speculative != "mtp" or mtp is None:
            raise ValueError(
                f"speculative={speculative!r}: the one method is 'mtp', with its module given as mtp= "
                "(hybridlm.load_mtp)"
            )
        return generate_speculative(
            runner,
            mtp,
            input_ids,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_ids=stop_ids,
            chunk_size=chunk_size,
            draft_tokens=draft_tokens,
            oracle=oracle_draft,
        )
    pre = prefill(runner, input_ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    token, key = sampler.pick(pre.logits, jax.random.key(seed), temperature, top_p)
    carry = block_carry(key, np.zeros(pre.batch, bool), stop_ids, temperature, top_p)
    carry = (carry[0], jnp.any(token[:, None] == carry[2][None, :], axis=1), *carry[2:])
    parts: list[tuple[jax.Array, jax.Array]] = [(token[:, None], np.int32(1))]  # (tokens, count) per program
    states, position, remaining, asked = pre.states, pre.prompt_tokens, max_new_tokens - 1, [1]
    first_step_s = 0.0
    t0 = time.perf_counter()
    while remaining > 0:
        steps = 1 if len(parts) == 1 else min(decode_block, remaining)  # the first compiles: timed apart
        out, count, token, states, _, carry = runner.decode_block(
            sampler, token, states, position, carry, steps
        )
        parts.append((out, count))
        asked.append(steps)
        position, remaining = position + steps, remaining - steps
        if len(parts) == 2:
            jax.block_until_ready(out)
            first_step_s = time.perf_counter() - t0
        # a program that ran short means every row had stopped; the one before this is read while this runs
        if stop_ids.size and len(parts) > 2 and int(parts[-2][1]) < asked[-2]:
            break
    tokens = np.concatenate([np.asarray(out)[:, : int(count)] for out, count in parts], axis=1)
    stop_reason = "length"
    if stop_ids.size:
        hit = np.isin(tokens, stop_ids)
        if hit.any(axis=1).all():  # cut after the step where the last row produced its first stop id
            tokens = tokens[:, : int(hit.argmax(axis=1).max()) + 1]
            stop_reason = "eos"
    return GenerateResult(
        tokens=tokens,
        prefill=pre,
        decode_s=time.perf_counter() - t0,
        first_step_s=first_step_s,
        stop_reason=stop_reason,
    )


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
    """`generate` with MTP speculative decoding (`hybridlm.engine.speculative`); see `generate`."""
    from hybridlm.engine import speculative as spec
    from hybridlm.mtp import init_mtp_cache

    ids = np.asarray(input_ids)
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence at a time; got a batch of {ids.shape[0]}")
    auto = draft_tokens == "auto"
    valid_k = isinstance(draft_tokens, int) and not isinstance(draft_tokens, bool)
    if not auto and not (valid_k and 1 <= draft_tokens <= spec.MAX_DRAFT_TOKENS):
        raise ValueError(
            f"draft_tokens={draft_tokens!r} must be 'auto' or an int in [1, {spec.MAX_DRAFT_TOKENS}]"
        )
    if oracle is not None and not sampler.greedy:
        raise ValueError("oracle drafts are for greedy decoding (temperature 0)")
    if oracle is not None and not (
        isinstance(oracle, tuple)
        and len(oracle) == 2
        and isinstance(oracle[1], (int, float))
        and 0 <= oracle[1] <= 1
    ):
        raise ValueError(f"oracle_draft={oracle!r} must be (reference ids or None, alpha in [0, 1])")
    if oracle is not None and oracle[0] is not None and np.size(oracle[0]) < ids.shape[-1] + max_new_tokens:
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
    k = max(spec.AUTO_DRAFT_TOKENS) if auto else draft_tokens
    slots, block = k + 1, sampler.block
    if ids.shape[-1] + max_new_tokens + 2 * slots > runner.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({ids.shape[-1]}) + max_new_tokens ({max_new_tokens}) + the last verify's {2 * slots} "
            f"positions exceed max_position_embeddings={runner.config.max_position_embeddings}"
        )
    mtp_graph, mtp_leaves = spec.flat_mtp(mtp)
    seq = ids.shape[-1]
    found: dict = {}

    def on_chunk(x, start, num_valid, next_ids, capacity):
        cache = found.get("cache")
        if cache is None:
            cache = init_mtp_cache(mtp.config, 1, capacity, runner.model.dtype)[0]
        pairs = (
            num_valid - 1 if start + num_valid == seq else num_valid
        )  # the last pairs with the sampled token
        found["cache"] = spec.mtp_prefill(
            mtp_graph, mtp_leaves, runner.embed_table, cache, x, jnp.asarray(next_ids), start, pairs
        )
        found["last"] = x[:, num_valid - 1]

    # room past max_new_tokens for the last iteration's drafts
    pre = prefill(
        runner, ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens + 2 * slots, on_chunk=on_chunk
    )
    token, key = sampler.pick(pre.logits, jax.random.key(seed), temperature, top_p)
    target, target_args = (
        runner.speculative_target()
    )  # after the prefill: an offloaded pool is set for decode
    oracle_mode = None if oracle is None else "coin" if oracle[0] is None else "reference"
    reference, alpha = (
        (None, 0.0) if oracle_mode != "reference" else (np.asarray(oracle[0]).reshape(1, -1), 0.0)
    )
    alpha = oracle[1] if oracle is not None else 0.0
    s = spec.initial_state(
        pre,
        token,
        [found["cache"]],
        found["last"],
        slots,
        key,
        stop_ids,
        temperature,
        top_p,
        reference,
        alpha,
    )
    s = commit(s)
    parts: list = [(token[:, None], np.int32(1))]
    limits, draft_used = [0], []
    total = max_new_tokens - 1
    first_step_s, first_parts = 0.0, 0
    t0 = time.perf_counter()
    # The first programs compile (timed apart): one iteration of each draft length "auto" may pick, so that a
    # later change of length compiles nothing inside the timed blocks.
    warmup = list(spec.AUTO_DRAFT_TOKENS[::-1]) if auto else [k]
    while limits[-1] < total:
        if warmup:
            k = warmup.pop(0)
        elif auto:  # the acceptance of the block before the last, read while that one runs
            k = spec.choose_draft_tokens(*found["counts"])
        cfg = spec.SpecConfig(k, slots, sampler, oracle_mode)
        warming = len(parts) <= (len(spec.AUTO_DRAFT_TOKENS) if auto else 1)
        limit = min(total, limits[-1] + (1 if warming else block))
        out, count, s = spec.spec_block(
            cfg, target, mtp_graph, block, target_args, mtp_leaves, s, np.int32(limit)
        )
        parts.append((out, count))
        limits.append(limit)
        draft_used.append(k)
        if warming and (not warmup or limit >= total):
            jax.block_until_ready(out)
            first_step_s = time.perf_counter() - t0
            first_parts = len(parts) - 1
        if auto:
            found["counts"] = (np.asarray(s.tried), np.asarray(s.passed))
        # a block that emitted nothing means a stop id came before it
        if stop_ids.size and len(parts) > 2 and int(parts[-2][1]) == 0:
            break
    tokens = np.concatenate([np.asarray(out)[:, : int(count)] for out, count in parts], axis=1)
    tokens = tokens[:, :max_new_tokens]
    stop_reason = "length"
    if stop_ids.size:
        hit = np.isin(tokens, stop_ids)
        if hit.any():
            tokens = tokens[:, : int(hit[0].argmax()) + 1]
            stop_reason = "eos"
    decode_s = time.perf_counter() - t0
    tried, passed = np.asarray(s.tried), np.asarray(s.passed)
    iterations = int(s.iterations)
    stats = {
        "method": "mtp",
        "draft_tokens": draft_used[-1] if draft_used else k,
        "draft_tokens_per_block": draft_used,
        "iterations": iterations,
        "mean_accepted": float(passed.sum() / iterations) if iterations else 0.0,
        "tokens_per_iteration": float(int(s.emitted) / iterations) if iterations else 0.0,
        "acceptance_per_position": [float(p / t) for p, t in zip(passed, tried, strict=True) if t],
    }
    return GenerateResult(
        tokens=tokens,
        prefill=pre,
        decode_s=decode_s,
        first_step_s=first_step_s,
        stop_reason=stop_reason,
        speculative=stats,
        first_step_tokens=sum(int(c) for _, c in parts[1 : 1 + first_parts]),
    )

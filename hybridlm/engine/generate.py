"""Decode: one-token steps on the prefill state, and `generate` (prefill + sampling loop)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.prefill import DEFAULT_CHUNK_SIZE, PrefillResult, prefill
from hybridlm.engine.runner import LayerwiseRunner
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
    draft_tokens: int | str = 3,
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
      draft_tokens: drafts per iteration, an int in [1, 8], or "auto": 1-4 chosen from the acceptance so far
        (each length compiles its own program, once).
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
        from hybridlm.engine.spec_generate import generate_speculative  # it builds on this module

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

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
    draft=None,
    tree_budget: int | None = None,
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
      speculative: None, "auto" (`choose_speculative`: plain decoding where experts are paged from host
        memory, else the given drafter's best method), "mtp": the MTP module `mtp` drafts `draft_tokens`
        tokens and the model verifies them in one forward (`hybridlm.engine.speculative`); "dflash": the
        DFlash model `draft` drafts a block in one parallel forward, verified as a chain; "ddtree": the
        block's distributions make a token tree of `tree_budget` nodes, verified in one forward
        (`hybridlm.engine.block_spec`). Greedy output equals plain decoding's, sampled output has its
        distribution. One sequence (batch 1); resident or offloaded experts.
      mtp: the `MTPModule` (`hybridlm.loading.load_mtp`), for speculative="mtp".
      draft_tokens: drafts per iteration, an int in [1, 8], or "auto": 1-4 chosen from the acceptance so far
        (each length compiles its own program, once).
      draft: the `DFlashDraft` (`hybridlm.loading.load_dflash`), for speculative="dflash" / "ddtree".
      tree_budget: tree nodes besides the root for "ddtree" (default `block_spec.DEFAULT_TREE_BUDGET`).
      oracle_draft: benchmarks only, greedy only: (reference [prompt + new] token ids by position, alpha),
        each draft the reference's token with probability alpha, else another one; or (None, alpha), each
        draft accepted with probability alpha and the verify's own tokens emitted (acceptance exact, not the
        text).

    Raises:
      ValueError: max_new_tokens or decode_block < 1, sampling settings out of range
        (`sampling.check_sampling`), a bad prompt (see `prefill`), or speculative decoding of a model split
        over several devices.
    """
    sampler, stop_ids = _decode_settings(
        max_new_tokens, decode_block, temperature, top_k, top_p, eos_token_id
    )
    runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
    auto = None
    if speculative == "auto":
        speculative, auto = choose_speculative(runner, mtp, draft)
    if speculative is not None:
        _check_speculative_args(speculative, mtp, draft, runner)
        from hybridlm.engine import spec_generate  # it builds on this module

        if speculative in ("dflash", "ddtree"):
            from hybridlm.engine.block_spec import DEFAULT_TREE_BUDGET

            result = spec_generate.generate_block_speculative(
                runner,
                draft,
                input_ids,
                method=speculative,
                max_new_tokens=max_new_tokens,
                sampler=sampler,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop_ids=stop_ids,
                chunk_size=chunk_size,
                tree_budget=DEFAULT_TREE_BUDGET if tree_budget is None else tree_budget,
                oracle=oracle_draft,
            )
        else:
            result = spec_generate.generate_speculative(
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
        if auto is not None:
            result.speculative["auto"] = auto
        return result
    pre = prefill(runner, input_ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    stream = TokenStream(runner, pre, sampler, seed, stop_ids, temperature, top_p, max_new_tokens)
    pieces = list(stream)
    return GenerateResult(
        tokens=np.concatenate(pieces, axis=1),
        prefill=pre,
        decode_s=stream.decode_s,
        first_step_s=stream.first_step_s,
        stop_reason=stream.stop_reason,
        speculative=None if auto is None else {"method": None, "auto": auto},
    )


def choose_speculative(runner: LayerwiseRunner, mtp, draft) -> tuple[str | None, str]:
    """`generate(speculative="auto")`'s choice: (the method, or None for plain decoding; why).

    Experts paged from host memory make a verify of n tokens copy about n times a step's experts (the
    tokens route to different experts), so speculative decoding there is slower than plain decoding unless
    the routers share experts across consecutive tokens (docs/performance.md): plain decoding. Otherwise a
    DFlash draft's token tree ("ddtree"), else the MTP module ("mtp"), else plain decoding."""
    if mtp is None and draft is None:
        return None, "no drafter given (mtp= or draft=)"
    if not runner.all_experts_fit:
        return None, "experts paged from host memory: a verify copies each drafted token's experts"
    if draft is not None:
        return "ddtree", "every expert on the device and a DFlash draft given"
    return "mtp", "every expert on the device and an MTP module given"


def _check_speculative_args(speculative, mtp, draft, runner) -> None:
    """Raises ValueError for a speculative method `generate` does not know, its drafter missing, or a model
    split over several devices (speculative decoding runs on one)."""
    drafter = {
        "mtp": ("mtp", mtp, "hybridlm.loading.load_mtp"),
        "dflash": ("draft", draft, "hybridlm.loading.load_dflash"),
    }
    drafter["ddtree"] = drafter["dflash"]
    if speculative not in drafter:
        raise ValueError(f"speculative={speculative!r}: choose from {sorted(drafter)}")
    name, value, loader = drafter[speculative]
    if value is None:
        raise ValueError(f"speculative={speculative!r} needs its drafter as {name}= ({loader})")
    if runner.placement is not None:
        raise ValueError(
            "speculative decoding runs on one device; this model is split over several "
            "(hybridlm.sharding): decode it without speculative="
        )


def _decode_settings(max_new_tokens, decode_block, temperature, top_k, top_p, eos_token_id):
    """(the `BlockSampler`, stop ids [n] int64) of `generate` / `generate_stream`'s settings, checked before
    any prefill work.

    Raises:
      ValueError: max_new_tokens or decode_block < 1, or sampling settings out of range.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not (isinstance(decode_block, int) and decode_block >= 1):
        raise ValueError(f"decode_block={decode_block!r} must be an int >= 1")
    sampler = BlockSampler.of(decode_block, temperature, top_k, top_p)
    return sampler, np.array([] if eos_token_id is None else np.ravel(eos_token_id), np.int64)


def generate_stream(
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
    resume: tuple | None = None,
) -> TokenStream:
    """`generate` (plain decoding) as a stream: prefills now, then iterating the result yields the new tokens
    as numpy [batch, n] int32 blocks while the next block decodes; the same tokens as `generate`. `resume`
    = (states, start): the prompt continues a prefix those states hold (`prefill(resume=...)`).

    Raises:
      ValueError: as `generate`, at the call.
    """
    sampler, stop_ids = _decode_settings(
        max_new_tokens, decode_block, temperature, top_k, top_p, eos_token_id
    )
    runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
    pre = prefill(runner, input_ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens, resume=resume)
    return TokenStream(runner, pre, sampler, seed, stop_ids, temperature, top_p, max_new_tokens)


class TokenStream:
    """The new tokens of one generation after its prefill, as they come: the prefill's token, then each decode
    block's (`LayerwiseRunner.decode_block`), each a numpy [batch, n] int32 array; the next block is enqueued
    before one is read, so the device keeps busy while the host streams. Ends at max_new_tokens, or after the
    step where every row has produced a stop id (tokens past it are not yielded).

    Args:
      runner: the runner that prefilled.
      pre: the `PrefillResult` (its states are consumed).
      sampler: a `BlockSampler`; seed, temperature, top_p: sampling (as `generate`).
      stop_ids: [n] int stop ids (may be empty).
      max_new_tokens: tokens to yield at most, the prefill's included.

    After iteration: `stop_reason` ("eos" or "length"), `decode_s` (seconds from the first decode block's
    enqueue to the last token), `first_step_s` (the first block's, one step: it compiles on a first call).
    """

    def __init__(self, runner, pre, sampler, seed: int, stop_ids, temperature, top_p, max_new_tokens: int):
        self.runner, self.pre, self.sampler = runner, pre, sampler
        self.seed, self.stop_ids = seed, np.asarray(stop_ids, np.int64).reshape(-1)
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.stop_reason, self.decode_s, self.first_step_s = "length", 0.0, 0.0
        self._yielded = 0

    def __iter__(self):
        pre, sampler = self.pre, self.sampler
        token, key = sampler.pick(pre.logits, jax.random.key(self.seed), self.temperature, self.top_p)
        carry = block_carry(key, np.zeros(pre.batch, bool), self.stop_ids, self.temperature, self.top_p)
        carry = (carry[0], jnp.any(token[:, None] == carry[2][None, :], axis=1), *carry[2:])
        first = np.asarray(token)[:, None]
        self._finished = np.zeros(pre.batch, bool)
        t0 = time.perf_counter()
        cut = self._cut(first)
        yield cut
        if self.stop_reason == "eos":
            return
        states, position, remaining, pending = pre.states, pre.prompt_tokens, self.max_new_tokens - 1, None
        while remaining > 0 or pending is not None:
            current = None
            if remaining > 0:
                steps = 1 if position == pre.prompt_tokens else min(self.sampler.block, remaining)
                out, count, token, states, _, carry = self.runner.decode_block(
                    sampler, token, states, position, carry, steps
                )
                position, remaining, current = position + steps, remaining - steps, (out, count)
                if steps == 1 and position == pre.prompt_tokens + 1:  # the first compiles: timed apart
                    jax.block_until_ready(out)
                    self.first_step_s = time.perf_counter() - t0
            if pending is not None:  # the block before this one, read while this one runs
                out, count = pending
                cut = self._cut(np.asarray(out)[:, : int(count)])
                self.decode_s = time.perf_counter() - t0
                if cut.shape[1]:
                    yield cut
                if self.stop_reason == "eos":
                    return
            pending = current
        self.decode_s = time.perf_counter() - t0

    def decode_tokens_per_s(self) -> float:
        """batch * tokens / second of the decode blocks after the first (`GenerateResult`'s rule), so far."""
        n = self._yielded - 1
        seconds = self.decode_s
        if n > 1 and self.decode_s > self.first_step_s > 0:
            n, seconds = n - 1, self.decode_s - self.first_step_s
        return self.pre.batch * n / seconds if n > 0 and seconds > 0 else 0.0

    def _cut(self, tokens: np.ndarray) -> np.ndarray:
        """tokens, cut after the step where the last row produces its first stop id (stop_reason "eos")."""
        tokens = self._stop(tokens)
        self._yielded += tokens.shape[1]
        return tokens

    def _stop(self, tokens: np.ndarray) -> np.ndarray:
        if not self.stop_ids.size:
            return tokens
        hit = np.isin(tokens, self.stop_ids)
        done = self._finished[:, None] | np.logical_or.accumulate(hit, axis=1)
        all_done = done.all(axis=0)
        if all_done.any():
            self.stop_reason = "eos"
            tokens = tokens[:, : int(all_done.argmax()) + 1]
        self._finished = done[:, -1] if done.shape[1] else self._finished
        return tokens

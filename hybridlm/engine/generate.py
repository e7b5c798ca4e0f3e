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
from hybridlm.engine.sampling import check_sampling, is_greedy, sample
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

    @property
    def decode_tokens_per_s(self) -> float:
        """batch * tokens / second of the decode steps after the first (whose compilation would otherwise
        count; with a single step, that step)."""
        n = self.tokens.shape[1] - 1  # decode steps: the first token comes from the prefill logits
        seconds = self.decode_s
        if n > 1 and self.decode_s > self.first_step_s > 0:
            n, seconds = n - 1, self.decode_s - self.first_step_s
        return self.tokens.shape[0] * n / seconds if n > 0 and seconds > 0 else 0.0


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
) -> GenerateResult:
    """Prefills the prompt, then samples `max_new_tokens` tokens one at a time.

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

    Raises:
      ValueError: max_new_tokens < 1, sampling settings out of range (`sampling.check_sampling`), or a bad
        prompt (see `prefill`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    check_sampling(temperature, top_k, top_p)  # before the prefill's work
    stop_ids = np.array([] if eos_token_id is None else np.ravel(eos_token_id), np.int64)
    runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
    pre = prefill(runner, input_ids, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    key = jax.random.key(seed)
    states, logits, position = pre.states, pre.logits, pre.prompt_tokens
    out = []
    first_step_s, stop_reason, finished = 0.0, "length", None
    t0 = time.perf_counter()
    for i in range(max_new_tokens):
        sub = None
        if not is_greedy(temperature):  # greedy needs no key (splitting one is a dispatch)
            key, sub = jax.random.split(key)
        token = sample(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        out.append(token)
        if i + 1 < max_new_tokens:  # queued before the host reads the token, so the device keeps busy
            logits, states = decode_step(runner, token, states, position)
            position += 1
            if i == 0:  # the first step compiles on a first call: timed apart
                jax.block_until_ready(logits)
                first_step_s = time.perf_counter() - t0
        if stop_ids.size:  # reading the token waits for it: only when there is something to stop at
            hit = np.isin(np.asarray(token), stop_ids)
            finished = hit if finished is None else finished | hit
            if finished.all():
                stop_reason = "eos"
                break
    tokens = np.asarray(jnp.stack(out, axis=1))
    return GenerateResult(
        tokens=tokens,
        prefill=pre,
        decode_s=time.perf_counter() - t0,
        first_step_s=first_step_s,
        stop_reason=stop_reason,
    )

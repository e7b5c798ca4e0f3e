"""Chunked prefill: a prompt ingested in fixed-size chunks, state carried between them (time to first token).

Each chunk reads every weight once, so a prompt of T tokens costs ceil(T / chunk_size) weight passes instead
of T. The last partial chunk is padded and masked, so the prompt length never changes compiled shapes; only
the KV-cache capacity does, and it is rounded up to a power-of-two number of chunks.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.runner import PHASES, LayerwiseRunner, PhaseTimer
from hybridlm.model import HybridLM, check_taps, check_token_ids
from hybridlm.state import KVCache, LayerState, init_layer_states

# "auto": chosen per call by `hybridlm.planning.choose_chunk_size_for`, from the memory left and, with
# offloaded experts, the bytes each chunk re-streams
DEFAULT_CHUNK_SIZE = "auto"


@dataclasses.dataclass
class PrefillResult:
    """What a prefill returns."""

    logits: jax.Array  # [batch, vocab] float32: next-token logits after the last prompt token
    states: list[LayerState]  # per-layer decode state after the prompt
    prompt_tokens: int  # tokens per sequence
    batch: int
    chunk_size: int  # tokens per chunk actually used
    num_chunks: int
    capacity: int  # KV-cache length in tokens
    ttft_s: float  # seconds from call to logits ready (compilation included on a first call)
    phase_seconds: dict[str, float] | None = None  # per-phase wall time when profile=True
    cached_tokens: int = 0  # leading prompt tokens the states already held (`prefill(resume=...)`)

    @property
    def tokens_per_s(self) -> float:
        """Prefill throughput: batch * prefilled tokens (the cached ones not counted) / TTFT."""
        return self.batch * (self.prompt_tokens - self.cached_tokens) / self.ttft_s

    def summary(self) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "batch": self.batch,
            "chunk_size": self.chunk_size,
            "chunks": self.num_chunks,
            "ttft_s": self.ttft_s,
            "prefill_tokens_per_s": self.tokens_per_s,
        }
        if self.cached_tokens:
            out["cached_tokens"] = self.cached_tokens
        if self.phase_seconds is not None:
            out["phase_seconds"] = {p: self.phase_seconds.get(p, 0.0) for p in PHASES}
        return out


def effective_chunk_size(prompt_tokens: int, chunk_size: int) -> int:
    """chunk_size, shrunk to the next power of two >= 16 for prompts shorter than one chunk."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    small = max(16, 1 << max(prompt_tokens - 1, 0).bit_length())
    return min(chunk_size, small)


def cache_capacity(prompt_tokens: int, chunk_size: int, max_new_tokens: int) -> int:
    """KV-cache length: whole chunks covering prompt + new tokens, rounded up to a power-of-two chunk
    count."""
    chunks = -(-(prompt_tokens + max_new_tokens) // chunk_size)
    return chunk_size * (1 << max(chunks - 1, 0).bit_length())


def prefill(
    model: HybridLM | LayerwiseRunner,
    input_ids,
    *,
    chunk_size: int | str = DEFAULT_CHUNK_SIZE,
    max_new_tokens: int = 0,
    profile: bool = False,
    on_chunk=None,
    resume: tuple[list[LayerState], int] | None = None,
    taps: tuple[int, ...] = (),
) -> PrefillResult:
    """Ingests a prompt chunk by chunk and returns the next-token logits and the decode state.

    Args:
      model: a `HybridLM` (or a `LayerwiseRunner` around one, to reuse its compiled functions).
      input_ids: [batch, seq] or [seq] int token ids (numpy or jax); all rows have the same length.
      chunk_size: tokens per chunk (the last one is padded); prompts shorter than a chunk use a smaller
        power-of-two chunk. "auto": the chunk of least predicted TTFT whose activations fit the memory left
        (`hybridlm.planning.choose_chunk_size_for`).
      max_new_tokens: room to reserve in the KV cache for decoding afterwards.
      profile: wait after every phase and report per-phase wall time (slower: it removes overlap).
      on_chunk: None, or a function called after each chunk with (hidden [batch, chunk, hidden] after the last
        layer, before the final norm; start position; valid tokens; next_ids [batch, chunk] int32 = the
        prompt shifted left by one, zero past its end; the KV-cache capacity): the MTP drafter ingests the
        prompt this way. With `taps`, a sixth argument: the chunk's features [batch, chunk, len(taps) *
        hidden], the outputs of layers `taps` concatenated in that order (a DFlash draft's context rows).
      resume: None, or (states holding positions [0, start), start): `input_ids` continue that prefix
        (a prefix cache's snapshot, `hybridlm.engine.prefix_cache`). The states' KV capacity must hold
        start + seq + max_new_tokens; the result's prompt_tokens counts the prefix too.
      taps: layer indices whose outputs `on_chunk` receives (needs on_chunk); () for none.

    Returns:
      A `PrefillResult`; only the last prompt token goes through the final norm and lm head.

    Raises:
      ValueError: empty prompt, ids outside the vocabulary, a prompt longer than max_position_embeddings, a
        chunk_size neither a positive int nor "auto", resumed states with too little KV capacity, taps
        outside the model's layers or without on_chunk.
    """
    runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
    config = runner.config
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {ids.shape}")
    check_token_ids(ids, config.vocab_size)
    taps = check_taps(taps, config.num_layers)
    if taps and on_chunk is None:
        raise ValueError(f"taps={taps} need an on_chunk to hand the features to")
    batch, seq = ids.shape
    offset = 0 if resume is None else int(resume[1])
    if offset + seq + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({offset + seq}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    if chunk_size == "auto":
        from hybridlm.planning import choose_chunk_size_for  # planning sizes chunks with this module's rules

        chunk_size = choose_chunk_size_for(runner, seq, batch=batch, max_new_tokens=max_new_tokens).chunk_size
    elif isinstance(chunk_size, (str, bool)):
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or 'auto'")
    chunk = effective_chunk_size(seq, chunk_size)
    num_chunks = -(-seq // chunk)
    capacity = cache_capacity(seq, chunk, max_new_tokens)
    if resume is not None:
        capacity = min((s.capacity for s in resume[0] if isinstance(s, KVCache)), default=capacity)
        if offset + seq + max_new_tokens > capacity:
            raise ValueError(
                f"resumed states hold a KV cache of {capacity} tokens, fewer than the prefix ({offset}) + "
                f"prompt ({seq}) + max_new_tokens ({max_new_tokens})"
            )
    padded = np.zeros((batch, num_chunks * chunk + 1), np.int32)
    padded[:, :seq] = ids

    timer = PhaseTimer(profile)
    runner.on_prefill_start(num_chunks)
    t0 = time.perf_counter()
    states = init_layer_states(config, batch, capacity, runner.model.dtype) if resume is None else resume[0]
    x = None
    for c in range(num_chunks):
        num_valid = min(chunk, seq - c * chunk)
        start = offset + c * chunk
        out = runner.forward_chunk(
            jnp.asarray(padded[:, c * chunk : (c + 1) * chunk]), states, start, num_valid, timer, taps=taps
        )
        x, states, extra = out[0], out[1], out[2:]  # extra: (features,) with taps
        if on_chunk is not None:
            on_chunk(x, start, num_valid, padded[:, c * chunk + 1 : (c + 1) * chunk + 1], capacity, *extra)
    last = x[:, num_valid - 1]
    logits = jax.block_until_ready(timer("head", runner.head_logits, last))
    ttft = time.perf_counter() - t0
    return PrefillResult(
        logits=logits,
        states=states,
        prompt_tokens=offset + seq,
        batch=batch,
        chunk_size=chunk,
        num_chunks=num_chunks,
        capacity=capacity,
        ttft_s=ttft,
        phase_seconds=dict(timer.seconds) if profile else None,
        cached_tokens=offset,
    )

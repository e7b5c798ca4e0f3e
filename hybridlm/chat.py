"""Conversations: messages in, the reply streamed out as text deltas.

`Chat` applies the model's chat template (`ChatTemplate`), tokenizes, prefills and decodes
(`generate_stream`), and turns the tokens into UTF-8-safe text deltas (`TextStream`) cut at stop strings
(`StopStrings`) and at the tokenizer's end-of-turn / end-of-text tokens. One request runs at a time per `Chat`
(`lock`): callers that serve several clients queue on it; with `batch_decode` only prefills do, and replies
decode together (`engine.batch`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from hybridlm.chat_template import ChatTemplate, check_messages
from hybridlm.engine.batch import DecodeBatcher
from hybridlm.engine.generate import DECODE_BLOCK, generate_stream
from hybridlm.engine.prefill import prefill
from hybridlm.engine.prefix_cache import PrefixCache
from hybridlm.engine.runner import LayerwiseRunner
from hybridlm.engine.sampling import BlockSampler, check_sampling
from hybridlm.state import init_layer_states
from hybridlm.text_stream import StopStrings, TextStream


@dataclasses.dataclass
class ReplyStats:
    """What a finished reply reports (OpenAI `usage` and more)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (not prefilled again)
    finish_reason: str | None = None  # "stop" (end of turn, EOS or a stop string) or "length"
    ttft_s: float = 0.0  # from the request to its first token
    decode_tokens_per_s: float = 0.0


class ReplyStream:
    """Iterator of a reply's text deltas; `stats` is complete once it is exhausted. Closing it early (a client
    that went away) stops the decoding and releases the `Chat`. With batched decoding, `decoding` says that
    the reply has left its prefill for the shared decode batch, and `cancel()` (from any thread) ends its
    decoding there, so that a `next()` waiting for tokens returns."""

    def __init__(self, deltas: Iterator[str] | None, stats: ReplyStats):
        self._deltas, self.stats = deltas, stats
        self._row = None  # its `BatchRow` once it decodes in a batch

    @property
    def decoding(self) -> bool:
        return self._row is not None

    def cancel(self) -> None:
        if self._row is not None:
            self._row.cancel()

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()

    def text(self) -> str:
        """The whole reply (consumes the stream)."""
        return "".join(self._deltas)


class Chat:
    """A model with its tokenizer and chat template, answering messages.

    Args:
      model: a `HybridLM` or a runner (`LayerwiseRunner`, `OffloadedRunner`).
      tokenizer: a `Tokenizer` (or a GGUF file's); its `stop_token_ids` end a reply.
      template: the chat template; None: the built-in Qwen3.5/3.6 one (`ChatTemplate.for_model(path)` reads a
        checkpoint's own).
      chunk_size: prefill chunk size, or "auto".
      max_context: tokens a request may use, prompt and reply together (default: the model's
        max_position_embeddings).
      prefix_cache: the `PrefixCache` of state snapshots (default: a new one; None for no reuse). Before
        each reply the state after the conversation's history is saved, so that the next turn, which repeats
        that history, prefills only what follows it.
      batch_decode: decode concurrent replies together (`engine.batch.DecodeBatcher`): a reply holds the lock
        for its prefill only, then decodes in a batch with the replies of the same sampling settings. A
        sampled reply's tokens then depend on the replies it shares steps with; a greedy one's do not, up to
        rounding. False: a reply holds the lock until it ends.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        template: ChatTemplate | None = None,
        chunk_size="auto",
        max_context=None,
        prefix_cache: PrefixCache | None | str = "default",
        batch_decode: bool = False,
    ):
        self.runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
        self.tokenizer = tokenizer
        self.template = template or ChatTemplate.builtin()
        self.chunk_size = chunk_size
        limit = self.runner.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        self.lock = threading.Lock()
        self.prefix_cache = PrefixCache() if prefix_cache == "default" else prefix_cache
        self.batcher = DecodeBatcher(self.runner, self.lock, block=DECODE_BLOCK) if batch_decode else None

    def prompt_ids(self, messages: Sequence[dict], *, enable_thinking: bool = False) -> list[int]:
        """The token ids of `messages` rendered with the template and a generation prompt.

        Raises:
          ValueError: malformed messages or a template error (naming them).
        """
        return self.prompt_with_history(messages, enable_thinking=enable_thinking)[0]

    def prompt_with_history(
        self, messages: Sequence[dict], *, enable_thinking: bool = False
    ) -> tuple[list[int], int | None]:
        """(prompt ids, the length of their history part: the messages without the generation prompt, where
        those tokens start the prompt, else None), for `complete_ids(ids, history_length=...)`.

        Raises:
          ValueError: malformed messages or a template error (naming them).
        """
        check_messages(messages)
        render = self.template.render
        ids = list(self.tokenizer.encode(render(list(messages), enable_thinking=enable_thinking)))
        past = render(list(messages), add_generation_prompt=False, enable_thinking=enable_thinking)
        history = list(self.tokenizer.encode(past))
        return ids, len(history) if 0 < len(history) < len(ids) and ids[: len(history)] == history else None

    def stream(self, messages: Sequence[dict], *, enable_thinking: bool = False, **sampling) -> ReplyStream:
        """The assistant's reply to `messages` as a stream of text deltas (`complete`'s keyword arguments).

        Raises:
          ValueError: malformed messages, or a prompt that leaves no room for max_tokens in max_context.
        """
        ids, history = self.prompt_with_history(messages, enable_thinking=enable_thinking)
        return self.complete_ids(ids, history_length=history, **sampling)

    def complete(self, prompt: str, **sampling) -> ReplyStream:
        """The continuation of raw text `prompt` (no template) as a stream of text deltas."""
        return self.complete_ids(list(self.tokenizer.encode(prompt)), **sampling)

    def complete_ids(
        self,
        ids: Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[str] = (),
        history_length: int | None = None,
    ) -> ReplyStream:
        """The continuation of prompt token ids as a stream of text deltas, ended by the tokenizer's stop
        tokens, a stop string (not included) or max_tokens. With a prefix cache the prompt resumes from its
        longest cached prefix, and the state after its first `history_length` tokens is saved.

        Raises:
          ValueError: an empty prompt, max_tokens < 1, sampling settings out of range, or a prompt that leaves
            no room for max_tokens in max_context (naming the numbers).
        """
        ids = np.asarray(ids, np.int32)
        if ids.size == 0:
            raise ValueError("the prompt is empty")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
        if ids.size + max_tokens > self.max_context:
            raise ValueError(
                f"the prompt's {ids.size} tokens + max_tokens {max_tokens} exceed the context of "
                f"{self.max_context} tokens"
            )
        check_sampling(temperature, top_k, top_p)
        stats = ReplyStats(prompt_tokens=int(ids.size))
        stops = StopStrings(list(stop)) if stop else None
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        reply = ReplyStream(None, stats)
        reply._deltas = self._deltas(ids, history_length, reply, stops, max_tokens, sampling)
        return reply

    def stats(self) -> dict:
        """The prefix cache's statistics (`PrefixCache.stats`), or {} without one."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else {}

    def _resume(self, ids: np.ndarray, history: int | None, max_tokens: int) -> tuple[list, int, int]:
        """(states holding the prompt's first n tokens, n, tokens taken from the cache): from the longest
        cached prefix, then prefilled up to the history's end and saved there."""
        total = ids.size + max_tokens
        capacity = max(16, 1 << (total - 1).bit_length())  # a power of two: whole prefill chunks
        cache, config = self.prefix_cache, self.runner.config
        snap = cache.lookup(ids) if cache is not None else None
        if snap is None:
            states, n = init_layer_states(config, 1, capacity, self.runner.model.dtype), 0
        else:
            states, n = cache.restore(snap, capacity), snap.length
        if cache is not None and history is not None and n < history < ids.size:
            pre = prefill(
                self.runner,
                ids[n:history],
                chunk_size=self.chunk_size,
                max_new_tokens=total - history,
                resume=(states, n),
            )
            cache.insert(ids[:history], pre.states)
            states, n = pre.states, history
        return states, n, 0 if snap is None else snap.length

    def _deltas(self, ids, history, reply: ReplyStream, stops, max_tokens, sampling: dict):
        """The generator behind a `ReplyStream`: holds the lock while it prefills, and while it decodes unless
        the decoding is batched."""
        stats, t0 = reply.stats, time.perf_counter()
        if self.batcher is None:
            with self.lock:
                states, n, stats.cached_tokens = self._resume(ids, history, max_tokens)
                tokens = generate_stream(
                    self.runner,
                    ids[n:],
                    resume=(states, n),
                    max_new_tokens=max_tokens,
                    eos_token_id=self.tokenizer.stop_token_ids,
                    chunk_size=self.chunk_size,
                    **sampling,
                )
                yield from self._text(tokens, stats, stops, t0)
            return
        with self.lock:
            states, n, stats.cached_tokens = self._resume(ids, history, max_tokens)
            chunk, resume = self.chunk_size, (states, n)
            pre = prefill(self.runner, ids[n:], chunk_size=chunk, max_new_tokens=max_tokens, resume=resume)
            sampler = BlockSampler.of(1, sampling["temperature"], sampling["top_k"], sampling["top_p"])
            first, _ = sampler.pick(
                pre.logits, jax.random.key(sampling["seed"]), sampling["temperature"], sampling["top_p"]
            )
        tokens = _BatchedTokens(self, reply, pre, first, max_tokens, sampling)
        try:
            yield from self._text(tokens, stats, stops, t0)
        finally:
            reply.cancel()

    def _text(self, tokens, stats: ReplyStats, stops, t0: float):
        """Text deltas of `tokens` (an iterable of [1, n] blocks with `stop_reason` and
        `decode_tokens_per_s()`), cut at stop ids and stop strings; fills `stats`."""
        text = TextStream(self.tokenizer)
        stop_ids = set(self.tokenizer.stop_token_ids)
        for block in tokens:
            row = [int(t) for t in block[0]]
            if not stats.completion_tokens:
                stats.ttft_s = time.perf_counter() - t0
            stats.completion_tokens += len(row)
            ended = bool(stop_ids.intersection(row))
            delta = text.push([t for t in row if t not in stop_ids])
            if stops is not None:
                delta, hit = stops.push(delta)
                ended = ended or hit
            if delta:
                yield delta
            if ended:
                stats.finish_reason = "stop"
                break
        else:
            if tokens.stop_reason is None:  # cancelled: the reply did not finish
                return
            stats.finish_reason = "stop" if tokens.stop_reason == "eos" else "length"
            rest = text.finish()
            if stops is not None:
                rest, hit = stops.push(rest)
                rest += "" if hit else stops.finish()
            if rest:
                yield rest
        stats.decode_tokens_per_s = tokens.decode_tokens_per_s()


class _BatchedTokens:
    """A reply's tokens from a `DecodeBatcher`: the prefill's token, then its row's blocks, each as [1, n]
    (the interface `Chat._text` reads, as `TokenStream`'s)."""

    def __init__(self, chat: Chat, reply: ReplyStream, pre, first, max_tokens: int, sampling: dict):
        self.chat, self.reply, self.pre, self.first = chat, reply, pre, first
        self.max_tokens, self.sampling = max_tokens, sampling
        self.stop_reason, self._tokens, self._t0, self._seconds = "length", 0, 0.0, 0.0

    def __iter__(self):
        stop_ids = self.chat.tokenizer.stop_token_ids
        first = np.asarray(self.first)[None, :]
        self._tokens = 1
        stopped = bool(np.isin(first, stop_ids).any())
        if stopped or self.max_tokens == 1:
            self.stop_reason = "eos" if stopped else "length"
            yield first
            return
        s = self.sampling
        # joined before the first token is handed out, so that the reply is `decoding` once it has one
        self.reply._row = self.chat.batcher.join(
            self.pre.states,
            self.pre.prompt_tokens,
            self.first,
            self.max_tokens - 1,
            temperature=s["temperature"],
            top_k=s["top_k"],
            top_p=s["top_p"],
            stop_ids=stop_ids,
            seed=s["seed"],
        )
        self.pre = None  # the batch holds the states now
        self._t0 = time.perf_counter()
        yield first
        for block in self.reply._row:
            self._tokens += block.size
            self._seconds = time.perf_counter() - self._t0
            if np.isin(block, stop_ids).any():
                self.stop_reason = "eos"
            yield block[None, :]
        if self.reply._row.cancelled:
            self.stop_reason = None

    def decode_tokens_per_s(self) -> float:
        """Tokens after the first a second of this reply's decoding (its share of the batch)."""
        return (self._tokens - 1) / self._seconds if self._tokens > 1 and self._seconds > 0 else 0.0

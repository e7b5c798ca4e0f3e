"""Conversations: messages in, the reply streamed out as text deltas.

`Chat` applies the model's chat template (`ChatTemplate`), tokenizes, prefills and decodes
(`generate_stream`), and turns the tokens into UTF-8-safe text deltas (`TextStream`) cut at stop strings
(`StopStrings`) and at the tokenizer's end-of-turn / end-of-text tokens. One request runs at a time per `Chat`
(`lock`): callers that serve several clients queue on it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from hybridlm.chat_template import ChatTemplate, check_messages
from hybridlm.engine.generate import generate_stream
from hybridlm.engine.runner import LayerwiseRunner
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
    that went away) stops the decoding and releases the `Chat`."""

    def __init__(self, deltas: Iterator[str], stats: ReplyStats):
        self._deltas, self.stats = deltas, stats

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
    """

    def __init__(
        self, model, tokenizer, *, template: ChatTemplate | None = None, chunk_size="auto", max_context=None
    ):
        self.runner = model if isinstance(model, LayerwiseRunner) else LayerwiseRunner(model)
        self.tokenizer = tokenizer
        self.template = template or ChatTemplate.builtin()
        self.chunk_size = chunk_size
        limit = self.runner.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        self.lock = threading.Lock()

    def prompt_ids(self, messages: Sequence[dict], *, enable_thinking: bool = False) -> list[int]:
        """The token ids of `messages` rendered with the template and a generation prompt.

        Raises:
          ValueError: malformed messages or a template error (naming them).
        """
        check_messages(messages)
        text = self.template.render(
            list(messages), add_generation_prompt=True, enable_thinking=enable_thinking
        )
        return list(self.tokenizer.encode(text))

    def stream(self, messages: Sequence[dict], *, enable_thinking: bool = False, **sampling) -> ReplyStream:
        """The assistant's reply to `messages` as a stream of text deltas (`complete`'s keyword arguments).

        Raises:
          ValueError: malformed messages, or a prompt that leaves no room for max_tokens in max_context.
        """
        return self.complete_ids(self.prompt_ids(messages, enable_thinking=enable_thinking), **sampling)

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
    ) -> ReplyStream:
        """The continuation of prompt token ids as a stream of text deltas, ended by the tokenizer's stop
        tokens, a stop string (not included) or max_tokens.

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
        stats = ReplyStats(prompt_tokens=int(ids.size))
        stops = StopStrings(list(stop)) if stop else None
        return ReplyStream(
            self._deltas(ids, stats, stops, max_tokens, temperature, top_p, top_k, seed), stats
        )

    def _deltas(self, ids, stats: ReplyStats, stops, max_tokens, temperature, top_p, top_k, seed):
        """The generator behind a `ReplyStream`: holds the lock while it decodes."""
        with self.lock:
            t0 = time.perf_counter()
            tokens = generate_stream(
                self.runner,
                ids,
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                eos_token_id=self.tokenizer.stop_token_ids,
                chunk_size=self.chunk_size,
            )
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
                stats.finish_reason = "stop" if tokens.stop_reason == "eos" else "length"
                rest = text.finish()
                if stops is not None:
                    rest, hit = stops.push(rest)
                    rest += "" if hit else stops.finish()
                if rest:
                    yield rest
            stats.decode_tokens_per_s = tokens.decode_tokens_per_s()

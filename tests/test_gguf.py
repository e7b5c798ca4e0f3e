"""GGUF: HF fixture -> save_gguf -> load reproduces the logits; every tensor type dequantizes like the gguf
package; keep_quantized="experts" keeps Q8_0 / Q4_K experts packed;
written files pass the gguf reader and dump.
"""

import subprocess
import sys
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from support import FIXTURES, K256, assert_finite

import hybridlm
from hybridlm.checkpoints import gguf_quants
from hybridlm.checkpoints.gguf import GGUFError, load_gguf, save_gguf, use_more_bits
from hybridlm.checkpoints.gguf_header import read_header
from pallas_kernels.quantized import QuantizedWeights

GGUF_FIXTURES = ("qwen35moe_text", "qwen3next")
F32_MAX_ABS_ERROR = 1e-5  # the bound for an F32 round trip (measured: 0.0, bit-identical)
# Max |logit error| of a quantized round trip vs the float model, measured on the fixtures (logit std 1) and
# bounded here with ~1.5x headroom. The fixtures' router logits have near-ties (gap 4.5e-3), so quantization
# noise flips some expert choices: the max error is a flip, the mean error the typical noise (docs/gguf.md).
# Measured (qwen35moe_text, 2x37 tokens): f16 max 0.56 / mean 0.014, bf16 1.30 / 0.074, q8_0 2.02 / 0.171,
# q4_k (Q5_0 fallback for these 64- and 32-wide rows) 3.84 / 0.547.
QUANT_MAX_ABS_ERROR = {"f16": 1.0, "bf16": 2.0, "q8_0": 3.0, "q4_k": 6.0}
QUANT_MEAN_ABS_ERROR = {"f16": 0.03, "bf16": 0.12, "q8_0": 0.25, "q4_k": 0.8}


@pytest.fixture(scope="session")
def gguf_case(hf_models, forward, tmp_path_factory):
    """name -> (HF-loaded model, input ids, its logits, tmp dir)."""
    out = {}
    for name in GGUF_FIXTURES:
        model, expected = hf_models[name]
        ids = jnp.asarray(expected["input_ids"])
        out[name] = (model, ids, np.asarray(forward(model, ids)), tmp_path_factory.mktemp(f"gguf_{name}"))
    return out


@pytest.mark.parametrize("name", GGUF_FIXTURES)
def test_f32_round_trip_reproduces_hf_logits(gguf_case, forward, name):
    model, ids, want, tmp = gguf_case[name]
    path = tmp / "model-f32.gguf"
    hybridlm.save_gguf(model, path, "f32")
    loaded = hybridlm.load(path, progress=False)
    assert loaded.config.replace(name=model.config.name, explicit_layer_types=None) == model.config.replace(
        explicit_layer_types=None
    )
    got = np.asarray(forward(loaded, ids))
    assert_finite(got, "logits")
    assert np.abs(got - want).max() <= F32_MAX_ABS_ERROR
    expected = np.load(FIXTURES / "hf" / name / "expected.npz")["logits"]
    assert np.abs(got - expected).max() < 1e-3  # HF transformers' own logits


@pytest.mark.parametrize("tensor_type", ["f16", "bf16", "q8_0", "q4_k"])
def test_quantized_round_trip_error_is_bounded(gguf_case, forward, tensor_type):
    model, ids, want, tmp = gguf_case["qwen35moe_text"]
    path = tmp / f"model-{tensor_type}.gguf"
    save_gguf(model, path, tensor_type)
    got = np.asarray(forward(load_gguf(path, dtype=jnp.float32, progress=False), ids))
    assert_finite(got, "logits")
    err = np.abs(got - want)
    print(f"{tensor_type}: max |dlogit| {err.max():.4f}, mean {err.mean():.5f}")
    assert err.max() <= QUANT_MAX_ABS_ERROR[tensor_type]
    assert err.mean() <= QUANT_MEAN_ABS_ERROR[tensor_type]


def test_written_file_matches_converter_layout(gguf_case):
    """Names, ne and types as llama.cpp's converter writes them (spec §10.2), and metadata keys."""
    model, _, _, tmp = gguf_case["qwen35moe_text"]
    path = tmp / "layout-bf16.gguf"
    save_gguf(model, path, "bf16")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    ne = {n: [int(x) for x in t.shape] for n, t in tensors.items()}
    assert ne["token_embd.weight"] == [64, 384] and ne["output.weight"] == [64, 384]
    assert ne["blk.0.attn_qkv.weight"] == [64, 128] and ne["blk.0.attn_gate.weight"] == [64, 64]
    assert ne["blk.0.ssm_conv1d.weight"] == [4, 128] and ne["blk.0.ssm_a"] == [4]
    assert ne["blk.0.ffn_gate_exps.weight"] == [64, 32, 8] and ne["blk.0.ffn_down_exps.weight"] == [32, 64, 8]
    assert ne["blk.0.ffn_gate_inp_shexp.weight"] == [64] and ne["blk.3.attn_q.weight"] == [64, 256]
    for name, t in tensors.items():
        f32 = (
            name.endswith(
                ("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight")
            )
            or len(t.shape) == 1
        )
        assert t.tensor_type == (T.F32 if f32 else T.BF16), name
    # every name is one the gguf package knows for the architecture
    known = {gguf.TENSOR_NAMES[k] for k in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35MOE]}
    for name in tensors:
        base = name.split(".weight")[0].split(".bias")[0]
        base = base if not base.startswith("blk.") else "blk.{bid}." + base.split(".", 2)[2]
        assert base in known, name
    keys = set(reader.fields)
    for key in (
        "block_count",
        "context_length",
        "embedding_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.layer_norm_rms_epsilon",
        "rope.freq_base",
        "rope.dimension_count",
        "rope.dimension_sections",
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "ssm.conv_kernel",
        "ssm.state_size",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.inner_size",
        "full_attention_interval",
    ):
        assert f"qwen35moe.{key}" in keys, key
    # ssm_a = -exp(A_log) in the tiled V-head order; norms carry +1
    g = model.layers[0].mixer
    order = np.array([0, 2, 1, 3])  # Hk=2, Hv=4: GGUF head j <- HF head (j%2)*2 + j//2
    a_log = np.asarray(g.log_decay_rate.get_value())
    np.testing.assert_allclose(np.asarray(tensors["blk.0.ssm_a"].data), -np.exp(a_log)[order], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(tensors["blk.0.attn_norm.weight"].data),
        np.asarray(model.layers[0].input_norm.scale.get_value()) + 1,
        rtol=1e-6,
    )


def test_written_file_passes_gguf_reader_and_dump(gguf_case, tmp_path):
    model, _, _, _ = gguf_case["qwen3next"]
    path = tmp_path / "model-q8_0.gguf"
    save_gguf(model, path, "q8_0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(read_header(path).tensors)
    dump = subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_dump", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dump.returncode == 0, dump.stderr
    assert "warn" not in (dump.stderr + dump.stdout).lower()
    assert "blk.0.ssm_ba.weight" in dump.stdout and "qwen3next.ssm.group_count" in dump.stdout


# ----------------------------------------------------------------------------------------------------------
# dequantization of every supported type, bit for bit, through a real file and GGUFReader
# ----------------------------------------------------------------------------------------------------------
def _random_raw(qtype: T, rows: int, blocks: int, rng) -> np.ndarray:
    """Valid random raw data: random bytes with finite float16/float32 scale fields."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        return rng.standard_normal((rows, blocks * block)).astype(np.float32)
    if qtype == T.F16:
        return rng.standard_normal((rows, blocks * block)).astype(np.float16)
    if qtype == T.BF16:
        return gguf.quants.quantize(rng.standard_normal((rows, blocks * block)).astype(np.float32), T.BF16)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    f16 = lambda n: rng.uniform(-2, 2, (rows, blocks, n)).astype(np.float16).view(np.uint8)
    fields = {
        T.Q8_0: [0],
        T.Q4_0: [0],
        T.Q4_1: [0, 2],
        T.Q5_0: [0],
        T.Q5_1: [0, 2],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [size - 2],
        T.IQ4_NL: [0],
        T.IQ4_XS: [0],
    }
    for off in fields.get(qtype, []):
        raw[..., off : off + 2] = f16(1)
    if qtype == T.Q8_K:
        raw[..., 0:4] = rng.uniform(-2, 2, (rows, blocks, 1)).astype(np.float32).view(np.uint8)
    return raw.reshape(rows, blocks * size)


def test_every_type_dequantizes_like_gguf(tmp_path):
    rng = np.random.default_rng(0)
    raws = {qtype: _random_raw(qtype, rows=3, blocks=2, rng=rng) for qtype in gguf_quants.SUPPORTED_TYPES}
    writer = gguf.GGUFWriter(tmp_path / "types.gguf", "qwen35moe")
    for qtype, raw in raws.items():
        writer.add_tensor(qtype.name, raw, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(tmp_path / "types.gguf")
    reader = gguf.GGUFReader(tmp_path / "types.gguf")
    for t in reader.tensors:
        qtype = T[t.name]
        got = gguf_quants.dequantize(t.data, header.tensors[t.name].type)
        assert got.shape == header.tensors[t.name].shape, t.name
        if qtype == T.Q8_K:  # gguf has no Q8_K dequantizer: d (float32) * q (int8) per 256-block
            blocks = raws[qtype].reshape(-1, GGML_QUANT_SIZES[qtype][1])
            want = (blocks[:, :4].copy().view(np.float32) * blocks[:, 4:260].view(np.int8)).reshape(got.shape)
        elif qtype in (T.F32, T.F16):
            want = raws[qtype].astype(np.float32)
        else:
            want = gguf.quants.dequantize(raws[qtype], qtype)
        np.testing.assert_array_equal(got, want, err_msg=t.name)


@pytest.mark.parametrize("qtype", gguf_quants.KEEPABLE_TYPES, ids=lambda t: t.name)
def test_quantized_weights_from_raw_blocks_are_exact(qtype):
    rng = np.random.default_rng(1)
    raw = _random_raw(qtype, rows=3 * 5, blocks=2, rng=rng).reshape(3, 5, -1)  # [experts, out, bytes]
    qw = gguf_quants.to_quantized_weights([(raw, qtype)])
    assert (qw.bits, qw.block_size) == (gguf_quants.KEPT_BITS[qtype], gguf_quants.KEPT_BLOCK[qtype])
    want = gguf.quants.dequantize(raw, qtype)  # [experts, out, k]
    np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32)), np.swapaxes(want, 1, 2))


def test_quantized_weights_concatenate_blocks_of_two_sizes():
    """A gate in Q6_K beside an up in Q8_0: one 8-bit tensor with Q8_0's scales repeated per 16 elements;
    8-bit beside 4-bit refused; a type with no exact layout refused."""
    rng = np.random.default_rng(4)
    gate, up = (_random_raw(t, rows=2 * 3, blocks=1, rng=rng).reshape(2, 3, -1) for t in (T.Q6_K, T.Q8_0))
    up = np.concatenate(
        [up] + [_random_raw(T.Q8_0, rows=2 * 3, blocks=1, rng=rng).reshape(2, 3, -1) for _ in range(7)],
        axis=-1,
    )  # 256 elements, as the gate
    qw = gguf_quants.to_quantized_weights([(gate, T.Q6_K), (up, T.Q8_0)])
    assert qw.block_size == 16 and qw.scales.dtype == jnp.float32 and qw.shape == (2, 256, 6)
    want = np.concatenate([gguf.quants.dequantize(gate, T.Q6_K), gguf.quants.dequantize(up, T.Q8_0)], axis=1)
    np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32)), np.swapaxes(want, 1, 2))
    with pytest.raises(ValueError, match="8-bit and 4-bit.*Q6_K, Q4_K"):
        gguf_quants.to_quantized_weights(
            [(gate, T.Q6_K), (_random_raw(T.Q4_K, 6, 1, rng).reshape(2, 3, -1), T.Q4_K)]
        )
    with pytest.raises(ValueError, match="Q8_K cannot be kept"):
        gguf_quants.to_quantized_weights([(_random_raw(T.Q8_K, 6, 1, rng).reshape(2, 3, -1), T.Q8_K)])
    # a Q5_K gate (offsets) beside a Q6_K up (none): the up's offsets are zeros, still exact
    gate5 = _random_raw(T.Q5_K, rows=2 * 3, blocks=1, rng=rng).reshape(2, 3, -1)
    qw = gguf_quants.to_quantized_weights([(gate5, T.Q5_K), (gate, T.Q6_K)])
    assert (qw.bits, qw.block_size) == (8, 16) and qw.offsets is not None
    want = np.concatenate(
        [gguf.quants.dequantize(gate5, T.Q5_K), gguf.quants.dequantize(gate, T.Q6_K)], axis=1
    )
    np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32)), np.swapaxes(want, 1, 2))


# (qtype, mean and max error bounds): Q5_K a step of ~range / 31 per 32 values, Q6_K ~max|x| / 32 per 16
@pytest.mark.parametrize(
    "qtype,mean,peak", [(T.Q5_K, 0.04, 0.12), (T.Q6_K, 0.02, 0.07)], ids=["Q5_K", "Q6_K"]
)
def test_q5_k_and_q6_k_quantizers_round_trip(qtype, mean, peak):
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    raw = gguf_quants.quantize(x, qtype)
    assert raw.shape == (4, 2 * GGML_QUANT_SIZES[qtype][1])
    err = np.abs(gguf.quants.dequantize(raw, qtype) - x)
    assert err.mean() < mean and err.max() < peak
    assert not gguf.quants.dequantize(
        gguf_quants.quantize(np.zeros((1, 256), np.float32), qtype), qtype
    ).any()


def test_q4_k_quantizer_round_trips():
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    y = gguf.quants.dequantize(gguf_quants.quantize_q4_k(x), T.Q4_K)
    err = np.abs(y - x)
    assert err.mean() < 0.08 and err.max() < 0.35  # Q4_0 (gguf's own quantizer) on the same data: mean 0.071


# ----------------------------------------------------------------------------------------------------------
# keep_quantized="experts"
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def k256_model():
    return hybridlm.init_random(K256, seed=3)


@pytest.mark.parametrize(
    "tensor_type,bytes_per_param", [("q8_0", 34 / 32), ("q4_k", 0.75), ("q5_k", 1.25), ("q6_k", 1.25)]
)
def test_keep_quantized_experts(k256_model, forward, tmp_path, tensor_type, bytes_per_param):
    path = tmp_path / f"k256-{tensor_type}.gguf"
    save_gguf(k256_model, path, tensor_type)
    header = read_header(path)
    want_type = {"q8_0": T.Q8_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}[tensor_type]
    assert header.tensors["blk.0.ffn_down_exps.weight"].type == want_type
    dense = load_gguf(path, dtype=jnp.float32, progress=False)
    kept = load_gguf(path, dtype=jnp.float32, keep_quantized="experts", progress=False)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, K256.vocab_size, (2, 19)), jnp.int32)
    for layer_kept, layer_dense in zip(kept.layers, dense.layers, strict=False):
        for name in ("experts_gate_up", "experts_down"):
            qw = getattr(layer_kept.ffn, name).get_value()
            assert isinstance(qw, QuantizedWeights) and qw.bits == (4 if tensor_type == "q4_k" else 8)
            dense_w = getattr(layer_dense.ffn, name).get_value()
            assert qw.shape == dense_w.shape
            assert qw.bytes_per_param == pytest.approx(bytes_per_param)
            assert qw.nbytes / dense_w.nbytes == pytest.approx(bytes_per_param / 4)  # vs float32
            np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32)), np.asarray(dense_w))
    want = np.asarray(forward(dense, ids))
    got = np.asarray(forward(kept, ids))
    assert_finite(got, "logits")
    assert np.abs(got - want).max() < 1e-4  # same weights, only the summation order may differ


@pytest.mark.parametrize("tensor_type,head_block", [("q8_0", 32), ("q4_k_m", 16)])
def test_keep_quantized_head(k256_model, forward, tmp_path, tensor_type, head_block):
    """keep_quantized="experts+head" keeps output.weight (Q8_0, or Q4_K_M's Q6_K) as the file's exact
    weights [1, hidden, vocab]; logits equal the dequantized model's, and saving writes the same head."""
    path = tmp_path / f"k256-{tensor_type}.gguf"
    save_gguf(k256_model, path, tensor_type)
    dense = load_gguf(path, dtype=jnp.float32, progress=False)
    kept = load_gguf(path, dtype=jnp.float32, keep_quantized="experts+head", progress=False)
    head = kept.head_weight()
    assert isinstance(head, QuantizedWeights) and (head.bits, head.block_size) == (8, head_block)
    assert head.shape == (1, K256.hidden_dim, K256.vocab_size)
    np.testing.assert_array_equal(np.asarray(head.dequantize()[0]), np.asarray(dense.head_weight()))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, K256.vocab_size, (2, 19)), jnp.int32)
    got = np.asarray(forward(kept, ids))
    assert_finite(got, "logits")
    assert np.abs(got - np.asarray(forward(dense, ids))).max() < 1e-4
    again = tmp_path / "again.gguf"
    save_gguf(kept, again, tensor_type)
    reloaded = load_gguf(again, dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(reloaded.head_weight()), np.asarray(dense.head_weight()))


TRUNK_MATRICES = {
    "linear_attention": ("qkv_proj", "output_gate_proj", "beta_proj", "decay_proj", "out_proj"),
    "full_attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@pytest.mark.parametrize("tensor_type", ["q8_0", "q4_k_m"])
def test_keep_quantized_all(k256_model, forward, tmp_path, tensor_type):
    """keep_quantized="all" keeps every trunk projection in the file's blocks as `QuantizedWeights`
    [1, in, out], in the model's order (the V heads reordered by whole blocks): each equals the dequantized
    load's matrix exactly, the logits and greedy tokens are the dequantized model's, and saving writes the
    same weights."""
    path = tmp_path / f"k256-{tensor_type}.gguf"
    save_gguf(k256_model, path, tensor_type)
    dense = load_gguf(path, dtype=jnp.float32, progress=False)
    kept = load_gguf(path, dtype=jnp.float32, keep_quantized="all", progress=False)
    assert isinstance(kept.head_weight(), QuantizedWeights)
    for layer, layer_dense, kind in zip(kept.layers, dense.layers, K256.layer_types, strict=True):
        pairs = [(getattr(layer.mixer, n), getattr(layer_dense.mixer, n)) for n in TRUNK_MATRICES[kind]]
        pairs += [
            (getattr(layer.ffn, n), getattr(layer_dense.ffn, n)) for n in ("shared_gate_up", "shared_down")
        ]
        for param, dense_param in pairs:
            qw, w = param.get_value(), dense_param.get_value()
            assert isinstance(qw, QuantizedWeights) and qw.shape == (1, *w.shape)
            np.testing.assert_array_equal(np.asarray(qw.dequantize()[0]), np.asarray(w))
        assert not isinstance(layer.ffn.router.get_value(), QuantizedWeights)  # F32 in the file
    assert not isinstance(kept.embed.get_value(), QuantizedWeights)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, K256.vocab_size, (2, 19)), jnp.int32)
    got = np.asarray(forward(kept, ids))
    assert_finite(got, "logits")
    assert np.abs(got - np.asarray(forward(dense, ids))).max() < 1e-4
    prompt = np.arange(3, 21) % K256.vocab_size
    tokens = [
        hybridlm.generate(hybridlm.LayerwiseRunner(m), prompt, max_new_tokens=5, chunk_size=8).tokens
        for m in (kept, dense)
    ]
    np.testing.assert_array_equal(np.asarray(tokens[0]), np.asarray(tokens[1]))
    again = tmp_path / "again.gguf"
    save_gguf(kept, again, tensor_type)
    reloaded = load_gguf(again, dtype=jnp.float32, progress=False)
    leaves = [jax.tree_util.tree_leaves(nnx.state(m)) for m in (reloaded, dense)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_quantized_head_of_a_float_file_stays_float(gguf_case, tmp_path):
    model, _, _, _ = gguf_case["qwen35moe_text"]
    path = tmp_path / "bf16.gguf"
    save_gguf(model, path, "bf16")
    kept = load_gguf(path, keep_quantized="experts+head", progress=False)
    assert kept.head_weight().dtype == jnp.bfloat16


def test_keep_quantized_names_its_choices(tmp_path):
    with pytest.raises(ValueError, match="experts\\+head.*all"):
        load_gguf(tmp_path / "absent.gguf", keep_quantized="head")


def test_use_more_bits_is_llama_quantize_rule():
    # llama.cpp's Q4_K_M ffn_down layers for 40 blocks (Qwen3.5/3.6-35B-A3B): 0-4, every third from 7, 35-39
    more = [i for i in range(40) if use_more_bits(i, 40)]
    assert more == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39]


@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_keep_quantized_k_m_mixes(k256_model, forward, tmp_path, mix):
    """Q4_K_M / Q5_K_M-like files: Q4_K / Q5_K experts, with Q6_K ffn_down in the layers of `use_more_bits`.
    Every expert stays quantized (Q5_K as int8 with offsets, the Q6_K downs as int8 with a float32 scale per
    16) with the file's exact weights."""
    path = tmp_path / f"k256-{mix}.gguf"
    save_gguf(k256_model, path, mix)
    header = read_header(path)
    layers = K256.num_layers
    base = T.Q4_K if mix == "q4_k_m" else T.Q5_K
    for i in range(layers):
        want = T.Q6_K if use_more_bits(i, layers) else base
        assert header.tensors[f"blk.{i}.ffn_down_exps.weight"].type == want
        assert header.tensors[f"blk.{i}.ffn_gate_exps.weight"].type == base
    assert header.tensors["output.weight"].type == T.Q6_K
    dense = load_gguf(path, dtype=jnp.float32, progress=False)
    kept = load_gguf(path, dtype=jnp.float32, keep_quantized="experts", progress=False)
    for i, (layer_kept, layer_dense) in enumerate(zip(kept.layers, dense.layers, strict=False)):
        for name in ("experts_gate_up", "experts_down"):
            qw = getattr(layer_kept.ffn, name).get_value()
            six = name == "experts_down" and use_more_bits(i, layers)
            kept_as = (8, 16, False) if six else (4, 32, True) if base == T.Q4_K else (8, 32, True)
            assert isinstance(qw, QuantizedWeights)
            assert (qw.bits, qw.block_size, qw.offsets is not None) == kept_as
            np.testing.assert_array_equal(
                np.asarray(qw.dequantize(jnp.float32)), np.asarray(getattr(layer_dense.ffn, name).get_value())
            )
    ids = jnp.asarray(np.random.default_rng(0).integers(0, K256.vocab_size, (2, 19)), jnp.int32)
    got = np.asarray(forward(kept, ids))
    assert_finite(got, "logits")
    assert np.abs(got - np.asarray(forward(dense, ids))).max() < 1e-4
    # against the model it was written from: Q4_K (Q5_K) / Q6_K error, bounded like the all-Q4_K file's
    assert np.abs(got - np.asarray(forward(k256_model, ids))).mean() < QUANT_MEAN_ABS_ERROR["q4_k"]


def test_keep_quantized_falls_back_for_other_types(gguf_case, tmp_path):
    """Experts in a type with no exact QuantizedWeights layout (here BF16) are dequantized."""
    model, _, _, _ = gguf_case["qwen35moe_text"]
    path = tmp_path / "bf16.gguf"
    save_gguf(model, path, "bf16")
    kept = load_gguf(path, keep_quantized="experts", progress=False)
    assert not isinstance(kept.layers[0].ffn.experts_gate_up.get_value(), QuantizedWeights)
    assert kept.layers[0].ffn.experts_gate_up.get_value().dtype == jnp.bfloat16


def test_unsupported_arch_and_type_are_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'llama'.*qwen35moe.*qwen35.*qwen3next"):
        hybridlm.load(tmp_path / "llama.gguf")
    with pytest.raises(ValueError, match="keep_quantized"):
        load_gguf(tmp_path / "llama.gguf", keep_quantized="everything")


def rewrite_f32_gguf(model, path, rewrite):
    """Writes `model` as F32 GGUF at `path` with every tensor passed through rewrite(name, data, all tensors),
    which returns (name, data) or None to drop it;
    the metadata is kept (as older converters' files differ)."""
    src = path.with_name(path.stem + ".src.gguf")
    save_gguf(model, src, "f32")
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(
            field.name,
            field.contents(),
            field.types[0],
            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None,
        )
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    for name, data in tensors.items():
        out = rewrite(name, data, tensors)
        if out is not None:
            writer.add_tensor(*out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_loader_accepts_fused_gate_up_experts(gguf_case, forward, tmp_path):
    """Files converted with the fuse option carry ffn_gate_up_exps
    [experts, 2*ffn, hidden] (gate rows first)."""
    model, ids, want, _ = gguf_case["qwen35moe_text"]

    def fuse(name, data, tensors):
        if name.endswith("ffn_up_exps.weight"):
            return None
        if name.endswith("ffn_gate_exps.weight"):
            up = tensors[name.replace("gate_exps", "up_exps")]
            return name.replace("gate_exps", "gate_up_exps"), np.concatenate([data, up], axis=1)
        return name, data

    rewrite_f32_gguf(model, tmp_path / "fused.gguf", fuse)
    got = np.asarray(forward(load_gguf(tmp_path / "fused.gguf", progress=False), ids))
    assert np.abs(got - want).max() <= F32_MAX_ABS_ERROR


def test_dense_qwen35_round_trip(forward, tmp_path):
    config = K256.replace(name="dense", moe=None, dense_ffn_dim=256, num_layers=4)
    model = hybridlm.init_random(config, seed=5)
    save_gguf(model, tmp_path / "dense.gguf", "f32")
    assert read_header(tmp_path / "dense.gguf").metadata["general.architecture"][1] == "qwen35"
    loaded = load_gguf(tmp_path / "dense.gguf", progress=False)
    assert loaded.config.moe is None and loaded.config.dense_ffn_dim == 256
    ids = jnp.asarray([[1, 5, 9, 200, 383]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(forward(loaded, ids)), np.asarray(forward(model, ids)))


# ----------------------------------------------------------------------------------------------------------
# the tokenizer stored in the file
# ----------------------------------------------------------------------------------------------------------
TOKENIZER_TEXTS = [
    (
        "Hello, world! <|im_start|>user\nCiao, come stai? 你好世界 🤖🎉 naïve café\t\t  x\r\n\r\n"
        "<think>ok</think><|im_end|>"
    ),
    "e\u0301 Å Å ﬁ",  # combining accent (NFC), angstrom sign vs letter, a ligature
    "   leading spaces and trailing   \n\n\n",
    "12345 3.14159 ١٢٣ ⅷ",
    "'s 'S 'LL don't I'M",
    "<|endoftext|><|vision_start|><tool_call>{}</tool_call>",
]


@pytest.fixture(scope="session")
def tiny_gguf_with_tokenizer(tmp_path_factory):
    """The `tiny` preset (full 248 320 vocabulary) written in Q8_0, which includes the tokenizer."""
    path = tmp_path_factory.mktemp("tok") / "tiny-q8_0.gguf"
    save_gguf(hybridlm.init_random(hybridlm.get_config("tiny"), seed=0), path, "q8_0")
    return path


def test_gguf_tokenizer_matches_qwen_tokenizer(tiny_gguf_with_tokenizer):
    from hybridlm.checkpoints.gguf import load_gguf_tokenizer
    from hybridlm.tokenizer import Tokenizer, default_prompt

    header = read_header(tiny_gguf_with_tokenizer)
    md = header.metadata
    assert md["tokenizer.ggml.model"][1] == "gpt2" and md["tokenizer.ggml.pre"][1] == "qwen35"
    assert len(md["tokenizer.ggml.tokens"][1][1]) == 248_320
    ours = load_gguf_tokenizer(tiny_gguf_with_tokenizer)
    ref = Tokenizer()
    assert ours.eos_token_id == ref.eos_token_id
    for text in [default_prompt()] + TOKENIZER_TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text[:40]
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.encode(text, allow_special=False) == ref.encode(text, allow_special=False), text[:40]


def test_cli_prefills_a_gguf_file_with_its_tokenizer(tiny_gguf_with_tokenizer, capsys):
    import json

    from hybridlm import cli
    from hybridlm.checkpoints.gguf import load_gguf_tokenizer

    text = "Alice was beginning to get very tired of sitting by her sister on the bank."
    assert (
        cli.main(
            [
                "prefill",
                "--model",
                str(tiny_gguf_with_tokenizer),
                "--prompt",
                text,
                "--chunk-size",
                "16",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["prompt_tokens"] == len(load_gguf_tokenizer(tiny_gguf_with_tokenizer).encode(text))
    assert report["next_token"]["id"] < 248_320


def test_gguf_without_tokenizer_and_small_vocab(gguf_case, tmp_path):
    from hybridlm.checkpoints.gguf import load_gguf_tokenizer

    model, _, _, _ = gguf_case["qwen35moe_text"]  # vocab 384: no tokenizer is written
    save_gguf(model, tmp_path / "m.gguf", "f32")
    assert load_gguf_tokenizer(tmp_path / "m.gguf") is None


def test_loader_accepts_legacy_qwen3next_ssm_in(gguf_case, forward, tmp_path):
    """Older Qwen3-Next GGUFs carry the fused, per-k-head grouped `ssm_in` (qkvz)
    instead of attn_qkv + attn_gate."""
    model, ids, want, _ = gguf_case["qwen3next"]
    g = model.config.gdn
    r = g.num_v_heads // g.num_k_heads

    def to_ssm_in(name, data, tensors):
        if name.endswith("attn_gate.weight") and "attn_qkv" not in name:
            return None
        if name.endswith("attn_qkv.weight"):
            z = tensors[name.replace("attn_qkv", "attn_gate")]  # [v_heads*value_dim, hidden]
            kd = g.num_k_heads * g.key_dim
            per_k = lambda x, rows: x.reshape(g.num_k_heads, rows, -1)
            grouped = np.concatenate(
                [
                    per_k(data[:kd], g.key_dim),
                    per_k(data[kd : 2 * kd], g.key_dim),
                    per_k(data[2 * kd :], r * g.value_dim),
                    per_k(z, r * g.value_dim),
                ],
                axis=1,
            )
            return name.replace("attn_qkv", "ssm_in"), grouped.reshape(-1, data.shape[-1])
        return name, data

    rewrite_f32_gguf(model, tmp_path / "legacy.gguf", to_ssm_in)
    assert "blk.0.ssm_in.weight" in read_header(tmp_path / "legacy.gguf").tensors
    got = np.asarray(forward(load_gguf(tmp_path / "legacy.gguf", progress=False), ids))
    assert np.abs(got - want).max() <= F32_MAX_ABS_ERROR

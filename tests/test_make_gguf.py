"""`python -m benchmarks make-gguf`: random-weight GGUF files that read, load and run like `save_gguf`'s."""

import argparse
import json
import subprocess
import sys
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf.constants import GGMLQuantizationType as T
from support import K256, assert_finite

import hybridlm
from benchmarks import make_gguf
from hybridlm.checkpoints.gguf import load_gguf_tokenizer, save_gguf
from hybridlm.config import PRESETS, AttentionConfig, GatedDeltaNetConfig, MoEConfig
from hybridlm.loading import load_mtp
from hybridlm.mtp import draft_step, init_random_mtp
from pallas_kernels.quantized import QuantizedWeights

PROMPT = [[1, 17, 42, 7, 300, 5, 99, 250]]
# Relative tolerance on a tensor's standard deviation: 0.1 for large tensors, wider for small ones, whose few
# blocks sample few of the random block scales (d spread over a factor 1.5, Q6_K sub-scales over 4x).
STD_RTOL = 0.1
# Rows of 64 / 48 / 32 elements, where Q4_K falls back to Q5_0 and Q8_0 to F16, in the qwen3next layout.
SMALL_ROWS = K256.replace(
    num_layers=2,
    hidden_dim=64,
    attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32),
    gdn=GatedDeltaNetConfig(num_k_heads=2, num_v_heads=4, key_dim=16, value_dim=16),
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=48, shared_ffn_dim=32),
)
K256_MTP = K256.replace(num_layers=2, mtp_layers=1)  # the MTP block is block 2
# llama.cpp's nextn tensors of one MTP block (docs/mtp.md §3): its own four and a full-attention layer's.
MTP_BLOCK = {
    f"nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")
} | {
    f"{n}.weight"
    for n in (
        "attn_norm", "post_attention_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
        "attn_k_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
        "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp",
    )
}  # fmt: skip


def _tensors(path) -> dict[str, tuple[tuple[int, ...], T]]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GGUFReader warns on a malformed file
        reader = gguf.GGUFReader(path)
    return {t.name: (tuple(int(x) for x in t.shape), T(t.tensor_type)) for t in reader.tensors}


def _metadata(path) -> dict:
    """The key-value pairs, less the description (ours says the weights are random) and the reader's own."""
    fields = gguf.GGUFReader(path).fields
    skip = ("general.description", "GGUF.")
    return {k: f.contents() for k, f in fields.items() if not k.startswith(skip)}


@pytest.fixture(scope="module")
def k256_file(tmp_path_factory):
    """K256 (every row a multiple of 256) with Q4_K experts and a Q8_0 trunk, as the CLI writes by default."""
    path = tmp_path_factory.mktemp("make_gguf") / "k256.gguf"
    make_gguf.write_random_gguf(path, K256, seed=3, threads=2, progress=False)
    return path


@pytest.mark.parametrize("tensor_type", ["q4_k", "q8_0", "q4_k_m", "f16"])
def test_header_matches_save_gguf(tmp_path, tensor_type):
    """Same tensor names, ne and types, and the same metadata, as save_gguf writes for the same config and
    type (experts and trunk both `tensor_type`)."""
    config = K256.replace(num_layers=2)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    make_gguf.write_random_gguf(ours, config, experts=tensor_type, trunk=tensor_type, progress=False)
    save_gguf(hybridlm.init_random(config, seed=0), theirs, tensor_type)
    assert _tensors(ours) == _tensors(theirs)
    assert _metadata(ours) == _metadata(theirs)


@pytest.mark.parametrize("tensor_type", ["q4_k", "q4_k_m"])
def test_mtp_block_header_matches_save_gguf(tmp_path, tensor_type):
    """A config with mtp_layers: the MTP block's tensors, types and the block_count / nextn_predict_layers
    keys as save_gguf(..., mtp=...) writes them (q4_k_m: the MTP block is a last-eighth layer, Q6_K down)."""
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    make_gguf.write_random_gguf(ours, K256_MTP, experts=tensor_type, trunk=tensor_type, progress=False)
    model = hybridlm.init_random(K256_MTP, seed=0)
    save_gguf(model, theirs, tensor_type, mtp=init_random_mtp(K256_MTP, seed=1))
    got = _tensors(ours)
    assert got == _tensors(theirs)
    assert {n[len("blk.2.") :] for n in got if n.startswith("blk.2.")} == MTP_BLOCK
    metadata = _metadata(ours)
    assert metadata == _metadata(theirs)
    assert metadata["qwen35moe.block_count"] == 3 and metadata["qwen35moe.nextn_predict_layers"] == 1


def test_header_matches_save_gguf_with_fallbacks(tmp_path):
    """SMALL_ROWS: the fallback types, as save_gguf picks them."""
    config = SMALL_ROWS
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    make_gguf.write_random_gguf(ours, config, experts="q4_k", trunk="q4_k", progress=False)
    save_gguf(hybridlm.init_random(config, seed=0), theirs, "q4_k")
    got = _tensors(ours)
    assert got == _tensors(theirs)
    assert {qtype for _, qtype in got.values()} >= {T.Q5_0, T.F16, T.F32}
    assert _metadata(ours) == _metadata(theirs)


def test_types_follow_experts_and_trunk(k256_file):
    tensors = _tensors(k256_file)
    for name, (_, qtype) in tensors.items():
        if name.endswith("_exps.weight"):
            assert qtype == T.Q4_K, name
        elif qtype != T.F32:
            assert qtype == T.Q8_0, name
    assert tensors["token_embd.weight"][1] == T.Q8_0 and tensors["blk.0.ssm_a"][1] == T.F32


@pytest.mark.parametrize(
    "config, experts, trunk, stored",
    [
        (K256, "q4_k", "q8_0", {T.Q4_K, T.Q8_0}),
        (K256.replace(num_layers=2), "q6_k", "bf16", {T.Q6_K, T.BF16}),
        (SMALL_ROWS, "q4_k", "f16", {T.Q5_0, T.F16}),  # Q4_K falls back to Q5_0 and F16
        (K256_MTP, "q4_k", "q8_0", {T.Q4_K, T.Q8_0}),  # the MTP block's tensors by the same rules
    ],
    ids=["q4_k-q8_0", "q6_k-bf16", "fallbacks", "mtp"],
)
def test_values_have_the_intended_spread(tmp_path, config, experts, trunk, stored):
    """Matrices: mean ~0, std ~1/sqrt(fan_in) (router 2/sqrt, embedding 1); F32 tensors as save_gguf writes an
    init_random model's (norms ~1 + 0.1 N, ssm_a in [-16, -1], dt bias in [-2, 1])."""
    path = tmp_path / "f.gguf"
    make_gguf.write_random_gguf(path, config, experts=experts, trunk=trunk, seed=1, progress=False)
    specs = {s.name: s for s in make_gguf.tensor_specs(config, experts, trunk)}
    types = set()
    for t in gguf.GGUFReader(path).tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert_finite(x, t.name)
        spec, n = specs[t.name], x.size
        types.add(T(t.tensor_type))
        if t.name.endswith("ssm_a"):
            assert (x <= -1).all() and (x >= -16).all(), t.name
        elif t.name.endswith("ssm_dt.bias"):
            assert (x >= -2).all() and (x <= 1).all(), t.name
        elif spec.role in ("scale", "q_norm", "k_norm", "output_norm"):
            assert abs(x.mean() - 1) < 0.05 + 0.3 / np.sqrt(n) and 0.05 < x.std() < 0.15, t.name
        else:
            assert abs(x.std() / spec.std - 1) < STD_RTOL + 4 / np.sqrt(n), (t.name, x.std(), spec.std)
            assert abs(x.mean()) < (0.1 + 3 / np.sqrt(n)) * spec.std, (t.name, x.mean())
    assert types == {T.F32} | stored


@pytest.mark.parametrize("keep", ["experts", None])
def test_loads_and_runs_finite(k256_file, forward, keep):
    model = hybridlm.load(k256_file, keep_quantized=keep, dtype=jnp.float32, progress=False)
    assert model.config.replace(name=K256.name) == K256
    experts = model.layers[0].ffn.experts_gate_up.get_value()
    assert isinstance(experts, QuantizedWeights) == (keep == "experts")
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert_finite(leaf, jax.tree_util.keystr(path))
    logits = np.asarray(forward(model, jnp.asarray(PROMPT)))
    assert_finite(logits, "logits")
    assert 0.1 < logits.std() < 10


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    """K256_MTP as the CLI writes it by default (Q4_K experts, Q8_0 trunk), with its MTP block."""
    path = tmp_path_factory.mktemp("make_gguf") / "k256-mtp.gguf"
    make_gguf.write_random_gguf(path, K256_MTP, seed=4, threads=2, progress=False)
    return path


def test_mtp_block_loads_beside_the_trunk(mtp_file, forward):
    """The trunk loads as before (the nextn block skipped); `load_mtp` reads the MTP block with Q4_K experts
    kept or dequantized, and both draft finite and alike."""
    tensors = _tensors(mtp_file)
    for name in MTP_BLOCK:
        qtype = tensors[f"blk.2.{name}"][1]
        assert qtype == (T.Q4_K if "_exps" in name else T.F32 if "norm" in name or "inp" in name else T.Q8_0)
    model = hybridlm.load(mtp_file, keep_quantized="experts", dtype=jnp.float32, progress=False)
    assert model.config.replace(name=K256_MTP.name) == K256_MTP and len(model.layers) == 2
    assert_finite(forward(model, jnp.asarray(PROMPT)), "logits")
    kept = load_mtp(mtp_file, dtype=jnp.float32, keep_quantized="experts")
    dense = load_mtp(mtp_file, dtype=jnp.float32)
    assert isinstance(kept.layers[0].ffn.experts_down.get_value(), QuantizedWeights)
    assert dense.fc[...].shape == (2 * K256.hidden_dim, K256.hidden_dim)
    ids = jnp.asarray(PROMPT)
    hidden = jax.random.normal(jax.random.key(0), (*ids.shape, K256.hidden_dim))
    _, want, _ = draft_step(dense, model, ids, hidden)
    _, got, _ = draft_step(kept, model, ids, hidden)
    assert_finite(got, "draft logits")
    assert 0.1 < float(jnp.std(got)) < 10
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("no_mtp", [False, True])
def test_cli_run_writes_the_presets_mtp_unless_told_not_to(tmp_path, monkeypatch, no_mtp):
    """`run` on a preset with mtp_layers: the MTP block by default, none with --no-mtp."""
    monkeypatch.setitem(PRESETS, "k256-mtp", K256_MTP)
    parser = argparse.ArgumentParser()
    make_gguf.add_arguments(parser)
    path = tmp_path / "f.gguf"
    argv = ["--preset", "k256-mtp", "--out", str(path), "--no-progress", "--threads", "2"]
    record = make_gguf.run(parser.parse_args(argv + ["--no-mtp"] * no_mtp))
    assert record["mtp_layers"] == (0 if no_mtp else 1)
    assert record["tensors"] == len(_tensors(path))
    assert any(".nextn." in n for n in _tensors(path)) != no_mtp
    assert hybridlm.load(path, progress=False).config.mtp_layers == record["mtp_layers"]


def test_35b_preset_has_its_mtp_block():
    """The full-size preset's file carries the one nextn block of the released Qwen3.5/3.6-35B-A3B GGUFs."""
    specs = {s.name: s for s in make_gguf.tensor_specs(PRESETS["qwen3.6-35b-a3b"])}
    assert {n[len("blk.40.") :] for n in specs if n.startswith("blk.40.")} == MTP_BLOCK
    assert specs["blk.40.nextn.eh_proj.weight"].shape == (2048, 4096)
    assert specs["blk.40.ffn_down_exps.weight"].shape == (256, 2048, 512)
    assert specs["blk.40.ffn_down_exps.weight"].qtype == T.Q4_K
    assert not any(n.startswith("blk.41.") for n in specs)
    assert not any(".nextn." in s.name for s in make_gguf.tensor_specs(PRESETS["qwen3-next-80b-a3b"]))


def test_same_seed_same_bytes(tmp_path):
    config = K256.replace(num_layers=1)
    paths = [tmp_path / f"{i}.gguf" for i in range(3)]
    for path, seed, threads in zip(paths, (5, 5, 6), (1, 3, 2), strict=True):
        make_gguf.write_random_gguf(path, config, seed=seed, threads=threads, progress=False)
    assert paths[0].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()


def test_cli_tiny_preset_with_tokenizer(tmp_path, forward):
    """The real CLI on the tiny preset (Qwen3.5 vocabulary, so the tokenizer is written; hidden 64, so Q4_K
    experts fall back to Q5_0): one JSON line, a file that loads with its tokenizer and runs finite."""
    path = tmp_path / "tiny.gguf"
    argv = ["make-gguf", "--preset", "tiny", "--layers", "2", "--out", str(path), "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["figures"]["file_bytes"] == path.stat().st_size and record["layers"] == 2
    model = hybridlm.load(path, keep_quantized="experts", progress=False)
    assert model.config.num_layers == 2
    tok = load_gguf_tokenizer(path)
    ids = tok.encode("Hello, world")
    assert tok.decode(ids) == "Hello, world"
    assert_finite(forward(model, jnp.asarray([ids])), "logits")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nope"], "invalid choice"),
        (["--preset", "tiny", "--layers", "0"], "at least 1"),
        (["--preset", "tiny", "--seed", "-1"], "at least 0"),
        (["--preset", "tiny", "--experts", "q3_k"], "invalid choice"),
        (["--preset", "tiny", "--out", "/no/such/dir/f.gguf"], "does not exist"),
    ],
)
def test_cli_rejects_bad_input(tmp_path, argv, message):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "f.gguf")]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "make-gguf", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

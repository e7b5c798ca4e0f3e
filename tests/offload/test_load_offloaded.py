"""`load_offloaded`: a GGUF file's or HF directory's experts packed into pinned host memory as they load,
giving the logits of the model loaded whole; its errors; the CLI's use of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offload_helpers import assert_finite
from support import FIXTURES, K256

import hybridlm
from hybridlm import cli
from hybridlm.checkpoints.gguf import use_more_bits
from hybridlm.offload import ExpertLayout, HostExperts, OffloadConfig, OffloadedRunner, load_offloaded
from hybridlm.offload.host import host_experts_of_layers
from pallas_kernels.q4_k import Q4KExperts
from pallas_kernels.quantized import QuantizedWeights, quantize_like


@pytest.fixture(scope="module")
def q8_gguf(tiny, tmp_path_factory):
    """The tiny model written as a Q8_0 GGUF file (its experts kept as 8-bit `QuantizedWeights` on
    loading)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    hybridlm.save_gguf(tiny, path, "q8_0")
    return path


def test_experts_go_to_host_memory_and_give_the_whole_models_logits(q8_gguf, prompts):
    whole = hybridlm.load(q8_gguf, keep_quantized="experts", dtype=jnp.float32, progress=False)
    model, host = load_offloaded(q8_gguf, dtype=jnp.float32, progress=False, parts=2)
    assert isinstance(whole.layers[0].ffn.experts_gate_up.get_value(), QuantizedWeights)
    for layer in model.layers:  # placeholders only: no expert weights on the device
        assert (
            layer.ffn.experts_gate_up.get_value().size == 1 and layer.ffn.experts_down.get_value().size == 1
        )
    assert (
        host.num_layers == whole.config.num_layers and [len(p) for p in host.layers] == [2] * host.num_layers
    )
    assert {buf.sharding.memory_kind for parts in host.layers for buf in parts} == {"pinned_host"}
    ffn = whole.layers[0].ffn
    assert host.layout == ExpertLayout.of(ffn.experts_gate_up.get_value(), ffn.experts_down.get_value())
    for i in (0, whole.config.num_layers - 1):  # the packed bytes unpack to the loaded experts, bit for bit
        ffn = whole.layers[i].ffn
        want = jax.tree_util.tree_leaves((ffn.experts_gate_up.get_value(), ffn.experts_down.get_value()))
        for got, w in zip(jax.tree_util.tree_leaves(host.unpack_layer(i)), want, strict=False):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    eb = host.layout.nbytes
    runner = OffloadedRunner(
        model, OffloadConfig(expert_budget=3 * host.num_experts * eb, cache_policy="lru"), host_experts=host
    )
    ids = prompts["short"]
    got = hybridlm.prefill(runner, ids, chunk_size=16).logits
    want = hybridlm.prefill(hybridlm.LayerwiseRunner(whole), ids, chunk_size=16).logits
    assert_finite(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_load_offloaded_errors(tmp_path, host_experts):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_offloaded(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_offloaded(tmp_path)  # a directory without a checkpoint
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="is neither a checkpoint directory nor a GGUF file"):
        load_offloaded(not_gguf)
    with pytest.raises(ValueError, match="unknown expert_format 'int3'"):
        load_offloaded(FIXTURES / "hf" / "qwen35moe_text", expert_format="int3")
    layout, parts = host_experts.layout, host_experts.layers[0]
    other = ExpertLayout.of(np.zeros((16, 2, 2), np.float32), np.zeros((16, 2, 2), np.float32))
    with pytest.raises(ValueError, match="no experts were loaded for layers \\[1\\]"):
        host_experts_of_layers({0: (layout, parts)}, 2)
    with pytest.raises(
        ValueError,
        match=r"2 formats \(layers \[0\]: gate_up .*; "
        r"layers \[1\]: gate_up float32\[2, 2\], down float32\[2, 2\], 32 B an expert",
    ):
        host_experts_of_layers({0: (layout, parts), 1: (other, parts)}, 2, "refuse")
    with pytest.raises(ValueError, match="weights of different shapes"):
        host_experts_of_layers({0: (layout, parts), 1: (other, parts)}, 2)
    with pytest.raises(ValueError, match="unknown mixed='exact'"):
        host_experts_of_layers({0: (layout, parts), 1: (layout, parts)}, 2, "exact")
    assert isinstance(host_experts_of_layers({0: (layout, parts), 1: (layout, parts)}, 2), HostExperts)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """mixed_gguf(mix): a Q4_K_M- or Q5_K_M-like file of K256: Q4_K / Q5_K experts, Q6_K downs in layers 2 and
    3 (kept as 8-bit with 16-element blocks)."""
    files = {}

    def get(mix):
        if mix not in files:
            files[mix] = tmp_path_factory.mktemp("gguf") / f"k256-{mix}.gguf"
            hybridlm.save_gguf(hybridlm.init_random(K256, seed=3), files[mix], mix)
        return files[mix]

    assert [use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]
    return get


@pytest.fixture(scope="module")
def q4_k_m_gguf(mixed_gguf):
    return mixed_gguf("q4_k_m")


def _offloaded_vs_whole(model, host, whole):
    runner = OffloadedRunner(
        model,
        OffloadConfig(expert_budget=2 * host.num_experts * host.layout.nbytes, cache_policy="lru"),
        host_experts=host,
    )
    ids = np.arange(1, 30) % K256.vocab_size
    got = hybridlm.prefill(runner, ids, chunk_size=8).logits
    want = hybridlm.prefill(hybridlm.LayerwiseRunner(whole), ids, chunk_size=8).logits
    assert_finite(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_q4_k_experts_stay_the_files_blocks_in_host_memory(mixed_gguf):
    """A file whose experts are all Q4_K keeps them in pinned host memory as its own blocks (144 bytes a
    256 weights: 4.5 bits a weight), unpacked on the device into exactly the weights of the model loaded
    whole; the offloaded logits are the whole model's and the copies count the compact bytes."""
    path = mixed_gguf("q4_k")
    model, host = load_offloaded(path, dtype=jnp.float32, progress=False, parts=2)
    whole = hybridlm.load(path, keep_quantized="experts", dtype=jnp.float32, progress=False)
    moe, hidden = K256.moe, K256.hidden_dim
    weights = 3 * moe.expert_ffn_dim * hidden
    assert host.layout.q4_k == (hidden, moe.expert_ffn_dim)
    assert (
        host.layout.nbytes == weights * 144 // 256 and host.nbytes == 4 * moe.num_experts * host.layout.nbytes
    )
    assert host.layout.device_nbytes == weights * 3 // 4  # unpacked: 4-bit codes, float32 scale+offset per 32
    for i in range(K256.num_layers):
        ffn = whole.layers[i].ffn
        want = jax.tree_util.tree_leaves((ffn.experts_gate_up.get_value(), ffn.experts_down.get_value()))
        for got, w in zip(jax.tree_util.tree_leaves(host.unpack_layer(i)), want, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    _offloaded_vs_whole(model, host, whole)
    runner = OffloadedRunner(
        model,
        OffloadConfig(expert_budget=2 * host.num_experts * host.layout.device_nbytes),
        host_experts=host,
    )
    hybridlm.prefill(runner, np.arange(1, 30) % K256.vocab_size, chunk_size=8)
    pool = runner.stats()["pool"]
    # a pool slot keeps the file's blocks too (`PackedExperts`): a budget holds a third more experts
    assert pool["host_expert_bytes"] == pool["expert_bytes"] == host.layout.nbytes
    assert "Q4_K blocks" in pool["expert_format"]
    assert runner.stats()["prefill"]["bytes_h2d"] % host.layout.nbytes == 0
    # decode pages single experts from the compact host bytes: the same greedy tokens as the whole model
    ids = np.arange(1, 12) % K256.vocab_size
    got = hybridlm.generate(runner, ids, max_new_tokens=4, chunk_size=8).tokens
    want = hybridlm.generate(hybridlm.LayerwiseRunner(whole), ids, max_new_tokens=4, chunk_size=8).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("parts", [1, 2])
def test_q4_k_decode_copies_are_read_in_place(mixed_gguf, parts):
    """A decode step's experts of Q4_K blocks reach the grouped matmul as `Q4KExperts` where they lie: a held
    layer's rows and the pool itself (each copy naming its row or slot), the copies from host memory (and a
    MIXED layer's pool rows among them) as they arrive; each copy's rows are its own expert's weights."""
    from hybridlm.offload import decode
    from hybridlm.offload.expert_cache import PackedExperts

    path = mixed_gguf("q4_k")
    _, host = load_offloaded(path, dtype=jnp.float32, progress=False, parts=parts)
    layout, layer, num_experts = host.layout, 1, host.num_experts
    assert layout.all_q4_k
    held = host.packed_layer(layer)  # [experts, nbytes] in expert order
    pool = PackedExperts(layout, held.data[::-1])  # slot s holds expert E-1-s
    ids = jnp.asarray([2, 0, 3, 1, 2, 3], jnp.int32)  # two tokens' copies: repeats across tokens
    want = jax.tree_util.tree_leaves(held.take(ids).unpack())
    page = jax.jit(decode.page_experts, static_argnums=(0, 1, 2))
    in_pool = num_experts - 1 - jnp.arange(num_experts, dtype=jnp.int32)
    mixed = jnp.where(jnp.arange(num_experts) % 2 == 1, in_pool, -1)
    for source, slot_row in (
        (decode.HELD, in_pool),
        (decode.IN_POOL, in_pool),
        (decode.MIXED, mixed),
        (decode.IN_HOST, jnp.full((num_experts,), -1, jnp.int32)),
    ):
        experts, local, hits = page(
            layout, tuple(host.part_start), source, held, tuple(host.layers[layer]), pool, slot_row, ids
        )
        assert all(isinstance(e, Q4KExperts) for e in experts), source
        if source == decode.IN_POOL:  # the pool itself, each copy naming its slot
            assert experts[0].data.shape == pool.data.shape
            np.testing.assert_array_equal(np.asarray(local), np.asarray(in_pool[ids]))
        got = [leaf for e in experts for leaf in jax.tree_util.tree_leaves(e.take(local).to_quantized())]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=source)
        assert int(hits) == int(jnp.sum(slot_row[ids] >= 0)) or source == decode.HELD


def _q4_k_runners(mixed_gguf, *, parts: int, policy: str):
    """(an offloaded runner of the Q4_K file with a pool of 3 experts' worth a layer, the resident runner of
    the same file)."""
    path = mixed_gguf("q4_k")
    model, host = load_offloaded(path, dtype=jnp.float32, progress=False, parts=parts)
    whole = hybridlm.load(path, keep_quantized="experts", dtype=jnp.float32, progress=False)
    config = OffloadConfig(expert_budget=3 * host.num_experts * host.layout.nbytes, cache_policy=policy)
    return OffloadedRunner(model, config, host_experts=host), hybridlm.LayerwiseRunner(whole)


def test_q4_k_offloaded_decode_gives_the_whole_models_logits(mixed_gguf):
    """Offloaded decode of a Q4_K file (experts read in place from held layers, the pool and host memory):
    the logits of the model loaded whole at every step."""
    from offload_helpers import assert_decode_matches

    from hybridlm.offload import decode

    runner, whole = _q4_k_runners(mixed_gguf, parts=1, policy="static")
    ids = np.arange(3, 40) % K256.vocab_size
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=3)
    ref = hybridlm.prefill(whole, ids, chunk_size=16, max_new_tokens=3)
    assert_decode_matches(runner, whole, pre, ref, len(ids), 3, exact=False, atol=1e-4)
    assert set(runner.paged_view.sources) == {decode.IN_POOL, decode.IN_HOST}


def test_q4_k_offloaded_verify_gives_the_whole_models_hidden_states(mixed_gguf):
    """A speculative verify of several tokens on the offloaded Q4_K model (each distinct expert of a host
    layer's copies fetched once, then read in place with the pool's) gives the whole model's hidden states."""
    from hybridlm.offload import decode

    runner, whole = _q4_k_runners(mixed_gguf, parts=2, policy="lru")
    ids = np.arange(5, 30) % K256.vocab_size
    tokens = jnp.asarray([[7, 3, 7, 11, 2]], jnp.int32)  # five tokens x top-2 over 4 experts: repeats
    hidden = []
    for r in (runner, whole):
        states = hybridlm.prefill(r, ids, chunk_size=16, max_new_tokens=8).states
        target, args = r.speculative_target()
        verify = jax.jit(lambda a, s, t, target=target: target.bind(a).verify(s, t, np.int32(len(ids)))[0])
        hidden.append(np.asarray(verify(args, states, tokens)))
    assert_finite(hidden[0])
    np.testing.assert_allclose(hidden[0], hidden[1], atol=1e-4, rtol=1e-4)
    assert {decode.IN_POOL, decode.IN_HOST} <= set(runner.paged_view.sources)


@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_mixed_formats_widened_exactly(mixed_gguf, mix):
    """By default the layers' two formats are widened into one that holds both (downs: int8 with a float32
    scale and offset per 16): the host bytes unpack to the file's weights bit for bit, and the offloaded
    logits are the whole model's."""
    path = mixed_gguf(mix)
    model, host = load_offloaded(path, dtype=jnp.float32, progress=False)
    whole = hybridlm.load(path, keep_quantized="experts", dtype=jnp.float32, progress=False)
    assert [whole.layers[i].ffn.experts_down.get_value().block_size for i in range(4)] == [32, 32, 16, 16]
    for i in range(4):
        ffn = whole.layers[i].ffn
        gate_up, down = host.unpack_layer(i)
        assert (down.bits, down.block_size, down.offsets is not None) == (8, 16, True)
        for got, w in ((gate_up, ffn.experts_gate_up.get_value()), (down, ffn.experts_down.get_value())):
            np.testing.assert_array_equal(
                np.asarray(got.dequantize(jnp.float32)), np.asarray(w.dequantize(jnp.float32))
            )
    _offloaded_vs_whole(model, host, whole)
    # the runner built from the model loaded whole widens the same way (and names the format in its stats)
    runner = OffloadedRunner(whole, OffloadConfig(expert_budget=2 * host.num_experts * host.layout.nbytes))
    gate_up = (
        "4-bit (float32 scales per 32)" if mix == "q4_k_m" else "8-bit (float32 scales and offsets per 32)"
    )
    assert runner.host.layout == host.layout and runner.stats()["pool"]["expert_format"].startswith(
        f"gate_up {gate_up}, down 8-bit (float32 scales and offsets per 16)"
    )


def test_mixed_formats_refused_or_requantized_into_the_smallest(q4_k_m_gguf, capsys):
    """mixed_formats="refuse" names the layers and formats; "smallest" requantizes the Q6_K downs into the
    others' 4-bit format, and the offloaded logits equal the model loaded whole with the same downs
    requantized."""
    path = q4_k_m_gguf
    with pytest.raises(
        ValueError,
        match=r"2 formats \(layers \[0, 1\]: gate_up 4-bit \(float32 scales per 32\), "
        r"down 4-bit .*; layers \[2, 3\]: .*down 8-bit \(float32 scales per 16\).*"
        r"mixed='smallest'",
    ):
        load_offloaded(path, dtype=jnp.float32, progress=False, mixed_formats="refuse")
    with pytest.raises(ValueError, match="unknown mixed_formats='exact'"):
        load_offloaded(path, mixed_formats="exact")
    model, host = load_offloaded(path, dtype=jnp.float32, progress=False, mixed_formats="smallest")
    whole = hybridlm.load(path, keep_quantized="experts", dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match=r"2 formats .*mixed='widen'"):
        OffloadedRunner(
            whole, OffloadConfig(expert_budget="1MiB", mixed_formats="refuse")
        )  # the model loaded whole
    template = whole.layers[0].ffn.experts_down.get_value()
    for i in (2, 3):
        ffn = whole.layers[i].ffn
        ffn.experts_down.set_value(quantize_like(ffn.experts_down.get_value(), template))
    ffn = whole.layers[3].ffn
    assert host.layout == ExpertLayout.of(ffn.experts_gate_up.get_value(), ffn.experts_down.get_value())
    _offloaded_vs_whole(model, host, whole)
    args = ["prefill", "--model", str(path), "--prompt", "x", "--expert-budget", "1MiB"]
    assert cli.main(args + ["--mixed-formats", "refuse"]) == 2
    assert "mixed='widen'" in capsys.readouterr().err
    assert cli.main(args) == 0  # "x" is one token id below the 384 of K256
    assert "down 8-bit (float32 scales and offsets per 16)" in capsys.readouterr().out


def test_gguf_refuses_expert_format(q8_gguf):
    with pytest.raises(ValueError, match="expert_format='int4' applies to HF checkpoint directories"):
        load_offloaded(q8_gguf, expert_format="int4")
    with pytest.raises(ValueError, match="expert_format='int4' applies to HF checkpoint directories"):
        hybridlm.load(q8_gguf, expert_format="int4")


@pytest.mark.parametrize("expert_format", [None, "int8"])
def test_hf_directory_experts_quantized_into_host_memory(expert_format):
    """An HF checkpoint directory: each layer's experts quantized as they load (or kept in dtype) and packed
    into host memory; the offloaded logits are the model's loaded whole with the same `expert_format`."""
    path = FIXTURES / "hf" / "qwen35moe_text"
    whole = hybridlm.load(path, dtype=jnp.float32, expert_format=expert_format, progress=False)
    model, host = load_offloaded(path, dtype=jnp.float32, expert_format=expert_format, progress=False)
    assert isinstance(whole.layers[0].ffn.experts_down.get_value(), QuantizedWeights) == (
        expert_format == "int8"
    )
    assert all(layer.ffn.experts_down.get_value().size == 1 for layer in model.layers)
    ids = np.arange(1, 40) % whole.config.vocab_size
    runner = OffloadedRunner(
        model,
        OffloadConfig(expert_budget=2 * host.num_experts * host.layout.nbytes, cache_policy="lru"),
        host_experts=host,
    )
    got = hybridlm.prefill(runner, ids, chunk_size=8).logits
    want = hybridlm.prefill(hybridlm.LayerwiseRunner(whole), ids, chunk_size=8).logits
    assert_finite(got)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_cli_loads_a_gguf_files_experts_into_host_memory(q8_gguf, capsys):
    """`hybridlm generate --model F.gguf --expert-budget B` loads the experts straight into host memory (4-bit
    and 8-bit ones kept) and generates what the model loaded whole does."""
    args = [
        "generate",
        "--model",
        str(q8_gguf),
        "--prompt",
        "Experts load into host memory.",
        "--chunk-size",
        "16",
        "--max-new-tokens",
        "3",
        "--dtype",
        "float32",
    ]
    assert cli.main(args) == 0
    whole = [line for line in capsys.readouterr().out.splitlines() if line.startswith("generated")]
    assert cli.main(args + ["--expert-budget", "1MiB", "--host-parts", "1"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("generated")] == whole
    assert "1 host buffer(s) a layer" in out
    assert cli.main(args + ["--expert-format", "int4"]) == 2
    assert "--expert-format applies to HF checkpoint directories" in capsys.readouterr().err

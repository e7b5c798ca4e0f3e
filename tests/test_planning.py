"""`hybridlm.planning`: the memory estimate against the bytes the model and engine really allocate, the
refusal, the chunk-size cost model against the offload runner's own counts and the issue's measured cases,
and the CLI's `--dry-run` and pre-check."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import K256, assert_finite

import hybridlm
from hybridlm import planning
from hybridlm.cli import main
from hybridlm.engine import phases
from hybridlm.engine.phases import flat_layer
from hybridlm.engine.prefill import cache_capacity
from hybridlm.model import EXPERT_PARAMS, HybridLM
from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner, load_offloaded
from hybridlm.offload.config import host_parts_for, tuned_default
from hybridlm.state import init_layer_states, state_nbytes

TINY = hybridlm.get_config("tiny")
BIG = hybridlm.get_config("qwen3.5-35b-a3b")
GIB = 2**30


def _weight_bytes(model) -> tuple[int, int]:
    """(trunk, routed experts) bytes of a model's state."""
    trunk = experts = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        leaves = jax.tree_util.tree_leaves(var.get_value())
        nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
        if path[-1] in EXPERT_PARAMS:
            experts += nbytes
        else:
            trunk += nbytes
    return trunk, experts


@pytest.mark.parametrize(
    "dtype, expert_format",
    [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, "int8"), (jnp.bfloat16, "int4")],
    ids=["f32", "bf16", "f32-int8", "bf16-int4"],
)
def test_weight_bytes_are_the_models(dtype, expert_format):
    config = TINY.replace(vocab_size=1024)
    model = hybridlm.init_random(config, dtype=dtype, expert_format=expert_format)
    trunk, experts = _weight_bytes(model)
    name = expert_format or jnp.dtype(dtype).name
    est = planning.estimate_memory(
        config, prompt_tokens=100, chunk_size=64, expert_format=name, trunk_dtype=dtype
    )
    assert est.components["trunk weights"].nbytes == trunk == planning.trunk_bytes(config, dtype)
    assert est.components["routed experts"].nbytes == experts
    assert planning.expert_bytes(config, name) * config.moe.num_experts * config.num_layers == experts


def test_experts_split_over_devices_count_their_share_on_each():
    kw = {"prompt_tokens": 100, "chunk_size": 64, "expert_format": "int4", "trunk_dtype": jnp.bfloat16}
    one = planning.estimate_memory(TINY, **kw)
    two = planning.estimate_memory(TINY, devices=2, **kw)
    assert two.components["routed experts"].nbytes * 2 == one.components["routed experts"].nbytes
    assert two.components["trunk weights"].nbytes == one.components["trunk weights"].nbytes  # replicated
    assert "split over 2 devices" in two.components["routed experts"].detail


@pytest.mark.parametrize("prompt, chunk, new", [(40, 16, 5), (300, 64, 0), (7, 2048, 30)])
def test_state_bytes_are_the_engines(tiny_runner, prompt, chunk, new):
    ids = np.arange(1, prompt + 1)
    result = hybridlm.prefill(tiny_runner, ids, chunk_size=chunk, max_new_tokens=new)
    assert_finite(result.logits)
    est = planning.estimate_memory(
        TINY,
        prompt_tokens=prompt,
        max_new_tokens=new,
        chunk_size=chunk,
        expert_format="float32",
        trunk_dtype=jnp.float32,
    )
    assert est.inputs["kv_capacity"] == result.capacity == cache_capacity(prompt, result.chunk_size, new)
    kv, rec = est.components["KV cache"].nbytes, est.components["recurrent states"].nbytes
    assert kv + rec == state_nbytes(result.states)
    assert kv + rec == state_nbytes(init_layer_states(TINY, 1, result.capacity, jnp.float32))


def _phase_bytes(config, tokens, dtype) -> dict[str, int]:
    """Temporaries + outputs of each CPU phase program for a chunk of `tokens`, from XLA's memory analysis
    of the compiled programs (abstract inputs: nothing is allocated)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0))))
    layers = [flat_layer(*nnx.split(layer)) for layer in nnx.merge(graphdef, state).layers]
    states = jax.eval_shape(lambda: init_layer_states(config, 1, tokens, dtype))
    x = jax.ShapeDtypeStruct((1, tokens, config.hidden_dim), dtype)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    u = jax.ShapeDtypeStruct((tokens, config.hidden_dim), dtype)
    weights = jax.ShapeDtypeStruct((tokens, config.moe.top_k), jnp.float32)
    ids = jax.ShapeDtypeStruct((tokens, config.moe.top_k), jnp.int32)
    attention = config.layer_types.index("full_attention")
    programs = {
        "gdn": (phases.mix, layers[0], (x, states[0], scalar, scalar)),
        "attention": (phases.mix, layers[attention], (x, states[attention], scalar, scalar)),
        "route": (phases.route, layers[0], (x,)),
        "experts": (phases.experts, layers[0], (x, u, weights, ids, scalar)),
    }
    out = {}
    for name, (fn, (graph, params), args) in programs.items():
        m = fn.lower(graph, params, *args).compile().memory_analysis()
        out[name] = m.temp_size_in_bytes + m.output_size_in_bytes
    return out


@pytest.mark.parametrize(
    "config, tokens, dtype",
    [(TINY, 256, jnp.float32), (TINY, 2048, jnp.float32), (K256, 512, jnp.bfloat16)],
    ids=["tiny-256", "tiny-2048", "k256-512-bf16"],
)
def test_activation_bound_covers_the_compiled_programs(config, tokens, dtype):
    measured = _phase_bytes(config, tokens, dtype)
    bound = planning.activation_bytes(config, tokens, dtype, cpu=True)
    assert max(measured.values()) <= bound <= 8 * max(measured.values()), (measured, bound)


def test_refusal_is_one_line_naming_need_availability_and_options():
    est = planning.estimate_memory(
        BIG,
        prompt_tokens=8190,
        chunk_size=2048,
        expert_format="float32",
        trunk_dtype="float32",
        backend="cpu",
    )
    assert 129 * GIB < est.device_bytes + est.host_bytes < 140 * GIB  # the issue's ~129 GiB of weights
    with pytest.raises(planning.InsufficientMemoryError) as e:
        planning.check_fits(est, device_free=None, host_available=24 * GIB)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert "needs 1" in msg and "24.00 GiB is available" in msg and "--expert-format int4" in msg
    assert "--expert-budget" not in msg  # on the CPU the host holds both: offloading saves nothing
    planning.check_fits(est, device_free=None, host_available=None)  # unknown: not checked
    planning.check_fits(est, device_free=None, host_available=200 * GIB)
    gpu = planning.estimate_memory(
        BIG, prompt_tokens=8190, chunk_size=8192, expert_format="bfloat16", trunk_dtype="bfloat16"
    )
    with pytest.raises(planning.InsufficientMemoryError, match=r"device memory.*--expert-budget"):
        planning.check_fits(gpu, device_free=24 * GIB, host_available=64 * GIB)
    pooled = planning.estimate_memory(
        BIG,
        prompt_tokens=8190,
        chunk_size=8192,
        expert_format="bfloat16",
        trunk_dtype="bfloat16",
        expert_budget=12 * GIB,
    )
    assert pooled.components["pinned experts"].memory == "host" and pooled.host_bytes > 60 * GIB
    with pytest.raises(planning.InsufficientMemoryError, match=r"of host memory .*--expert-format int4"):
        planning.check_fits(pooled, device_free=78 * GIB, host_available=32 * GIB)
    assert "GiB" in str(pooled) and pooled.summary()["device_bytes"] == pooled.device_bytes


def test_bad_estimate_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown expert_format 'int3'"):
        planning.estimate_memory(
            TINY, prompt_tokens=8, chunk_size=8, expert_format="int3", trunk_dtype="float32"
        )
    with pytest.raises(ValueError, match="chunk_size=0"):
        planning.estimate_memory(
            TINY, prompt_tokens=8, chunk_size=0, expert_format="int4", trunk_dtype="float32"
        )
    q4k = planning.estimate_memory(
        BIG, prompt_tokens=8, chunk_size=8, expert_format="q4_k", trunk_dtype="bfloat16", expert_budget=GIB
    )
    assert q4k.inputs["expert_bytes"] == 3 * 2048 * 512 * 144 // 256  # the file's 4.5 bits a weight


def _q4k_plan(cache_policy="static"):
    # the issue's GGUF: Q4_K experts as kept today (float32 scale and offset per 32: 0.75 bytes a weight)
    return planning.OffloadPlan(
        expert_bytes=3 * 2048 * 512 * 3 // 4, budget=12 * GIB, cache_policy=cache_policy
    )


def test_streamed_bytes_match_the_measured_transfers():
    # 8 190 tokens, 12 GiB, static: 15.7 GB a chunk of 8192, 62.8 GB in chunks of 2048 (docs/performance.md)
    assert planning.predict_ttft(BIG, 8190, 8192, offload=_q4k_plan()).streamed / 1e9 == pytest.approx(
        15.7, abs=0.05
    )
    assert planning.predict_ttft(BIG, 8190, 2048, offload=_q4k_plan()).streamed / 1e9 == pytest.approx(
        62.8, abs=0.1
    )
    int4 = planning.OffloadPlan(expert_bytes=planning.expert_bytes(BIG, "int4"), budget=12 * GIB)
    for chunk, gb in ((8192, 44.3), (16384, 22.1), (32768, 11.1)):  # 32 768 tokens, 4-bit experts
        assert planning.predict_ttft(BIG, 32768, chunk, offload=int4).streamed / 1e9 == pytest.approx(
            gb, abs=0.05
        )
    # slru drops each layer after use below the full budget: every layer streams every chunk
    assert planning.streamed_bytes(BIG, _q4k_plan("slru"), 8192) == 40 * 256 * _q4k_plan().expert_bytes


def test_q4_k_blocks_on_the_host_stream_their_own_bytes():
    """The file's Q4_K blocks in host memory: slots hold unpacked experts (the pool shape is unchanged),
    copies move 144 bytes a 256 weights; measured: 11.8 GB for 8 190 tokens at chunk 8 192
    (docs/performance.md)."""
    blocks = dataclasses.replace(_q4k_plan(), copy_bytes=3 * 2048 * 512 * 144 // 256)
    unpacked = _q4k_plan()
    assert planning.pool_shape(BIG, blocks, 8192) == planning.pool_shape(BIG, unpacked, 8192)
    got = planning.streamed_bytes(BIG, blocks, 8192)
    assert got * unpacked.expert_bytes == planning.streamed_bytes(BIG, unpacked, 8192) * blocks.copy_bytes
    assert got / 1e9 == pytest.approx(11.8, abs=0.05)


@pytest.mark.parametrize(
    "policy, layers_budget", [("static", 10), ("static", 6), ("slru", 10), ("slru", 6), ("stream", 10)]
)
def test_streamed_bytes_match_the_offload_runner(tiny_model, policy, layers_budget):
    host = HostExperts.from_model(tiny_model)
    eb, experts = host.layout.nbytes, TINY.moe.num_experts
    config = OffloadConfig(expert_budget=layers_budget * experts * eb, cache_policy=policy)
    runner = OffloadedRunner(tiny_model, config, host_experts=host)
    ids = np.arange(1, 101)
    hybridlm.prefill(runner, ids, chunk_size=32)  # fills the layers the pool holds
    result = hybridlm.prefill(runner, ids, chunk_size=32)
    assert_finite(result.logits)
    plan = planning.OffloadPlan.of_runner(runner)
    shape = planning.pool_shape(TINY, plan, 32)
    assert shape.whole_layer and shape.held_layers == len(runner.held_layers)
    predicted = planning.predict_ttft(TINY, 100, 32, offload=plan).streamed
    assert runner.stats()["prefill"]["bytes_h2d"] == predicted == 4 * planning.streamed_bytes(TINY, plan, 32)


def test_chunk_choice_on_the_issues_cases():
    offloaded = planning.choose_chunk_size(BIG, 8190, offload=_q4k_plan())
    assert offloaded.chunk_size == 8192 and "15.7 GB over PCIe" in offloaded.reason
    assert "4096 would take" in offloaded.reason
    resident = planning.choose_chunk_size(BIG, 32760)
    assert resident.chunk_size == 32768 and "whole prompt in one chunk" in resident.reason
    assert planning.choose_chunk_size(BIG, 32760, offload=_q4k_plan()).chunk_size == 32768
    capped = planning.choose_chunk_size(BIG, 4 * 32768)
    assert capped.chunk_size == 32768 and "largest chunk considered" in capped.reason
    # 40 000 tokens: two chunks of 32 768 would compute 25 536 padding tokens, five of 8192 only 960
    assert planning.choose_chunk_size(BIG, 40_000).chunk_size == 8192
    tight = planning.choose_chunk_size(BIG, 32760, memory_left=6 * GIB)
    assert tight.chunk_size < 32768 and f"{2 * tight.chunk_size} needs" in tight.reason
    kv, rec = planning.state_bytes(BIG, 1, cache_capacity(32760, tight.chunk_size, 0), "bfloat16")
    assert kv + rec + planning.activation_bytes(BIG, tight.chunk_size, "bfloat16") <= 6 * GIB
    assert planning.choose_chunk_size(BIG, 20).chunk_size == 32  # a short prompt: one chunk
    assert planning.choose_chunk_size(TINY, 20_000, backend="cpu").chunk_size <= 2048  # the CPU's cap
    nothing = planning.choose_chunk_size(BIG, 32760, memory_left=-GIB)
    assert nothing.chunk_size == 1 and "no chunk fits" in nothing.reason


def test_chunk_choice_respects_a_budget_below_one_layer():
    # 100 experts' budget: a layer's 256 do not fit, so whole-layer chunks (>= 128 tokens) cannot run
    plan = planning.OffloadPlan(expert_bytes=_q4k_plan().expert_bytes, budget=100 * _q4k_plan().expert_bytes)
    choice = planning.choose_chunk_size(BIG, 8190, offload=plan)
    assert choice.chunk_size == 8 and "16 needs 128 experts in the pool, which holds 100" in choice.reason


def test_prefill_auto_chunk_matches_the_chosen_chunk(tiny_runner):
    ids = np.arange(1, 301)
    auto = hybridlm.prefill(tiny_runner, ids, chunk_size="auto")
    chosen = planning.choose_chunk_size_for(tiny_runner, 300).chunk_size
    given = hybridlm.prefill(tiny_runner, ids, chunk_size=chosen)
    assert auto.chunk_size == given.chunk_size == 512  # the whole prompt in one chunk
    np.testing.assert_array_equal(np.asarray(auto.logits), np.asarray(given.logits))
    with pytest.raises(ValueError, match="chunk_size='big' must be a positive int or 'auto'"):
        hybridlm.prefill(tiny_runner, ids, chunk_size="big")


def test_gguf_expert_storage_from_the_header(tmp_path):
    path = tmp_path / "k256-q4_k_m.gguf"
    hybridlm.save_gguf(hybridlm.init_random(K256, seed=3), path, "q4_k_m")
    weights = 3 * K256.hidden_dim * K256.moe.expert_ffn_dim
    resident = hybridlm.load(path, keep_quantized="experts")
    _, expert_total = _weight_bytes(resident)
    source = planning.model_source(str(path), dtype="bfloat16")
    assert source.config == resident.config
    per_layer = K256.moe.num_experts * K256.num_layers
    assert source.bytes_per_weight * weights * per_layer == pytest.approx(expert_total)
    _, host = load_offloaded(path, progress=False)
    offloaded = planning.model_source(str(path), dtype="bfloat16", offloaded=True)
    assert offloaded.bytes_per_weight * weights == pytest.approx(host.layout.nbytes)
    assert "4-bit" in offloaded.expert_format and "8-bit" in offloaded.expert_format  # widened Q6_K downs


def test_defaults_are_one_rule_for_prefill_and_generate():
    threshold = tuned_default("one_host_part_from_tokens")
    assert host_parts_for(0) == host_parts_for(threshold - 1) == tuned_default("host_parts")
    assert host_parts_for(threshold) == 1 and host_parts_for(threshold, 3) == 3
    assert OffloadConfig(expert_budget="1GiB").cache_policy == "static"


def test_cli_dry_run_allocates_nothing_and_reports(capsys):
    argv = ["prefill", "--preset", "qwen3.5-35b-a3b", "--random-weights", "--dry-run"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is True and report["memory"]["model"] == "qwen3.5-35b-a3b"
    assert report["memory"]["components"]["routed experts"]["nbytes"] == 40 * 256 * 3 * 2048 * 512 * 4
    assert isinstance(report["chunk_size"], int) and report["chunk_reason"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "memory estimate: qwen3.5-35b-a3b" in text and "routed experts" in text and "chunk size" in text


def test_cli_reports_the_chunk_choice_and_refuses_bad_chunk_sizes(capsys):
    assert main(["prefill", "--prompt", "The quick brown fox jumps over the lazy dog.", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunk_size"] == 16 and "whole prompt in one chunk" in report["chunk_reason"]
    assert report["memory_estimate"]["chunk_size"] == 16
    assert main(["prefill", "--chunk-size", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chunk-size must be positive or auto, got lots" in err and "\n" not in err


@pytest.mark.skipif(
    (planning.host_available_bytes() or 0) > 130 * GIB, reason="the 35B preset fits this machine's memory"
)
def test_cli_refuses_the_35b_preset_before_building_it(capsys):
    start = time.monotonic()
    assert main(["prefill", "--preset", "qwen3.5-35b-a3b", "--random-weights"]) == 2
    assert (
        time.monotonic() - start < 5
    )  # an acceptance bound (building the model takes minutes), not a timing
    err = capsys.readouterr().err.strip()
    assert "needs" in err and "is available" in err and "try --expert-format int4" in err and "\n" not in err

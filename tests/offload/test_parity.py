"""Offloaded prefill and decode give the all-resident logits, for every policy, budget and chunk size."""

import numpy as np
import pytest
from offload_helpers import assert_decode_matches, assert_finite, assert_stats_add_up, quantized_tiny

import hybridlm
from hybridlm.offload import POLICIES, HostExperts, OffloadConfig, OffloadedRunner, programs

# Same kernels on the same rows: the pool only renames expert groups. On CPU the logits have come out
# bit-identical in every case so far; the tolerance leaves room for kernels whose tiling depends on the
# number of groups (exact mode runs the grouped matmul over all pool slots).
ATOL, RTOL = 1e-5, 1e-5
NUM_LAYERS, NUM_EXPERTS, TOP_K = 8, 16, 4


def expert_bytes(host_experts) -> int:
    return host_experts.layout.nbytes


# (chunk, prompt, budgets in experts): one layer's active experts for the chunk, in between, everything.
CASES = [
    (1, "short", (TOP_K, 3 * TOP_K, NUM_LAYERS * NUM_EXPERTS)),
    (16, "short", (NUM_EXPERTS, 3 * NUM_EXPERTS, NUM_LAYERS * NUM_EXPERTS)),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk,prompt,budgets", CASES, ids=["chunk1", "chunk16"])
def test_prefill_parity(tiny, host_experts, reference, prompts, policy, chunk, prompt, budgets):
    ref = reference(prompt, chunk)
    eb = expert_bytes(host_experts)
    for experts in budgets:
        runner = OffloadedRunner(
            tiny, OffloadConfig(expert_budget=experts * eb, cache_policy=policy), host_experts=host_experts
        )
        out = hybridlm.prefill(runner, prompts[prompt], chunk_size=chunk)
        assert_finite(out.logits)
        np.testing.assert_allclose(
            np.asarray(out.logits),
            np.asarray(ref.logits),
            atol=ATOL,
            rtol=RTOL,
            err_msg=f"policy={policy} chunk={chunk} budget={experts} experts",
        )
        stats = runner.stats()["prefill"]
        assert_stats_add_up(stats, eb)
        assert stats["lookups"] > 0 and stats["chunks"] == ref.num_chunks
        if policy == "stream":
            assert stats["hits"] == 0


@pytest.mark.parametrize(
    "policy,experts",
    [("static", NUM_EXPERTS), ("slru", NUM_LAYERS * NUM_EXPERTS)],
    ids=["static-one-layer", "slru-everything"],
)
def test_prefill_parity_chunk_4096(tiny, host_experts, reference, prompts, policy, experts):
    """One 4096-token chunk (whole-layer streaming) at the smallest budget (one layer) and at everything."""
    ref = reference("long", 4096)
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=experts * eb, cache_policy=policy), host_experts=host_experts
    )
    out = hybridlm.prefill(runner, prompts["long"], chunk_size=4096)
    assert out.chunk_size == 4096
    assert_finite(out.logits)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    stats = runner.stats()["prefill"]
    assert_stats_add_up(stats, eb)
    assert stats["lookups"] == NUM_LAYERS * NUM_EXPERTS


@pytest.mark.parametrize("prefetch", ["none", "router", "layer"])
@pytest.mark.parametrize("whole_layer", [False, True], ids=["exact", "whole"])
def test_prefetch_modes(tiny, host_experts, reference, prompts, prefetch, whole_layer):
    ref = reference("short", 16)
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=40 * eb, cache_policy="lru", prefetch=prefetch, whole_layer=whole_layer),
        host_experts=host_experts,
    )
    out = hybridlm.prefill(runner, prompts["short"], chunk_size=16)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    stats = runner.stats()["prefill"]
    assert_stats_add_up(stats, eb)
    if prefetch == "none":
        assert stats["prefetched"] == 0 and stats["bytes_h2d"] == stats["misses"] * eb
    else:
        assert stats["prefetched"] > 0
    if whole_layer:
        assert stats["lookups"] == 3 * NUM_LAYERS * NUM_EXPERTS  # 3 chunks, every expert of every layer


@pytest.mark.parametrize("policy", POLICIES)
def test_decode_parity_after_offloaded_prefill(tiny, host_experts, base_runner, prompts, policy):
    """Prefill (chunk 16) then 4 decode steps: same logits at every step; decode uses the same cache."""
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=2 * NUM_EXPERTS * eb, cache_policy=policy),
        host_experts=host_experts,
    )
    ids = prompts["short"]
    steps = 4
    pre_ref = hybridlm.prefill(base_runner, ids, chunk_size=16, max_new_tokens=steps)
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=steps)
    np.testing.assert_allclose(np.asarray(pre.logits), np.asarray(pre_ref.logits), atol=ATOL, rtol=RTOL)
    assert_decode_matches(runner, base_runner, pre, pre_ref, len(ids), steps, exact=False, atol=ATOL)
    stats = runner.stats()
    assert stats["decode"]["chunks"] == steps and stats["prefill"]["chunks"] == pre.num_chunks
    assert stats["decode"]["lookups"] > 0
    assert_stats_add_up(stats["decode"], eb)


def test_generate_with_offloaded_runner(tiny, host_experts, base_runner, prompts):
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy="lfu"), host_experts=host_experts
    )
    ref = hybridlm.generate(base_runner, prompts["short"], max_new_tokens=5, chunk_size=16)
    out = hybridlm.generate(runner, prompts["short"], max_new_tokens=5, chunk_size=16)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts(bits):
    """QuantizedWeights experts: every leaf (values, scales, offsets) is paged; same logits."""
    model = quantized_tiny(bits)
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 20)
    ref = hybridlm.prefill(hybridlm.LayerwiseRunner(model), ids, chunk_size=16)
    runner = OffloadedRunner(
        model, OffloadConfig(expert_budget="1MiB", cache_policy="slru", whole_layer=False)
    )
    moe, hidden = model.config.moe, model.config.hidden_dim
    float_bytes = 3 * hidden * moe.expert_ffn_dim * 4
    assert runner.expert_bytes < float_bytes * (0.3 if bits == 8 else 0.2)  # quantized bytes are what moves
    out = hybridlm.prefill(runner, ids, chunk_size=16)
    assert_finite(out.logits)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    stats = runner.stats()["prefill"]
    assert_stats_add_up(stats, runner.expert_bytes)
    assert stats["bytes_h2d"] > 0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("paging", ["device", "host"])
def test_quantized_experts_decode(bits, paging):
    """Decode with QuantizedWeights experts paged either way: the all-resident logits at every step."""
    model = quantized_tiny(bits)
    base = hybridlm.LayerwiseRunner(model)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 20)
    ref = hybridlm.prefill(base, ids, chunk_size=16, max_new_tokens=3)
    host = HostExperts.from_model(model)  # packed once, its layout giving the budget
    runner = OffloadedRunner(
        model,
        OffloadConfig(
            expert_budget=3 * NUM_EXPERTS * host.layout.nbytes, cache_policy="lru", decode_paging=paging
        ),
        host_experts=host,
    )
    out = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=3)
    assert_decode_matches(runner, base, out, ref, len(ids), 3, exact=False, atol=ATOL)
    decode = runner.stats()["decode"]
    assert_stats_add_up(decode, runner.expert_bytes)
    assert decode["misses"] > 0 and (decode["hits"] > 0 or paging == "host")  # device: the pool filled first


@pytest.mark.parametrize("whole_layer", [False, True], ids=["exact", "whole"])
def test_batch_of_two_and_profile(tiny, host_experts, base_runner, whole_layer):
    """Two sequences per chunk (ids of both rows decide the experts); profile=True times phases as usual."""
    ids = np.random.default_rng(5).integers(0, tiny.config.vocab_size, (2, 21))
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16)
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=2 * NUM_EXPERTS * eb, cache_policy="slru", whole_layer=whole_layer),
        host_experts=host_experts,
    )
    out = hybridlm.prefill(runner, ids, chunk_size=16, profile=True)
    assert_finite(out.logits)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    assert out.phase_seconds["experts"] > 0
    assert_stats_add_up(runner.stats()["prefill"], eb)


@pytest.mark.parametrize("in_program", [True, False], ids=["in-program-copies", "device-put-copies"])
@pytest.mark.parametrize("policy", ["stream", "static", "lru"])
def test_whole_layer_streaming_copies_inside_programs(
    tiny, host_experts, reference, prompts, monkeypatch, policy, in_program
):
    """Whole-layer mode copies the next absent layer inside the mixer-and-router / experts programs (or,
    switched off, by device_put): same logits, same statistics, and the in-program path is really taken."""
    calls = []
    for name in ("mix_route_copying", "pool_experts_copying", "staged_experts"):
        fn = getattr(programs, name)
        monkeypatch.setattr(
            programs, name, lambda *a, _fn=fn, _name=name: calls.append((_name, a)) or _fn(*a)
        )
    ref = reference("short", 16)
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy=policy, in_program_copies=in_program),
        host_experts=host_experts,
    )
    out = hybridlm.prefill(runner, prompts["short"], chunk_size=16)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    stats = runner.stats()["prefill"]
    assert_stats_add_up(stats, eb)
    assert stats["prefetched"] > 0
    copying = [name for name, a in calls if name != "staged_experts" or a[-1]]  # with host parts to copy
    if in_program:
        assert copying.count("mix_route_copying") > 0 and len(copying) > copying.count("mix_route_copying")
    else:
        assert not copying
    # below the full-model budget every policy releases a layer after use (static pins nothing at this
    # budget), so with in-program copies the experts run straight from the staged parts
    assert any(name == "staged_experts" for name, _ in calls) == in_program


@pytest.mark.parametrize("policy", ["static", "slru", "stream"])
def test_second_prompt_compiles_nothing(tiny, host_experts, prompts, policy):
    """A first prefill compiles every program later prefills of the same length use, whatever the cache
    then holds (the static policy's second prompt, its pinned layers resident, used to compile the programs
    without an in-program copy, and programs fed uncommitted arrays)."""
    import logging

    import jax

    eb = expert_bytes(host_experts)
    # 101 experts at prefetch depth 1: 16 for the layer, 32 staged, 53 left of which static pins one whole
    # layer (layer 4: in the second prompt, layer 3 copies nothing inside its programs).
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(
            expert_budget=(NUM_LAYERS * NUM_EXPERTS * 3 // 4 + 5) * eb, cache_policy=policy, prefetch_depth=1
        ),
        host_experts=host_experts,
    )
    first, second = prompts["long"][:64], prompts["long"][64:128]
    hybridlm.prefill(runner, first, chunk_size=64)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            out = hybridlm.prefill(runner, second, chunk_size=64)
    finally:
        logger.removeHandler(handler)
    assert_finite(out.logits)
    assert runner.stats()["pool"]["pinned"] == (NUM_EXPERTS if policy == "static" else 0)
    compiled = [m.split(" with ")[0] for m in records if m.startswith("Compiling")]
    assert not compiled, compiled


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
def test_every_policy_holds_layers_when_everything_fits(tiny, host_experts, base_runner, prompts, policy):
    """A budget above every expert: lru / slru / lfu never evict, so in whole-layer mode they hold layers
    outside the pool as static does (first and last layers first) and keep the others in the pool; same
    logits, and the second prompt copies nothing."""
    eb = expert_bytes(host_experts)
    num_layers = host_experts.num_layers
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(
            expert_budget=(num_layers + 3) * NUM_EXPERTS * eb, cache_policy=policy, prefetch_depth=1
        ),
        host_experts=host_experts,
    )
    ids = prompts["short"]
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16)
    for prompt in range(2):
        out = hybridlm.prefill(runner, ids, chunk_size=16)
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
        stats = runner.stats()
        assert_stats_add_up(stats["prefill"], eb)
        # the pool keeps slots for the layer running and the two layers in staging (depth 1); the rest is held
        assert len(runner.held_layers) == num_layers - 3 and stats["pool"]["slots"] == 3 * NUM_EXPERTS
        assert stats["prefill"]["evictions"] == 0
        assert stats["prefill"]["misses"] == (num_layers * NUM_EXPERTS if prompt == 0 else 0)
        if prompt == 1:
            assert stats["prefill"]["bytes_h2d"] == 0 and stats["prefill"]["hit_rate"] == 1.0


def test_static_pool_built_for_exact_mode_is_rebuilt_to_hold_layers(tiny, host_experts, base_runner, prompts):
    """A static runner whose first prefill ran in exact mode (1-token chunks) rebuilds its pool once for the
    first whole-layer chunk, holding its pinned layers outside it; the exact-mode run after that keeps
    them."""
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=7 * NUM_EXPERTS * eb, cache_policy="static", prefetch_depth=1),
        host_experts=host_experts,
    )
    ids = prompts["short"][:3]
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16)
    out = hybridlm.prefill(runner, ids, chunk_size=1)
    assert not runner.uses_whole_layer(1) and runner.held_layers == frozenset()
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    whole = hybridlm.prefill(runner, prompts["short"], chunk_size=16)
    assert runner.uses_whole_layer(16) and runner.held_layers == {2, 6}
    full_ref = hybridlm.prefill(base_runner, prompts["short"], chunk_size=16)
    np.testing.assert_allclose(np.asarray(whole.logits), np.asarray(full_ref.logits), atol=ATOL, rtol=RTOL)
    cache = runner.cache
    out = hybridlm.prefill(runner, ids, chunk_size=1)
    assert runner.cache is cache and runner.held_layers == {2, 6}
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)


def test_static_whole_layer_holds_pinned_layers_outside_the_pool(
    tiny, host_experts, base_runner, prompts, monkeypatch
):
    """In whole-layer mode the static policy's pinned layers are held as [experts, ...] arrays outside the
    pool (no gather out of it): same logits in prefill and in the decode steps after it, the held program is
    the one run, their lookups are misses the first prompt (bytes counted) and hits the next."""
    calls = []
    fn = programs.held_experts
    monkeypatch.setattr(programs, "held_experts", lambda *a: calls.append(a) or fn(*a))
    eb = expert_bytes(host_experts)
    # 7 layers of experts at prefetch depth 1: one for the layer, two staged, two pinned (layers 2 and 6)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=7 * NUM_EXPERTS * eb, cache_policy="static", prefetch_depth=1),
        host_experts=host_experts,
    )
    ids = prompts["short"]
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16, max_new_tokens=2)
    for prompt in range(2):
        calls.clear()
        out = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=2)
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
        stats = runner.stats()
        assert runner.held_layers == {2, 6} and stats["pool"]["pinned"] == 2 * NUM_EXPERTS
        assert stats["pool"]["slots"] == 3 * NUM_EXPERTS  # the held layers are not pool slots
        # (plus, the first time, its variants with other numbers of in-program copies: `compile_twins`)
        assert len(calls) == 2 * out.num_chunks or (prompt == 0 and len(calls) > 2 * out.num_chunks)
        assert_stats_add_up(stats["prefill"], eb)
        for layer in runner.held_layers:
            s = stats["prefill"]["per_layer"][layer]
            assert s["hits"] == s["lookups"] - (NUM_EXPERTS if prompt == 0 else 0)
    assert_decode_matches(runner, base_runner, out, ref, len(ids), 2, exact=False, atol=ATOL)
    decode = runner.stats()["decode"]
    assert_stats_add_up(decode, eb)
    assert all(
        decode["per_layer"][layer]["hits"] == decode["per_layer"][layer]["lookups"] > 0
        for layer in runner.held_layers
    )


def test_whole_layer_streaming_prefetches_across_chunks(tiny, host_experts, reference, prompts):
    """Whole-layer streaming runs on into the next chunk's first layers during a chunk's last ones: after the
    first chunk no layer is copied on demand, and the last chunk prefetches nothing past the prompt (stream
    moves every layer exactly once per chunk)."""
    ref = reference("short", 16)
    eb = expert_bytes(host_experts)
    # 5 layers of experts: one for the layer, staging for two (prefetch depth 2), two slack
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=5 * NUM_EXPERTS * eb, cache_policy="stream", whole_layer=True),
        host_experts=host_experts,
    )
    out = hybridlm.prefill(runner, prompts["short"], chunk_size=16)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    stats = runner.stats()["prefill"]
    assert_stats_add_up(stats, eb)
    assert out.num_chunks == 3 and stats["lookups"] == 3 * NUM_LAYERS * NUM_EXPERTS
    assert stats["bytes_h2d"] == stats["lookups"] * eb
    first = stats["per_layer"][0]
    assert first["prefetch_used"] == first["prefetched"] == 2 * NUM_EXPERTS  # chunks 2 and 3
    assert all(s["prefetch_used"] == s["misses"] for s in stats["per_layer"][1:])


def test_exact_mode_gathers_only_the_chunks_experts(tiny, host_experts, reference, prompts, monkeypatch):
    """Exact mode never hands the kernel the whole pool (its leaves can pass the kernel's int32 offsets): it
    gathers the chunk's experts, padded to a power of two, and remaps the ids; same logits."""
    groups = []
    fn = programs.pool_experts_table  # exact mode's experts program: spec = (experts, gathered groups)
    monkeypatch.setattr(programs, "pool_experts_table", lambda *a: groups.append(a[4][1]) or fn(*a))
    ref = reference("short", 1)
    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy="lru"), host_experts=host_experts
    )
    out = hybridlm.prefill(runner, prompts["short"], chunk_size=1)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=RTOL)
    assert groups and set(groups) == {TOP_K}  # one token: its top_k experts, a power of two


def test_batched_decode_with_offloaded_runner(tiny, host_experts, base_runner, prompts):
    """Two sequences at different positions decoded in one batch (`engine.batch`) with paged experts: each
    gets the greedy tokens it gets alone on the all-resident runner."""
    import threading

    import jax.numpy as jnp

    from hybridlm.engine.batch import DecodeBatcher

    eb = expert_bytes(host_experts)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=2 * NUM_EXPERTS * eb, cache_policy="static"),
        host_experts=host_experts,
    )
    seqs = [prompts["short"], prompts["short"][:7]]
    want = [hybridlm.generate(base_runner, s, max_new_tokens=5, chunk_size=16).tokens[0] for s in seqs]
    batcher = DecodeBatcher(runner, threading.Lock(), block=4)
    try:
        rows = []
        for s in seqs:
            with batcher.lock:  # the batcher's thread may be decoding on the runner
                pre = hybridlm.prefill(runner, s, chunk_size=16, max_new_tokens=5)
            first = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
            greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
            rows.append((first, batcher.join(pre.states, pre.prompt_tokens, first, 4, stop_ids=[], **greedy)))
        got = [np.concatenate([np.asarray(f), *row]) for f, row in rows]
    finally:
        batcher.close(timeout=60)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_prefill_taps_match_the_resident_runner(tiny, host_experts, base_runner, prompts):
    """Layer taps (a DFlash draft's features) through paged experts: the resident runner's."""
    taps = (6, 1)

    def collect(rows):
        return lambda x, start, num_valid, next_ids, capacity, features: rows.append(
            np.asarray(features)[:, :num_valid]
        )

    want, got = [], []
    hybridlm.prefill(base_runner, prompts["short"], chunk_size=16, on_chunk=collect(want), taps=taps)
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=3 * NUM_EXPERTS * expert_bytes(host_experts)),
        host_experts=host_experts,
    )
    hybridlm.prefill(runner, prompts["short"], chunk_size=16, on_chunk=collect(got), taps=taps)
    got, want = np.concatenate(got, axis=1), np.concatenate(want, axis=1)
    assert_finite(got)
    assert got.shape == (1, len(prompts["short"]), len(taps) * tiny.config.hidden_dim)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)

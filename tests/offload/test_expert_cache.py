"""Expert cache bookkeeping: policies, byte sizes, budgets, statistics across prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from offload_helpers import assert_decode_matches, assert_stats_add_up

import hybridlm
from hybridlm.engine import phases
from hybridlm.offload import (
    HostExperts,
    OffloadConfig,
    OffloadedRunner,
    decode,
    default_host_parts,
    parse_bytes,
    programs,
    static_pinned_keys,
)
from hybridlm.offload.exact import ExactMode
from hybridlm.offload.expert_cache import ExpertCache, ExpertLayout, PackedExperts
from hybridlm.offload.host import power_of_two_parts
from hybridlm.offload.part_queue import MAX_PARTS_PER_PROGRAM

HOST_PARTS = default_host_parts()

NUM_LAYERS, NUM_EXPERTS, TOP_K = 8, 16, 4


@pytest.mark.parametrize(
    "text,value",
    [
        ("12GiB", 12 * 2**30),
        ("12 GB", 12 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5g", int(1.5 * 2**30)),
        (4096, 4096),
        ("100", 100),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["twelve", "12XB", "-1GiB", 0])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def _cache(policy, slots, pinned=0):
    layout = ExpertLayout.of(
        np.zeros((NUM_EXPERTS, 2, 2), np.float32), np.zeros((NUM_EXPERTS, 2, 2), np.float32)
    )
    return ExpertCache(
        layout, slots, policy, num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, pinned_count=pinned
    )


def _use(cache, key):
    if not cache.lookup(key):
        return cache.allocate(key, protected={key})[1]
    return None


def test_lru_evicts_least_recent():
    c = _cache("lru", 2)
    _use(c, (0, 0)), _use(c, (0, 1)), _use(c, (0, 0))
    assert _use(c, (0, 2)) == (0, 1)


def test_slru_keeps_reused_entries_through_a_scan():
    c = _cache("slru", 4)
    for _ in range(2):
        _use(c, (0, 0))  # second use promotes (0, 0) to the protected segment
    evicted = [_use(c, (1, e)) for e in range(8)]  # a one-off scan
    assert (0, 0) not in evicted and (0, 0) in c


def test_lfu_evicts_least_frequent():
    c = _cache("lfu", 2)
    for _ in range(3):
        _use(c, (0, 0))
    _use(c, (0, 1))
    assert _use(c, (0, 2)) == (0, 1)


def test_static_pins_layers_spread_over_the_depth():
    keys = static_pinned_keys(NUM_LAYERS, NUM_EXPERTS, 2 * NUM_EXPERTS + 3)  # 3 layers of 8: 1, 4, 6
    assert {(1, e) for e in range(NUM_EXPERTS)} <= keys and {(4, e) for e in range(NUM_EXPERTS)} <= keys
    assert {k for k in keys if k[0] not in (1, 4)} == {(6, 0), (6, 1), (6, 2)}
    assert static_pinned_keys(40, 256, 20 * 256) == {
        (layer, e) for layer in range(1, 40, 2) for e in range(256)
    }
    assert not static_pinned_keys(NUM_LAYERS, NUM_EXPERTS, 0)
    assert len(static_pinned_keys(NUM_LAYERS, NUM_EXPERTS, 10**6)) == NUM_LAYERS * NUM_EXPERTS
    c = _cache("static", 3, pinned=1)
    (pinned,) = static_pinned_keys(NUM_LAYERS, NUM_EXPERTS, 1)
    assert pinned == (4, 0)
    _use(c, pinned)
    for e in range(10):
        assert _use(c, (3, e)) != pinned
    assert pinned in c


def test_allocate_respects_protected():
    c = _cache("lru", 2)
    _use(c, (0, 0)), _use(c, (0, 1))
    assert c.allocate((0, 2), protected={(0, 0), (0, 1)}) is None


def test_budget_too_small_names_both_numbers(tiny, host_experts, prompts):
    eb = host_experts.layout.nbytes
    with pytest.raises(ValueError, match=rf"expert_budget={3 * eb} bytes.*needs up to {TOP_K} experts"):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget=3 * eb), host_experts=host_experts
        )  # below one token's top-k
    runner = OffloadedRunner(tiny, OffloadConfig(expert_budget=TOP_K * eb), host_experts=host_experts)
    with pytest.raises(
        ValueError,
        match=rf"holds {TOP_K} experts.*needs up to {NUM_EXPERTS} experts "
        rf"\({NUM_EXPERTS * eb} bytes",
    ):
        hybridlm.prefill(runner, prompts["short"], chunk_size=16)  # checked before any work
    with pytest.raises(ValueError, match="needs up to 16 experts"):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget=TOP_K * eb, chunk_size=16), host_experts=host_experts
        )


def test_budget_above_device_memory(tiny, host_experts):
    with pytest.raises(
        ValueError,
        match=r"expert_budget=12884901888 bytes \(12.00 GiB\) exceeds the free device "
        r"memory 1000000 bytes",
    ):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget="12GiB", device_memory_bytes=10**6), host_experts=host_experts
        )


def test_bad_arguments(tiny, host_experts):
    with pytest.raises(ValueError, match="unknown cache_policy 'fifo'"):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget="1MiB", cache_policy="fifo"), host_experts=host_experts
        )
    with pytest.raises(ValueError, match="unknown prefetch"):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget="1MiB", prefetch="always"), host_experts=host_experts
        )


def test_experts_live_in_pinned_host_memory(tiny, host_experts):
    runner = OffloadedRunner(tiny, OffloadConfig(expert_budget="1MiB"), host_experts=host_experts)
    kinds = {buf.sharding.memory_kind for parts in runner.host.layers for buf in parts}
    assert kinds == {"pinned_host"}
    assert [[buf.shape for buf in parts] for parts in runner.host.layers] == [
        [(tiny.config.moe.num_experts // HOST_PARTS, host_experts.layout.nbytes)] * HOST_PARTS
    ] * tiny.config.num_layers
    moe, hidden = tiny.config.moe, tiny.config.hidden_dim
    assert host_experts.layout.nbytes == 3 * hidden * moe.expert_ffn_dim * 4  # float32 gate, up, down
    for graph, leaves in runner.layers:  # the runner's per-layer weights hold no expert weights
        assert graph.params(leaves)["ffn"]["experts_gate_up"].get_value().size == 1
        assert isinstance(leaves, tuple) and all(isinstance(x, jax.Array) for x in leaves)


def test_reuse_across_prompts_and_stats_reset(tiny, host_experts, prompts):
    """With everything fitting, the second prompt hits every expert and copies nothing."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=NUM_LAYERS * NUM_EXPERTS * eb, cache_policy="lru", prefetch="none"),
        host_experts=host_experts,
    )
    hybridlm.prefill(runner, prompts["short"], chunk_size=16)
    first = runner.stats()["prefill"]
    assert first["misses"] == NUM_LAYERS * NUM_EXPERTS and first["bytes_h2d"] == first["misses"] * eb
    assert first["evictions"] == 0
    hybridlm.prefill(runner, prompts["short"][::-1].copy(), chunk_size=16)
    second = runner.stats()["prefill"]
    assert second["misses"] == 0 and second["bytes_h2d"] == 0 and second["hit_rate"] == 1.0
    assert second["lookups"] == 3 * NUM_LAYERS * NUM_EXPERTS
    assert_stats_add_up(second, eb)
    assert len(second["per_layer"]) == NUM_LAYERS


def test_stream_copies_every_lookup(tiny, host_experts, prompts):
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget="1MiB", cache_policy="stream", prefetch="none"),
        host_experts=host_experts,
    )
    hybridlm.prefill(runner, prompts["short"], chunk_size=1)
    s = runner.stats()["prefill"]
    assert s["hits"] == 0 and s["misses"] == s["lookups"] and s["bytes_h2d"] == s["lookups"] * eb
    for layer in s["per_layer"]:
        assert layer["lookups"] >= TOP_K * 40 // 10  # at least a few distinct experts per token


def test_power_of_two_parts():
    assert power_of_two_parts(13) == [8, 4, 1]
    assert power_of_two_parts(77) == [32, 32, 8, 4, 1]
    assert power_of_two_parts(256, cap=256) == [256]
    assert power_of_two_parts(0) == []
    for n in range(1, 300):
        parts = power_of_two_parts(n, cap=16)
        assert sum(parts) == n and max(parts) <= 16 and all(p & (p - 1) == 0 for p in parts)
        assert len({p for p in parts if p < 16}) == len([p for p in parts if p < 16])


@pytest.mark.parametrize("experts", [None, [3], [5, 0, 7], list(range(8)), [7, 6, 5, 4, 3, 2, 1]])
def test_host_rows_reach_the_device_intact(host_experts, experts):
    """Whole-layer copies and row copies (power-of-two batches, any order) deliver exactly the host bytes."""
    host_np = np.concatenate([np.asarray(buf) for buf in host_experts.layers[1]])
    batches = host_experts.to_device(1, experts)
    got_ids = [e for _, ids in batches for e in ids]
    assert sorted(got_ids) == sorted(range(host_experts.num_experts) if experts is None else experts)
    for buf, ids in batches:
        assert buf.sharding.memory_kind == "device"
        assert len(ids) & (len(ids) - 1) == 0 or len(ids) in host_experts.part_rows
        np.testing.assert_array_equal(np.asarray(buf), host_np[ids])


def test_host_experts_refuse_mismatched_buffers(host_experts):
    with pytest.raises(ValueError, match="must all be"):
        HostExperts(host_experts.layout, [[buf[:, :8] for buf in host_experts.layers[0]]])
    with pytest.raises(ValueError, match="must all be"):
        HostExperts(host_experts.layout, [host_experts.layers[0], host_experts.layers[1][:1]])


def test_copy_queue_spreads_parts_over_the_programs_before_each_deadline(tiny, host_experts):
    """Layer j's parts must be copied by the programs (mixer, experts) of the layers before j: a layer
    queued two layers ahead goes one part per program, one queued one layer ahead as fast as needed."""
    runner = OffloadedRunner(tiny, OffloadConfig(expert_budget="1MiB"), host_experts=host_experts)
    queue = runner.queue
    queue.push([(3, p) for p in range(HOST_PARTS)])  # 4 parts, 4 programs (layers 1 and 2)
    assert [len(queue.pop(1, 0)), len(queue.pop(1, 1))] == [1, 1]
    queue.clear()
    queue.push([(2, p) for p in range(HOST_PARTS)])  # 4 parts, 2 programs (layer 1)
    assert [len(queue.pop(1, 0)), len(queue.pop(1, 1))] == [2, 2]
    queue.clear()
    queue.push([(2, p) for p in range(HOST_PARTS)] + [(3, 0)])  # never more than the cap
    assert len(queue.pop(1, 1)) == MAX_PARTS_PER_PROGRAM
    assert queue.items[0] == (2, MAX_PARTS_PER_PROGRAM)  # in order, earliest deadline first
    queue.clear()
    assert queue.pop(0, 0) == []


@pytest.mark.parametrize(
    "rows", [[[3]], [[2, 0]], [[1, 3, 0]], [[2], [], [0, 3]]], ids=["one", "two", "three-padded", "parts"]
)
def test_copy_rows_writes_host_rows_into_their_slots(host_experts, rows):
    """`ExpertCache.copy_rows`: the rows of pinned host parts (one, or several with m rows each) land in their
    pool slots, bit for bit; the padding rows go to a slot past the pool and change nothing else."""
    layout, parts = host_experts.layout, host_experts.layers[2][: len(rows)]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    cache = ExpertCache(layout, 6, "lru", num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, sharding=sharding)
    before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(cache.pool)]
    slots = iter([4, 1, 5])
    slots = [[next(slots) for _ in r] for r in rows]
    m = 1 << (max(len(r) for r in rows) - 1).bit_length()
    width, base = 8, 3
    table = np.full((base + 2 * 2 * width,), -7, np.int32)  # batch 1 of two; batch 0 unused
    for b, (r, sl) in enumerate(zip(rows, slots, strict=False)):
        lo = base + 2 * width + b * m
        table[lo : lo + m] = (r + [r[0] if r else 0] * m)[:m]
        table[lo + width : lo + width + m] = (sl + [6] * m)[:m]
    cache.copy_rows(
        tuple(parts), jax.device_put(table, sharding), jax.device_put(np.int32(1), sharding), (base, width), m
    )
    flat = [s for sl in slots for s in sl]
    want = np.concatenate([np.asarray(p)[r] for p, r in zip(parts, rows, strict=False) if r])
    (old,) = before
    got = np.asarray(cache.pool.data)  # the pool keeps the host bytes (`PackedExperts`)
    np.testing.assert_array_equal(got[flat], want)
    others = [s for s in range(6) if s not in flat]
    np.testing.assert_array_equal(got[others], old[others])


def test_copy_batches_pad_few_rows_into_one_program(tiny, host_experts):
    """A few experts spread over a layer's parts go as one program over all of them; one part's rows, or
    padding past OffloadConfig.padded_copy_bytes, as one program per part touched."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb), host_experts=host_experts
    )
    hybridlm.prefill(runner, np.arange(8), chunk_size=8)  # builds the pool
    per_part = NUM_EXPERTS // HOST_PARTS
    ((bufs, rows, ids, m),) = runner.schedule.exact.copy_batches(1, [0, per_part + 1, 3 * per_part])
    assert bufs == tuple(host_experts.layers[1]) and m == 1
    assert rows == [[0], [1], [], [0]] and ids == [[0], [per_part + 1], [], [3 * per_part]]
    ((bufs, rows, ids, m),) = runner.schedule.exact.copy_batches(1, [1, 2])  # one part
    assert bufs == (host_experts.layers[1][0],) and rows == [[1, 2]] and m == 2
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, padded_copy_bytes=eb - 1),
        host_experts=host_experts,
    )  # no padding allowed
    hybridlm.prefill(runner, np.arange(8), chunk_size=8)
    batches = runner.schedule.exact.copy_batches(1, [0, per_part + 1])
    assert [len(b[0]) for b in batches] == [1, 1]


def _count_calls(monkeypatch, owner, names: tuple[str, ...], calls: dict | None = None) -> dict:
    """Counts the calls of `owner`'s functions or methods `names` (a module or a class), each still run, in
    `calls` (a new dict, or one shared with other owners' counts)."""
    calls = {} if calls is None else calls
    calls.update(dict.fromkeys(names, 0))
    for name in names:
        fn = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, _fn=fn, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _fn(*a)
        )
    return calls


def test_exact_mode_decode_copies_into_the_pool_with_one_table_per_layer(
    tiny, host_experts, prompts, monkeypatch
):
    """A layer-by-layer offloaded decode step (decode_paging="host": exact mode, router prefetch) copies its
    experts straight into the pool: no staged batches, no pool writes, one index table moved to the device per
    layer, at most one copy program per host part of the layer and of the next; the mixer, router and
    prediction run as one program."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy="lru", decode_paging="host"),
        host_experts=host_experts,
    )
    pre = hybridlm.prefill(runner, prompts["short"], chunk_size=16, max_new_tokens=2)
    calls = _count_calls(monkeypatch, ExpertCache, ("write", "copy_rows"))
    _count_calls(monkeypatch, ExactMode, ("index_table",), calls)
    _count_calls(monkeypatch, programs, ("mix_route",), calls)
    token = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    hybridlm.decode_step(runner, token, pre.states, len(prompts["short"]))
    stats = runner.stats()["decode"]
    assert calls["write"] == 0 and calls["index_table"] == calls["mix_route"] == NUM_LAYERS
    assert 0 < calls["copy_rows"] <= NUM_LAYERS * 2 * HOST_PARTS
    assert stats["misses"] > 0 and stats["prefetched"] > 0 and stats["stall_s"] == 0.0
    assert_stats_add_up(stats, eb)


def test_device_paged_decode_is_one_program_reading_the_pool_as_left(
    tiny, host_experts, base_runner, prompts, monkeypatch
):
    """decode_paging="device" (the default): each step is one program (no per-layer programs, copies or
    tables) with the all-resident logits. The first step sets the pool to whole layers (the whole-layer
    prefill below the full-model budget left it empty), counted as prefetched; later steps insert and evict
    nothing. Every routed copy of every layer is a lookup, a hit exactly where its expert was resident."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy="lru"), host_experts=host_experts
    )
    ids, steps = prompts["short"], 3
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=steps)
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16, max_new_tokens=steps)
    assert not runner.cache.slot_of  # whole-layer mode released every layer after use
    calls = _count_calls(monkeypatch, decode, ("decode_paged",))
    _count_calls(monkeypatch, programs, ("mix_route", "pool_experts_table"), calls)
    _count_calls(monkeypatch, phases, ("mix",), calls)
    filled = {}

    def pool_filled_once(step):
        if step == 0:
            filled.update(runner.cache.slot_of)
            assert len(filled) == runner.cache.num_slots and not runner.cache.free
        assert runner.cache.slot_of == filled

    assert_decode_matches(runner, base_runner, pre, ref, len(ids), steps, after_step=pool_filled_once)
    assert calls == {"decode_paged": steps, "mix_route": 0, "mix": 0, "pool_experts_table": 0}
    stats = runner.stats()["decode"]
    assert stats["chunks"] == steps and stats["lookups"] == steps * NUM_LAYERS * TOP_K
    assert stats["prefetched"] == len(filled) and stats["prefetch_used"] == 0
    assert_stats_add_up(stats, eb)
    assert 0 < stats["hits"] < stats["lookups"]
    filled_layers = {layer for layer, _ in filled}
    for layer, s in enumerate(stats["per_layer"]):
        assert (s["hits"] == s["lookups"]) if layer in filled_layers else s["hits"] == 0
    assert runner.paged_view.sources == tuple(
        decode.IN_POOL if layer in filled_layers else decode.IN_HOST for layer in range(NUM_LAYERS)
    )


def test_device_paged_decode_compiles_once_across_prompts(tiny, host_experts, base_runner, prompts):
    """The paged view depends on the policy and the budget, not on what a prompt routed: after exact-mode
    prompts (their partial layers released, whole layers filled) and a whole-layer one of the same length, the
    step program compiled once; the all-resident logits, bit for bit, after each."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=NUM_LAYERS * NUM_EXPERTS * eb // 2, cache_policy="lru"),
        host_experts=host_experts,
    )
    before = decode.decode_paged._cache_size()
    views = []
    short = prompts["short"]  # prompts of one length: one KV cache shape (each shape compiles its own step)
    for ids, chunk in ((short[:16], 2), (short[16:32], 16), (short[8:24], 4)):
        pre = hybridlm.prefill(runner, ids, chunk_size=chunk, max_new_tokens=2)
        ref = hybridlm.prefill(base_runner, ids, chunk_size=chunk, max_new_tokens=2)
        assert_decode_matches(runner, base_runner, pre, ref, len(ids), 2)
        views.append(runner.paged_view.sources)
    assert views[0] == views[1] == views[2] and set(views[0]) == {decode.IN_POOL, decode.IN_HOST}
    assert decode.decode_paged._cache_size() == before + 1


@pytest.fixture(scope="module")
def host_experts_one_part(tiny):
    """The tiny model's experts as one pinned buffer a layer (`OffloadedRunner(host_parts=1)`'s layout)."""
    return HostExperts.from_model(tiny, parts=1)


@pytest.mark.parametrize("parts", [HOST_PARTS, 1])
def test_fetch_experts_takes_each_copy_from_where_it_lies(
    tiny, host_experts, host_experts_one_part, monkeypatch, parts
):
    """`decode.fetch_experts` returns each id's own expert weights, whether its slot says pool or host memory
    (a MIXED layer), from host memory alone (IN_HOST) and from the pool alone (IN_POOL). From one host buffer
    a layer, an IN_HOST layer's copies carry no `lax.switch`."""
    host = host_experts if parts == HOST_PARTS else host_experts_one_part
    assert len(host.layers[0]) == parts
    layout, layer = host.layout, 2
    want = host.unpack_layer(layer)  # (gate_up, down) [experts, ...]
    packed = host.packed_layer(layer)
    pool = PackedExperts(layout, packed.data[::-1])  # slot s holds expert E-1-s
    ids = jnp.asarray([0, 5, 9, 15, 7], jnp.int32)
    layer_parts, starts = tuple(host.layers[layer]), tuple(host.part_start)
    switches = _count_calls(monkeypatch, jax.lax, ("switch",))
    for source, resident in (
        (decode.MIXED, [True, False, True, False, False]),
        (decode.IN_HOST, [False] * 5),
        (decode.IN_POOL, [True] * 5),
    ):
        slots = jnp.where(jnp.asarray(resident), NUM_EXPERTS - 1 - ids, -1)
        before = switches["switch"]
        got = jax.jit(decode.fetch_experts, static_argnums=(0, 2, 6))(
            layout, layer_parts, starts, pool, slots, ids, source
        )
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=False):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[np.asarray(ids)])
        copies_switched = switches["switch"] - before
        if source == decode.IN_POOL or (source == decode.IN_HOST and parts == 1):
            assert copies_switched == 0, source
        else:
            assert copies_switched == len(ids), source


@pytest.mark.parametrize("policy", ["lru", "static"])
def test_one_host_part_a_layer_prefills_and_decodes_exactly(
    tiny, host_experts, base_runner, reference, prompts, monkeypatch, policy
):
    """OffloadedRunner(host_parts=1) packs one pinned buffer a layer: exact-mode and whole-layer prefills give
    the all-resident logits, and so do device-paged decode steps, bit for bit, whose copies from host memory
    carry no `lax.switch`."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, cache_policy=policy, host_parts=1)
    )
    assert [len(parts) for parts in runner.host.layers] == [1] * NUM_LAYERS
    ids = prompts["short"]
    for chunk in (4, 16):
        assert runner.uses_whole_layer(chunk) == (chunk == 16)  # exact mode, then whole-layer mode
        pre = hybridlm.prefill(runner, ids, chunk_size=chunk, max_new_tokens=3)
        np.testing.assert_allclose(
            np.asarray(pre.logits), np.asarray(reference("short", chunk).logits), atol=1e-5, rtol=1e-5
        )
    ref = hybridlm.prefill(base_runner, ids, chunk_size=16, max_new_tokens=3)  # its states are donated below
    switches = _count_calls(monkeypatch, jax.lax, ("switch",))
    assert_decode_matches(runner, base_runner, pre, ref, len(ids), 3)
    assert decode.IN_HOST in runner.paged_view.sources and decode.MIXED not in runner.paged_view.sources
    assert switches["switch"] == 0


def test_host_parts_errors(tiny, host_experts):
    eb = host_experts.layout.nbytes
    with pytest.raises(ValueError, match="host_parts=0 must be >= 1"):
        OffloadedRunner(tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, host_parts=0))
    with pytest.raises(ValueError, match=f"host_parts=1, but host_experts hold {HOST_PARTS} buffers a layer"):
        OffloadedRunner(
            tiny, OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, host_parts=1), host_experts=host_experts
        )
    with pytest.raises(ValueError, match="parts=0: a layer needs at least one host buffer"):
        HostExperts.from_model(tiny, parts=0)


@pytest.mark.parametrize("policy,layers_budget,want_hits", [("lru", NUM_LAYERS, TOP_K), ("stream", 3, 0)])
def test_device_paged_decode_counts_hits_per_layer(
    tiny, host_experts, prompts, policy, layers_budget, want_hits
):
    """Per layer, a device-paged step's hits are its routed copies found on the device: all of them when every
    expert fits, none under "stream" (which keeps nothing and fills no slots for decode)."""
    eb = host_experts.layout.nbytes
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(expert_budget=layers_budget * NUM_EXPERTS * eb, cache_policy=policy),
        host_experts=host_experts,
    )
    ids = prompts["short"]
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=2)
    token = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    logits, _ = runner.decode_step(token, pre.states, len(ids))
    assert np.isfinite(np.asarray(logits)).all()
    stats = runner.stats()["decode"]
    assert_stats_add_up(stats, eb)
    assert [s["hits"] for s in stats["per_layer"]] == [want_hits] * NUM_LAYERS
    assert [s["lookups"] for s in stats["per_layer"]] == [TOP_K] * NUM_LAYERS


def test_device_paged_decode_falls_back_to_layers_for_large_batches(tiny, host_experts, prompts, monkeypatch):
    """Batches past OffloadConfig.paged_max_copies routed copies a layer take the layer-by-layer step; an
    unknown decode_paging is refused by name."""
    eb = host_experts.layout.nbytes
    with pytest.raises(ValueError, match="decode_paging"):
        OffloadedRunner(
            tiny,
            OffloadConfig(expert_budget=3 * NUM_EXPERTS * eb, decode_paging="gpu"),
            host_experts=host_experts,
        )
    runner = OffloadedRunner(
        tiny,
        OffloadConfig(
            expert_budget=3 * NUM_EXPERTS * eb, cache_policy="lru", paged_max_copies=TOP_K
        ),  # one sequence's copies
        host_experts=host_experts,
    )
    ids = np.stack([prompts["short"], prompts["short"][::-1]])
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=2)
    calls = _count_calls(monkeypatch, decode, ("decode_paged",))
    _count_calls(monkeypatch, programs, ("mix_route",), calls)
    token = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    logits, _ = runner.decode_step(token, pre.states, ids.shape[1])
    assert np.isfinite(np.asarray(logits)).all()
    assert calls == {"decode_paged": 0, "mix_route": NUM_LAYERS}

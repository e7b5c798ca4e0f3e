"""Host-offload expert scheduler: experts in pinned host memory, paged into a device pool around the jitted
per-layer phases of `LayerwiseRunner`.

Per chunk and layer i (see docs/offload.md):
  1. `_mix`, `_route` run on the device as in the all-resident runner.
  2. Which experts are needed:
     - exact mode (small chunks, decode): the router's top-k ids of the valid tokens are read back to the host.
       This is a device -> host sync per layer, inherent to routing-driven paging.
     - whole-layer mode (chunk tokens * top_k >= 4 * experts, where a chunk touches nearly every expert): all
       experts of the layer, no sync.
  3. Misses get a slot (eviction by the cache policy) and are copied host -> device (a whole layer as one
     `jax.device_put` of its contiguous pinned buffer, a subset as row copies inside one jitted program); then copies for the *next* layers are issued (prefetch, see below) so they run
     while this layer computes; then the host waits for this layer's copies (measured as stall), writes the
     staged bytes into the pool slots (one jitted scatter) and launches the grouped matmul on the pool with
     expert ids remapped to slot ids.
  Prefetch: exact mode applies layer i+1's router to the hidden state after layer i's mixer (a prediction,
  read back together with layer i's ids); whole-layer mode streams whole layers i+1..i+depth (double
  buffering when depth = 1). Prefetched bytes wait in device staging buffers and are written into the pool
  only when their layer runs, so the compute stream never waits on a copy it does not need yet.

Device memory: pool slots + staging buffers <= expert_budget. The trunk (embeddings, mixers, router, shared
expert, head) stays on the device.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridlm.engine.runner import LayerwiseRunner, PhaseTimer, _embed, _mix, _route
from hybridlm.model import HybridLM
from hybridlm.offload.expert_cache import (
    POLICIES,
    CacheStats,
    ExpertCache,
    ExpertLayout,
    Key,
    LayerStats,
    format_bytes,
    parse_bytes,
)
from hybridlm.state import LayerState

Prefetch = Literal["auto", "router", "layer", "none"]


class Staged(NamedTuple):
    """Expert bytes copied to the device, waiting to be written into pool slots."""

    buf: jax.Array            # uint8 [m, nbytes] in device memory
    keys: list[Key]           # the (layer, expert) of each row
    in_program: bool = False  # copied inside a compute program (ready when that program ends: not a stall)
WHOLE_LAYER_FACTOR = 4   # whole-layer mode when chunk tokens * top_k >= 4 * experts (~98% of experts touched)


def pinned_host_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def device_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="device")


def measure_h2d_gbps(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Pinned host -> device bandwidth of one `nbytes` `jax.device_put`, in GB/s (10^9 bytes/s), median of
    `repeats` copies: the transfer floor of an offloaded prefill is bytes moved / this."""
    x = jax.device_put(np.ones((nbytes,), np.uint8), pinned_host_sharding())
    jax.block_until_ready(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(x, device_sharding()))
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


@functools.partial(jax.jit, static_argnums=0)
def _pack_layer(layout: ExpertLayout, gate_up, down) -> jax.Array:
    return layout.pack(jax.tree_util.tree_leaves((gate_up, down)))    # [experts, nbytes] uint8


@jax.jit
def _gather_to_device(host_layer: jax.Array, rows: jax.Array) -> jax.Array:
    """host_layer[rows] on the device: one host -> device copy per row, issued by XLA inside one program.

    host_layer: uint8 [experts, nbytes] in pinned host memory; rows: int32 [m]. Returns uint8 [m, nbytes] in
    device memory. Each row is a dynamic slice of the host buffer moved to the device (XLA's host offloader
    turns it into an asynchronous copy of just that row); measured on an H100 at 33-35 GB/s for 64-256 rows
    of 1.6 MB, against 21 GB/s for the same rows as separate `jax.device_put`s of per-expert buffers
    (benchmarks/h2d_copies.py).
    """
    out = [jax.device_put(jax.lax.dynamic_index_in_dim(host_layer, rows[j], keepdims=False), jax.memory.Space.Device)
           for j in range(rows.shape[0])]
    return jnp.stack(out)


MAX_ROWS_PER_COPY = 32   # row copies per gather program: bounds its (unrolled) size and compile time


def power_of_two_parts(n: int, cap: int = MAX_ROWS_PER_COPY) -> list[int]:
    """n as batches of `cap` (a power of two) then distinct smaller powers of two, largest first (cap 32: 77 ->
    [32, 32, 8, 4, 1]): batch sizes of row copies, so that the gather program compiles for at most
    log2(cap) + 1 shapes and moves no padding bytes."""
    full, rest = divmod(n, cap)
    return [cap] * full + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


class HostExperts:
    """Every layer's experts in pinned host memory, one contiguous uint8 `jax.Array` [experts, nbytes] per layer.

    One buffer per layer, so that a whole layer moves in one copy at the full pinned host -> device rate (50
    GB/s measured on an H100 for a 0.4 GB layer, against 21 GB/s for 256 per-expert buffers); a subset of
    experts moves as row copies of the same buffer (`to_device`).

    Args:
      layout: byte layout of one expert.
      layers: layers[layer] -> uint8 [experts, layout.nbytes] jax.Array with memory_kind="pinned_host".

    Raises:
      ValueError: layers of different shapes, or rows of a size other than layout.nbytes.
    """

    def __init__(self, layout: ExpertLayout, layers: list[jax.Array]):
        shapes = {tuple(buf.shape) for buf in layers}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[1] != layout.nbytes:
            raise ValueError(f"host expert buffers must all be [experts, {layout.nbytes}] uint8; got shapes "
                             f"{sorted(shapes)}")
        self.layout = layout
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return self.layers[0].shape[0]

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.layout.nbytes

    @staticmethod
    def pack_layer(gate_up, down, host_sharding=None) -> tuple[ExpertLayout, jax.Array]:
        """One layer's experts (device arrays or QuantizedWeights [experts, ...]) -> (layout, pinned buffer
        uint8 [experts, nbytes]). Packs on the device (bitcasts, no host round trip), then one copy to the host."""
        layout = ExpertLayout.of(gate_up, down)
        return layout, jax.device_put(_pack_layer(layout, gate_up, down), host_sharding or pinned_host_sharding())

    @classmethod
    def from_model(cls, model: HybridLM, host_sharding=None) -> HostExperts:
        """Copies the experts of `model` (its values are left in place) to pinned host memory."""
        layout, layers = None, []
        for layer in model.layers:
            layout, buffer = cls.pack_layer(layer.ffn.experts_gate_up.get_value(),
                                            layer.ffn.experts_down.get_value(), host_sharding)
            layers.append(buffer)
        return cls(layout, layers)

    def to_device(self, layer: int, experts=None, sharding=None) -> list[tuple[jax.Array, list[int]]]:
        """Issues the host -> device copies of some experts of `layer` (asynchronous; nothing waits).

        Args:
          layer: layer index.
          experts: expert ids (any order, no repeats); None: the whole layer in one copy.
          sharding: destination (default: device memory of the first device).

        Returns:
          [(uint8 [m, nbytes] device array, the m expert ids of its rows)]: one entry for a whole layer, else
          one per part of `power_of_two_parts(len(experts))`.
        """
        sharding = sharding or device_sharding()
        if experts is None or len(experts) == self.num_experts and list(experts) == list(range(self.num_experts)):
            return [(jax.device_put(self.layers[layer], sharding), list(range(self.num_experts)))]
        experts = [int(e) for e in experts]
        out, at = [], 0
        for m in power_of_two_parts(len(experts)):
            ids = experts[at:at + m]
            at += m
            out.append((_gather_to_device(self.layers[layer], jnp.asarray(ids, jnp.int32)), ids))
        return out

    def unpack_layer(self, layer: int, sharding=None):
        """All experts of `layer` on the device as the model holds them: (gate_up, down) [experts, ...]."""
        return _unpack_all(self.layout, jax.device_put(self.layers[layer], sharding or device_sharding()))


@functools.partial(jax.jit, static_argnums=0)
def _unpack_all(layout: ExpertLayout, staged):
    return layout.unpack(staged)


@functools.partial(jax.jit, static_argnums=0)
def _predict_ids(graphdef, params, h):
    """Layer graphdef/params's router on h [batch, seq, hidden] (a guess of its experts before its mixer ran)."""
    layer = nnx.merge(graphdef, params)
    batch, seq, hidden = h.shape
    return layer.ffn.route(layer.post_norm(h).reshape(batch * seq, hidden))[1]


@functools.partial(jax.jit, static_argnums=(0, 9))
def _pool_experts(graphdef, params, pool, slot_table, h, u, weights, ids, num_valid, compact):
    """`_experts` of the all-resident runner on the pool.

    compact=False: the grouped matmul runs on the whole pool (groups = slots) with ids remapped to slots.
    compact=True (whole-layer mode): the layer's experts are first gathered from the pool into a contiguous
    [experts, ...] array (a device copy of one layer, ~1 ms per GB of experts), so the grouped matmul sees
    exactly the shapes, group order and tile sizes of the all-resident model.
    """
    layer = nnx.merge(graphdef, params)
    if compact:
        pool = jax.tree_util.tree_map(lambda p: p[slot_table], pool)   # [experts, ...] in expert order
    else:
        ids = slot_table[ids]                                         # [tokens, top_k] expert id -> pool slot
    layer.ffn.experts_gate_up.set_value(pool[0])
    layer.ffn.experts_down.set_value(pool[1])
    batch, seq, hidden = h.shape
    valid = jnp.broadcast_to(jnp.arange(seq) < num_valid, (batch, seq)).reshape(-1)
    return h + layer.ffn.experts(u, weights, ids, valid).reshape(batch, seq, hidden)


def _rows_to_device(host_layer: jax.Array, rows: tuple[int, int]) -> jax.Array:
    """host_layer[rows[0]:rows[1]] (pinned host, static bounds) moved to device memory inside a jitted program."""
    return jax.device_put(host_layer[rows[0]:rows[1]], jax.memory.Space.Device)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _mix_copying(graphdef, params, x, state, start, num_valid, host_layer, rows):
    """`_mix`, and rows of a host expert buffer copied to the device beside it (returned third)."""
    x, state = _mix(graphdef, params, x, state, start, num_valid)
    return x, state, _rows_to_device(host_layer, rows)


@functools.partial(jax.jit, static_argnums=(0, 9, 11))
def _pool_experts_copying(graphdef, params, pool, slot_table, h, u, weights, ids, num_valid, compact, host_layer,
                          rows):
    """`_pool_experts`, and rows of a host expert buffer copied to the device beside it (returned second)."""
    out = _pool_experts(graphdef, params, pool, slot_table, h, u, weights, ids, num_valid, compact)
    return out, _rows_to_device(host_layer, rows)


def _placeholder_experts(params):
    """A copy of a layer's params tree whose expert weights are 1-element placeholders (no device memory)."""
    params = jax.tree_util.tree_map(lambda x: x, params)
    for name in ("experts_gate_up", "experts_down"):
        params["ffn"][name].set_value(jnp.zeros((1, 1, 1), jnp.float32))
    return params


class OffloadedRunner(LayerwiseRunner):
    """A `LayerwiseRunner` whose routed experts live in pinned host memory and are paged into a device pool.

    Use it wherever a `LayerwiseRunner` is accepted (`hybridlm.prefill`, `hybridlm.generate`, `decode_step`);
    `stats()` returns the statistics of the last prefill and of the decode steps after it.

    Args:
      model: the model. Its trunk is used in place; its experts are copied to pinned host memory unless
        `host_experts` is given (then the model's expert values are ignored and may be placeholders).
      expert_budget: device bytes for expert slots and prefetch staging, e.g. "12GiB" or an int.
      cache_policy: "lru" | "slru" | "lfu" | "static" | "stream" (see `hybridlm.offload.expert_cache`).
      prefetch: "auto" (router prediction in exact mode, whole-layer streaming in whole-layer mode), "router",
        "layer" (whole next layers in both modes), or "none" (on-demand copies only).
      prefetch_depth: layers streamed ahead in whole-layer mode (1 = double buffering).
      whole_layer: force whole-layer mode on (True) or off (False); None: when chunk tokens * top_k >=
        4 * experts.
      host_experts: experts already in pinned host memory (e.g. built per layer for a model too large to
        initialise on the device).
      chunk_size: optional, the largest chunk (tokens per sequence) to be run, to check the budget now.
      batch: sequences per chunk for that check.
      device_memory_bytes: device memory available for the budget; None reads `device.memory_stats()`
        (bytes_limit - bytes_in_use); backends without memory stats (CPU) are not checked.
      in_program_copies: whole-layer mode: copy the next layer absent from the device inside this layer's
        mixer and experts programs (half each), where the copy overlaps their compute; False: a separate
        `jax.device_put` (which, measured on an H100 with JAX 0.11.2, runs mostly after the queued compute).

    Raises:
      ValueError: unknown policy or prefetch mode; budget above the device memory; budget below the
        experts one layer needs for one token (or for `chunk_size`); a model without MoE.
    """

    def __init__(self, model: HybridLM, *, expert_budget: int | str, cache_policy: str = "slru",
                 prefetch: Prefetch = "auto", prefetch_depth: int = 1, whole_layer: bool | None = None,
                 host_experts: HostExperts | None = None, chunk_size: int | None = None, batch: int = 1,
                 device_memory_bytes: int | None = None, in_program_copies: bool = True):
        if model.config.moe is None:
            raise ValueError("OffloadedRunner needs a sparse-MoE model (config.moe is None)")
        if cache_policy not in POLICIES:
            raise ValueError(f"unknown cache_policy {cache_policy!r}; choose from {POLICIES}")
        if prefetch not in ("auto", "router", "layer", "none"):
            raise ValueError(f"unknown prefetch {prefetch!r}; choose from auto, router, layer, none")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={prefetch_depth} must be >= 1")
        super().__init__(model)
        self.budget = parse_bytes(expert_budget)
        self.cache_policy, self.prefetch, self.prefetch_depth = cache_policy, prefetch, prefetch_depth
        self.whole_layer = whole_layer
        self.in_program_copies = in_program_copies
        self.device = jax.devices()[0]
        self.dev_sharding = device_sharding(self.device)
        moe = self.config.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.num_layers = self.config.num_layers

        # Device memory check before any copy.
        free = device_memory_bytes
        if free is None:
            stats = self.device.memory_stats()
            if stats and "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if free is not None and self.budget > free:
            raise ValueError(f"expert_budget={self.budget} bytes ({format_bytes(self.budget)}) exceeds the free "
                             f"device memory {free} bytes ({format_bytes(free)}) on {self.device}")

        if host_experts is not None:
            if host_experts.num_layers != self.num_layers or host_experts.num_experts != self.num_experts:
                raise ValueError(f"host_experts hold {host_experts.num_layers} layers x {host_experts.num_experts} "
                                 f"experts; the model has {self.num_layers} x {self.num_experts}")
            layout = host_experts.layout
        else:
            ffn = model.layers[0].ffn
            layout = ExpertLayout.of(ffn.experts_gate_up.get_value(), ffn.experts_down.get_value())
        self.expert_bytes = layout.nbytes
        self.total_slots = self.budget // self.expert_bytes
        self.check_chunk(batch * (chunk_size or 1))      # before copying anything to the host
        self.host = host_experts if host_experts is not None else HostExperts.from_model(model)
        # Per-layer trunk params without expert weights: the runner holds no device copy of any expert.
        self.layers = [(g, _placeholder_experts(p)) for g, p in self.layers]
        self.cache: ExpertCache | None = None
        self._staged: dict[Key, Staged] = {}     # pending (prefetched) keys -> their staged batch
        self._kind = "prefill"
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self._t_start: float | None = None

    # ----- budget -----
    def min_experts(self, tokens: int) -> int:
        """Experts one layer may need for a chunk of `tokens` tokens: top_k * tokens, capped at experts."""
        return min(self.top_k * tokens, self.num_experts)

    def check_chunk(self, tokens: int) -> None:
        """Raises ValueError if the budget cannot hold one layer's active experts for `tokens` tokens."""
        need = self.min_experts(tokens)
        if self.total_slots < need:
            raise ValueError(
                f"expert_budget={self.budget} bytes ({format_bytes(self.budget)}) holds {self.total_slots} "
                f"experts of {self.expert_bytes} bytes, but one layer needs up to {need} experts "
                f"({need * self.expert_bytes} bytes = min(top_k={self.top_k} x {tokens} tokens, "
                f"{self.num_experts} experts)) for one chunk")

    def _whole(self, tokens: int) -> bool:
        if self.whole_layer is not None:
            return self.whole_layer
        return self.top_k * tokens >= WHOLE_LAYER_FACTOR * self.num_experts

    def _ensure_pool(self, tokens: int) -> None:
        need = self.min_experts(tokens)
        whole = self._whole(tokens)
        if whole:
            need = self.num_experts
        if self.cache is not None and self.cache.num_slots >= need:
            return
        self.check_chunk(tokens)
        if self.total_slots < need:   # forced whole-layer mode on a budget below one layer
            raise ValueError(f"whole_layer=True needs {need} expert slots ({need * self.expert_bytes} bytes); "
                             f"expert_budget={self.budget} bytes holds {self.total_slots}")
        # Staging for prefetched experts comes out of the budget too: up to prefetch_depth layers (whole-layer
        # mode) or one layer's active experts (exact mode), leaving at least `need` pool slots.
        everything = self.num_layers * self.num_experts
        want = 0 if self.prefetch == "none" else self.num_experts * (self.prefetch_depth if whole else 1)
        if self.total_slots >= everything:     # all experts fit: one slot each, spare budget for staging
            slots = everything
            staging = min(want, self.total_slots - everything)
        else:
            staging = max(0, min(want, (self.total_slots - need) // 2))
            slots = self.total_slots - staging
        working = need + (staging if self.prefetch != "none" else 0)
        pinned = max(0, slots - working) if self.cache_policy == "static" else 0
        self.staging_slots = staging
        self._staged.clear()
        self.cache = None
        self.cache = ExpertCache(self.host.layout, slots, self.cache_policy, num_layers=self.num_layers,
                                 num_experts=self.num_experts, pinned_count=pinned, sharding=self.dev_sharding)

    # ----- statistics -----
    def _new_stats(self, kind: str) -> CacheStats:
        return CacheStats(kind=kind, expert_bytes=self.expert_bytes,
                          layers=[LayerStats() for _ in range(self.num_layers)])

    def on_prefill_start(self) -> None:
        """Called by `prefill` before its first chunk: starts new prefill statistics."""
        self._kind = "prefill"
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self._t_start = None

    def stats(self, per_layer: bool = True) -> dict:
        """{'prefill': last prefill's statistics, 'decode': decode steps since, 'pool': pool configuration}."""
        pool = {"budget_bytes": self.budget, "expert_bytes": self.expert_bytes, "policy": self.cache_policy,
                "prefetch": self.prefetch, "prefetch_depth": self.prefetch_depth,
                "slots": self.cache.num_slots if self.cache else None,
                "staging_slots": getattr(self, "staging_slots", None),
                "pinned": len(self.cache.pinned) if self.cache else 0}
        return {"prefill": self._prefill_stats.to_dict(per_layer), "decode": self._decode_stats.to_dict(per_layer),
                "pool": pool}

    def head_logits(self, x_last: jax.Array) -> jax.Array:
        logits = super().head_logits(x_last)
        if self._t_start is not None:
            jax.block_until_ready(logits)
            stats = self._prefill_stats if self._kind == "prefill" else self._decode_stats
            stats.wall_s += time.perf_counter() - self._t_start
            self._t_start = None
        self._kind = "decode"   # what follows a prefill's logits is decode
        return logits

    # ----- the schedule -----
    def _needed(self, ids: np.ndarray, batch: int, seq: int, num_valid: int) -> np.ndarray:
        ids = ids.reshape(batch, seq, -1)[:, :num_valid]
        return np.unique(ids)

    def _stage(self, keys: list[Key]) -> list[Staged]:
        """Issues the host -> device copies of `keys` (asynchronous), grouped by layer: a layer's whole set of
        experts in one copy, a subset as row copies. Returns [(uint8 [m, nbytes] device array, its m keys)]."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in keys:
            by_layer.setdefault(layer, []).append(e)
        out = []
        for layer, experts in by_layer.items():
            for buf, ids in self.host.to_device(layer, experts, self.dev_sharding):
                out.append(Staged(buf, [(layer, e) for e in ids]))
        return out

    def _allocate_prefetch(self, keys, protected: set, stats: CacheStats, layer_now: int) -> list[Key]:
        """Allocates slots for predicted `keys` (best effort within staging and slots); returns those allocated."""
        cache = self.cache
        issue = []
        for key in keys:
            if key in cache or len(self._staged) + len(issue) >= self.staging_slots:
                continue
            got = cache.allocate(key, protected)
            if got is None:
                break
            protected.add(key)
            if got[1] is not None:
                stats.layers[layer_now].evictions += 1
            issue.append(key)
        return issue

    def _record_prefetch(self, pending: Staged, stats: CacheStats) -> None:
        for key in pending.keys:
            self._staged[key] = pending
            self.cache.speculative.add(key)
            s = stats.layers[key[0]]
            s.prefetched += 1
            s.bytes_h2d += self.expert_bytes

    def _prefetch(self, keys, protected: set, stats: CacheStats, layer_now: int) -> None:
        """Allocates slots for predicted `keys` and issues their copies; best effort within staging and slots."""
        for pending in self._stage(self._allocate_prefetch(keys, protected, stats, layer_now)):
            self._record_prefetch(pending, stats)

    def _lookup(self, keys: list[Key], s: LayerStats, protected: set) -> list[Key]:
        """Counts hits and misses of one layer's `keys`, allocates slots for the misses not already prefetched;
        returns those (to copy on demand)."""
        cache = self.cache
        s.lookups += len(keys)
        demand = []
        for key in keys:
            if key in self._staged or key in cache.speculative:
                s.misses += 1
                s.prefetch_used += 1
                cache.speculative.discard(key)   # its insertion was its first use for the policy
            elif cache.lookup(key):
                s.hits += 1
            else:
                s.misses += 1
                got = cache.allocate(key, protected)
                assert got is not None, "pool smaller than one layer's active experts"
                if got[1] is not None:
                    s.evictions += 1
                demand.append(key)
        return demand

    def forward_chunk(self, ids: jax.Array, states: list[LayerState], start, num_valid: int,
                      timer: PhaseTimer | None = None) -> tuple[jax.Array, list[LayerState]]:
        """`LayerwiseRunner.forward_chunk` with experts paged from host memory (same arguments and results)."""
        timer = timer or PhaseTimer(False)
        batch, seq = ids.shape
        tokens = batch * seq
        self._ensure_pool(tokens)          # budget errors before any work
        whole = self._whole(tokens)
        stats = self._prefill_stats if self._kind == "prefill" else self._decode_stats
        if self._t_start is None:
            self._t_start = time.perf_counter()
        stats.chunks += 1
        stats.tokens += tokens
        cache, num_layers, E = self.cache, self.num_layers, self.num_experts
        stream = self.cache_policy == "stream"
        nv = int(num_valid)
        start = jnp.asarray(start, jnp.int32)
        num_valid_dev = jnp.asarray(num_valid, jnp.int32)
        x = timer("embed", _embed, self.embed_table, ids)
        new_states = []
        use_router = self.prefetch in ("auto", "router") and not whole
        stream_layers = self.prefetch == "layer" or (self.prefetch != "none" and whole)
        for i, ((graphdef, params), state, layer_type) in enumerate(zip(self.layers, states, self.config.layer_types)):
            s = stats.layers[i]
            phase = "gdn" if layer_type == "linear_attention" else "attention"
            batches: list[Staged] = []
            in_program = None      # (layer, host buffer): its two halves are copied inside this layer's programs
            if whole:
                # Every expert is needed: lookups and on-demand copies now, then the next layers' copies. The
                # first layer wholly absent from the device is copied by this layer's own programs (mixer: rows
                # [0, E/2), experts: [E/2, E)), where XLA runs the copy beside the compute; a standalone
                # device_put would run after it (benchmarks/h2d_copies.py); the rest through `_prefetch`.
                keys = [(i, e) for e in range(E)]
                protected = set(keys) | set(self._staged)
                demand = self._lookup(keys, s, protected)
                batches = self._stage(demand)
                s.bytes_h2d += len(demand) * self.expert_bytes
                if stream_layers:
                    predicted = [(j, e) for j in range(i + 1, min(i + 1 + self.prefetch_depth, num_layers))
                                 for e in range(E)]
                    issue = self._allocate_prefetch(predicted, protected, stats, i)
                    for j in sorted({k[0] for k in issue}):
                        layer_keys = [k for k in issue if k[0] == j]
                        if in_program is None and self.in_program_copies and len(layer_keys) == E:
                            in_program = (j, self.host.layers[j])
                        else:
                            for pending in self._stage(layer_keys):
                                self._record_prefetch(pending, stats)
            half = E // 2
            if in_program is not None:
                x, state, copied = timer(phase, _mix_copying, graphdef, params, x, state, start, num_valid_dev,
                                         in_program[1], (0, half))
                self._record_prefetch(Staged(copied, [(in_program[0], e) for e in range(half)], True), stats)
            else:
                x, state = timer(phase, _mix, graphdef, params, x, state, start, num_valid_dev)
            new_states.append(state)
            u, weights, expert_ids = timer("router", _route, graphdef, params, x)

            if not whole:
                # Which experts (this layer, from the router: a device -> host sync) and which to prefetch.
                guess = _predict_ids(*self.layers[i + 1], x) if use_router and i + 1 < num_layers else None
                needed = self._needed(np.asarray(expert_ids), batch, seq, nv)
                keys = [(i, int(e)) for e in needed]
                protected = set(keys) | set(self._staged)
                demand = self._lookup(keys, s, protected)
                batches = self._stage(demand)
                s.bytes_h2d += len(demand) * self.expert_bytes
                predicted: list[Key] = []
                if guess is not None:
                    predicted = [(i + 1, int(e)) for e in self._needed(np.asarray(guess), batch, seq, nv)]
                if stream_layers:
                    predicted = [(j, e) for j in range(i + 1, min(i + 1 + self.prefetch_depth, num_layers))
                                 for e in range(E)]
                if predicted:     # issued now: they run behind this layer's copies and beside its compute
                    self._prefetch(predicted, protected, stats, i)

            # This layer's bytes: wait for those copied outside the programs (stall), write all into their slots,
            # run the experts on the pool.
            for key in [k for k in self._staged if k[0] == i]:
                pending = self._staged.pop(key)
                if not any(b is pending for b in batches):
                    batches.append(pending)
            outside = [b.buf for b in batches if not b.in_program]
            if outside:
                t0 = time.perf_counter()
                jax.block_until_ready(outside)
                s.stall_s += time.perf_counter() - t0
            for b in batches:
                cache.write(b.buf, [cache.slot_of[k] for k in b.keys])
            table = jnp.asarray(cache.slot_table(i))
            compact = whole and cache.num_slots > E
            args = (graphdef, params, cache.pool, table, x, u, weights, expert_ids, num_valid_dev, compact)
            if in_program is not None:
                x, copied = timer("experts", _pool_experts_copying, *args, in_program[1], (half, E))
                self._record_prefetch(Staged(copied, [(in_program[0], e) for e in range(half, E)], True), stats)
            else:
                x = timer("experts", _pool_experts, *args)
            if stream:
                cache.release_layer(i, keep=self._staged)
        cache.speculative.clear()   # unused prefetches stay cached as ordinary entries (counted in `prefetched`)
        return x, new_states

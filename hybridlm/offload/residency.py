"""Where each layer's experts are on the device: the pool (`ExpertCache`), layers held outside it, bytes
staged for a later layer, and host parts queued for an in-program copy; the budget split between them."""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import numpy as np

from hybridlm.offload.config import OffloadConfig
from hybridlm.offload.expert_cache import ExpertCache, PackedExperts, format_bytes
from hybridlm.offload.host import MAX_ROWS_PER_COPY, HostExperts
from hybridlm.offload.part_queue import PartQueue
from hybridlm.offload.policies import Key, static_pinned_keys
from hybridlm.offload.stats import CacheStats, LayerStats


class Staged(NamedTuple):
    """Expert bytes copied to the device, waiting to be written into pool slots."""

    buf: jax.Array  # uint8 [m, nbytes] in device memory
    keys: list[Key]  # the (layer, expert) of each row
    in_program: bool = False  # copied inside a compute program (ready when that program ends: not a stall)


def check_budget(budget: int, expert_bytes: int, top_k: int, num_experts: int, tokens: int) -> None:
    """Raises ValueError if `budget` bytes cannot hold one layer's active experts for a chunk of `tokens`
    tokens."""
    slots, need = budget // expert_bytes, min(top_k * tokens, num_experts)
    if slots < need:
        raise ValueError(
            f"expert_budget={budget} bytes ({format_bytes(budget)}) holds {slots} experts of {expert_bytes} "
            "bytes, "
            f"but one layer needs up to {need} experts ({need * expert_bytes} bytes = min(top_k={top_k} x "
            f"{tokens} tokens, {num_experts} experts)) for one chunk"
        )


class Residency:
    """The device side of an offloaded model: pool slots, held layers, staging and the part queue.

    Args:
      host: the experts in pinned host memory.
      config: the runner's options (policy, prefetch, thresholds).
      num_layers, num_experts, top_k: the model's MoE shape.
      budget: device bytes for expert slots and staging.
      sharding: device-memory sharding of the pool.
    """

    def __init__(
        self,
        host: HostExperts,
        config: OffloadConfig,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        budget: int,
        sharding,
    ):
        self.host, self.config = host, config
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        # a pool slot and a held expert keep the host bytes that a copy moves (`PackedExperts`)
        self.budget, self.expert_bytes, self.copy_bytes = budget, host.layout.nbytes, host.layout.nbytes
        self.total_slots = budget // self.expert_bytes
        self.sharding = sharding
        self.cache: ExpertCache | None = None
        self.held_layers: frozenset[int] = frozenset()  # whole-layer mode: held outside the pool
        self.held: dict[int, PackedExperts] = {}  # ... those loaded: layer -> its experts on the device
        self.staged: dict[Key, Staged] = {}  # pending (prefetched) keys -> their staged batch
        self.queue = PartQueue(num_layers)  # (layer, host part) allocated, to be copied inside a program
        self.staging_slots: int | None = None
        self._pool_for_holding = False  # the pool was sized for holding layers (may hold none)
        self._part_keys: dict[tuple[int, int], list[Key]] = {}  # see `part_keys`

    # ----- budget -----
    def min_experts(self, tokens: int) -> int:
        """Experts one layer may need for a chunk of `tokens` tokens: top_k * tokens, capped at experts."""
        return min(self.top_k * tokens, self.num_experts)

    def check_chunk(self, tokens: int) -> None:
        """Raises ValueError if the budget cannot hold one layer's active experts for `tokens` tokens."""
        check_budget(self.budget, self.expert_bytes, self.top_k, self.num_experts, tokens)

    def uses_whole_layer(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` tokens (batch x seq) runs in whole-layer mode."""
        if self.config.whole_layer is not None:
            return self.config.whole_layer
        return self.top_k * tokens >= self.config.whole_layer_factor * self.num_experts

    def _holds_layers(self, whole: bool) -> bool:
        """Whether a pool built for this mode holds layers outside it (see `ensure`)."""
        everything = self.num_layers * self.num_experts
        if not whole or self.config.cache_policy == "stream":
            return False
        return self.config.cache_policy == "static" or self.total_slots >= everything

    def ensure(self, tokens: int) -> bool:
        """Builds the pool for chunks of `tokens` tokens unless the current one serves them; True if built.

        A pool first built for exact mode (decode, small chunks) is rebuilt once for the first whole-layer
        chunk that should hold layers outside it; one built holding layers serves exact mode as it is.

        Raises:
          ValueError: the budget cannot hold one layer's experts for such a chunk.
        """
        need = self.min_experts(tokens)
        whole = self.uses_whole_layer(tokens)
        if whole:
            need = self.num_experts
        if (
            self.cache is not None
            and self.cache.num_slots >= need
            and (not self._holds_layers(whole) or self._pool_for_holding)
        ):
            return False
        self.check_chunk(tokens)
        if self.total_slots < need:  # forced whole-layer mode on a budget below one layer
            raise ValueError(
                f"whole_layer=True needs {need} expert slots ({need * self.expert_bytes} bytes); "
                f"expert_budget={self.budget} bytes holds {self.total_slots}"
            )
        slots, staging, pinned = self._split_budget(need, whole)
        self.staging_slots = staging
        self.staged.clear()
        self.queue.clear()
        self.cache = None
        self.cache = ExpertCache(
            self.host.layout,
            slots,
            self.config.cache_policy,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            pinned_count=pinned,
            sharding=self.sharding,
        )
        # No compilation inside a timed prefill: the row-copy programs and the pool writes of every batch size
        # (a whole part, or a power of two of rows).
        self.host.compile_row_copies(self.sharding)
        sizes = set(self.host.part_rows) | {1 << b for b in range(MAX_ROWS_PER_COPY.bit_length())}
        self.cache.compile_writes(sizes, self.sharding)
        return True

    def _split_budget(self, need: int, whole: bool) -> tuple[int, int, int]:
        """(pool slots, staging slots, static pinned experts) of the budget; sets the held layers."""
        config, E = self.config, self.num_experts
        # Staging for prefetched experts comes out of the budget too: up to prefetch_depth layers (whole-layer
        # mode) or one layer's active experts (exact mode), leaving at least `need` pool slots.
        everything = self.num_layers * E
        # Whole-layer mode holds depth + 1 layers of staged bytes at once: the layer about to be written into
        # the pool and the `prefetch_depth` layers being copied behind it.
        want = 0 if config.prefetch == "none" else E * (config.prefetch_depth + 1 if whole else 1)
        if self.total_slots >= everything:  # all experts fit: one slot each, spare budget for staging
            slots = everything
            staging = min(want, self.total_slots - everything)
        else:
            staging = max(0, min(want, (self.total_slots - need) // 2))
            slots = self.total_slots - staging
        working = need + (staging if config.prefetch != "none" else 0)
        pinned = max(0, slots - working) if config.cache_policy == "static" else 0
        self.held_layers, self.held = frozenset(), {}
        self._pool_for_holding = self._holds_layers(whole)
        if self._pool_for_holding:
            # Whole layers only (a partial layer would move as row copies, outside the programs), held outside
            # the pool as the all-resident model holds them, so that no pinned layer is gathered out of the
            # pool for each use. With every expert fitting, lru / slru / lfu never evict: they hold layers
            # like static and keep the other layers in the pool, which then holds them all.
            hold = max(0, slots - working)
            hold -= hold % E
            self.held_layers = frozenset(k[0] for k in static_pinned_keys(self.num_layers, E, hold))
            slots, pinned = slots - hold, 0
        return slots, staging, pinned

    # ----- lookups and prefetch -----
    def part_keys(self, layer: int, part: int) -> list[Key]:
        """The keys of host part `part` of `layer` (one list per part, made once: whole-layer mode asks for
        each part's several times a chunk; callers only read it)."""
        keys = self._part_keys.get((layer, part))
        if keys is None:
            keys = self._part_keys[(layer, part)] = [(layer, e) for e in self.host.part_experts(part)]
        return keys

    def queued_experts(self) -> int:
        return sum(self.host.part_rows[p] for _, p in self.queue)

    def lookup(self, keys: list[Key], s: LayerStats, protected: set) -> list[Key]:
        """Counts hits and misses of one layer's `keys`, allocates slots for the misses not already
        prefetched; returns those (to copy on demand)."""
        cache = self.cache
        s.lookups += len(keys)
        demand = []
        for key in keys:
            if key in self.staged or key in cache.speculative:
                s.misses += 1
                s.prefetch_used += 1
                cache.speculative.discard(key)  # its insertion was its first use for the policy
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

    def allocate_prefetch(self, keys, protected: set, stats: CacheStats, layer_now: int) -> list[Key]:
        """Allocates slots for predicted `keys` (best effort within staging and slots); returns those
        allocated."""
        cache = self.cache
        issue = []
        room = self.staging_slots - len(self.staged) - self.queued_experts()
        for key in keys:
            if key in cache or key[0] in self.held_layers or len(issue) >= room:
                continue
            got = cache.allocate(key, protected)
            if got is None:
                break
            protected.add(key)
            if got[1] is not None:
                stats.layers[layer_now].evictions += 1
            issue.append(key)
        return issue

    def count_prefetch(self, keys: list[Key], stats: CacheStats) -> None:
        self.cache.speculative.update(keys)
        per_layer = collections.Counter(layer for layer, _ in keys)
        for layer, n in per_layer.items():
            s = stats.layers[layer]
            s.prefetched += n
            s.bytes_h2d += n * self.copy_bytes

    def record_prefetch(self, pending: Staged, stats: CacheStats) -> None:
        self.staged.update(dict.fromkeys(pending.keys, pending))
        self.count_prefetch(pending.keys, stats)

    def prefetch(self, keys, protected: set, stats: CacheStats, layer_now: int) -> None:
        """Allocates slots for predicted `keys` and issues their copies; best effort within staging and
        slots."""
        for pending in self.stage(self.allocate_prefetch(keys, protected, stats, layer_now)):
            self.record_prefetch(pending, stats)

    # ----- copies -----
    def stage(self, keys: list[Key]) -> list[Staged]:
        """Issues the host -> device copies of `keys` (asynchronous), grouped by layer: a layer's whole set of
        experts in one copy, a subset as row copies."""
        by_layer: dict[int, list[int]] = {}
        for layer, e in keys:
            by_layer.setdefault(layer, []).append(e)
        out = []
        for layer, experts in by_layer.items():
            for buf, ids in self.host.to_device(layer, experts, self.sharding):
                out.append(Staged(buf, [(layer, e) for e in ids]))
        return out

    def put_parts(self, parts, stats: CacheStats) -> None:
        """Copies host parts [(layer, part)] with `device_put`, outside any program, and records them
        staged."""
        for j, p in parts:
            buf = jax.device_put(self.host.layers[j][p], self.sharding)
            self.record_prefetch(Staged(buf, self.part_keys(j, p)), stats)

    def record_in_program(self, taken, copied, stats: CacheStats) -> None:
        """Records host parts `taken` [(layer, part)] copied inside a program (device arrays `copied`)."""
        for (j, p), buf in zip(taken, copied, strict=True):
            self.record_prefetch(Staged(buf, self.part_keys(j, p), True), stats)

    def take_staged(self, layer: int | None = None) -> list[Staged]:
        """Removes and returns the staged batches of `layer` (None: of every layer), each batch once."""
        out: list[Staged] = []
        for key in [k for k in self.staged if layer is None or k[0] == layer]:
            pending = self.staged.pop(key)
            if not any(b is pending for b in out):
                out.append(pending)
        return out

    def hold(self, layer: int, s: LayerStats, lookups: int) -> tuple:
        """A held layer's experts (gate_up, down) on the device; `lookups` of its experts counted as hits, or
        as misses when this first use copies the layer (outside any program; its bytes counted)."""
        s.lookups += lookups
        if layer in self.held:
            s.hits += lookups
        else:
            s.misses += lookups
            s.bytes_h2d += self.num_experts * self.copy_bytes
            self.held[layer] = self.host.packed_layer(layer, self.sharding)
        return self.held[layer]

    def pool_tables(
        self, layer: int, active: list[int] | None
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(gather, remap) for `programs.pool_experts` (numpy: jit moves them, cheaper than an eager copy).

        A pool of at most one layer's experts: the grouped matmul runs on it, ids remapped to slots. A larger
        one
        never goes to the kernel whole: its leaves can pass 2**31 elements, past the kernel's int32 offsets.
        Whole-layer mode (active None) gathers the layer in expert order (the all-resident shapes); exact mode
        gathers only the chunk's `active` experts, padded to a power of two (few compiled shapes), ids
        remapped to their rows.
        """
        if self.cache.num_slots <= self.num_experts:
            return None, self.cache.slot_table(layer)
        if active is None:
            return self.cache.slot_table(layer), None
        groups = min(self.num_experts, 1 << max(0, len(active) - 1).bit_length())
        slot_of = self.cache.slot_of  # only the active experts' slots (a full table costs host time)
        gather = np.full((groups,), slot_of[(layer, active[0])], np.int32)
        gather[: len(active)] = [slot_of[(layer, e)] for e in active]
        remap = np.zeros((self.num_experts,), np.int32)
        remap[active] = np.arange(len(active), dtype=np.int32)
        return gather, remap

"""Exact mode of the prefill schedule (small chunks, layer-by-layer decode): the router's ids of each layer
are read back to the host, and only the experts they name are paged into the pool.

Per layer: the mixer, the router and the next layer's router prediction run as one program (`mix_route`); the
ids come back (a device -> host sync per layer, inherent to routing-driven paging); misses and predicted
experts get slots and are copied host -> device straight into them, one program per host part touched
(`copy_batches`), all indices in one table moved to the device once a layer (`index_table`). The host waits
for none of the copies: the device runs each before the programs that read the pool after it.
"""

from __future__ import annotations

import jax
import numpy as np

from hybridlm.offload import programs
from hybridlm.offload.host import MAX_ROWS_PER_COPY
from hybridlm.offload.policies import Key
from hybridlm.offload.residency import Residency


def needed_experts(ids: np.ndarray, batch: int, seq: int, num_valid: int) -> np.ndarray:
    """The distinct expert ids routed to the valid tokens: ids [batch * seq, top_k] -> sorted [n]."""
    return np.unique(ids.reshape(batch, seq, -1)[:, :num_valid])


class ExactMode:
    """Exact-mode mixer, router and copies of one layer (`LayerMode` of the prefill schedule).

    Args:
      residency: the runner's pool, held layers and staged bytes.
      padded_copy_bytes: padding bytes one copy program over all of a layer's parts may move
        (`OffloadConfig.padded_copy_bytes`).
    """

    whole = False

    def __init__(self, residency: Residency, padded_copy_bytes: int):
        self.res = residency
        self.padded_copy_bytes = padded_copy_bytes
        self.padded_max = 0

    def prepare(self) -> None:
        """Lays out the index table for the pool just built and compiles its copy programs (every batch
        size)."""
        res = self.res
        host, cache = res.host, res.cache
        # remap [E], gather [E], then copy batches of MAX_ROWS_PER_COPY rows and as many slots; at most
        # ceil(E / 32) + parts batches for each of two layers.
        E, C = res.num_experts, MAX_ROWS_PER_COPY
        batches = 2 * (-(-E // C) + len(host.part_rows))
        self.table_at, self.table_len = (2 * E, C), 2 * E + batches * 2 * C
        self.batch_ids = [jax.device_put(np.int32(j), res.sharding) for j in range(batches)]
        template = np.zeros((self.table_len,), np.int32)
        template[2 * E + C : 2 * E + 2 * C] = cache.num_slots  # batch 0: every row dropped
        template = jax.device_put(template, res.sharding)
        for p in sorted({host.part_rows.index(r) for r in host.part_rows}):
            cache.compile_row_copies(
                (host.layers[0][p],), template, self.batch_ids[0], self.table_at, min(C, host.part_rows[p])
            )
        # A few rows from each of a layer's parts go as one program over all of them (`copy_batches`).
        parts = len(host.part_rows)
        self.padded_max = 0
        if parts > 1 and len(set(host.part_rows)) == 1:
            self.padded_max = min(C // parts, 1 << (host.part_rows[0] - 1).bit_length())
            cache.compile_row_copies(
                tuple(host.layers[0]), template, self.batch_ids[0], self.table_at, self.padded_max
            )

    def mix_and_route(self, chunk, i: int, layers, x, state, timer, phase: str):
        """Runs layer i's mixer and router, reads its ids back, and issues its copies into the pool.

        Returns:
          (x, state, (u, weights, ids), (index table, (experts, groups)), lookups of this layer, staged
          batches).
        """
        res, stats = self.res, chunk.stats
        s, E = stats.layers[i], res.num_experts
        graph, params = layers[i]
        use_next = chunk.use_router and i + 1 < res.num_layers
        nxt = layers[i + 1] if use_next else (None, None)
        x, state, routed, guess = timer(
            phase, programs.mix_route, graph, params, *nxt, x, state, chunk.start, chunk.num_valid_dev
        )
        # Which experts (this layer, from the router: a device -> host sync) and which to prefetch.
        keys = [
            (i, int(e))
            for e in needed_experts(np.asarray(routed[2]), chunk.batch, chunk.seq, chunk.num_valid)
        ]
        protected = set(keys) | set(res.staged)
        demand = res.lookup(keys, s, protected) if i not in res.held_layers else []
        issue = []
        if guess is not None:  # copied behind this layer's misses, into the pool too
            guessed = needed_experts(np.asarray(guess), chunk.batch, chunk.seq, chunk.num_valid)
            issue = res.allocate_prefetch([(i + 1, int(e)) for e in guessed], protected, stats, i)
        table, groups, copies = self.index_table(i, [e for _, e in keys], demand + issue)
        for j, (bufs, m) in enumerate(copies):
            res.cache.copy_rows(bufs, table, self.batch_ids[j], self.table_at, m)
        s.bytes_h2d += len(demand) * res.copy_bytes
        res.count_prefetch(issue, stats)
        if chunk.stream_layers:  # whole next layers: staged, as in whole-layer mode
            depth = res.config.prefetch_depth
            predicted = [(j, e) for j in range(i + 1, min(i + 1 + depth, res.num_layers)) for e in range(E)]
            res.prefetch(predicted, protected, stats, i)
        return x, state, routed, (table, (E, groups)), len(keys), []

    def index_table(
        self, layer: int, active: list[int], copies: list[Key]
    ) -> tuple[jax.Array, int, list[tuple[tuple, int]]]:
        """Exact mode's one index table of `layer` (its experts `active` gathered out of the pool), moved to
        the device in one transfer, and its copies.

        `copies` (keys with slots allocated: this layer's misses and the next layer's predicted experts) go
        host -> device straight into their pool slots (`ExpertCache.copy_rows`, batched by `copy_batches`).
        One table and no staging keep the host time per layer low.

        Returns:
          (int32 table [table_len] on the device: remap [E] at 0 and gather [E] at E for
          `programs.pool_experts_table`, then the copy batches (rows, slots) of MAX_ROWS_PER_COPY each; the
          gather's groups (0: none); [(host buffers, rows m from each)] per batch, in table order).
        """
        res = self.res
        E, (base, width) = res.num_experts, self.table_at
        table = np.zeros((self.table_len,), np.int32)
        groups = 0
        if layer not in res.held_layers:
            gather, remap = res.pool_tables(layer, active)
            table[:E] = remap
            if gather is not None:
                groups = len(gather)
                table[E : E + groups] = gather
        by_layer: dict[int, list[int]] = {}
        for j, e in copies:
            by_layer.setdefault(j, []).append(e)
        batches = []
        for j, experts in by_layer.items():
            for bufs, rows, ids, m in self.copy_batches(j, experts):
                at = base + len(batches) * 2 * width
                for b, (r, e) in enumerate(zip(rows, ids, strict=True)):
                    lo, n = at + b * m, len(r)
                    table[lo : lo + n], table[lo + n : lo + m] = r, (r[0] if n else 0)
                    table[lo + width : lo + width + n] = [res.cache.slot_of[(j, x)] for x in e]
                    table[lo + width + n : lo + width + m] = res.cache.num_slots  # padding: dropped
                batches.append((bufs, m))
        assert len(batches) <= len(self.batch_ids), "exact-mode table too small"
        return jax.device_put(table, res.sharding), groups, batches

    def copy_batches(self, layer: int, experts: list[int]) -> list[tuple[tuple, list, list, int]]:
        """The copy programs for `experts` of `layer`: [(host buffers, rows per buffer, expert ids per buffer,
        m)].

        One program per host part touched (m = its rows rounded up to a power of two), or, when several parts
        hold a few rows each, one program over all of the layer's parts with m rows from each (padding rows
        dropped) if that pads at most `padded_copy_bytes`: a program saved costs more host time than a few
        padding rows cost copying."""
        res = self.res
        found = res.host.row_batches(experts)
        parts = res.host.layers[layer]
        if len(found) > 1 and self.padded_max:
            m = 1 << (max(len(rows) for _, rows, _ in found) - 1).bit_length()
            waste = len(parts) * m - sum(len(rows) for _, rows, _ in found)
            if m <= self.padded_max and waste * res.expert_bytes <= self.padded_copy_bytes:
                # m <= padded_max <= MAX_ROWS_PER_COPY // 2: row_batches gave each part one batch
                mine = {p: (rows, ids) for p, rows, ids in found}
                rows, ids = zip(*(mine.get(p, ([], [])) for p in range(len(parts))), strict=True)
                return [(tuple(parts), list(rows), list(ids), m)]
        return [((parts[p],), [rows], [ids], 1 << (len(rows) - 1).bit_length()) for p, rows, ids in found]

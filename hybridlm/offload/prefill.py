"""The offloaded forward pass of one chunk: per layer, page the experts it needs into the device, then run
them.

A chunk runs in one of two modes, chosen by its size (`Residency.uses_whole_layer`), each a `LayerMode` with
one method, `mix_and_route`, that runs a layer's mixer and router and issues the copies of its experts:
  - exact mode (`hybridlm.offload.exact.ExactMode`): small chunks and layer-by-layer decode; only the experts
    the router names, read back per layer.
  - whole-layer mode (`WholeLayerMode`): chunks that touch nearly every expert; every expert of the layer, no
    sync. Whole host parts of the next layers are queued (`PartQueue`) and copied inside the coming programs,
    where XLA overlaps each copy with compute; with more chunks to run, streaming runs on into the next
    chunk's first layers. Prefetched bytes wait in device staging buffers until their layer runs.
Then `PrefillSchedule.run_experts` runs the grouped matmul on the experts gathered out of the pool, on a layer
held outside it, or straight from the staged parts of a layer released after use.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from hybridlm.offload import programs
from hybridlm.offload.exact import ExactMode
from hybridlm.offload.part_queue import MAX_PARTS_PER_PROGRAM
from hybridlm.offload.residency import Residency, Staged
from hybridlm.offload.stats import CacheStats


class Chunk(NamedTuple):
    """What every layer of one chunk's pass needs to know about the chunk."""

    stats: CacheStats  # the prefill's or the decode steps' statistics
    batch: int
    seq: int
    num_valid: int  # real tokens per sequence (host int)
    start: jax.Array  # int32 absolute position of the chunk's first token
    num_valid_dev: jax.Array  # int32 num_valid on the device
    more: bool  # more chunks of this prefill follow (whole-layer streaming runs on into them)
    stream_layers: bool  # whole next layers are prefetched
    use_router: bool  # exact mode predicts the next layer's experts with its router
    twins: bool  # whole-layer mode copies host parts inside the programs


class LayerMode(Protocol):
    """One layer's mixer, router and expert copies, in exact or whole-layer mode."""

    whole: bool

    def mix_and_route(self, chunk: Chunk, i: int, layers, x, state, timer, phase: str) -> tuple:
        """Returns (x, state, (u, weights, ids), exact index table or None, lookups, staged batches)."""


class WholeLayerMode:
    """Whole-layer mode's mixer, router and copies of one layer (every expert of the layer, no ids read back).

    Args:
      residency: the runner's pool, held layers, staged bytes and part queue.
      schedule: the prefill schedule (compiles the in-program copy variants).
    """

    whole = True

    def __init__(self, residency: Residency, schedule: PrefillSchedule):
        self.res = residency
        self.schedule = schedule

    def mix_and_route(self, chunk: Chunk, i: int, layers, x, state, timer, phase: str) -> tuple:
        res = self.res
        batches = self.plan(chunk, i)
        graph, params = layers[i]
        taken = res.queue.pop(i, 0) if chunk.twins else []
        args = (x, state, chunk.start, chunk.num_valid_dev)

        def run_mix(parts, args=args):
            # the mixer and the router in one program (one dispatch fewer a layer), copying `parts` beside
            if parts:
                return programs.mix_route_copying(graph, params, *args, parts)
            return programs.mix_route(graph, params, None, None, *args)  # its guess: None

        if chunk.twins:
            self.schedule.compile_twins("mix", graph, args, run_mix, len(taken))
        x, state, routed, copied = timer(phase, run_mix, tuple(res.host.layers[j][p] for j, p in taken))
        if taken:
            res.record_in_program(taken, copied, chunk.stats)
        return x, state, routed, None, res.num_experts, batches

    def plan(self, chunk: Chunk, i: int) -> list[Staged]:
        """Lookups and copies of layer i before its mixer runs; returns its on-demand staged batches.

        Queued parts of this layer that no program copied in time move now (they stall); then lookups and
        on-demand copies; then the next layers' slots are allocated and their host parts queued, to be copied
        inside the coming programs (mixer and experts), where XLA runs a copy beside the compute (a standalone
        device_put runs after it). Partial layers move as row copies through `Residency.stage`.
        """
        res, stats, config = self.res, chunk.stats, self.res.config
        s, E, num_layers = stats.layers[i], res.num_experts, res.num_layers
        late = res.queue.take_layer(i)
        if late:
            res.put_parts(late, stats)
        keys = [] if i in res.held_layers else [(i, e) for e in range(E)]
        protected = set(keys) | set(res.staged) | {k for q in res.queue for k in res.part_keys(*q)}
        demand = res.lookup(keys, s, protected)
        batches = res.stage(demand)
        s.bytes_h2d += len(demand) * res.copy_bytes
        if chunk.stream_layers:
            ahead = range(
                i + 1, min(i + 1 + config.prefetch_depth, i + num_layers if chunk.more else num_layers)
            )
            predicted = [(j % num_layers, e) for j in ahead for e in range(E)]
            issue = res.allocate_prefetch(predicted, protected, stats, i)
            for j in sorted({k[0] for k in issue}, key=lambda j: (j - i) % num_layers):
                layer_keys = [k for k in issue if k[0] == j]
                if config.in_program_copies and len(layer_keys) == E:
                    res.queue.push([(j, p) for p in range(len(res.host.layers[j]))])
                else:
                    for pending in res.stage(layer_keys):
                        res.record_prefetch(pending, stats)
        return batches


class PrefillSchedule:
    """Runs one chunk through every layer with its experts paged (`OffloadedRunner.forward_chunk`).

    Args:
      residency: the runner's pool, held layers, staged bytes and part queue.
    """

    def __init__(self, residency: Residency):
        self.res = residency
        self.exact = ExactMode(residency, residency.config.padded_copy_bytes)
        self.whole = WholeLayerMode(residency, self)
        self._twins_run: set = set()  # see `compile_twins`

    def compile_twins(self, name, graph, args, run, copies: int) -> None:
        """The first time program `name` runs for `graph` and these argument shapes, runs its variants with
        the other numbers of in-program copies (0..MAX_PARTS_PER_PROGRAM; results discarded).

        In whole-layer mode a layer's mixer and experts programs copy 0, 1 or 2 host parts of later layers
        beside their compute, as the copy queue and the cache's contents decide; so a later prompt could need
        a variant the first did not and compile inside a timed prefill. run(parts) runs the program with host
        parts `parts`.
        """
        key = (name, graph, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)))
        if key not in self._twins_run:
            self._twins_run.add(key)
            spare = [buf for layer in self.res.host.layers for buf in layer][:MAX_PARTS_PER_PROGRAM]
            for n in range(MAX_PARTS_PER_PROGRAM + 1):
                if n != copies:
                    jax.block_until_ready(run(tuple(spare[:n])))

    def run(
        self, chunk: Chunk, mode: LayerMode, layers, layer_types, x, states, timer, taps=()
    ) -> tuple[jax.Array, list, dict]:
        """Every layer of `layers` [(graph, flat weights)] over the chunk's embeddings x; returns (x,
        states, {layer in `taps`: its output})."""
        res = self.res
        new_states, tapped = [], {}
        for i, (state, layer_type) in enumerate(zip(states, layer_types, strict=True)):
            phase = "gdn" if layer_type == "linear_attention" else "attention"
            x, state, routed, exact, lookups, batches = mode.mix_and_route(
                chunk, i, layers, x, state, timer, phase
            )
            new_states.append(state)
            x = self.run_experts(chunk, mode.whole, i, layers[i], x, routed, exact, lookups, batches, timer)
            if i in taps:
                tapped[i] = x
        if not chunk.more:  # none expected (each layer takes its late parts): fill every slot
            res.put_parts(list(res.queue), chunk.stats)
            res.queue.clear()
        # unused prefetches stay cached as ordinary entries (counted in `prefetched`)
        res.cache.speculative.clear()
        return x, new_states, tapped

    def run_experts(
        self,
        chunk: Chunk,
        whole: bool,
        i: int,
        layer,
        x,
        routed,
        exact,
        lookups: int,
        batches: list[Staged],
        timer,
    ) -> jax.Array:
        """Layer i's experts on x: waits for (exact mode) and writes its staged bytes, runs the experts
        program, and releases the layer's experts where the policy keeps none of them."""
        res, cache, E = self.res, self.res.cache, self.res.num_experts
        s = chunk.stats.layers[i]
        batches = batches + res.take_staged(i)
        # In exact mode (staged only with prefetch="layer": the other copies went straight into the pool) the
        # host waits for them (the device is idle after the ids sync anyway; the wait is the stall). In
        # whole-layer mode it does not: the device orders the copies before their use, while a host wait would
        # drain the queue.
        outside = [b.buf for b in batches if not b.in_program]
        if outside and not whole:
            t0 = time.perf_counter()
            jax.block_until_ready(outside)
            s.stall_s += time.perf_counter() - t0
        # Whole-layer mode sweeps the layers in a cycle: below the full-model budget a recency or frequency
        # policy would evict every expert before its next use, so its layers are released after use like
        # stream's and take the direct path; static releases its unpinned experts. With every expert in the
        # budget (layers held, the rest fitting the pool) nothing is released.
        policy = res.config.cache_policy
        pooled_layers = res.num_layers - len(res.held_layers)
        releases = policy == "stream" or (
            whole and (policy == "static" or cache.num_slots < pooled_layers * E)
        )
        batches.sort(key=lambda b: b.keys[0][1])
        # A layer whose staged bytes are exactly its host parts, none of it kept after use: its experts run
        # straight from the staged parts (no scatter into the pool, no gather out of it).
        direct = (
            chunk.twins
            and releases
            and len(batches) == len(res.host.part_rows)
            and all(b.keys == res.part_keys(i, p) for p, b in enumerate(batches))
            and not any((i, e) in cache.pinned for e in range(E))
        )
        name, shapes, run = self._experts_program(chunk, i, layer, x, routed, exact, lookups, batches, direct)
        taken = res.queue.pop(i, 1) if chunk.twins else []
        if chunk.twins:
            self.compile_twins(name, layer[0], shapes, run, len(taken))
        if taken:
            x, copied = timer("experts", run, tuple(res.host.layers[j][p] for j, p in taken))
            res.record_in_program(taken, copied, chunk.stats)
        else:
            x = timer("experts", run, ())
        if releases:
            # Kept, they would leave partial layers that move as row copies instead of whole parts, and be
            # evicted before their next use anyway.
            cache.release_layer(i, keep=set(res.staged) | cache.pinned)
        return x

    def _experts_program(self, chunk: Chunk, i: int, layer, x, routed, exact, lookups, batches, direct):
        """(name, argument shapes, run(host parts)) of layer i's experts program: on a held layer, straight
        from the staged parts (`direct`), or on the pool after writing the staged bytes into it."""
        res, cache = self.res, self.res.cache
        graph, params = layer
        u, weights, expert_ids = routed
        nv = chunk.num_valid_dev
        if i in res.held_layers:
            args = (graph, params, res.hold(i, chunk.stats.layers[i], lookups), x, u, weights, expert_ids, nv)

            def run_held(parts, args=args):
                out = programs.held_experts(*args, parts)
                return out if parts else out[0]

            return "held_experts", args[2:7], run_held
        if direct:
            staged = tuple(b.buf for b in batches)
            args = (res.host.layout, graph, params, staged, x, u, weights, expert_ids, nv)

            def run_staged(parts, args=args):
                out = programs.staged_experts(*args, parts)
                return out if parts else out[0]

            return "staged_experts", args[3:8], run_staged
        for b in batches:
            cache.write(b.buf, [cache.slot_of[k] for k in b.keys])
        if exact is not None:
            args = (graph, params, cache.pool, *exact, x, u, weights, expert_ids, nv)

            def run_table(parts, args=args):
                return programs.pool_experts_table(*args)

            return ("experts_table", exact[1]), args[2:9], run_table
        gather, remap = res.pool_tables(i, None)
        args = (graph, params, cache.pool, gather, remap, x, u, weights, expert_ids, nv)

        def run_pool(parts, args=args):
            return programs.pool_experts_copying(*args, parts) if parts else programs.pool_experts(*args)

        return ("experts", gather is None, remap is None), args[2:9], run_pool


def chunk_inputs(start, num_valid) -> tuple[jax.Array, jax.Array]:
    """(start, num_valid) as int32 device scalars."""
    return jnp.asarray(start, jnp.int32), jnp.asarray(num_valid, jnp.int32)

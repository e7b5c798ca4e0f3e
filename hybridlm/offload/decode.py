"""Device-paged decode: one program a step, each routed expert read from a held layer, the pool or pinned host
memory as the device's router picks it, so that no ids go back to the host.

The pool is first set to whole layers chosen by the policy and the budget (`PagedDecoder.make_view`), then
read
only: decode evicts and inserts nothing, and the step compiles once per pool.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.phases import DEVICE_LOOP_OPTIONS, StaticGraph
from hybridlm.engine.tree import ancestor_mask
from hybridlm.model import check_taps, concat_taps, head_logits
from hybridlm.offload.expert_cache import ExpertLayout
from hybridlm.offload.residency import Residency
from hybridlm.offload.stats import CacheStats
from pallas_kernels.grouped_matmul import pallas_gemv

# Where a device-paged decode step finds a layer's experts (`decode_paged`), known on the host when the step's
# pool view is made (`PagedDecoder.make_view`): static per layer, so that only layers with experts in host
# memory pay for the conditional copies.
HELD, IN_POOL, MIXED, IN_HOST = "held", "pool", "mixed", "host"


def fetch_experts(
    layout: ExpertLayout,
    host_parts: tuple,
    part_start: tuple[int, ...],
    pool,
    slots: jax.Array,
    ids: jax.Array,
    source: str,
    skip: jax.Array | None = None,
    unpack: bool = True,
):
    """The weights of experts `ids` [n] of one layer as (gate_up, down) [n, ...] on the device, each from the
    pool (`PackedExperts`) where `slots` [n] (its pool slot, or -1) says it is resident, else copied from its
    pinned host part; the gathered bytes are unpacked once (`unpack`), or returned packed, uint8 [n, nbytes].

    `source` (static): IN_POOL, every expert of the layer is in the pool (a gather, no control flow); IN_HOST,
    none is; MIXED, some are. A copy from host memory is a dynamic slice of the host part holding the expert,
    moved to the device, which XLA runs as a kernel reading that row from host memory. With one host part a
    layer (`OffloadConfig(host_parts=1)`) an IN_HOST layer's copies are just these kernels. Otherwise each
    copy is one `lax.switch`: branch 1 + p reads host part p, and, in a MIXED layer, branch 0 gives a zero row
    for a resident expert, whose pool row is selected instead. One host part a layer makes the copies cheaper
    than a switch over several; the branches are kept to one operation each, because unpacking inside them
    made the step slower. `skip` [n] bool (optional): rows whose copy is not needed (zeros come back), so that
    a verify fetches each distinct expert once."""
    if source == IN_POOL:
        rows = pool.take(slots)
        return rows.unpack() if unpack else rows.data
    starts = jnp.asarray(part_start, jnp.int32)

    def from_host(p):
        return lambda row: jax.device_put(
            jax.lax.dynamic_index_in_dim(host_parts[p], row, keepdims=True), jax.memory.Space.Device
        )

    def resident(row):
        return jnp.zeros((1, layout.nbytes), jnp.uint8)

    mixed = source == MIXED
    zero = mixed or skip is not None  # branch 0: a zero row (a resident or a skipped expert)
    branches = ([resident] if zero else []) + [from_host(p) for p in range(len(host_parts))]
    rows = []
    for j in range(ids.shape[0]):
        if len(branches) == 1:  # one host part, no resident expert: no control flow
            rows.append(branches[0](ids[j]))
            continue
        part = jnp.sum(ids[j] >= starts[1:]).astype(jnp.int32)
        if zero:
            no_copy = (slots[j] >= 0) if mixed else False
            no_copy = no_copy | skip[j] if skip is not None else no_copy
            index = jnp.where(no_copy, 0, 1 + part)
        else:
            index = part
        rows.append(jax.lax.switch(index, branches, ids[j] - starts[part]))
    copied = jnp.concatenate(rows)  # [n, nbytes]
    if mixed:  # each row from the pool or from its copy, still packed: one unpack for both
        copied = jnp.where((slots >= 0)[:, None], pool.data[jnp.maximum(slots, 0)], copied)
    return layout.unpack(copied) if unpack else copied


def page_experts(
    layout: ExpertLayout,
    part_start: tuple[int, ...],
    source: str,
    held,
    host: tuple,
    pool,
    slot_row: jax.Array,
    flat: jax.Array,
    *,
    distinct_once: bool = False,
):
    """The experts of one layer's routed copies `flat` [n] (expert ids) on the device, from wherever `source`
    (static: HELD, IN_POOL, MIXED or IN_HOST) says they are.

    Args:
      held: the layer's experts held outside the pool (HELD; `PackedExperts`), else unused.
      host: the layer's pinned host parts; pool: the device pool; slot_row: [experts] int32 pool slot or -1.
      distinct_once: fetch each distinct expert of the copies once (a verify's tokens share experts), rather
        than one fetch a copy (a decode step's top-k copies are distinct already).

    Returns:
      ((gate_up, down) with a leading axis, local [n] int32: the row of each copy's expert there, hits int32
      scalar: the copies whose expert was on the device).

    Experts of Q4_K blocks (`ExpertLayout.all_q4_k`) are read where they lie by the matrix-vector kernel
    (`pallas_kernels.q4_k.Q4KExperts`): a held layer's rows and the pool's slots in place, copied rows as they
    arrive; nothing is gathered on the device or unpacked.
    """
    local = jnp.arange(flat.shape[0], dtype=jnp.int32)  # copy j runs fetched expert j
    in_place = layout.all_q4_k
    if source == HELD:
        if in_place:
            return layout.q4_k_experts(held.data), flat, jnp.int32(flat.shape[0])
        return held.take(flat).unpack(), local, jnp.int32(flat.shape[0])
    hits = jnp.sum(slot_row[flat] >= 0).astype(jnp.int32)
    if in_place and source == IN_POOL and pallas_gemv.addressable(pool.data):
        return layout.q4_k_experts(pool.data), slot_row[flat], hits
    fetch, skip = flat, None
    if distinct_once and source != IN_POOL:  # the distinct experts, padded with skipped repeats of the first
        order = jnp.sort(flat)
        distinct = jnp.sum(order[1:] != order[:-1]) + 1
        fetch, local = jnp.unique(flat, return_inverse=True, size=flat.shape[0])
        local = local.astype(jnp.int32)
        skip = jnp.arange(flat.shape[0]) >= distinct
    experts = fetch_experts(
        layout, host, part_start, pool, slot_row[fetch], fetch, source, skip, unpack=not in_place
    )
    return (layout.q4_k_experts(experts) if in_place else experts), local, hits


def paged_step(
    layout: ExpertLayout,
    graphs: tuple,
    head_graph: StaticGraph,
    sources: tuple[str, ...],
    part_start: tuple[int, ...],
    embed,
    layer_leaves: tuple,
    head_leaves: tuple,
    lm_head,
    tokens,
    states,
    position,
    host: tuple,
    pool,
    slot_table,
    held: tuple,
    hits,
):
    """One decode step of the offloaded model as one program, its experts paged by the device
    (`OffloadedRunner.decode_step`).

    Per layer: the mixer, the router, then each routed copy's expert from the device (a held layer's arrays,
    or the pool where `slot_table` [layers, experts] int32 gives its slot) or from pinned host memory
    (`fetch_experts`), chosen on the device: no ids go back to the host. The experts then run as in the
    all-resident model, each copy naming its own fetched expert. `sources` (static) says per layer where its
    experts are: HELD (`held[i]`), IN_POOL, MIXED or IN_HOST (`fetch_experts`). Returns (logits [batch, vocab]
    float32, the new states, hits + this step's resident copies per layer ([layers] int32))."""
    x = embed[tokens[:, None]]
    batch, _, hidden = x.shape
    valid = jnp.ones((batch,), bool)
    new_states, step_hits = [], []
    for i, (graph, leaves, state) in enumerate(zip(graphs, layer_leaves, states, strict=False)):
        layer = graph.merge(leaves)
        h, state = layer.mix(x, state, position, 1)
        new_states.append(state)
        u = layer.post_norm(h).reshape(batch, hidden)
        weights, ids = layer.ffn.route(u)  # [batch, top_k]
        experts, local, hit = page_experts(
            layout, part_start, sources[i], held[i], host[i], pool, slot_table[i], ids.reshape(-1)
        )
        step_hits.append(hit)
        layer.ffn.experts_gate_up.set_value(experts[0])
        layer.ffn.experts_down.set_value(experts[1])
        x = h + layer.ffn.experts(u, weights, local.reshape(ids.shape), valid).reshape(batch, 1, hidden)
    head_weight = embed.T if lm_head is None else lm_head  # as HybridLM.head_weight
    logits = head_logits(head_graph.merge(head_leaves), head_weight, x[:, 0])
    return logits, new_states, hits + jnp.stack(step_hits)


decode_paged = jax.jit(paged_step, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(10, 16))


@functools.partial(
    jax.jit,
    static_argnums=(0, 1, 2, 3, 4, 5),
    donate_argnums=(11, 17, 18),
    compiler_options=DEVICE_LOOP_OPTIONS,
)
def decode_paged_block(
    sampler,
    layout: ExpertLayout,
    graphs: tuple,
    head_graph: StaticGraph,
    sources: tuple[str, ...],
    part_start: tuple[int, ...],
    embed,
    layer_leaves: tuple,
    head_leaves: tuple,
    lm_head,
    tokens,
    states,
    position,
    host: tuple,
    pool,
    slot_table,
    held: tuple,
    hits,
    carry,
    steps,
):
    """Up to `sampler.block` paged decode steps (`paged_step`) in one program, each sampled token fed back on
    the device (`sampling.BlockSampler.loop`). Returns the loop's outputs, its states being (layer states,
    hits)."""

    def step(token, states_hits, pos):
        logits, new_states, new_hits = paged_step(
            layout,
            graphs,
            head_graph,
            sources,
            part_start,
            embed,
            layer_leaves,
            head_leaves,
            lm_head,
            token,
            states_hits[0],
            pos,
            host,
            pool,
            slot_table,
            held,
            states_hits[1],
        )
        return logits, (new_states, new_hits)

    return sampler.loop(step, tokens, (states, hits), position, carry, steps)


@dataclasses.dataclass(frozen=True)
class OffloadTarget:
    """The offloaded model that a speculative verify (`engine.speculative`) or a tree verify
    (`engine.tree_verify`) runs: the static layout, layer graphs and expert sources of a `PagedView`;
    `bind(args)`, args = (embed, layer_leaves, head_leaves, lm_head, host parts, pool, slot_table, held) as
    `OffloadedRunner.speculative_target` gives them."""

    layout: ExpertLayout
    graphs: tuple
    head_graph: StaticGraph
    sources: tuple[str, ...]
    part_start: tuple[int, ...]

    def bind(self, args) -> _PagedModel:
        return _PagedModel(self, *args)


class _PagedModel:
    """An `OffloadTarget` bound to its arrays inside a traced program."""

    def __init__(self, target, embed, layer_leaves, head_leaves, lm_head, host, pool, slot_table, held):
        self.target, self.layer_leaves, self.head_leaves = target, layer_leaves, head_leaves
        self.host, self.pool, self.slot_table, self.held = host, pool, slot_table, held
        self.embed = embed
        self.head_weight = embed.T if lm_head is None else lm_head  # as HybridLM.head_weight

    def logits(self, hidden):
        return head_logits(self.target.head_graph.merge(self.head_leaves), self.head_weight, hidden)

    def verify(self, states: list, tokens, position, taps: tuple[int, ...] = ()):
        """`engine.speculative.verify` with the experts paged: tokens [1, seq] -> (hidden [1, seq, hidden],
        states with a leading [seq] axis on Gated DeltaNet layers, and with `taps` the tapped layers'
        outputs concatenated [1, seq, len(taps) * hidden]). In a layer whose experts are not all resident,
        each distinct expert of the seq x top_k copies is fetched once."""
        return self._forward(
            states, tokens, lambda layer, x, state: layer.verify_mix(x, state, position), taps
        )

    def verify_tree(self, states: list, tokens, parents, depth, position, valid=None, taps=()):
        """`engine.tree_verify.verify_tree` with the experts paged: tokens [1, nodes] -> (hidden [1, nodes,
        hidden], the tree states[, features with `taps`]). Each distinct expert of the nodes' copies is
        fetched once (padding nodes' copies included: their outputs are zeroed, not their fetches)."""
        ancestors = ancestor_mask(parents)

        def mix(layer, x, state):
            return layer.verify_tree_mix(x, state, position, parents, depth, ancestors)

        return self._forward(states, tokens, mix, taps, valid)

    def _forward(self, states: list, tokens, mix, taps, valid=None):
        """The paged model over tokens [1, seq]: per layer `mix(layer, x, state)` (the mixer and its residual,
        giving the layer's new state), then the routed experts of every token, each distinct expert fetched
        once; `valid` [seq] bool (or None) marks tokens that get no routed experts."""
        t = self.target
        taps = check_taps(taps, len(t.graphs))
        x = self.embed[tokens]
        batch, seq, hidden = x.shape
        rows = None if valid is None else jnp.broadcast_to(valid, (batch, seq)).reshape(-1)
        new_states, tapped = [], {}
        for i, (graph, leaves, state) in enumerate(zip(t.graphs, self.layer_leaves, states, strict=False)):
            layer = graph.merge(leaves)
            h, state = mix(layer, x, state)
            new_states.append(state)
            u = layer.post_norm(h).reshape(batch * seq, hidden)
            weights, ids = layer.ffn.route(u)  # [seq, top_k]
            experts, local, _ = page_experts(
                t.layout,
                t.part_start,
                t.sources[i],
                self.held[i],
                self.host[i],
                self.pool,
                self.slot_table[i],
                ids.reshape(-1),
                distinct_once=True,
            )
            layer.ffn.experts_gate_up.set_value(experts[0])
            layer.ffn.experts_down.set_value(experts[1])
            x = h + layer.ffn.experts(u, weights, local.reshape(ids.shape), rows).reshape(batch, seq, hidden)
            if i in taps:
                tapped[i] = x
        return (x, new_states, concat_taps(tapped, taps)) if taps else (x, new_states)


class PagedView(NamedTuple):
    """The pool's residency as a device-paged step reads it (made after the pool last changed)."""

    slot_table: jax.Array  # int32 [layers, experts] on the device: pool slot, or -1
    sources: tuple[str, ...]  # per layer: HELD, IN_POOL, MIXED or IN_HOST
    held: tuple  # per layer: its `PackedExperts` held outside the pool, or None


class PagedDecoder:
    """The device-paged decode steps of an offloaded runner: the pool view and the hits counted on the device.

    Args:
      residency: the runner's pool, held layers and staged bytes.
      policy: the cache policy ("stream" keeps no layer in the pool for decode).
    """

    def __init__(self, residency: Residency, policy: str):
        self.residency = residency
        self.policy = policy
        self.view: PagedView | None = None
        self.reset_counters()

    def reset_counters(self) -> None:
        res = self.residency
        self.lookups = 0  # per layer, over the paged steps
        self.hits = jnp.zeros((res.num_layers,), jnp.int32, device=res.sharding)  # on the device

    def step(self, runner, step_inputs: tuple, stats: CacheStats) -> tuple[jax.Array, list]:
        """One step of `runner` (an `OffloadedRunner`: its trunk weights) as one program (`decode_paged`).

        Args:
          runner: the offloaded runner.
          step_inputs: (tokens [batch] int32, states, position) as `LayerwiseRunner.step_inputs` makes them.
          stats: the decode statistics (the first step after a prefill counts its pool fill there).
        """
        res = self.residency
        if self.view is None:
            self.view = self.make_view(stats)
        graphs, leaves = zip(*runner.layers, strict=True)
        logits, states, self.hits = decode_paged(
            res.host.layout,
            graphs,
            runner.final_norm[0],
            self.view.sources,
            tuple(res.host.part_start),
            runner.embed_table,
            leaves,
            runner.final_norm[1],
            runner.lm_head,
            *step_inputs,
            tuple(tuple(parts) for parts in res.host.layers),
            res.cache.pool,
            self.view.slot_table,
            self.view.held,
            self.hits,
        )
        self.lookups += step_inputs[0].shape[0] * res.top_k
        return logits, states

    def block(self, runner, sampler, step_inputs: tuple, carry, steps: int, stats: CacheStats) -> tuple:
        """Up to `sampler.block` steps of `runner` in one program (`decode_paged_block`); `step` otherwise."""
        res = self.residency
        if self.view is None:
            self.view = self.make_view(stats)
        graphs, leaves = zip(*runner.layers, strict=True)
        tokens, states, position = step_inputs
        out, count, token, (states, self.hits), position, carry = decode_paged_block(
            sampler,
            res.host.layout,
            graphs,
            runner.final_norm[0],
            self.view.sources,
            tuple(res.host.part_start),
            runner.embed_table,
            leaves,
            runner.final_norm[1],
            runner.lm_head,
            tokens,
            states,
            position,
            tuple(tuple(parts) for parts in res.host.layers),
            res.cache.pool,
            self.view.slot_table,
            self.view.held,
            self.hits,
            carry,
            np.int32(steps),
        )
        self.lookups += tokens.shape[0] * res.top_k * steps
        return out, count, token, states, position, carry

    def make_view(self, stats: CacheStats) -> PagedView:
        """Sets the pool for decode and returns its `PagedView`; copies counted as prefetched in `stats`.

        The pool's content depends on the policy and the budget only, not on what the last prompt routed, so
        that the step compiles once per pool (its sources are static arguments): staged bytes still waiting
        for their layer are written, then every policy but "stream" keeps whole layers in the pool, the static
        policy's pinned layers first, then layers spread over the depth up to the pool's size. Other entries
        are released and missing experts of those layers copied. Without this fill a whole-layer prefill below
        the full-model budget would leave the LRU family's pool empty and every expert read from host memory.
        """
        res = self.residency
        cache, E = res.cache, res.num_experts
        for b in res.take_staged():
            cache.write(b.buf, [cache.slot_of[k] for k in b.keys])
        target: list[int] = []
        if self.policy != "stream":
            capacity = cache.num_slots // E
            pinned = sorted({layer for layer, _ in cache.pinned})[:capacity]
            others = [i for i in range(res.num_layers) if i not in res.held and i not in pinned]
            n = max(0, min(len(others), capacity - len(pinned)))
            target = pinned + [others[int((k + 0.5) * len(others) / n)] for k in range(n)]
        for layer in range(res.num_layers):
            if layer not in target:
                cache.release_layer(layer, keep=cache.pinned)
        for layer in target:
            # free slots only (never an eviction): should pinned keys outside these layers leave too few, the
            # layer stays partly resident (MIXED), which is correct, only slower
            experts = [e for e in range(E) if (layer, e) not in cache][: len(cache.free)]
            for e in experts:
                cache.allocate((layer, e), set())
            for buf, ids in res.host.to_device(layer, experts, res.sharding) if experts else ():
                cache.write(buf, [cache.slot_of[(layer, e)] for e in ids])
            s = stats.layers[layer]
            s.prefetched += len(experts)
            s.bytes_h2d += len(experts) * res.copy_bytes
        table = np.stack([cache.slot_table(layer, missing=-1) for layer in range(res.num_layers)])
        resident = (table >= 0).sum(axis=1)
        sources = tuple(
            HELD if i in res.held else IN_POOL if resident[i] == E else MIXED if resident[i] else IN_HOST
            for i in range(res.num_layers)
        )
        held = tuple(res.held.get(i) for i in range(res.num_layers))
        return PagedView(jax.device_put(table, res.sharding), sources, held)

    def stats_with_paged(self, stats: CacheStats) -> CacheStats:
        """`stats` with the paged steps' lookups, hits and misses added (their hits were counted on the
        device; read back here). Paged steps are not in wall_s (they are never waited for)."""
        if not self.lookups:
            return stats
        out = copy.deepcopy(stats)
        for s, hits in zip(out.layers, np.asarray(self.hits).tolist(), strict=True):
            misses = self.lookups - hits
            s.lookups += self.lookups
            s.hits += hits
            s.misses += misses
            s.bytes_h2d += misses * self.residency.copy_bytes
        return out

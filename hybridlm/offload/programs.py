"""The jitted programs of an offloaded layer: the engine's phases on experts paged into the device pool.

Each runs the experts of one layer on weights found elsewhere than in the layer (gathered out of the pool,
held outside it, or unpacked from staged host parts), or a layer's mixer and router in one program; the
`*_copying` variants move whole pinned host buffers to the device inside the same program, where XLA overlaps
the copy with the compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridlm.engine import phases
from hybridlm.offload.expert_cache import ExpertLayout, unpacked


@functools.partial(jax.jit, static_argnums=0)
def predict_ids(graph, params, h):
    """Layer graph/params's router on h [batch, seq, hidden] (a guess of its experts before its mixer ran)."""
    layer = graph.merge(params)
    batch, seq, hidden = h.shape
    return layer.ffn.route(layer.post_norm(h).reshape(batch * seq, hidden))[1]


@functools.partial(jax.jit, static_argnums=(0, 2))
def mix_route(graph, params, next_graph, next_params, x, state, start, num_valid):
    """`phases.mix` then `phases.route` of one layer and, with a `next_graph`, `predict_ids` of the next layer
    on the mixer's
    output, in one program: exact mode's phases before its ids sync (one dispatch instead of three a
    layer)."""
    x, state = phases.mix(graph, params, x, state, start, num_valid)
    routed = phases.route(graph, params, x)
    guess = None if next_graph is None else predict_ids(next_graph, next_params, x)
    return x, state, routed, guess


@functools.partial(jax.jit, static_argnums=(0, 4))
def pool_experts_table(graph, params, pool, table, spec, h, u, weights, ids, num_valid):
    """`pool_experts` with (remap, gather) read from an exact-mode layer table (`ExactMode.index_table`):
    remap = table[:experts]; gather = table[experts:experts + groups], or none when groups is 0. spec =
    (experts, groups), static."""
    experts, groups = spec
    gather = table[experts : experts + groups] if groups else None
    return pool_experts(graph, params, pool, gather, table[:experts], h, u, weights, ids, num_valid)


@functools.partial(jax.jit, static_argnums=0)
def pool_experts(graph, params, pool, gather, remap, h, u, weights, ids, num_valid):
    """`phases.experts` of the all-resident runner on experts in the pool (`PackedExperts`, unpacked here).

    gather: int32 [groups] pool slots copied out of the pool into a contiguous [groups, nbytes] array (a
      device copy), unpacked for the grouped matmul; None: it runs on the whole pool (groups = slots;
      only for a pool of at most one layer, see `pool_tables`).
    remap: int32 [experts] expert id -> group (the gathered row or the pool slot); None: the identity (the
      layer gathered in expert order: exactly the shapes, group order and tile sizes of the all-resident
      model).
    """
    if gather is not None:
        pool = pool.take(gather)  # [groups, nbytes]
    if remap is not None:
        ids = remap[ids]  # [tokens, top_k] expert id -> group
    return phases.experts(graph, params, h, u, weights, ids, num_valid, pool.unpack())


def _to_device(host_parts):
    """Whole pinned host buffers moved to device memory inside a jitted program: XLA issues a copy-start /
    copy-done pair that runs beside the program's compute (a slice of a host buffer does not)."""
    return jax.device_put(host_parts, jax.memory.Space.Device)


@functools.partial(jax.jit, static_argnums=0)
def mix_route_copying(graph, params, x, state, start, num_valid, host_parts):
    """`phases.mix` then `phases.route` in one program (whole-layer mode: no ids go back to the host), and
    host expert buffers (a tuple) copied to the device beside them: (x, state, (u, weights, ids), copies)."""
    x, state = phases.mix(graph, params, x, state, start, num_valid)
    return x, state, phases.route(graph, params, x), _to_device(host_parts)


@functools.partial(jax.jit, static_argnums=0)
def pool_experts_copying(graph, params, pool, gather, remap, h, u, weights, ids, num_valid, host_parts):
    """`pool_experts`, and host expert buffers (a tuple) copied to the device beside it (returned second)."""
    out = pool_experts(graph, params, pool, gather, remap, h, u, weights, ids, num_valid)
    return out, _to_device(host_parts)


def _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts):
    """`phases.experts` with the weights `experts` (or `PackedExperts`, unpacked here), and host buffers
    `host_parts` copied to the device beside it."""
    out = phases.experts(graph, params, h, u, weights, ids, num_valid, unpacked(experts))
    return out, _to_device(host_parts)


@functools.partial(jax.jit, static_argnums=0)
def held_experts(graph, params, experts, h, u, weights, ids, num_valid, host_parts=()):
    """`phases.experts` with the layer's experts held on the device outside the pool
    (`OffloadedRunner.held_layers`: `PackedExperts` in expert order, unpacked here; no gather out of the
    pool). Host buffers `host_parts` are copied to the device beside it (returned second)."""
    return _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts)


@functools.partial(jax.jit, static_argnums=(0, 1))
def staged_experts(layout: ExpertLayout, graph, params, staged, h, u, weights, ids, num_valid, host_parts=()):
    """The experts of a layer run straight from its staged parts (a tuple of uint8 [rows, nbytes] device
    arrays covering experts 0..E-1 in order), unpacked in this program: no pool write, no gather (whole-layer
    mode, for a layer whose experts are all dropped after use). Host buffers `host_parts` are copied to the
    device beside it (returned second)."""
    experts = layout.unpack(jnp.concatenate(staged))
    return _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts)

"""Host-offload expert scheduler: experts in pinned host memory, paged into a device pool around the jitted
per-layer phases of `LayerwiseRunner`.

Per chunk and layer i (see docs/offload.md):
  1. `_mix`, `_route` run on the device as in the all-resident runner.
  2. Which experts are needed:
     - exact mode (small chunks, decode): the router's top-k ids of the valid tokens are read back to the host.
       This is a device -> host sync per layer, inherent to routing-driven paging.
     - whole-layer mode (chunk tokens * top_k >= 4 * experts, where a chunk touches nearly every expert): all
       experts of the layer, no sync.
  3. Misses get a slot (eviction by the cache policy) and are copied host -> device:
     - exact mode: straight into their pool slots, one program per host part touched, or one over all of the
       layer's parts for a few rows in several (row copies and the scatter into the pool in one program,
       `ExpertCache.copy_rows`); then the copies of the next layer's
       predicted experts, the same way. The host waits for none of them: the device runs each copy before the
       programs that read the pool after it.
     - whole-layer mode: whole host parts of a layer, inside the jitted programs; a partial layer as staged
       row copies. Then copies for the *next* layers are issued (prefetch, see below) so that they run while
       this layer computes; the staged bytes are written into the pool slots (one jitted scatter) when their
       layer runs.
     The grouped matmul runs on the experts gathered out of the pool (the chunk's experts in exact mode, ids
     remapped; the layer in expert order in whole-layer mode), or straight from the staged parts (a layer
     released after use), or on layers held outside the pool (whole-layer mode: the static policy's pinned
     layers, or, when every expert fits the budget, as many layers as fit beside the pool for any policy).
  Prefetch: exact mode applies layer i+1's router to the hidden state after layer i's mixer (a prediction,
  read back together with layer i's ids); whole-layer mode streams whole layers i+1..i+depth (double
  buffering when depth = 1), on into the next chunk's first layers when `prefill` has more chunks to run.
  In whole-layer mode prefetched bytes wait in device staging buffers until their layer runs, so the compute
  stream never waits on a copy it does not need yet.

Decode (`OffloadedRunner.decode_step`, so `generate`): by default the whole step is one program in which the device
picks each routed expert from the held layers or the pool (set once after each prefill to whole layers chosen by the
policy and the budget) or reads it straight from pinned host memory (`_decode_paged`): no ids go back to the host.
decode_paging="host" (and large batches) step layer by layer through the schedule above instead.

Device memory: pool slots + staging buffers <= expert_budget. The trunk (embeddings, mixers, router, shared
expert, head) stays on the device.
"""

from __future__ import annotations

import copy
import functools
import itertools
import statistics
import time
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.phases import StaticGraph, flat_layer
from hybridlm.engine.phases import embed as _embed
from hybridlm.engine.phases import experts as _experts
from hybridlm.engine.phases import mix as _mix
from hybridlm.engine.phases import route as _route
from hybridlm.engine.runner import LayerwiseRunner, PhaseTimer, check_decode_inputs
from hybridlm.model import EXPERT_PARAMS, HybridLM, head_logits
from hybridlm.offload.expert_cache import (
    POLICIES,
    CacheStats,
    ExpertCache,
    ExpertLayout,
    Key,
    LayerStats,
    format_bytes,
    parse_bytes,
    static_pinned_keys,
)
from hybridlm.state import LayerState
from pallas_kernels.quantized import QuantizedWeights, common_format, quantize_like, reencode

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
PADDED_COPY_BYTES = 8 * 2**20   # exact mode: padding bytes one copy program over all of a layer's parts may move


def power_of_two_parts(n: int, cap: int = MAX_ROWS_PER_COPY) -> list[int]:
    """n as batches of `cap` (a power of two) then distinct smaller powers of two, largest first (cap 32: 77 ->
    [32, 32, 8, 4, 1]): batch sizes of row copies, so that the gather program compiles for at most
    log2(cap) + 1 shapes and moves no padding bytes."""
    full, rest = divmod(n, cap)
    return [cap] * full + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


HOST_PARTS = 4   # contiguous pinned buffers per layer: whole-layer streaming copies 0-2 inside each program
MAX_PARTS_PER_PROGRAM = 2   # bounds the program variants compiled (0, 1 or 2 copies inside)


class HostExperts:
    """Every layer's experts in pinned host memory: per layer, `parts` contiguous uint8 `jax.Array`s
    [experts / parts, nbytes] (experts in order).

    Contiguous, so that a layer moves at the full pinned host -> device rate: 49-51 GB/s measured on an H100
    for a 0.4 GB layer as one buffer or 4-16 parts, against 16-21 GB/s for 256 per-expert buffers
    (benchmarks/h2d_copies.py). Four parts by default, because a copy overlaps compute when it is a whole
    buffer moved inside a jitted program (XLA's copy-start / copy-done), not a slice of one, and smaller
    parts let the offload scheduler spread a layer's copy over several programs. A subset of experts moves
    as row copies.

    Args:
      layout: byte layout of one expert.
      layers: layers[layer] -> list of uint8 [rows, layout.nbytes] jax.Arrays with memory_kind="pinned_host"
        (or one such array), the same row counts in every layer.

    Raises:
      ValueError: layers of different part shapes, or rows of a size other than layout.nbytes.
    """

    def __init__(self, layout: ExpertLayout, layers: list[list[jax.Array]] | list[jax.Array]):
        layers = [list(parts) if isinstance(parts, (list, tuple)) else [parts] for parts in layers]
        shapes = {tuple(tuple(buf.shape) for buf in parts) for parts in layers}
        if len(shapes) != 1 or any(len(sh) != 2 or sh[1] != layout.nbytes for sh in next(iter(shapes))):
            raise ValueError(f"host expert buffers must all be [rows, {layout.nbytes}] uint8 with the same rows "
                             f"in every layer; got part shapes {sorted(shapes)}")
        self.layout = layout
        self.layers = layers
        self.part_rows = [buf.shape[0] for buf in layers[0]]
        self.part_start = [sum(self.part_rows[:p]) for p in range(len(self.part_rows))]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return sum(self.part_rows)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.layout.nbytes

    def part_experts(self, part: int) -> list[int]:
        """Expert ids held by `part` (the same in every layer)."""
        return list(range(self.part_start[part], self.part_start[part] + self.part_rows[part]))

    @staticmethod
    def pack_layer(gate_up, down, host_sharding=None, parts: int = HOST_PARTS) -> tuple[ExpertLayout, list[jax.Array]]:
        """One layer's experts (device arrays or QuantizedWeights [experts, ...]) -> (layout, `parts` pinned
        buffers uint8 [~experts / parts, nbytes]; fewer where the layer has fewer experts). Packs on the device
        (bitcasts, no host round trip).

        Raises:
          ValueError: parts < 1."""
        if parts < 1:
            raise ValueError(f"parts={parts}: a layer needs at least one host buffer")
        layout = ExpertLayout.of(gate_up, down)
        packed = _pack_layer(layout, gate_up, down)
        bounds = np.linspace(0, packed.shape[0], min(parts, packed.shape[0]) + 1).astype(int)
        pieces = [packed[a:b] for a, b in itertools.pairwise(bounds)]
        return layout, list(jax.device_put(pieces, host_sharding or pinned_host_sharding()))

    @classmethod
    def from_model(cls, model: HybridLM, host_sharding=None, parts: int = HOST_PARTS,
                   mixed: str = "widen") -> HostExperts:
        """Copies the experts of `model` (its values are left in place) to pinned host memory; layers whose experts
        are stored in different formats are brought to one as `mixed` says (`host_experts_of_layers`).

        Raises:
          ValueError: as `host_experts_of_layers`."""
        packed = {i: cls.pack_layer(layer.ffn.experts_gate_up.get_value(), layer.ffn.experts_down.get_value(),
                                    host_sharding, parts) for i, layer in enumerate(model.layers)}
        return host_experts_of_layers(packed, len(model.layers), mixed)

    def to_device(self, layer: int, experts=None, sharding=None) -> list[tuple[jax.Array, list[int]]]:
        """Issues the host -> device copies of some experts of `layer` (asynchronous; nothing waits).

        Args:
          layer: layer index.
          experts: expert ids (no repeats); None: the whole layer.
          sharding: destination (default: device memory of the first device).

        Returns:
          [(uint8 [m, nbytes] device array, the m expert ids of its rows)], covering `experts` (in some order):
          a part wholly requested moves as one copy, the rest as row copies in batches of
          `power_of_two_parts` sizes.
        """
        sharding = sharding or device_sharding()
        wanted = set(range(self.num_experts)) if experts is None else {int(e) for e in experts}
        out = []
        for p, buf in enumerate(self.layers[layer]):
            ids = self.part_experts(p)
            mine = [e for e in ids if e in wanted]
            if len(mine) == len(ids):
                out.append((jax.device_put(buf, sharding), ids))
                continue
            at = 0
            for m in power_of_two_parts(len(mine)):
                rows = mine[at:at + m]
                at += m
                local = np.asarray([e - self.part_start[p] for e in rows], np.int32)   # jit moves it
                out.append((_gather_to_device(buf, local), rows))
        return out

    def row_batches(self, experts) -> list[tuple[int, list[int], list[int]]]:
        """Where `experts` (expert ids, no repeats) lie: [(host part, rows within it, their expert ids)], one
        entry per part touched, split into batches of at most MAX_ROWS_PER_COPY rows (the same in every layer)."""
        wanted = sorted(int(e) for e in experts)
        out = []
        for p, start in enumerate(self.part_start):
            mine = [e for e in wanted if start <= e < start + self.part_rows[p]]
            for at in range(0, len(mine), MAX_ROWS_PER_COPY):
                ids = mine[at:at + MAX_ROWS_PER_COPY]
                out.append((p, [e - start for e in ids], ids))
        return out

    def compile_row_copies(self, sharding=None) -> None:
        """Compiles the row-copy programs of every batch size `to_device` can use (copies a few rows)."""
        for p in sorted({self.part_rows.index(r) for r in self.part_rows}):
            m = 1
            while m <= min(MAX_ROWS_PER_COPY, self.part_rows[p] - 1):
                jax.block_until_ready([b for b, _ in self.to_device(0, self.part_experts(p)[:m], sharding)])
                m *= 2

    def unpack_layer(self, layer: int, sharding=None):
        """All experts of `layer` on the device as the model holds them: (gate_up, down) [experts, ...]."""
        staged = jax.device_put(self.layers[layer], sharding or device_sharding())
        return _unpack_all(self.layout, tuple(staged))


@functools.partial(jax.jit, static_argnums=0)
def _unpack_all(layout: ExpertLayout, staged):
    return layout.unpack(jnp.concatenate(staged))


@functools.partial(jax.jit, static_argnums=0)
def _predict_ids(graph, params, h):
    """Layer graph/params's router on h [batch, seq, hidden] (a guess of its experts before its mixer ran)."""
    layer = graph.merge(params)
    batch, seq, hidden = h.shape
    return layer.ffn.route(layer.post_norm(h).reshape(batch * seq, hidden))[1]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _mix_route(graph, params, next_graph, next_params, x, state, start, num_valid):
    """`_mix` then `_route` of one layer and, with a `next_graph`, `_predict_ids` of the next layer on the mixer's
    output, in one program: exact mode's phases before its ids sync (one dispatch instead of three a layer)."""
    x, state = _mix(graph, params, x, state, start, num_valid)
    routed = _route(graph, params, x)
    guess = None if next_graph is None else _predict_ids(next_graph, next_params, x)
    return x, state, routed, guess


@functools.partial(jax.jit, static_argnums=(0, 4))
def _pool_experts_table(graph, params, pool, table, spec, h, u, weights, ids, num_valid):
    """`_pool_experts` with (remap, gather) read from an exact-mode layer table (`OffloadedRunner._exact_table`):
    remap = table[:experts]; gather = table[experts:experts + groups], or none when groups is 0. spec =
    (experts, groups), static."""
    experts, groups = spec
    gather = table[experts:experts + groups] if groups else None
    return _pool_experts(graph, params, pool, gather, table[:experts], h, u, weights, ids, num_valid)


@functools.partial(jax.jit, static_argnums=0)
def _pool_experts(graph, params, pool, gather, remap, h, u, weights, ids, num_valid):
    """`_experts` of the all-resident runner on experts in the pool.

    gather: int32 [groups] pool slots copied out of the pool into a contiguous [groups, ...] array (a device
      copy, ~1 ms per GB) that the grouped matmul runs on; None: it runs on the whole pool (groups = slots;
      only for a pool of at most one layer, see `_pool_tables`).
    remap: int32 [experts] expert id -> group (the gathered row or the pool slot); None: the identity (the
      layer gathered in expert order: exactly the shapes, group order and tile sizes of the all-resident model).
    """
    if gather is not None:
        pool = jax.tree_util.tree_map(lambda p: p[gather], pool)     # [groups, ...]
    if remap is not None:
        ids = remap[ids]                                               # [tokens, top_k] expert id -> group
    return _experts(graph, params, h, u, weights, ids, num_valid, pool)


def _to_device(host_parts):
    """Whole pinned host buffers moved to device memory inside a jitted program: XLA issues a copy-start /
    copy-done pair that runs beside the program's compute (a slice of a host buffer does not: measured)."""
    return jax.device_put(host_parts, jax.memory.Space.Device)


@functools.partial(jax.jit, static_argnums=0)
def _mix_copying(graph, params, x, state, start, num_valid, host_parts):
    """`_mix`, and host expert buffers (a tuple) copied to the device beside it (returned third)."""
    x, state = _mix(graph, params, x, state, start, num_valid)
    return x, state, _to_device(host_parts)


@functools.partial(jax.jit, static_argnums=0)
def _pool_experts_copying(graph, params, pool, gather, remap, h, u, weights, ids, num_valid, host_parts):
    """`_pool_experts`, and host expert buffers (a tuple) copied to the device beside it (returned second)."""
    out = _pool_experts(graph, params, pool, gather, remap, h, u, weights, ids, num_valid)
    return out, _to_device(host_parts)


def _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts):
    """`_experts` with the weights `experts`, and host buffers `host_parts` copied to the device beside it."""
    return _experts(graph, params, h, u, weights, ids, num_valid, experts), _to_device(host_parts)


@functools.partial(jax.jit, static_argnums=0)
def _held_experts(graph, params, experts, h, u, weights, ids, num_valid, host_parts=()):
    """`_experts` with the layer's experts (gate_up, down) [experts, ...] held on the device outside the pool
    (`OffloadedRunner.held_layers`, held as the all-resident model holds them: no gather out of the pool).
    Host buffers `host_parts` are copied to the device beside it (returned second)."""
    return _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _staged_experts(layout: ExpertLayout, graph, params, staged, h, u, weights, ids, num_valid, host_parts=()):
    """The experts of a layer run straight from its staged parts (a tuple of uint8 [rows, nbytes] device
    arrays covering experts 0..E-1 in order), unpacked in this program: no pool write, no gather (whole-layer
    mode, for a layer whose experts are all dropped after use). Host buffers `host_parts` are copied to the
    device beside it (returned second)."""
    experts = layout.unpack(jnp.concatenate(staged))
    return _experts_copying(graph, params, experts, h, u, weights, ids, num_valid, host_parts)


# A decode step pages on the device (`_decode_paged`) up to this many expert copies a layer (batch x top_k): each is
# one conditional copy in the program, unrolled, so the program grows with it. Larger batches take the layer-by-layer
# step.
PAGED_MAX_COPIES = 64


MIXED_FORMATS = ("widen", "smallest", "refuse")


def host_experts_of_layers(packed: dict[int, tuple], num_layers: int, mixed: str = "widen") -> HostExperts:
    """`HostExperts` from {layer: (ExpertLayout, pinned buffers)} for layers 0..num_layers-1.

    The host buffers and the device pool hold one format for every layer's experts. Where layers were packed in
    different ones (llama-quantize's Q4_K_M keeps half the layers' ffn_down experts as Q6_K: 8-bit with a float32
    scale per 16, where the other layers' are 4-bit), `mixed` says what happens:
    - "widen" (default): each expert parameter goes to the narrowest format that holds every layer's exactly
      (`pallas_kernels.quantized.common_format` / `reencode`: for Q4_K_M, downs as int8 with float32 scale and
      offset per 16): the same weights bit for bit, more bytes an expert;
    - "smallest": into the layout of fewest bytes an expert (`quantize_like`; for Q4_K_M the Q6_K downs to 4
      bits): fewer bytes, not exact for the requantized tensors;
    - "refuse": a ValueError naming the layers and formats.
    A layer to convert is copied to the device, converted, packed again (`HostExperts.pack_layer`) and its old
    buffers are dropped.

    Raises:
      ValueError: a layer missing; an unknown `mixed`; layers packed in different layouts with mixed="refuse"
        (the message names the layers of each layout)."""
    if mixed not in MIXED_FORMATS:
        raise ValueError(f"unknown mixed={mixed!r}; choose from {MIXED_FORMATS}")
    missing = [i for i in range(num_layers) if i not in packed]
    if missing:
        raise ValueError(f"no experts were loaded for layers {missing[:8]}")
    target = one_layout([packed[i][0] for i in range(num_layers)], mixed)
    templates, convert = _params(target), quantize_like if mixed == "smallest" else reencode
    layers = {i: packed[i][1] for i in range(num_layers)}
    for i in range(num_layers):
        layout = packed[i][0]
        if layout == target:
            continue
        weights = HostExperts(layout, [layers[i]]).unpack_layer(0)
        weights = [convert(w, t) for w, t in zip(weights, templates)]
        got, layers[i] = HostExperts.pack_layer(*weights, parts=len(layers[i]))
        jax.block_until_ready(layers[i])
        if got != target:
            raise ValueError(f"layer {i}'s experts converted to {_describe(got)}, not {_describe(target)}")
    return HostExperts(target, [layers[i] for i in range(num_layers)])


def one_layout(layer_layouts, mixed: str = "widen") -> ExpertLayout:
    """The one layout `host_experts_of_layers` stores experts in, given each layer's own (`layer_layouts`, in layer
    order; see there for `mixed`).

    Raises:
      ValueError: several layouts with mixed="refuse" (naming the layers of each)."""
    by_layout: dict[ExpertLayout, list[int]] = {}
    for i, layout in enumerate(layer_layouts):
        by_layout.setdefault(layout, []).append(i)
    layouts = list(by_layout)
    if len(layouts) == 1:
        return layouts[0]
    if mixed == "refuse":
        kinds = "; ".join(f"layers {_span(layers)}: {_describe(layout)}" for layout, layers in by_layout.items())
        raise ValueError(f"the layers store their experts in {len(layouts)} formats ({kinds}); the host buffers and "
                         "the device pool hold one. mixed='widen' (the default) stores them all in one format that "
                         "holds each exactly; mixed='smallest' requantizes them into the smallest (not exact)")
    if mixed == "smallest":
        return min(layouts, key=lambda layout: layout.nbytes)
    return ExpertLayout.of(*[common_format(p) for p in zip(*map(_params, layouts))])


def _params(layout: ExpertLayout) -> list:
    """The (gate_up, down) of `layout`, leaves as ShapeDtypeStructs with one expert axis of 1."""
    leaves = [jax.ShapeDtypeStruct((1,) + shape, dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    return list(jax.tree_util.tree_unflatten(layout.treedef, leaves))


def _span(layers: list[int]) -> str:
    return "[" + ", ".join(map(str, layers[:12])) + (f", ... ({len(layers)} layers)]" if len(layers) > 12 else "]")


def _describe(layout: ExpertLayout) -> str:
    """e.g. "gate_up 4-bit (float32 scales per 32), down 8-bit (float32 scales per 16), 2.75 MiB an expert"
    (unquantized parameters by dtype and shape without the expert axis)."""
    names = [n.removeprefix("experts_") for n in EXPERT_PARAMS]
    kinds = [f"{q.bits}-bit ({q.scales.dtype.name} scales{' and offsets' if q.bits == 8 and q.offsets is not None else ''}"
             f" per {q.block_size})" if isinstance(q, QuantizedWeights) else f"{q.dtype.name}{list(q.shape[1:])}"
             for q in _params(layout)]
    return ", ".join(f"{n} {k}" for n, k in zip(names, kinds)) + f", {format_bytes(layout.nbytes)} an expert"


# Where a device-paged decode step finds a layer's experts (`_decode_paged`), known on the host when the step's pool
# view is made (`OffloadedRunner._make_paged_view`): static per layer, so that only layers with experts in host
# memory pay for the conditional copies.
HELD, IN_POOL, MIXED, IN_HOST = "held", "pool", "mixed", "host"


def _fetch_experts(layout: ExpertLayout, host_parts: tuple, part_start: tuple[int, ...], pool, slots: jax.Array,
                   ids: jax.Array, source: str):
    """The weights of experts `ids` [n] of one layer as (gate_up, down) [n, ...] on the device, each from the pool
    where `slots` [n] (its pool slot, or -1) says it is resident, else copied from its pinned host part.

    `source` (static): IN_POOL, every expert of the layer is in the pool (a gather, no control flow); IN_HOST, none
    is; MIXED, some are. A copy from host memory is a dynamic slice of the host part holding the expert, moved to
    the device, which XLA runs as a kernel reading that row from host memory. With one host part a layer
    (`OffloadedRunner(host_parts=1)`) an IN_HOST layer's copies are just these kernels. Otherwise each copy is one
    `lax.switch`: branch 1 + p reads host part p, and, in a MIXED layer, branch 0 gives a zero row for a resident
    expert, whose pool row is selected instead. Measured on an H100, JAX 0.11.2, 2026-11-27 (docs/offload.md):
    18 layers x 8 copies of 2 MiB from device-computed ids took 7.0 ms a step from one buffer a layer and
    10.4-10.9 ms through a switch over four; each switch adds ~30 us to the host's launch of the step's CUDA graph
    and ~20 us on the device. The branches are kept to one operation each (unpacking inside them cost 20% more
    time a step for the "static" policy, measured)."""
    if source == IN_POOL:
        return jax.tree_util.tree_map(lambda a: a[slots], pool)
    starts = jnp.asarray(part_start, jnp.int32)

    def from_host(p):
        return lambda row: jax.device_put(jax.lax.dynamic_index_in_dim(host_parts[p], row, keepdims=True),
                                          jax.memory.Space.Device)

    def resident(row):
        return jnp.zeros((1, layout.nbytes), jnp.uint8)

    mixed = source == MIXED
    branches = ([resident] if mixed else []) + [from_host(p) for p in range(len(host_parts))]
    rows = []
    for j in range(ids.shape[0]):
        if len(branches) == 1:                  # one host part, no resident expert: no control flow
            rows.append(branches[0](ids[j]))
            continue
        part = jnp.sum(ids[j] >= starts[1:]).astype(jnp.int32)
        index = jnp.where(slots[j] >= 0, 0, 1 + part) if mixed else part
        rows.append(jax.lax.switch(index, branches, ids[j] - starts[part]))
    copied = layout.unpack(jnp.concatenate(rows))                       # leaves [n, ...]
    if not mixed:
        return copied
    where = slots >= 0
    return jax.tree_util.tree_map(
        lambda a, c: jnp.where(where.reshape((-1,) + (1,) * (c.ndim - 1)), a[jnp.maximum(slots, 0)], c), pool, copied)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(10, 16))
def _decode_paged(layout: ExpertLayout, graphs: tuple, head_graph: StaticGraph, sources: tuple[str, ...],
                  part_start: tuple[int, ...], embed, layer_leaves: tuple, head_leaves: tuple, lm_head, tokens,
                  states, position, host: tuple, pool, slot_table, held: tuple, hits):
    """One decode step of the offloaded model as one program, its experts paged by the device
    (`OffloadedRunner.decode_step`).

    Per layer: the mixer, the router, then each routed copy's expert from the device (a held layer's arrays, or
    the pool where `slot_table` [layers, experts] int32 gives its slot) or from pinned host memory
    (`_fetch_experts`), chosen on the device: no ids go back to the host. The experts then run as in the
    all-resident model, each copy naming its own fetched expert. `sources` (static) says per layer where its
    experts are: HELD (`held[i]`), IN_POOL, MIXED or IN_HOST (`_fetch_experts`). Returns (logits [batch, vocab]
    float32, the new states, hits + this step's resident copies per layer ([layers] int32))."""
    x = embed[tokens[:, None]]
    batch, _, hidden = x.shape
    valid = jnp.ones((batch,), bool)
    new_states, step_hits = [], []
    for i, (graph, leaves, state) in enumerate(zip(graphs, layer_leaves, states)):
        layer = graph.merge(leaves)
        h, state = layer.mix(x, state, position, 1)
        new_states.append(state)
        u = layer.post_norm(h).reshape(batch, hidden)
        weights, ids = layer.ffn.route(u)                                  # [batch, top_k]
        flat = ids.reshape(-1)
        if sources[i] == HELD:
            experts = jax.tree_util.tree_map(lambda a, flat=flat: a[flat], held[i])
            step_hits.append(jnp.int32(flat.shape[0]))
        else:
            slots = slot_table[i][flat]
            experts = _fetch_experts(layout, host[i], part_start, pool, slots, flat, sources[i])
            step_hits.append(jnp.sum(slots >= 0).astype(jnp.int32))
        layer.ffn.experts_gate_up.set_value(experts[0])
        layer.ffn.experts_down.set_value(experts[1])
        local = jnp.arange(flat.shape[0], dtype=jnp.int32).reshape(ids.shape)   # copy j runs fetched expert j
        x = h + layer.ffn.experts(u, weights, local, valid).reshape(batch, 1, hidden)
    head_weight = embed.T if lm_head is None else lm_head                # as HybridLM.head_weight
    logits = head_logits(head_graph.merge(head_leaves), head_weight, x[:, 0])
    return logits, new_states, hits + jnp.stack(step_hits)


def _placeholder_experts(graph: StaticGraph, leaves: tuple) -> tuple[StaticGraph, tuple]:
    """A layer's (graph, flat weights) with its expert weights replaced by 1-element placeholders (no device
    memory)."""
    params = jax.tree_util.tree_map(lambda x: x, graph.params(leaves))
    for name in EXPERT_PARAMS:
        params["ffn"][name].set_value(jnp.zeros((1, 1, 1), jnp.float32))
    return flat_layer(graph.graphdef, params)


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
      prefetch_depth: layers streamed ahead in whole-layer mode (their staging comes out of the budget). At 2,
        the copy of a layer can spread over the programs of the two layers before it.
      whole_layer: force whole-layer mode on (True) or off (False); None: when chunk tokens * top_k >=
        4 * experts.
      host_experts: experts already in pinned host memory (e.g. built per layer for a model too large to
        initialise on the device).
      chunk_size: optional, the largest chunk (tokens per sequence) to be run, to check the budget now.
      batch: sequences per chunk for that check.
      device_memory_bytes: device memory available for the budget; None reads `device.memory_stats()`
        (bytes_limit - bytes_in_use); backends without memory stats (CPU) are not checked.
      in_program_copies: whole-layer mode: copy the next layer absent from the device inside this layer's
        mixer and experts programs (one host part each), where the copy overlaps their compute; False: a separate
        `jax.device_put` (which, measured on an H100 with JAX 0.11.2, runs mostly after the queued compute).
      host_parts: pinned host buffers a layer when the runner copies the model's experts (`host_experts` None;
        default HOST_PARTS = 4). Four let whole-layer prefill spread a layer's copy over several programs; one
        lets device-paged decode copy each expert with no control flow. Measured on an H100 (JAX 0.11.2,
        Qwen3.6-35B-A3B shape, 4-bit, 12 GiB, static, 2026-11-27): one part decodes at 88.4 tokens/s against
        60.6-64.4 and prefills a 32 768-token prompt at 47 143 tokens/s against 51 918-51 932 (docs/offload.md).
      mixed_formats: where the model's layers store their experts in different formats (a Q4_K_M GGUF's Q6_K
        downs), how the host copy brings them to one: "widen" (exact, more bytes), "smallest" (requantized, not
        exact) or "refuse" (`host_experts_of_layers`).
      decode_paging: how `decode_step` (and so `generate`) pages experts. "device" (default): the whole step is
        one program that picks each routed expert on the device, from the pool or held layers as the last
        prefill left them, the pool set at the first step to whole layers chosen by the policy and the budget
        (then read only: decode evicts and inserts nothing), or else straight from pinned host
        memory; no ids go back to the host (`_decode_paged`). Batches of more than PAGED_MAX_COPIES / top_k
        sequences take the "host" path: layer by layer, the ids read back each layer and misses inserted into
        the pool by the cache policy (`decode_step_layerwise`).

    Raises:
      ValueError: unknown policy, prefetch mode or decode paging; budget above the device memory; budget below
        the experts one layer needs for one token (or for `chunk_size`); a model without MoE; host_parts < 1, or
        given with `host_experts` of another part count; unknown mixed_formats, or layers in different formats
        with "refuse".
    """

    def __init__(self, model: HybridLM, *, expert_budget: int | str, cache_policy: str = "slru",
                 prefetch: Prefetch = "auto", prefetch_depth: int = 2, whole_layer: bool | None = None,
                 host_experts: HostExperts | None = None, chunk_size: int | None = None, batch: int = 1,
                 device_memory_bytes: int | None = None, in_program_copies: bool = True,
                 decode_paging: Literal["device", "host"] = "device", host_parts: int | None = None,
                 mixed_formats: str = "widen"):
        if model.config.moe is None:
            raise ValueError("OffloadedRunner needs a sparse-MoE model (config.moe is None)")
        if decode_paging not in ("device", "host"):
            raise ValueError(f"unknown decode_paging {decode_paging!r}; choose from device, host")
        if cache_policy not in POLICIES:
            raise ValueError(f"unknown cache_policy {cache_policy!r}; choose from {POLICIES}")
        if prefetch not in ("auto", "router", "layer", "none"):
            raise ValueError(f"unknown prefetch {prefetch!r}; choose from auto, router, layer, none")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={prefetch_depth} must be >= 1")
        if host_parts is not None and host_parts < 1:
            raise ValueError(f"host_parts={host_parts} must be >= 1")
        if mixed_formats not in MIXED_FORMATS:
            raise ValueError(f"unknown mixed_formats={mixed_formats!r}; choose from {MIXED_FORMATS}")
        if host_parts is not None and host_experts is not None and len(host_experts.part_rows) != host_parts:
            raise ValueError(f"host_parts={host_parts}, but host_experts hold {len(host_experts.part_rows)} "
                             "buffers a layer (HostExperts.from_model(..., parts=) sets them)")
        super().__init__(model)
        self.budget = parse_bytes(expert_budget)
        self.cache_policy, self.prefetch, self.prefetch_depth = cache_policy, prefetch, prefetch_depth
        self.whole_layer = whole_layer
        self.in_program_copies = in_program_copies
        self._twins_run: set = set()   # see `_compile_twins`
        self._queue: list[tuple[int, int]] = []   # (layer, host part) allocated, to be copied inside a program
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
        else:   # the layout HostExperts.from_model will store, before anything is copied
            layout = one_layout([ExpertLayout.of(layer.ffn.experts_gate_up.get_value(),
                                                 layer.ffn.experts_down.get_value()) for layer in model.layers],
                                mixed_formats)
        self.expert_bytes = layout.nbytes
        self.total_slots = self.budget // self.expert_bytes
        self.check_chunk(batch * (chunk_size or 1))      # before copying anything to the host
        self.host = host_experts if host_experts is not None else HostExperts.from_model(
            model, parts=HOST_PARTS if host_parts is None else host_parts, mixed=mixed_formats)
        # Per-layer trunk params without expert weights: the runner holds no device copy of any expert.
        self.layers = [_placeholder_experts(g, p) for g, p in self.layers]
        self.cache: ExpertCache | None = None
        self.held_layers: frozenset[int] = frozenset()     # whole-layer mode, static or all fit: held outside the pool
        self.held: dict[int, tuple] = {}                   # ... those loaded: layer -> (gate_up, down) on the device
        self._pool_for_holding = False                     # the pool was sized for holding layers (may hold none)
        self._staged: dict[Key, Staged] = {}     # pending (prefetched) keys -> their staged batch
        self._kind = "prefill"
        self._num_chunks = 1     # of the prefill running: see on_prefill_start
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self._t_start: float | None = None
        # Device-paged decode (`decode_step`): the pool's residency as the device reads it (made after the pool
        # last changed), and its counters.
        self.decode_paging = decode_paging
        self._paged_view: tuple | None = None
        self._reset_paged_counters()

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

    def uses_whole_layer(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` tokens (batch x seq) runs in whole-layer mode (see the class docstring)."""
        if self.whole_layer is not None:
            return self.whole_layer
        return self.top_k * tokens >= WHOLE_LAYER_FACTOR * self.num_experts

    def _holds_layers(self, whole: bool) -> bool:
        """Whether a pool built for this mode holds layers outside it (see `_ensure_pool`)."""
        everything = self.num_layers * self.num_experts
        if not whole or self.cache_policy == "stream":
            return False
        return self.cache_policy == "static" or self.total_slots >= everything

    def _ensure_pool(self, tokens: int) -> None:
        need = self.min_experts(tokens)
        whole = self.uses_whole_layer(tokens)
        if whole:
            need = self.num_experts
        # A pool first built for exact mode (decode, small chunks) is rebuilt once for the first whole-layer
        # chunk that should hold layers outside it; one built holding layers serves exact mode as it is.
        if (self.cache is not None and self.cache.num_slots >= need
                and (not self._holds_layers(whole) or self._pool_for_holding)):
            return
        self.check_chunk(tokens)
        if self.total_slots < need:   # forced whole-layer mode on a budget below one layer
            raise ValueError(f"whole_layer=True needs {need} expert slots ({need * self.expert_bytes} bytes); "
                             f"expert_budget={self.budget} bytes holds {self.total_slots}")
        # Staging for prefetched experts comes out of the budget too: up to prefetch_depth layers (whole-layer
        # mode) or one layer's active experts (exact mode), leaving at least `need` pool slots.
        everything = self.num_layers * self.num_experts
        # Whole-layer mode holds depth + 1 layers of staged bytes at once: the layer about to be written into
        # the pool and the `prefetch_depth` layers being copied behind it.
        want = 0 if self.prefetch == "none" else self.num_experts * (self.prefetch_depth + 1 if whole else 1)
        if self.total_slots >= everything:     # all experts fit: one slot each, spare budget for staging
            slots = everything
            staging = min(want, self.total_slots - everything)
        else:
            staging = max(0, min(want, (self.total_slots - need) // 2))
            slots = self.total_slots - staging
        working = need + (staging if self.prefetch != "none" else 0)
        pinned = max(0, slots - working) if self.cache_policy == "static" else 0
        self.held_layers, self.held = frozenset(), {}
        self._pool_for_holding = self._holds_layers(whole)
        if self._pool_for_holding:
            # Whole layers only (a partial layer would move as row copies, outside the programs), held outside
            # the pool as the all-resident model holds them: a pinned layer in the pool was gathered out of it
            # for each use (41 ms of device copies per 32k-token prefill in the H100 trace of 2026-11-23).
            # With every expert fitting, lru / slru / lfu never evict: they hold layers like static (at 24 GiB
            # on the H100, slru with all in the pool ran at 33 272 tokens/s, static holding 36 layers 35 652)
            # and keep the other layers in the pool, which then holds them all (none released after use).
            hold = max(0, slots - working)
            hold -= hold % self.num_experts
            self.held_layers = frozenset(k[0] for k in static_pinned_keys(self.num_layers, self.num_experts, hold))
            slots, pinned = slots - hold, 0
        self.staging_slots = staging
        self._paged_view = None
        self._staged.clear()
        self._queue.clear()
        self.cache = None
        self.cache = ExpertCache(self.host.layout, slots, self.cache_policy, num_layers=self.num_layers,
                                 num_experts=self.num_experts, pinned_count=pinned, sharding=self.dev_sharding)
        # No compilation inside a timed prefill: the row-copy programs and the pool writes of every batch size
        # (a whole part, or a power of two of rows; the first timed prompt of the 2026-11-22 H100 run compiled
        # its writes of partial layers, which the warm-up prompt had moved whole).
        self.host.compile_row_copies(self.dev_sharding)
        sizes = set(self.host.part_rows) | {1 << b for b in range(MAX_ROWS_PER_COPY.bit_length())}
        self.cache.compile_writes(sizes, self.dev_sharding)
        # Exact mode's per-layer table (`_exact_table`): remap [E], gather [E], then copy batches of
        # MAX_ROWS_PER_COPY rows and as many slots; at most ceil(E / 32) + parts batches for each of two layers.
        E, C = self.num_experts, MAX_ROWS_PER_COPY
        batches = 2 * (-(-E // C) + len(self.host.part_rows))
        self._table_at, self._table_len = (2 * E, C), 2 * E + batches * 2 * C
        self._batch_ids = [jax.device_put(np.int32(j), self.dev_sharding) for j in range(batches)]
        template = np.zeros((self._table_len,), np.int32)
        template[2 * E + C:2 * E + 2 * C] = self.cache.num_slots       # batch 0: every row dropped
        template = jax.device_put(template, self.dev_sharding)
        for p in sorted({self.host.part_rows.index(r) for r in self.host.part_rows}):
            self.cache.compile_row_copies((self.host.layers[0][p],), template, self._batch_ids[0], self._table_at,
                                          min(C, self.host.part_rows[p]))
        # A few rows from each of a layer's parts go as one program over all of them (`_copy_batches`).
        parts = len(self.host.part_rows)
        self._padded_max = 0
        if parts > 1 and len(set(self.host.part_rows)) == 1:
            self._padded_max = min(C // parts, 1 << (self.host.part_rows[0] - 1).bit_length())
            self.cache.compile_row_copies(tuple(self.host.layers[0]), template, self._batch_ids[0], self._table_at,
                                          self._padded_max)

    # ----- statistics -----
    def _new_stats(self, kind: str) -> CacheStats:
        return CacheStats(kind=kind, expert_bytes=self.expert_bytes,
                          layers=[LayerStats() for _ in range(self.num_layers)])

    def on_prefill_start(self, num_chunks: int = 1) -> None:
        """Called by `prefill` before its first chunk: starts new prefill statistics; `num_chunks` tells whole-
        layer streaming whether to prefetch the next chunk's first layers during this chunk's last ones."""
        self._kind = "prefill"
        self._num_chunks = num_chunks
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self._reset_paged_counters()
        self._t_start = None

    def _reset_paged_counters(self) -> None:
        self._paged_lookups = 0                                          # per layer, over the paged steps
        self._paged_hits = jnp.zeros((self.num_layers,), jnp.int32, device=self.dev_sharding)   # on the device

    def _decode_stats_now(self) -> CacheStats:
        """The decode statistics, with the device-paged steps' lookups, hits and misses added (their hits were
        counted on the device; read back here). Paged steps are not in wall_s (they are never waited for)."""
        if not self._paged_lookups:
            return self._decode_stats
        out = copy.deepcopy(self._decode_stats)
        for s, hits in zip(out.layers, np.asarray(self._paged_hits).tolist()):
            misses = self._paged_lookups - hits
            s.lookups += self._paged_lookups
            s.hits += hits
            s.misses += misses
            s.bytes_h2d += misses * self.expert_bytes
        return out

    def stats(self, per_layer: bool = True) -> dict:
        """{'prefill': last prefill's statistics, 'decode': decode steps since, 'pool': pool configuration}."""
        pool = {"budget_bytes": self.budget, "expert_bytes": self.expert_bytes, "policy": self.cache_policy,
                "prefetch": self.prefetch, "prefetch_depth": self.prefetch_depth,
                "host_parts": len(self.host.part_rows), "expert_format": _describe(self.host.layout),
                "slots": self.cache.num_slots if self.cache else None,
                "staging_slots": getattr(self, "staging_slots", None),
                "pinned": (len(self.cache.pinned) + len(self.held_layers) * self.num_experts) if self.cache else 0}
        return {"prefill": self._prefill_stats.to_dict(per_layer), "decode": self._decode_stats_now().to_dict(per_layer),
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
    def _compile_twins(self, name: str, graph, args, run, copies: int) -> None:
        """The first time program `name` runs for `graph` and these argument shapes, runs its variants
        with the other numbers of in-program copies (0..MAX_PARTS_PER_PROGRAM; results discarded).

        In whole-layer mode a layer's mixer and experts programs copy 0, 1 or 2 host parts of later layers
        beside their compute, as the copy queue and the cache's contents decide; so a later prompt could need
        a variant the first did not (measured on an H100: the static policy's second 8192-token prompt took
        12.8 s instead of ~0.6 s). Running every variant during the first prompt's compilation keeps
        compilation out of every later prefill. run(parts) runs the program with host parts `parts`.
        """
        key = (name, graph, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)))
        if key not in self._twins_run:
            self._twins_run.add(key)
            spare = [buf for layer in self.host.layers for buf in layer][:MAX_PARTS_PER_PROGRAM]
            for n in range(MAX_PARTS_PER_PROGRAM + 1):
                if n != copies:
                    jax.block_until_ready(run(tuple(spare[:n])))

    def _queued_experts(self) -> int:
        return sum(self.host.part_rows[p] for _, p in self._queue)

    def _pop_parts(self, layer_now: int, programs_done: int) -> list[tuple[int, int]]:
        """Host parts to copy inside the next program of layer `layer_now` (its mixer: programs_done=0, its
        experts: 1): at least one if any is queued, and as many as every queued layer's deadline needs,
        spread evenly over the programs left before it (layer j's parts must be copied by the programs of
        layers layer_now..j-1), at most MAX_PARTS_PER_PROGRAM."""
        if not self._queue:
            return []
        n, queued = 1, 0
        ahead = lambda j: (j - layer_now) % self.num_layers
        for j in sorted({q[0] for q in self._queue}, key=ahead):
            queued += sum(1 for q in self._queue if q[0] == j)
            n = max(n, -(-queued // max(1, 2 * ahead(j) - programs_done)))
        n = min(n, MAX_PARTS_PER_PROGRAM)
        taken, self._queue = self._queue[:n], self._queue[n:]
        return taken

    def _part_keys(self, layer: int, part: int) -> list[Key]:
        return [(layer, e) for e in self.host.part_experts(part)]

    def _record_in_program(self, taken, copied, stats: CacheStats) -> None:
        for (j, p), buf in zip(taken, copied):
            self._record_prefetch(Staged(buf, self._part_keys(j, p), True), stats)

    def _put_parts(self, parts, stats: CacheStats) -> None:
        """Copies host parts [(layer, part)] with `device_put`, outside any program, and records them staged."""
        for j, p in parts:
            buf = jax.device_put(self.host.layers[j][p], self.dev_sharding)
            self._record_prefetch(Staged(buf, self._part_keys(j, p)), stats)

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
        room = self.staging_slots - len(self._staged) - self._queued_experts()
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

    def _count_prefetch(self, keys: list[Key], stats: CacheStats) -> None:
        for key in keys:
            self.cache.speculative.add(key)
            s = stats.layers[key[0]]
            s.prefetched += 1
            s.bytes_h2d += self.expert_bytes

    def _record_prefetch(self, pending: Staged, stats: CacheStats) -> None:
        for key in pending.keys:
            self._staged[key] = pending
        self._count_prefetch(pending.keys, stats)

    def _prefetch(self, keys, protected: set, stats: CacheStats, layer_now: int) -> None:
        """Allocates slots for predicted `keys` and issues their copies; best effort within staging and slots."""
        for pending in self._stage(self._allocate_prefetch(keys, protected, stats, layer_now)):
            self._record_prefetch(pending, stats)

    def _exact_table(self, layer: int, active: list[int], copies: list[Key]
                     ) -> tuple[jax.Array, int, list[tuple[jax.Array, int]]]:
        """Exact mode's one index table of `layer` (its experts `active` gathered out of the pool), moved to the
        device in one transfer, and its copies.

        `copies` (keys with slots allocated: this layer's misses and the next layer's predicted experts) go
        host -> device straight into their pool slots (`ExpertCache.copy_rows`, batched by `_copy_batches`).
        Nothing is staged and the host waits for none of them: the device runs each copy before the programs
        that read the pool after it. Measured on an H100 (2026-11-27, docs/offload.md): staged row copies and a
        pool write per batch, each program with its own numpy indices, cost ~8 ms of host time per layer of an
        offloaded decode step.

        Returns:
          (int32 table [self._table_len] on the device: remap [E] at 0 and gather [E] at E for
          `_pool_experts_table`, then the copy batches (rows, slots) of MAX_ROWS_PER_COPY each; the gather's
          groups (0: none); [(host buffers, rows m from each)] per batch, in table order).
        """
        E, (base, width) = self.num_experts, self._table_at
        table = np.zeros((self._table_len,), np.int32)
        groups = 0
        if layer not in self.held_layers:
            gather, remap = self._pool_tables(layer, active)
            table[:E] = remap
            if gather is not None:
                groups = len(gather)
                table[E:E + groups] = gather
        by_layer: dict[int, list[int]] = {}
        for j, e in copies:
            by_layer.setdefault(j, []).append(e)
        batches = []
        for j, experts in by_layer.items():
            for bufs, rows, ids, m in self._copy_batches(j, experts):
                at = base + len(batches) * 2 * width
                for b, (r, e) in enumerate(zip(rows, ids)):
                    lo, n = at + b * m, len(r)
                    table[lo:lo + n], table[lo + n:lo + m] = r, (r[0] if n else 0)
                    table[lo + width:lo + width + n] = [self.cache.slot_of[(j, x)] for x in e]
                    table[lo + width + n:lo + width + m] = self.cache.num_slots     # padding: dropped
                batches.append((bufs, m))
        assert len(batches) <= len(self._batch_ids), "exact-mode table too small"
        return jax.device_put(table, self.dev_sharding), groups, batches

    def _copy_batches(self, layer: int, experts: list[int]) -> list[tuple[tuple, list, list, int]]:
        """The copy programs for `experts` of `layer`: [(host buffers, rows per buffer, expert ids per buffer, m)].

        One program per host part touched (m = its rows rounded up to a power of two), or, when several parts
        hold a few rows each, one program over all of the layer's parts with m rows from each (padding rows
        dropped) if that pads at most PADDED_COPY_BYTES: each program saved is ~0.2 ms of host time, each
        padding row ~45 us of copying on the H100 (2026-11-27, docs/offload.md)."""
        found = self.host.row_batches(experts)
        parts = self.host.layers[layer]
        if len(found) > 1 and self._padded_max:
            m = 1 << (max(len(rows) for _, rows, _ in found) - 1).bit_length()
            waste = len(parts) * m - sum(len(rows) for _, rows, _ in found)
            if m <= self._padded_max and waste * self.expert_bytes <= PADDED_COPY_BYTES:
                # m <= _padded_max <= MAX_ROWS_PER_COPY // 2: row_batches gave each part one batch
                mine = {p: (rows, ids) for p, rows, ids in found}
                rows, ids = zip(*(mine.get(p, ([], [])) for p in range(len(parts))))
                return [(tuple(parts), list(rows), list(ids), m)]
        return [((parts[p],), [rows], [ids], 1 << (len(rows) - 1).bit_length()) for p, rows, ids in found]

    def _pool_tables(self, layer: int, active: list[int] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(gather, remap) for `_pool_experts` (numpy: jit moves them; an eager jnp.asarray costs more host time).

        A pool of at most one layer's experts: the grouped matmul runs on it, ids remapped to slots. A larger one
        never goes to the kernel whole: its leaves can pass 2**31 elements (a 12 GiB pool of 4-bit experts
        holds 6e9 bytes of gate_up codes), past the kernel's int32 offsets (measured on an H100, 2026-11-23: wrong
        logits). Whole-layer mode (active None) gathers the layer in expert order (the all-resident shapes);
        exact mode gathers only the chunk's `active` experts, padded to a power of two (few compiled shapes; a
        decode step copies 8 experts), ids remapped to their rows.
        """
        if self.cache.num_slots <= self.num_experts:
            return None, self.cache.slot_table(layer)
        if active is None:
            return self.cache.slot_table(layer), None
        groups = min(self.num_experts, 1 << max(0, len(active) - 1).bit_length())
        slot_of = self.cache.slot_of        # only the active experts' slots (a full table costs ~0.1 ms a layer)
        gather = np.full((groups,), slot_of[(layer, active[0])], np.int32)
        gather[:len(active)] = [slot_of[(layer, e)] for e in active]
        remap = np.zeros((self.num_experts,), np.int32)
        remap[active] = np.arange(len(active), dtype=np.int32)
        return gather, remap

    def _hold(self, layer: int, s: LayerStats, lookups: int) -> tuple:
        """A held layer's experts (gate_up, down) on the device; `lookups` of its experts counted as hits, or as
        misses when this first use copies the layer (outside any program; its bytes counted)."""
        s.lookups += lookups
        if layer in self.held:
            s.hits += lookups
        else:
            s.misses += lookups
            s.bytes_h2d += self.num_experts * self.expert_bytes
            self.held[layer] = self.host.unpack_layer(layer, self.dev_sharding)
        return self.held[layer]

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

    def decode_step(self, tokens: jax.Array, states: list[LayerState], position) -> tuple[jax.Array, list[LayerState]]:
        """`LayerwiseRunner.decode_step` with the experts paged (same arguments and results).

        With decode_paging="device" (and batch x top_k <= PAGED_MAX_COPIES) one program a step, which reads each
        routed expert from the held layers or the pool (set to whole layers at the first step after a prefill,
        `_make_paged_view`), or else from pinned host memory, as
        the device's router picks it (`_decode_paged`); otherwise layer by layer (`decode_step_layerwise`).

        Raises:
          ValueError: tokens not one per sequence, a position outside the KV cache, or token ids outside the
            vocabulary (`check_decode_inputs`).
        """
        batch = np.shape(tokens)[0] if np.ndim(tokens) else 0
        if self.decode_paging == "host" or batch * self.top_k > PAGED_MAX_COPIES:
            return self.decode_step_layerwise(tokens, states, position)
        check_decode_inputs(self.config.vocab_size, tokens, states, position)
        self._ensure_pool(batch)
        if self._paged_view is None:
            self._paged_view = self._make_paged_view()
        slot_table, sources, held = self._paged_view
        graphs, leaves = zip(*self.layers)
        logits, states, self._paged_hits = _decode_paged(
            self.host.layout, graphs, self.final_norm[0], sources, tuple(self.host.part_start), self.embed_table,
            leaves, self.final_norm[1], self.lm_head, *self._step_inputs(tokens, states, position),
            tuple(tuple(parts) for parts in self.host.layers), self.cache.pool, slot_table, held, self._paged_hits)
        self._paged_lookups += batch * self.top_k
        self._decode_stats.chunks += 1
        self._decode_stats.tokens += batch
        self._kind = "decode"
        return logits, states

    def _make_paged_view(self) -> tuple:
        """(slot table [layers, experts] int32 on the device: pool slot or -1, each layer's source (HELD, IN_POOL,
        MIXED or IN_HOST), held arrays) for `_decode_paged`.

        The pool is first set to a content that depends on the policy and the budget only, not on what the last
        prompt routed, so that the step compiles once per pool (its sources are static arguments; a full-size step
        compiles for ~30 s or more): staged bytes still waiting for their layer are written, then every policy but
        "stream" keeps whole layers in the pool, the static policy's pinned layers first, then layers spread over
        the depth up to the pool's size. Other entries are released and missing experts of those layers copied
        (counted as prefetched in the decode statistics). A whole-layer prefill below the full-model budget leaves
        the LRU family's pool empty: without this fill a paged step would read every expert from host memory
        (~0.6 GB a step for Qwen3.6-35B-A3B with 4-bit experts)."""
        cache, E = self.cache, self.num_experts
        pending = []
        for b in self._staged.values():
            if not any(b is x for x in pending):
                pending.append(b)
        self._staged.clear()
        for b in pending:
            cache.write(b.buf, [cache.slot_of[k] for k in b.keys])
        target: list[int] = []
        if self.cache_policy != "stream":
            capacity = cache.num_slots // E
            pinned = sorted({layer for layer, _ in cache.pinned})[:capacity]
            others = [i for i in range(self.num_layers) if i not in self.held and i not in pinned]
            n = max(0, min(len(others), capacity - len(pinned)))
            target = pinned + [others[int((k + 0.5) * len(others) / n)] for k in range(n)]
        for layer in range(self.num_layers):
            if layer not in target:
                cache.release_layer(layer, keep=cache.pinned)
        for layer in target:
            # free slots only (never an eviction): should pinned keys outside these layers leave too few, the
            # layer stays partly resident (MIXED), which is correct, only slower
            experts = [e for e in range(E) if (layer, e) not in cache][:len(cache.free)]
            for e in experts:
                cache.allocate((layer, e), set())
            for buf, ids in self.host.to_device(layer, experts, self.dev_sharding) if experts else ():
                cache.write(buf, [cache.slot_of[(layer, e)] for e in ids])
            s = self._decode_stats.layers[layer]
            s.prefetched += len(experts)
            s.bytes_h2d += len(experts) * self.expert_bytes
        table = np.stack([cache.slot_table(layer, missing=-1) for layer in range(self.num_layers)])
        resident = (table >= 0).sum(axis=1)
        sources = tuple(HELD if i in self.held else IN_POOL if resident[i] == E
                        else MIXED if resident[i] else IN_HOST for i in range(self.num_layers))
        held = tuple(self.held.get(i) for i in range(self.num_layers))
        return jax.device_put(table, self.dev_sharding), sources, held

    def forward_chunk(self, ids: jax.Array, states: list[LayerState], start, num_valid: int,
                      timer: PhaseTimer | None = None) -> tuple[jax.Array, list[LayerState]]:
        """`LayerwiseRunner.forward_chunk` with experts paged from host memory (same arguments and results).

        With a timer, exact mode counts the router's time in the mixer's phase ("gdn" / "attention"): they run as
        one program (`_mix_route`)."""
        timer = timer or PhaseTimer(False)
        batch, seq = ids.shape
        tokens = batch * seq
        self._ensure_pool(tokens)          # budget errors before any work
        self._paged_view = None            # the pool changes below
        whole = self.uses_whole_layer(tokens)
        stats = self._prefill_stats if self._kind == "prefill" else self._decode_stats
        if self._t_start is None:
            self._t_start = time.perf_counter()
        stats.chunks += 1
        stats.tokens += tokens
        # Whole-layer streaming runs on into the next chunk's first layers while this chunk's last ones compute
        # (without it, each chunk began with ~7 ms of copies and no compute: H100 trace of 2026-11-23).
        more = self._kind == "prefill" and stats.chunks < self._num_chunks
        cache, num_layers, E = self.cache, self.num_layers, self.num_experts
        stream = self.cache_policy == "stream"
        nv = int(num_valid)
        start = jnp.asarray(start, jnp.int32)
        num_valid_dev = jnp.asarray(num_valid, jnp.int32)
        x = timer("embed", _embed, self.embed_table, ids)
        # Committed to the device, so that each program compiles once: a copying program's outputs are
        # committed, a plain one's follow its inputs, and jit compiles again for the other kind of input.
        x, states = jax.device_put((x, states), self.dev_sharding)
        new_states = []
        use_router = self.prefetch in ("auto", "router") and not whole
        stream_layers = self.prefetch == "layer" or (self.prefetch != "none" and whole)
        for i, ((graph, params), state, layer_type) in enumerate(zip(self.layers, states, self.config.layer_types)):
            s = stats.layers[i]
            phase = "gdn" if layer_type == "linear_attention" else "attention"
            batches: list[Staged] = []
            if whole:
                # Every expert is needed. Queued parts of this layer no program copied in time move now (they
                # stall); then lookups and on-demand copies; then the next layers' slots are allocated and
                # their host parts queued, to be copied inside the coming programs (mixer and experts) where
                # XLA runs a copy beside the compute (a standalone device_put runs after it, measured:
                # benchmarks/h2d_copies.py). Partial layers move as row copies through `_stage`.
                late = [q for q in self._queue if q[0] == i]
                if late:
                    self._queue = [q for q in self._queue if q[0] != i]
                    self._put_parts(late, stats)
                keys = [] if i in self.held_layers else [(i, e) for e in range(E)]
                protected = set(keys) | set(self._staged) | {k for q in self._queue for k in self._part_keys(*q)}
                demand = self._lookup(keys, s, protected)
                batches = self._stage(demand)
                s.bytes_h2d += len(demand) * self.expert_bytes
                if stream_layers:
                    ahead = range(i + 1, min(i + 1 + self.prefetch_depth, i + num_layers if more else num_layers))
                    predicted = [(j % num_layers, e) for j in ahead for e in range(E)]
                    issue = self._allocate_prefetch(predicted, protected, stats, i)
                    for j in sorted({k[0] for k in issue}, key=lambda j: (j - i) % num_layers):
                        layer_keys = [k for k in issue if k[0] == j]
                        if self.in_program_copies and len(layer_keys) == E:
                            self._queue += [(j, p) for p in range(len(self.host.layers[j]))]
                        else:
                            for pending in self._stage(layer_keys):
                                self._record_prefetch(pending, stats)
            twins = whole and stream_layers and self.in_program_copies
            taken = self._pop_parts(i, 0) if twins else []
            mix_args = (graph, params, x, state, start, num_valid_dev)

            def run_mix(parts, mix_args=mix_args):
                return _mix_copying(*mix_args, parts) if parts else _mix(*mix_args)

            if twins:
                self._compile_twins("mix", graph, mix_args[2:], run_mix, len(taken))
            exact = None
            if taken:
                x, state, copied = timer(phase, run_mix, tuple(self.host.layers[j][p] for j, p in taken))
                self._record_in_program(taken, copied, stats)
            elif not whole:    # mixer, router and the next layer's prediction in one program (phase: the mixer's)
                nxt = self.layers[i + 1] if use_router and i + 1 < num_layers else (None, None)
                x, state, (u, weights, expert_ids), guess = timer(phase, _mix_route, graph, params, *nxt,
                                                                  *mix_args[2:])
            else:
                x, state = timer(phase, _mix, *mix_args)
            new_states.append(state)
            if whole:
                u, weights, expert_ids = timer("router", _route, graph, params, x)
            else:
                # Which experts (this layer, from the router: a device -> host sync) and which to prefetch.
                needed = self._needed(np.asarray(expert_ids), batch, seq, nv)
                keys = [(i, int(e)) for e in needed]
                protected = set(keys) | set(self._staged)
                demand = self._lookup(keys, s, protected) if i not in self.held_layers else []
                issue = []
                if guess is not None:   # copied behind this layer's misses, into the pool too
                    predicted = [(i + 1, int(e)) for e in self._needed(np.asarray(guess), batch, seq, nv)]
                    issue = self._allocate_prefetch(predicted, protected, stats, i)
                table, groups, copies = self._exact_table(i, [e for _, e in keys], demand + issue)
                for j, (bufs, m) in enumerate(copies):
                    cache.copy_rows(bufs, table, self._batch_ids[j], self._table_at, m)
                s.bytes_h2d += len(demand) * self.expert_bytes
                self._count_prefetch(issue, stats)
                exact = (table, (E, groups))
                if stream_layers:       # whole next layers: staged, as in whole-layer mode
                    predicted = [(j, e) for j in range(i + 1, min(i + 1 + self.prefetch_depth, num_layers))
                                 for e in range(E)]
                    self._prefetch(predicted, protected, stats, i)

            # This layer's bytes: wait for those copied outside the programs (stall), write all into their slots,
            # run the experts on the pool.
            for key in [k for k in self._staged if k[0] == i]:
                pending = self._staged.pop(key)
                if not any(b is pending for b in batches):
                    batches.append(pending)
            # In exact mode (staged only with prefetch="layer": the router-predicted and on-demand copies went
            # straight into the pool) the host waits for them (the device is idle after the ids sync anyway; the
            # wait is the stall). In whole-layer mode it does not: the device orders the copies before their use,
            # while a host wait would let the queue of programs drain (seen in a trace of the H100 run).
            outside = [b.buf for b in batches if not b.in_program]
            if outside and not whole:
                t0 = time.perf_counter()
                jax.block_until_ready(outside)
                s.stall_s += time.perf_counter() - t0
            # Whole-layer mode sweeps the layers in a cycle: below the full-model budget a recency or frequency
            # policy evicts every expert before its next use (0% hits, measured), so its layers are released
            # after use like stream's and take the direct path; static releases its unpinned experts.
            # With every expert in the budget (layers held, the rest fitting the pool) nothing is released.
            pooled_layers = num_layers - len(self.held_layers)
            releases = stream or (whole and (self.cache_policy == "static" or cache.num_slots < pooled_layers * E))
            batches.sort(key=lambda b: b.keys[0][1])
            # A layer whose staged bytes are exactly its host parts, none of it kept after use: its experts
            # run straight from the staged parts (no scatter into the pool, no gather out of it).
            direct = (twins and releases and len(batches) == len(self.host.part_rows)
                      and all(b.keys == self._part_keys(i, p) for p, b in enumerate(batches))
                      and not any((i, e) in cache.pinned for e in range(E)))
            if i in self.held_layers:
                args = (graph, params, self._hold(i, s, E if whole else len(keys)), x, u, weights, expert_ids,
                        num_valid_dev)

                def run_experts(parts, args=args):
                    out = _held_experts(*args, parts)
                    return out if parts else out[0]
                name, shapes = "held_experts", args[2:7]
            elif direct:
                staged = tuple(b.buf for b in batches)
                args = (self.host.layout, graph, params, staged, x, u, weights, expert_ids, num_valid_dev)

                def run_experts(parts, args=args):
                    out = _staged_experts(*args, parts)
                    return out if parts else out[0]
                name, shapes = "staged_experts", args[3:8]
            else:
                for b in batches:
                    cache.write(b.buf, [cache.slot_of[k] for k in b.keys])
                if exact is not None:
                    args = (graph, params, cache.pool, *exact, x, u, weights, expert_ids, num_valid_dev)

                    def run_experts(parts, args=args):
                        return _pool_experts_table(*args)
                    name, shapes = ("experts_table", exact[1]), args[2:9]
                else:
                    gather, remap = self._pool_tables(i, None)
                    args = (graph, params, cache.pool, gather, remap, x, u, weights, expert_ids, num_valid_dev)

                    def run_experts(parts, args=args):
                        return _pool_experts_copying(*args, parts) if parts else _pool_experts(*args)
                    name, shapes = ("experts", gather is None, remap is None), args[2:9]
            taken = self._pop_parts(i, 1) if twins else []
            if twins:
                self._compile_twins(name, graph, shapes, run_experts, len(taken))
            if taken:
                x, copied = timer("experts", run_experts, tuple(self.host.layers[j][p] for j, p in taken))
                self._record_in_program(taken, copied, stats)
            else:
                x = timer("experts", run_experts, ())
            if releases:
                # Kept, they would leave partial layers that move as row copies instead of whole parts, and be
                # evicted before their next use anyway.
                cache.release_layer(i, keep=set(self._staged) | cache.pinned)
        if not more:   # none expected (each layer takes its late parts): fill every slot
            self._put_parts(self._queue, stats)
            self._queue.clear()
        cache.speculative.clear()   # unused prefetches stay cached as ordinary entries (counted in `prefetched`)
        return x, new_states

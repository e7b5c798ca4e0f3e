"""Pinned host buffers of the routed experts (`HostExperts`): packing, host -> device copies, one format.

Every layer's experts lie in pinned host memory as a few contiguous uint8 buffers (host parts), so that a
whole layer moves at the full pinned host -> device rate and a subset as row copies inside one program. Layers
whose experts are stored in different formats are brought to one (`host_experts_of_layers`).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.checkpoints.gguf_device import Q4KBlocks
from hybridlm.model import EXPERT_PARAMS, HybridLM
from hybridlm.offload.config import MIXED_FORMATS, default_host_parts
from hybridlm.offload.expert_cache import ExpertLayout, PackedExperts, format_bytes
from pallas_kernels.quantized import QuantizedWeights, common_format, quantize_like, reencode


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


def _blocks_of(param) -> jax.Array:
    """A parameter's Q4_K bytes on the device, uint8 [experts, out, row bytes].

    Raises:
      ValueError: a parameter that is not Q4_K blocks beside one that is."""
    if not isinstance(param, Q4KBlocks):
        raise ValueError("Q4_K blocks pack only beside Q4_K blocks (both parameters)")
    return jnp.asarray(param.data)


@jax.jit
def _pack_q4_k(gate_up: jax.Array, down: jax.Array) -> jax.Array:
    return jnp.concatenate([x.reshape(x.shape[0], -1) for x in (gate_up, down)], axis=1)  # [experts, nbytes]


@functools.partial(jax.jit, static_argnums=0)
def _pack_layer(layout: ExpertLayout, gate_up, down) -> jax.Array:
    return layout.pack(jax.tree_util.tree_leaves((gate_up, down)))  # [experts, nbytes] uint8


# Structural: pinned regions are reserved in multiples of this.
_REGION_UNIT = 256 * 2**20


def reserve_pinned(total_bytes: int, buffer_bytes: int, sharding=None) -> list[int]:
    """Lets XLA's pinned host memory hold `total_bytes` of buffers of up to `buffer_bytes` with little waste.

    XLA's GPU client allocates pinned host memory in regions that double in size as it grows (a best-fit
    allocator with growth), so packing a model's experts buffer by buffer can commit twice their bytes. This
    asks for regions of increasing powers of two that sum to the bytes needed (plus one buffer of
    fragmentation per region) and frees them at once: later buffers reuse them. Nothing on other backends, or
    when the device cannot hold the largest region for a moment.

    Returns:
      The region sizes reserved (bytes), [] when none."""
    if jax.default_backend() != "gpu" or total_bytes <= 0:
        return []
    units = -(-(total_bytes + 6 * buffer_bytes) // _REGION_UNIT)
    sizes = [_REGION_UNIT << b for b in range(units.bit_length()) if units >> b & 1]
    held = []
    try:
        for size in sizes:  # increasing, so that each becomes one region of exactly its size
            held.append(jax.device_put(jnp.zeros((size,), jnp.uint8), sharding or pinned_host_sharding()))
            jax.block_until_ready(held[-1])
    except jax.errors.JaxRuntimeError:
        return []
    finally:
        del held
    return sizes


@jax.jit
def _gather_to_device(host_layer: jax.Array, rows: jax.Array) -> jax.Array:
    """host_layer[rows] on the device: one host -> device copy per row, issued by XLA inside one program.

    host_layer: uint8 [experts, nbytes] in pinned host memory; rows: int32 [m]. Returns uint8 [m, nbytes] in
    device memory. Each row is a dynamic slice of the host buffer moved to the device (XLA's host offloader
    turns it into an asynchronous copy of just that row), faster than separate `jax.device_put`s of per-expert
    buffers.
    """
    out = [
        jax.device_put(
            jax.lax.dynamic_index_in_dim(host_layer, rows[j], keepdims=False), jax.memory.Space.Device
        )
        for j in range(rows.shape[0])
    ]
    return jnp.stack(out)


# Structural, not tuned: row copies per gather program, bounding its (unrolled) size and compile time.
MAX_ROWS_PER_COPY = 32


def power_of_two_parts(n: int, cap: int = MAX_ROWS_PER_COPY) -> list[int]:
    """n as batches of `cap` (a power of two) then distinct smaller powers of two, largest first (cap 32: 77
    -> [32, 32, 8, 4, 1]): batch sizes of row copies, so that the gather program compiles for at most
    log2(cap) + 1 shapes and moves no padding bytes."""
    full, rest = divmod(n, cap)
    return [cap] * full + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


class HostExperts:
    """Every layer's experts in pinned host memory: per layer, `parts` contiguous uint8 `jax.Array`s
    [experts / parts, nbytes] (experts in order).

    Contiguous, so that a layer moves at the full pinned host -> device rate (per-expert buffers move at a
    fraction of it). Several parts by default (`default_host_parts`), because a copy overlaps compute when it
    is a whole buffer moved inside a jitted program (XLA's copy-start / copy-done), not a slice of one, and
    smaller parts let the prefill schedule spread a layer's copy over several programs. A subset of experts
    moves as row copies.

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
            raise ValueError(
                f"host expert buffers must all be [rows, {layout.nbytes}] uint8 with the same rows "
                f"in every layer; got part shapes {sorted(shapes)}"
            )
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
    def pack_layer(
        gate_up, down, host_sharding=None, parts: int | None = None
    ) -> tuple[ExpertLayout, list[jax.Array]]:
        """One layer's experts (device arrays or QuantizedWeights [experts, ...], or `Q4KBlocks` for both
        parameters) -> (layout, `parts` pinned buffers uint8 [~experts / parts, nbytes]; fewer where the layer
        has fewer experts). Packs on the device (bitcasts or concatenated Q4_K blocks, no host round trip).
        parts None: `default_host_parts()`.

        Raises:
          ValueError: parts < 1."""
        parts = default_host_parts() if parts is None else parts
        if parts < 1:
            raise ValueError(f"parts={parts}: a layer needs at least one host buffer")
        layout = ExpertLayout.of(gate_up, down)
        if layout.q4_k:  # the file's Q4_K blocks: expert-major on the device, then into pinned memory
            packed = _pack_q4_k(*(_blocks_of(p) for p in (gate_up, down)))
        else:
            packed = _pack_layer(layout, gate_up, down)
        bounds = np.linspace(0, packed.shape[0], min(parts, packed.shape[0]) + 1).astype(int)
        pieces = [packed[a:b] for a, b in itertools.pairwise(bounds)]
        return layout, list(jax.device_put(pieces, host_sharding or pinned_host_sharding()))

    @classmethod
    def from_model(
        cls, model: HybridLM, host_sharding=None, parts: int | None = None, mixed: str = "widen"
    ) -> HostExperts:
        """Copies the experts of `model` (its values are left in place) to pinned host memory; layers whose
        experts are stored in different formats are brought to one as `mixed` says (`host_experts_of_layers`).

        Raises:
          ValueError: as `host_experts_of_layers`."""
        packed = {
            i: cls.pack_layer(
                layer.ffn.experts_gate_up.get_value(),
                layer.ffn.experts_down.get_value(),
                host_sharding,
                parts,
            )
            for i, layer in enumerate(model.layers)
        }
        return host_experts_of_layers(packed, len(model.layers), mixed)

    def to_device(self, layer: int, experts=None, sharding=None) -> list[tuple[jax.Array, list[int]]]:
        """Issues the host -> device copies of some experts of `layer` (asynchronous; nothing waits).

        Args:
          layer: layer index.
          experts: expert ids (no repeats); None: the whole layer.
          sharding: destination (default: device memory of the first device).

        Returns:
          [(uint8 [m, nbytes] device array, the m expert ids of its rows)], covering `experts` (in some
          order): a part wholly requested moves as one copy, the rest as row copies in batches of
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
                rows = mine[at : at + m]
                at += m
                local = np.asarray([e - self.part_start[p] for e in rows], np.int32)  # jit moves it
                out.append((_gather_to_device(buf, local), rows))
        return out

    def row_batches(self, experts) -> list[tuple[int, list[int], list[int]]]:
        """Where `experts` (expert ids, no repeats) lie: [(host part, rows within it, their expert ids)], one
        entry per part touched, split into batches of at most MAX_ROWS_PER_COPY rows (the same in every
        layer)."""
        wanted = sorted(int(e) for e in experts)
        out = []
        for p, start in enumerate(self.part_start):
            mine = [e for e in wanted if start <= e < start + self.part_rows[p]]
            for at in range(0, len(mine), MAX_ROWS_PER_COPY):
                ids = mine[at : at + MAX_ROWS_PER_COPY]
                out.append((p, [e - start for e in ids], ids))
        return out

    def compile_row_copies(self, sharding=None) -> None:
        """Compiles the row-copy programs of every batch size `to_device` can use (copies a few rows)."""
        for p in sorted({self.part_rows.index(r) for r in self.part_rows}):
            m = 1
            while m <= min(MAX_ROWS_PER_COPY, self.part_rows[p] - 1):
                jax.block_until_ready([b for b, _ in self.to_device(0, self.part_experts(p)[:m], sharding)])
                m *= 2

    def packed_layer(self, layer: int, sharding=None) -> PackedExperts:
        """All experts of `layer` on the device in their host bytes (`PackedExperts`, [experts, nbytes])."""
        parts = jax.device_put(self.layers[layer], sharding or device_sharding())
        return PackedExperts(self.layout, parts[0] if len(parts) == 1 else _concat(tuple(parts)))

    def unpack_layer(self, layer: int, sharding=None):
        """All experts of `layer` on the device as the model holds them: (gate_up, down) [experts, ...]."""
        staged = jax.device_put(self.layers[layer], sharding or device_sharding())
        return _unpack_all(self.layout, tuple(staged))


@jax.jit
def _concat(parts):
    return jnp.concatenate(parts)


@functools.partial(jax.jit, static_argnums=0)
def _unpack_all(layout: ExpertLayout, staged):
    return layout.unpack(jnp.concatenate(staged))


def host_experts_of_layers(packed: dict[int, tuple], num_layers: int, mixed: str = "widen") -> HostExperts:
    """`HostExperts` from {layer: (ExpertLayout, pinned buffers)} for layers 0..num_layers-1.

    The host buffers and the device pool hold one format for every layer's experts. Where layers were packed
    in different ones (llama-quantize's Q4_K_M keeps half the layers' ffn_down experts as Q6_K: 8-bit with a
    float32 scale per 16, where the other layers' are 4-bit), `mixed` says what happens:
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
        weights = [convert(w, t) for w, t in zip(weights, templates, strict=False)]
        got, layers[i] = HostExperts.pack_layer(*weights, parts=len(layers[i]))
        jax.block_until_ready(layers[i])
        if got != target:
            raise ValueError(
                f"layer {i}'s experts converted to {describe_layout(got)}, not {describe_layout(target)}"
            )
    return HostExperts(target, [layers[i] for i in range(num_layers)])


def one_layout(layer_layouts, mixed: str = "widen") -> ExpertLayout:
    """The one layout `host_experts_of_layers` stores experts in, given each layer's own (`layer_layouts`, in
    layer order; see there for `mixed`).

    Raises:
      ValueError: several layouts with mixed="refuse" (naming the layers of each)."""
    by_layout: dict[ExpertLayout, list[int]] = {}
    for i, layout in enumerate(layer_layouts):
        by_layout.setdefault(layout, []).append(i)
    layouts = list(by_layout)
    if len(layouts) == 1:
        return layouts[0]
    if mixed == "refuse":
        kinds = "; ".join(
            f"layers {_span(layers)}: {describe_layout(layout)}" for layout, layers in by_layout.items()
        )
        raise ValueError(
            f"the layers store their experts in {len(layouts)} formats ({kinds}); the host buffers and "
            "the device pool hold one. mixed='widen' (the default) stores them all in one format that "
            "holds each exactly; mixed='smallest' requantizes them into the smallest (not exact)"
        )
    if mixed == "smallest":
        return min(layouts, key=lambda layout: layout.nbytes)
    return ExpertLayout.of(*[common_format(p) for p in zip(*map(_params, layouts), strict=False)])


def _params(layout: ExpertLayout) -> list:
    """The (gate_up, down) of `layout`, leaves as ShapeDtypeStructs with one expert axis of 1."""
    leaves = [
        jax.ShapeDtypeStruct((1,) + shape, dtype)
        for shape, dtype in zip(layout.shapes, layout.dtypes, strict=False)
    ]
    return list(jax.tree_util.tree_unflatten(layout.treedef, leaves))


def _span(layers: list[int]) -> str:
    return (
        "["
        + ", ".join(map(str, layers[:12]))
        + (f", ... ({len(layers)} layers)]" if len(layers) > 12 else "]")
    )


def describe_layout(layout: ExpertLayout) -> str:
    """e.g. "gate_up 4-bit (float32 scales per 32), down 8-bit (float32 scales per 16), 2.75 MiB an expert"
    (unquantized parameters by dtype and shape without the expert axis)."""
    names = [n.removeprefix("experts_") for n in EXPERT_PARAMS]
    kinds = [
        f"{q.bits}-bit ({q.scales.dtype.name} scales"
        f"{' and offsets' if q.bits == 8 and q.offsets is not None else ''}"
        f" per {q.block_size})"
        if isinstance(q, QuantizedWeights)
        else f"{q.dtype.name}{list(q.shape[1:])}"
        for q in _params(layout)
    ]
    if layout.q4_k:
        kinds = [
            f"the file's Q4_K blocks, unpacked where used to {kind}" if k is not None else kind
            for kind, k in zip(kinds, layout.q4_k, strict=True)
        ]
        return (
            ", ".join(f"{n} {k}" for n, k in zip(names, kinds, strict=False))
            + f", {format_bytes(layout.nbytes)} an expert on the host, "
            f"{format_bytes(layout.device_nbytes)} on the device"
        )
    return (
        ", ".join(f"{n} {k}" for n, k in zip(names, kinds, strict=False))
        + f", {format_bytes(layout.nbytes)} an expert"
    )

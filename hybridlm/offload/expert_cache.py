"""Device expert cache: a pool of expert slots on the device and the (layer, expert) -> slot map.

One *expert* is the pair (gate_up[e], down[e]) of one layer: `[hidden, 2*ffn]` and `[ffn, hidden]`, float or
`QuantizedWeights` (values + scales (+ offsets)). On the host every expert is ONE contiguous uint8 buffer
(all its leaves packed back to back, `ExpertLayout`), so paging an expert is a single `jax.device_put` and the
bytes moved are exactly the expert's bytes. On the device the pool keeps those same bytes, one row a slot
(`PackedExperts`, uint8 [slots, nbytes]): a program gathers the rows it needs and unpacks them into the
kernels' leaves, so that a budget holds as many experts as their compact form allows (a GGUF Q4_K expert:
4.5 bits a weight instead of 6 unpacked). Eviction is delegated to `hybridlm.offload.policies`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.checkpoints.gguf_device import Q4KBlocks
from hybridlm.offload.policies import POLICIES, Key, make_policy, static_pinned_keys
from pallas_kernels.q4_k import Q4_K_BYTES, QK_K, Q4KExperts, q4_k_to_quantized

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}


def parse_bytes(size: float | str) -> int:
    """'12GiB', '12 GB', '512MiB', '1.5g' or a number of bytes -> int bytes (G = GiB, GB = 10^9).

    Raises:
      ValueError: an unparsable string or a non-positive size.
    """
    if isinstance(size, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot parse byte size {size!r}; use e.g. '12GiB', '500MB' or a number of bytes"
            )
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        value = float(size)
    if value <= 0:
        raise ValueError(f"byte size must be positive, got {size!r}")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------------------------------
# Packing one expert's leaves into one uint8 buffer
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert: the leaves of (gate_up[e], down[e]) packed back to back.

    Attributes:
      treedef: pytree structure of (gate_up, down) (arrays or `QuantizedWeights`) as the device holds it.
      shapes: per leaf, its shape without the expert axis.
      dtypes: per leaf, its dtype.
      q4_k: per parameter (gate_up, down), the input dim k where the host holds it as the GGUF file's own
        Q4_K blocks (4.5 bits a weight) that `unpack` expands into the kernels' 4-bit `QuantizedWeights` on
        the device, else None; () when no parameter is.
    """

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    q4_k: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, gate_up, down) -> ExpertLayout:
        """Layout of the experts of `gate_up` [experts, ...] and `down` [experts, ...] (arrays,
        QuantizedWeights, or `gguf_device.Q4KBlocks`, which stay Q4_K blocks on the host)."""
        params = (gate_up, down)
        q4_k = tuple(p.k if isinstance(p, Q4KBlocks) else None for p in params)
        unpacked = [
            jax.eval_shape(lambda x, k=p.k: q4_k_to_quantized(x, k), p.data)
            if isinstance(p, Q4KBlocks)
            else p
            for p in params
        ]
        leaves, treedef = jax.tree_util.tree_flatten(tuple(unpacked))
        return cls(
            treedef,
            tuple(tuple(leaf.shape[1:]) for leaf in leaves),
            tuple(np.dtype(leaf.dtype) for leaf in leaves),
            q4_k if any(k is not None for k in q4_k) else (),
        )

    @property
    def leaf_nbytes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=False))

    def _param_spans(self) -> list[tuple[int | None, int, int]]:
        """Per parameter: (Q4_K k or None, its leaf count, its bytes on the host)."""
        out, leaf = [], 0
        for i, sub in enumerate(self.treedef.children()):
            n = sub.num_leaves
            k = self.q4_k[i] if self.q4_k else None
            if k is None:
                size = sum(self.leaf_nbytes[leaf : leaf + n])
            else:  # values [out, k/2] uint8: out rows of k/256 Q4_K blocks
                size = self.shapes[leaf][0] * (k // QK_K) * Q4_K_BYTES
            out.append((k, n, size))
            leaf += n
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of one expert on the host (what one host -> device copy moves)."""
        return sum(size for _, _, size in self._param_spans())

    @property
    def device_nbytes(self) -> int:
        """Bytes of one expert unpacked on the device (as the model and the kernels hold it; a pool slot
        holds `nbytes`, `PackedExperts`)."""
        return sum(self.leaf_nbytes)

    @property
    def all_q4_k(self) -> bool:
        """Whether every parameter is held as Q4_K blocks, so that packed rows can be read in place
        (`q4_k_experts`)."""
        return bool(self.q4_k) and all(k is not None for k in self.q4_k)

    def q4_k_experts(self, data: jax.Array) -> tuple[Q4KExperts, ...]:
        """(gate_up, down) of the packed rows `data` uint8 [rows, nbytes] (the pool, a held layer, copied
        rows) as `Q4KExperts` read in place by the matrix-vector kernel: no gather, no unpack.

        Raises:
          ValueError: a layout with a parameter that is not Q4_K blocks (`all_q4_k`)."""
        if not self.all_q4_k:
            raise ValueError("only a layout of Q4_K parameters is read in place")
        out, offset, leaf = [], 0, 0
        for k, count, size in self._param_spans():
            out.append(Q4KExperts(data, offset=offset, k=k, n=self.shapes[leaf][0]))
            offset += size
            leaf += count
        return tuple(out)

    def pack_numpy(self, leaves_e: list[np.ndarray]) -> np.ndarray:
        """The leaves of one expert (numpy, no expert axis) -> uint8 [nbytes]."""
        return np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves_e])

    def pack(self, leaves: list[jax.Array]) -> jax.Array:
        """Leaves with an expert axis [experts, ...] (device) -> uint8 [experts, nbytes] (traceable).

        Raises:
          ValueError: a layout with Q4_K parameters (they are packed from the file's blocks)."""
        if self.q4_k:
            raise ValueError("a layout of Q4_K blocks is packed from the file's blocks, not from weights")
        parts = []
        for x in leaves:
            b = x.reshape(x.shape[0], -1)
            if b.dtype.itemsize == 1:
                b = jax.lax.bitcast_convert_type(b, jnp.uint8)
            else:
                b = jax.lax.bitcast_convert_type(b, jnp.uint8).reshape(x.shape[0], -1)  # [e, n*itemsize]
            parts.append(b)
        return jnp.concatenate(parts, axis=1)

    def unpack(self, packed: jax.Array):
        """uint8 [n, nbytes] -> the (gate_up, down) pytree with leading axis n (traceable); Q4_K parameters
        are expanded into the kernels' `QuantizedWeights`."""
        n = packed.shape[0]
        out, offset, leaf = [], 0, 0
        for k, count, size in self._param_spans():
            b = packed[:, offset : offset + size]
            offset += size
            if k is not None:
                qw = q4_k_to_quantized(b.reshape(n, self.shapes[leaf][0], -1), k)
                out.extend(jax.tree_util.tree_leaves(qw))
                leaf += count
                continue
            at = 0
            for shape, dtype, nb in zip(
                self.shapes[leaf : leaf + count],
                self.dtypes[leaf : leaf + count],
                self.leaf_nbytes[leaf : leaf + count],
                strict=True,
            ):
                x = b[:, at : at + nb]
                at += nb
                if dtype.itemsize == 1:
                    x = jax.lax.bitcast_convert_type(x, dtype)
                else:
                    x = jax.lax.bitcast_convert_type(x.reshape(n, -1, dtype.itemsize), dtype)
                out.append(x.reshape((n,) + shape))
            leaf += count
        return jax.tree_util.tree_unflatten(self.treedef, out)


@jax.tree_util.register_pytree_node_class
class PackedExperts:
    """Experts on the device in their host byte layout, uint8 [n, nbytes] (`ExpertLayout`), unpacked into the
    kernels' weights only where a program uses them (`unpack`). The pool and the held layers keep experts so:
    a GGUF Q4_K expert takes its file's 4.5 bits a weight there instead of the 6 bits of its unpacked codes,
    scales and offsets, so a budget holds a third more of them. A pytree whose layout is static."""

    def __init__(self, layout: ExpertLayout, data: jax.Array):
        self.layout, self.data = layout, data

    def tree_flatten(self):
        return (self.data,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(layout, children[0])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def take(self, rows: jax.Array) -> PackedExperts:
        """The experts at `rows` [m] int32 (traceable)."""
        return PackedExperts(self.layout, self.data[rows])

    def unpack(self):
        """(gate_up, down) with a leading [n] axis, as the model holds them (traceable)."""
        return self.layout.unpack(self.data)


def unpacked(experts):
    """`experts` as weights: `PackedExperts` unpacked, anything else (already weights) as it is."""
    return experts.unpack() if isinstance(experts, PackedExperts) else experts


def _scatter_slots(layout: ExpertLayout, pool: PackedExperts, staged: jax.Array, slots: jax.Array):
    """pool[slots[j]] = staged[j] for staged uint8 [m, nbytes]; slots past the pool are dropped."""
    return PackedExperts(layout, pool.data.at[slots].set(staged, mode="drop"))


_write_slots = jax.jit(_scatter_slots, static_argnums=0, donate_argnums=1)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=1)
def _copy_rows_into_pool(
    layout: ExpertLayout,
    pool,
    host_bufs: tuple,
    table: jax.Array,
    batch: jax.Array,
    at: tuple[int, int],
    m: int,
):
    """Copy batch `batch` of `table` (see `ExpertCache.copy_rows`), m rows of each buffer of `host_bufs`, into
    the
    pool in one program: each row a dynamic slice of a pinned host buffer moved to the device (an asynchronous
    copy of just that row), then one scatter into the pool; slots past the pool are dropped (padding)."""
    base, width = at
    rows_slots = jax.lax.dynamic_slice_in_dim(table, base + batch * 2 * width, 2 * width).reshape(2, width)
    rows = [
        jax.device_put(
            jax.lax.dynamic_index_in_dim(buf, rows_slots[0, b * m + j], keepdims=False),
            jax.memory.Space.Device,
        )
        for b, buf in enumerate(host_bufs)
        for j in range(m)
    ]
    return _scatter_slots(layout, pool, jnp.stack(rows), rows_slots[1, : len(rows)])


# ----------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------


class ExpertCache:
    """`num_slots` device slots of experts (`PackedExperts`), the (layer, expert) -> slot map and the
    eviction policy.

    The cache does bookkeeping and owns the pool arrays; copies are issued by the scheduler. An entry is
    *resident* (slot holds its weights, or will once the pending write is enqueued) or *pending* (allocated,
    its bytes staged on the device by a prefetch, written into the pool when its layer runs).

    Args:
      layout: byte layout of one expert.
      num_slots: pool slots.
      policy: one of `POLICIES`.
      num_layers, num_experts: model shape (static pinning order, statistics).
      pinned_count: static policy only: how many experts (in pinning order) are never evicted.
      sharding: where the pool lives (a device-memory sharding).
    """

    def __init__(
        self,
        layout: ExpertLayout,
        num_slots: int,
        policy: str,
        *,
        num_layers: int,
        num_experts: int,
        pinned_count: int = 0,
        sharding=None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache_policy {policy!r}; choose from {POLICIES}")
        if num_slots <= 0:
            raise ValueError(f"num_slots={num_slots} must be positive")
        self.layout = layout
        self.num_slots = num_slots
        self.policy_name = policy
        self.num_layers, self.num_experts = num_layers, num_experts
        self.pinned: set[Key] = (
            static_pinned_keys(num_layers, num_experts, pinned_count) if policy == "static" else set()
        )
        self.policy = make_policy(policy, num_slots, self.pinned)
        self.slot_of: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.speculative: set[Key] = set()  # prefetched and not yet asked for
        self.pool = (
            PackedExperts(layout, jnp.zeros((num_slots, layout.nbytes), jnp.uint8, device=sharding))
            if sharding is not None
            else None
        )

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.nbytes

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def lookup(self, key: Key) -> bool:
        """Marks a use of `key`; True if it was resident (a hit for the policy)."""
        if key in self.slot_of:
            self.policy.hit(key)
            return True
        return False

    def allocate(self, key: Key, protected) -> tuple[int, Key | None] | None:
        """A slot for `key` (not resident): a free slot, else the policy's victim outside `protected`.

        Returns:
          (slot, evicted key or None), or None when every slot is protected.
        """
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.policy.victim(protected)
            if evicted is None:
                return None
            slot = self.slot_of[evicted]
            self._drop(evicted)
            self.free.pop()  # _drop pushed the slot back
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.insert(key)
        return slot, evicted

    def _drop(self, key: Key) -> None:
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        self.policy.remove(key)
        self.speculative.discard(key)
        self.free.append(slot)

    def release_layer(self, layer: int, keep=()) -> None:
        """Stream policy: forget every resident expert of `layer` except `keep`."""
        for key in [(layer, e) for e in range(self.num_experts)]:
            if key in self.slot_of and key not in keep:
                self._drop(key)

    def write(self, staged: jax.Array, slots) -> None:
        """Enqueues pool[slots[j]] = staged[j] for staged uint8 [m, nbytes] on the device (one jitted scatter;
        m is a power of two or a whole layer, so the scatter compiles for few shapes).

        Raises:
          ValueError: len(slots) != m.
        """
        slots = np.asarray(slots, np.int32)
        if slots.shape != (staged.shape[0],):
            raise ValueError(f"{staged.shape[0]} staged experts but {slots.shape[0]} slots")
        self.pool = _write_slots(self.layout, self.pool, staged, slots)

    def copy_rows(
        self, host_bufs: tuple, table: jax.Array, batch: jax.Array, at: tuple[int, int], m: int
    ) -> None:
        """Enqueues pool[slots[i]] = host_bufs[i // m][rows[i]] for i < len(host_bufs) * m as ONE program: the
        row copies host -> device and the scatter into the pool, with no staging buffer and no separate write.

        Args:
          host_bufs: uint8 [experts, nbytes] arrays in pinned host memory (a tuple: one host part, or several
            parts of a layer with m rows each).
          table: int32 device array holding, from `at[0] + batch * 2 * at[1]`, `at[1]` rows (buffer b's m rows
            at b * m) then their `at[1]` pool slots; a padding row goes to a slot past the pool (dropped). One
            table serves every batch of a layer, so the indices cross to the device once per layer.
          batch: int32 device scalar, the batch within `table`.
          at: (base, width) of the batches in `table` (static); len(host_bufs) * m <= width.
          m: rows copied from each buffer (static; powers of two keep the compiled shapes few).

        One program instead of a row-copy program and a pool write saves host time per call.
        """
        self.pool = _copy_rows_into_pool(self.layout, self.pool, tuple(host_bufs), table, batch, at, m)

    def compile_row_copies(
        self, host_bufs: tuple, table: jax.Array, batch: jax.Array, at: tuple[int, int], max_rows: int
    ) -> None:
        """Compiles `copy_rows` for `host_bufs` and every power-of-two m up to `max_rows`, with a `table` of
        the shape the caller will use whose batch `batch` sends every row to a slot past the pool (the pool is
        unchanged), so that no decode step or prefill compiles one while timed."""
        m = 1
        while True:
            self.copy_rows(host_bufs, table, batch, at, m)
            if m >= max_rows:
                break
            m *= 2
        jax.block_until_ready(self.pool)

    def compile_writes(self, sizes, sharding=None) -> None:
        """Compiles `write` for staged batches of each of `sizes` rows (writes zeros to slots past the pool,
        which the scatter drops: the pool is unchanged), so that no prefill compiles a scatter while timed."""
        for m in sorted(set(sizes)):
            staged = jax.device_put(np.zeros((m, self.layout.nbytes), np.uint8), sharding)
            self.write(staged, np.full((m,), self.num_slots, np.int32))
        jax.block_until_ready(self.pool)

    def slot_table(self, layer: int, missing: int = 0) -> np.ndarray:
        """[experts] int32: the slot of each resident expert of `layer`, `missing` for the others (0 by
        default: a slot the grouped matmul may be pointed at but never reads; -1 where the reader tells them
        apart)."""
        table = np.full((self.num_experts,), missing, np.int32)
        for e in range(self.num_experts):
            slot = self.slot_of.get((layer, e))
            if slot is not None:
                table[e] = slot
        return table

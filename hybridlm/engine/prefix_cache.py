"""Prefix cache for hybrid models: snapshots of the whole decode state at a token position, keyed by the
tokens.

A Gated DeltaNet state is a running sum: it cannot be cut back to an earlier position as a KV cache can.
So a prefix is reusable only where its state was saved. A snapshot holds, at position n, every Gated
DeltaNet layer's conv and recurrent state (fixed size: ~60 MiB at the 35B shapes, whatever n) and every
attention layer's keys and values of positions [0, n) (~20 KiB a token at the 35B shapes, cut to a multiple
of `KV_BUCKET` tokens so that few snapshot programs compile). A new request resumes from the longest
snapshot whose tokens start its prompt and prefills only the rest (`prefill(resume=...)`).

Snapshots live on the device up to `device_bytes`, then in host memory up to `host_bytes`, the least
recently used moved down first (and dropped from host memory first). Source: the checkpoints of llama.cpp's
server for recurrent models (state saved at exact positions), the positions chosen by the caller (`Chat`
saves the conversation's history before each reply).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.state import KVCache, LayerState

# Snapshot KV lengths are rounded up to a multiple of this many tokens (fewer compiled copy programs).
KV_BUCKET = 1024


def _key(ids: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(ids, np.int32).tobytes(), digest_size=16).hexdigest()


@functools.partial(jax.jit, static_argnums=1)
def _take(states: list[LayerState], kv_length: int) -> list[LayerState]:
    """Copies of states (new buffers: the originals are donated by the next prefill), the KV caches cut to
    their first kv_length positions."""
    out = []
    for s in states:
        if isinstance(s, KVCache):
            out.append(KVCache(key=s.key[:, :kv_length] + 0, value=s.value[:, :kv_length] + 0))
        else:
            out.append(jax.tree_util.tree_map(lambda a: a + 0, s))
    return out


@functools.partial(jax.jit, static_argnums=1)
def _restore(snapshot: list[LayerState], capacity: int) -> list[LayerState]:
    """Full decode states from a snapshot: KV caches of `capacity` positions holding the snapshot's first."""
    out = []
    for s in snapshot:
        if isinstance(s, KVCache):
            n = min(s.key.shape[1], capacity)
            shape = (s.key.shape[0], capacity, *s.key.shape[2:])
            key = jnp.zeros(shape, s.key.dtype).at[:, :n].set(s.key[:, :n])
            value = jnp.zeros(shape, s.value.dtype).at[:, :n].set(s.value[:, :n])
            out.append(KVCache(key=key, value=value))
        else:
            out.append(jax.tree_util.tree_map(lambda a: a + 0, s))
    return out


@dataclasses.dataclass
class Snapshot:
    """The decode state after `length` tokens (`tokens`), on the device or (moved down) in host memory."""

    tokens: np.ndarray  # [length] int32
    states: list  # GatedDeltaNetState / KVCache per layer, KV cut to a bucket >= length
    nbytes: int
    on_device: bool = True

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class PrefixCache:
    """Snapshots of decode states keyed by their token prefix, LRU by bytes over two tiers.

    Args:
      device_bytes: bytes of snapshots kept on the device.
      host_bytes: bytes kept in host memory once moved off the device (0: dropped instead).

    Statistics (`stats()`): lookups, hits, tokens resumed, snapshots and bytes per tier.
    """

    def __init__(self, device_bytes: int = 2 << 30, host_bytes: int = 8 << 30):
        self.device_bytes, self.host_bytes = int(device_bytes), int(host_bytes)
        self._entries: OrderedDict[str, Snapshot] = OrderedDict()  # least recently used first
        self.lookups = self.hits = self.resumed_tokens = self.inserted = 0

    def lookup(self, ids) -> Snapshot | None:
        """The longest snapshot whose tokens are a prefix of `ids` (1-D), shorter than ids (at least one token
        is left to prefill, for the next-token logits); None if there is none."""
        ids = np.asarray(ids, np.int32).reshape(-1)
        self.lookups += 1
        best = None
        for key, snap in self._entries.items():
            n = snap.length
            if (
                n < ids.shape[0]
                and (best is None or n > best[1].length)
                and np.array_equal(ids[:n], snap.tokens)
            ):
                best = (key, snap)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        self.hits += 1
        self.resumed_tokens += best[1].length
        return best[1]

    def insert(self, ids, states: list[LayerState]) -> Snapshot:
        """Saves `states` (holding exactly the positions of `ids`, 1-D) as the snapshot of that prefix."""
        ids = np.asarray(ids, np.int32).reshape(-1)
        key = _key(ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        capacity = min((s.capacity for s in states if isinstance(s, KVCache)), default=0)
        bucket = min(capacity, -(-max(ids.shape[0], 1) // KV_BUCKET) * KV_BUCKET)
        taken = _take(states, bucket)
        snap = Snapshot(ids.copy(), taken, sum(a.nbytes for a in jax.tree_util.tree_leaves(taken)))
        self._entries[key] = snap
        self.inserted += 1
        self._fit()
        return snap

    def restore(self, snap: Snapshot, capacity: int) -> list[LayerState]:
        """Decode states with a KV capacity of `capacity` positions holding the snapshot's prefix (new
        buffers; the snapshot stays)."""
        states = snap.states if snap.on_device else jax.device_put(snap.states)
        return _restore(states, capacity)

    def _fit(self) -> None:
        """Moves least recently used snapshots off the device, then drops them, until both tiers fit."""
        for key in list(self._entries):
            if self._bytes(True) <= self.device_bytes:
                break
            snap = self._entries[key]
            if snap.on_device:
                snap.states, snap.on_device = jax.device_get(snap.states), False
        for key in list(self._entries):
            if self._bytes(False) <= self.host_bytes:
                break
            if not self._entries[key].on_device:
                del self._entries[key]

    def _bytes(self, on_device: bool) -> int:
        return sum(s.nbytes for s in self._entries.values() if s.on_device == on_device)

    def stats(self) -> dict:
        """lookups, hits, resumed tokens, snapshots and bytes on the device and in host memory."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "resumed_tokens": self.resumed_tokens,
            "snapshots": len(self._entries),
            "inserted": self.inserted,
            "device_bytes": self._bytes(True),
            "host_bytes": self._bytes(False),
            "device_budget_bytes": self.device_bytes,
            "host_budget_bytes": self.host_bytes,
        }

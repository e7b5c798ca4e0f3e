"""Eviction policies of the expert cache: pure bookkeeping over keys (layer, expert).

Policies (`POLICIES`): which resident expert to evict when a slot is needed.
  lru     least recently used.
  slru    segmented LRU: new entries enter a probation segment; a second use promotes to a protected
          segment (80% of the slots); victims come from probation first. Resists one-off scans.
  lfu     least frequently used (use counts kept across evictions), ties broken by recency.
  static  whole layers spread evenly over the depth are pinned once loaded and never evicted, up to the
          budget minus a working area; the rest of the slots are LRU. Spread, so that in whole-layer
          streaming the copies of the layers in between run beside the pinned layers' compute.
  stream  no reuse: every expert is dropped right after its layer used it (every lookup misses).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

POLICIES = ("lru", "slru", "lfu", "static", "stream")


Key = tuple[int, int]


class LRU:
    def __init__(self, capacity: int):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self.order[key] = None

    def hit(self, key: Key) -> None:
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, protected) -> Key | None:
        for key in self.order:
            if key not in protected:
                return key
        return None


class SLRU:
    def __init__(self, capacity: int, protected_fraction: float = 0.8):
        self.probation: OrderedDict[Key, None] = OrderedDict()
        self.protected: OrderedDict[Key, None] = OrderedDict()
        self.protected_capacity = max(1, int(capacity * protected_fraction))

    def insert(self, key: Key) -> None:
        self.probation[key] = None

    def hit(self, key: Key) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        self.probation.pop(key, None)
        self.protected[key] = None
        if len(self.protected) > self.protected_capacity:  # demote the protected LRU to probation MRU
            old, _ = self.protected.popitem(last=False)
            self.probation[old] = None

    def remove(self, key: Key) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)

    def victim(self, protected) -> Key | None:
        for segment in (self.probation, self.protected):
            for key in segment:
                if key not in protected:
                    return key
        return None


class LFU:
    """Use counts persist across evictions (frequency history); ties go to the least recently used."""

    def __init__(self, capacity: int):
        self.count: dict[Key, int] = {}
        self.tick = 0
        self.stamp: dict[Key, tuple[int, int]] = {}  # resident key -> (count, tick) in the heap
        self.heap: list[tuple[int, int, Key]] = []

    def _push(self, key: Key) -> None:
        self.tick += 1
        self.stamp[key] = (self.count[key], self.tick)
        heapq.heappush(self.heap, (self.count[key], self.tick, key))

    def insert(self, key: Key) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self._push(key)

    def hit(self, key: Key) -> None:
        self.count[key] += 1
        self._push(key)

    def remove(self, key: Key) -> None:
        self.stamp.pop(key, None)

    def victim(self, protected) -> Key | None:
        skipped, found = [], None
        while self.heap:
            count, tick, key = self.heap[0]
            if self.stamp.get(key) != (count, tick):  # stale entry
                heapq.heappop(self.heap)
                continue
            if key in protected:
                skipped.append(heapq.heappop(self.heap))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found


class Static(LRU):
    """LRU over the unpinned keys; pinned keys, once resident, are never victims."""

    def __init__(self, capacity: int, pinned: set[Key]):
        super().__init__(capacity)
        self.pinned = pinned

    def insert(self, key: Key) -> None:
        if key not in self.pinned:
            self.order[key] = None

    def hit(self, key: Key) -> None:
        if key not in self.pinned:
            self.order.move_to_end(key)


def static_pinned_keys(num_layers: int, num_experts: int, count: int) -> set[Key]:
    """The first `count` experts in pinning order: ceil(count / experts) layers spaced evenly over the depth
    (layer int((k + 1/2) * L / n) for k < n), whole layers first, the remainder from the last of them."""
    count = max(0, min(count, num_layers * num_experts))
    n = -(-count // num_experts)
    layers = [int((k + 0.5) * num_layers / n) for k in range(n)]
    keys: set[Key] = set()
    for layer in layers:
        for e in range(min(num_experts, count - len(keys))):
            keys.add((layer, e))
    return keys


def make_policy(name: str, capacity: int, pinned: set[Key]):
    """The bookkeeping object of policy `name` over `capacity` slots (`pinned`: the static policy's keys)."""
    if name == "static":
        return Static(capacity, pinned)
    return {"lru": LRU, "slru": SLRU, "lfu": LFU, "stream": LRU}[name](capacity)

"""Hit-rate and transfer statistics of the expert cache, per layer and in total."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LayerStats:
    """Counters of one layer (one prefill or one decode run).

    Invariants: hits + misses == lookups; bytes_h2d == (misses - prefetch_used + prefetched) * expert bytes
    (a prefetched expert counts as a miss where it is used, and its bytes when it is copied).
    """

    lookups: int = 0  # experts the router asked for, summed over chunks
    hits: int = 0  # already resident (copied by an earlier chunk, layer pass or prompt)
    misses: int = 0  # had to be copied for this use (on demand, or prefetched for it)
    prefetched: int = 0  # copies issued ahead of need (router prediction or whole-layer streaming)
    prefetch_used: int = 0  # prefetched experts that the router then asked for (counted in misses)
    evictions: int = 0
    bytes_h2d: int = 0  # host -> device bytes copied
    stall_s: float = 0.0  # seconds the host waited for this layer's staged copies before its experts
    # (exact mode with prefetch="layer"; other exact-mode copies go straight into
    # the pool and the host waits for none: 0)

    def add(self, other: LayerStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


@dataclasses.dataclass
class CacheStats:
    """Statistics of one prefill (or of the decode steps after it): totals and per layer."""

    kind: str  # "prefill" | "decode"
    expert_bytes: int
    layers: list[LayerStats]
    chunks: int = 0  # forward_chunk calls (decode: steps)
    tokens: int = 0  # batch * chunk tokens processed (padding included)
    wall_s: float = 0.0  # from the first chunk's start to the logits being ready (device-paged
    # decode steps are not waited for: not counted)

    @property
    def total(self) -> LayerStats:
        t = LayerStats()
        for layer in self.layers:
            t.add(layer)
        return t

    @property
    def achieved_gbps(self) -> float:
        """Host -> device bytes over the wall time (10^9 bytes/s); the copy engine's share of the run."""
        return self.total.bytes_h2d / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def to_dict(self, per_layer: bool = True) -> dict:
        d = {
            "kind": self.kind,
            "chunks": self.chunks,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "expert_bytes": self.expert_bytes,
            **self.total.to_dict(),
            "achieved_gbps": self.achieved_gbps,
        }
        if per_layer:
            d["per_layer"] = [s.to_dict() for s in self.layers]
        return d

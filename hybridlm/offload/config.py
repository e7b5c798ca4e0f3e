"""`OffloadConfig`: every option of `OffloadedRunner`, tuned thresholds included, in one dataclass."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hybridlm.offload.policies import POLICIES
from pallas_kernels import tuning

Prefetch = Literal["auto", "router", "layer", "none"]
PREFETCH_MODES = ("auto", "router", "layer", "none")
DECODE_PAGING = ("device", "host")
MIXED_FORMATS = ("widen", "smallest", "refuse")

# Device-independent defaults of the tuned fields; `pallas_kernels.tuning.lookup("offload")` overrides them
# with the values measured on the running device (docs/performance.md).
HEURISTIC = {
    # chunk tokens * top_k >= 4 * experts touches ~98% of a layer's experts (expected coverage 1 - e^-4):
    # whole-layer mode moves the layer in a few large copies instead of reading ids back
    "whole_layer_factor": 4,
    # pinned buffers a layer: several let whole-layer prefill spread a layer's copy over several programs
    "host_parts": 4,
    # exact mode: padding bytes one copy program over all of a layer's parts may move to save programs
    "padded_copy_bytes": 8 * 2**20,
    # device-paged decode unrolls one conditional copy per routed expert a layer: bounds the program's size
    "paged_max_copies": 64,
    # the CLI keeps one host part a layer for a `generate` of this many new tokens (decode gains)
    "one_host_part_from_tokens": 64,
}


def tuned_default(name: str) -> int:
    """The default of tuned field `name`: the running device's measured value, else `HEURISTIC[name]`."""
    return {**HEURISTIC, **tuning.lookup("offload")}[name]


def default_host_parts() -> int:
    """Pinned host buffers a layer when none are asked for (`OffloadConfig.host_parts` None)."""
    return tuned_default("host_parts")


def host_parts_for(decode_tokens: int, host_parts: int | None = None) -> int:
    """Pinned host buffers a layer for a run that decodes `decode_tokens` tokens after its prefill, the one
    rule for `prefill` (0 decode tokens) and `generate`: `host_parts` where given, else 1 from
    `one_host_part_from_tokens` decode tokens on (each decode step then copies experts without control flow,
    which gains more over those tokens than the prefill loses), else `default_host_parts()` (a layer's copy
    spread over the prefill's programs)."""
    if host_parts is not None:
        return host_parts
    return 1 if decode_tokens >= tuned_default("one_host_part_from_tokens") else default_host_parts()


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Options of `OffloadedRunner`.

    Attributes:
      expert_budget: device bytes for expert slots and prefetch staging, e.g. "12GiB" or an int.
      cache_policy: "lru" | "slru" | "lfu" | "static" | "stream" (`hybridlm.offload.policies`); "static"
        by default, for prefill and decode alike: a whole-layer prefill sweeps the layers in a cycle, which
        makes LRU-like policies evict each expert just before its next use, and decode fills the pool with
        whole layers at its first step under any policy.
      prefetch: "auto" (router prediction in exact mode, whole-layer streaming in whole-layer mode), "router",
        "layer" (whole next layers in both modes) or "none" (on-demand copies only).
      prefetch_depth: layers streamed ahead in whole-layer mode (their staging comes out of the budget).
      whole_layer: force whole-layer mode on (True) or off (False); None: when chunk tokens * top_k >=
        whole_layer_factor * experts.
      chunk_size: optional, the largest chunk (tokens per sequence) to be run, to check the budget at
        construction; batch: sequences per chunk for that check.
      device_memory_bytes: device memory available for the budget; None reads `device.memory_stats()`
        (backends without memory stats, such as CPU, are not checked).
      in_program_copies: whole-layer mode copies the next absent layer inside this layer's mixer and experts
        programs, where the copy overlaps their compute; False: a separate `jax.device_put`.
      decode_paging: "device": a decode step is one program that picks each routed expert on the device, from
        the held layers, the pool or pinned host memory; "host": layer by layer, ids read back each layer.
        Batches of more than paged_max_copies / top_k sequences always take the "host" path.
      host_parts: pinned host buffers a layer when the runner copies the model's experts; None: the tuned
        default (`default_host_parts`); with `host_experts`, None accepts any count.
      mixed_formats: layers storing experts in different formats are brought to one: "widen" (exact),
        "smallest" (requantized, not exact) or "refuse" (`hybridlm.offload.host.host_experts_of_layers`).
      whole_layer_factor, padded_copy_bytes, paged_max_copies, one_host_part_from_tokens: thresholds (see
        `HEURISTIC`); None takes the running device's tuned value.

    Raises:
      ValueError: an unknown policy, prefetch mode, decode paging or mixed_formats; prefetch_depth < 1;
        host_parts < 1.
    """

    expert_budget: int | str
    cache_policy: str = "static"
    prefetch: Prefetch = "auto"
    prefetch_depth: int = 2
    whole_layer: bool | None = None
    chunk_size: int | None = None
    batch: int = 1
    device_memory_bytes: int | None = None
    in_program_copies: bool = True
    decode_paging: Literal["device", "host"] = "device"
    host_parts: int | None = None
    mixed_formats: str = "widen"
    whole_layer_factor: int | None = None
    padded_copy_bytes: int | None = None
    paged_max_copies: int | None = None
    one_host_part_from_tokens: int | None = None

    def __post_init__(self):
        if self.decode_paging not in DECODE_PAGING:
            raise ValueError(f"unknown decode_paging {self.decode_paging!r}; choose from device, host")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"unknown cache_policy {self.cache_policy!r}; choose from {POLICIES}")
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"unknown prefetch {self.prefetch!r}; choose from auto, router, layer, none")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be >= 1")
        if self.host_parts is not None and self.host_parts < 1:
            raise ValueError(f"host_parts={self.host_parts} must be >= 1")
        if self.mixed_formats not in MIXED_FORMATS:
            raise ValueError(f"unknown mixed_formats={self.mixed_formats!r}; choose from {MIXED_FORMATS}")
        for name in (
            "whole_layer_factor",
            "padded_copy_bytes",
            "paged_max_copies",
            "one_host_part_from_tokens",
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, tuned_default(name))

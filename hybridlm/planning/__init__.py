"""Planning a run before it starts: the memory it needs and the defaults that make it fast.

`estimate_memory` counts the device and host bytes of a run by component (weights by format, the expert pool,
one chunk's activations, the KV cache and recurrent states); `check_fits` refuses one that cannot fit with one
line naming the option that helps; `choose_chunk_size` picks the prefill chunk from the memory left and, with
offloaded experts, from a cost model of the bytes each chunk re-streams over PCIe against its compute time;
`plan_run` does all three for the command line before any weight is allocated. docs/offload.md, "Choosing
defaults", describes the model and where its constants come from.
"""

from hybridlm.planning.chunks import (
    HEURISTIC,
    ChunkChoice,
    ChunkCost,
    OffloadPlan,
    PoolShape,
    choose_chunk_size,
    choose_chunk_size_for,
    pool_shape,
    predict_ttft,
    streamed_bytes,
)
from hybridlm.planning.memory import (
    EXPERT_BYTES_PER_WEIGHT,
    Component,
    InsufficientMemoryError,
    MemoryEstimate,
    activation_bytes,
    check_fits,
    device_free_bytes,
    estimate_memory,
    expert_bytes,
    host_available_bytes,
    memory_left,
    state_bytes,
    trunk_bytes,
)
from hybridlm.planning.sources import ModelSource, model_source, plan_run

__all__ = [
    "EXPERT_BYTES_PER_WEIGHT",
    "HEURISTIC",
    "ChunkChoice",
    "ChunkCost",
    "Component",
    "InsufficientMemoryError",
    "MemoryEstimate",
    "ModelSource",
    "OffloadPlan",
    "PoolShape",
    "activation_bytes",
    "check_fits",
    "choose_chunk_size",
    "choose_chunk_size_for",
    "device_free_bytes",
    "estimate_memory",
    "expert_bytes",
    "host_available_bytes",
    "memory_left",
    "model_source",
    "plan_run",
    "pool_shape",
    "predict_ttft",
    "state_bytes",
    "streamed_bytes",
    "trunk_bytes",
]

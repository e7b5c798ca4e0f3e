"""Host-offload of routed experts: experts in pinned host memory, paged into a device expert pool.

    config = OffloadConfig(expert_budget="12GiB", cache_policy="slru")
    runner = hybridlm.offload.OffloadedRunner(model, config)
    result = hybridlm.prefill(runner, ids)  # the same logits as the all-resident model
    runner.stats()  # hits, misses, bytes host->device, stall, evictions, per layer

A GGUF file too large for the device loads with its experts straight into pinned host memory:

    model, host = hybridlm.offload.load_offloaded("model.gguf")
    runner = hybridlm.offload.OffloadedRunner(model, OffloadConfig(expert_budget="12GiB"), host_experts=host)
"""

from hybridlm.offload.config import OffloadConfig, default_host_parts
from hybridlm.offload.expert_cache import ExpertCache, ExpertLayout, format_bytes, parse_bytes
from hybridlm.offload.host import HostExperts, measure_h2d_gbps
from hybridlm.offload.load import load_offloaded
from hybridlm.offload.policies import POLICIES, static_pinned_keys
from hybridlm.offload.runner import OffloadedRunner
from hybridlm.offload.stats import CacheStats, LayerStats

__all__ = [
    "POLICIES",
    "CacheStats",
    "ExpertCache",
    "ExpertLayout",
    "HostExperts",
    "LayerStats",
    "OffloadConfig",
    "OffloadedRunner",
    "default_host_parts",
    "format_bytes",
    "load_offloaded",
    "measure_h2d_gbps",
    "parse_bytes",
    "static_pinned_keys",
]

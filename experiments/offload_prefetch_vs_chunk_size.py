"""Expert offload: which prefetch schedule and cache policy win at which prefill chunk size?

Issue 6 asks to measure router-predicted prefetch (the next layer's router applied to the current hidden state)
against whole-layer streaming (double-buffered) across chunk sizes. This sweeps chunk size x prefetch x policy
at one expert budget and records, per run: prefill tokens/s, bytes host->device, hit rate, stall (time the GPU
waited on copies), the ratio of TTFT to the transfer floor (bytes moved / pinned host->device bandwidth
measured in the same process) and the logit difference to the all-resident prefill.

Run: python experiments/offload_prefetch_vs_chunk_size.py (the `tiny` preset on CPU, where the timings only
exercise the bookkeeping). This script initialises the whole model on the device first, so on a GPU use it with
a preset whose experts fit there (the budget then decides what is offloaded), e.g. `preset="qwen3.6-35b-a3b"`,
`expert_format="int4"`, `budget="12GiB"`, `prompt_tokens=8192`, `chunk_sizes=(512, 2048, 8192)`. For experts
that do not fit, benchmarks/offload.py builds them straight into pinned host memory.
Writes results/offload_prefetch_vs_chunk_size.json.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

import hybridlm
from hybridlm.offload import HostExperts, OffloadedRunner, measure_h2d_gbps


@dataclasses.dataclass(frozen=True)
class OffloadSweep:
    preset: str = "tiny"
    expert_format: str | None = None           # None (model dtype), "int8" or "int4"
    budget: str | float = 0.5                   # bytes ("12GiB") or a fraction of all expert bytes
    prompt_tokens: int = 1024
    chunk_sizes: tuple[int, ...] = (16, 128, 1024)
    prefetch: tuple[str, ...] = ("none", "router", "layer")
    policies: tuple[str, ...] = ("slru", "static", "stream")
    h2d_probe_bytes: int = 64 * 2**20          # one pinned device_put of this size gives the floor's bandwidth


EXPERIMENT = OffloadSweep()


def run(exp: OffloadSweep, results_dir: str = "results") -> list[dict]:
    config = hybridlm.get_config(exp.preset)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = hybridlm.init_random(config, seed=0, dtype=dtype, expert_format=exp.expert_format)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, exp.prompt_tokens)
    gbps = measure_h2d_gbps(exp.h2d_probe_bytes)
    reference = hybridlm.prefill(hybridlm.LayerwiseRunner(model), ids, chunk_size=max(exp.chunk_sizes))
    host = HostExperts.from_model(model)                     # pinned host copy of the experts, shared
    budget = int(exp.budget * host.nbytes) if isinstance(exp.budget, float) else exp.budget
    rows = []
    for policy in exp.policies:
        for prefetch in exp.prefetch:
            runner = OffloadedRunner(model, expert_budget=budget, cache_policy=policy, prefetch=prefetch,
                                     host_experts=host)
            for chunk in exp.chunk_sizes:
                key = {"policy": policy, "prefetch": prefetch, "chunk_size": chunk}
                try:
                    hybridlm.prefill(runner, ids, chunk_size=chunk)                # compile, warm the cache
                    result = hybridlm.prefill(runner, ids, chunk_size=chunk)
                except ValueError as e:                                           # budget too small for it
                    rows.append({**key, "error": str(e)})
                    continue
                s = runner.stats(per_layer=False)["prefill"]
                floor_s = s["bytes_h2d"] / (gbps * 1e9)
                diff = np.abs(np.asarray(result.logits) - np.asarray(reference.logits)).max()
                rows.append({**key, "budget_bytes": runner.budget, "ttft_s": result.ttft_s,
                             "tokens_per_s": result.tokens_per_s, "bytes_h2d": s["bytes_h2d"],
                             "hit_rate": s["hit_rate"], "stall_s": s["stall_s"], "floor_s": floor_s,
                             "ttft_over_floor": result.ttft_s / floor_s if floor_s else None,
                             "max_abs_logit_diff_vs_resident": float(diff)})
                print({k: rows[-1][k] for k in ("policy", "prefetch", "chunk_size", "tokens_per_s", "hit_rate")})
    out = pathlib.Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"experiment": dataclasses.asdict(exp), "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "pinned_h2d_gbps": gbps}
    (out / "offload_prefetch_vs_chunk_size.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    run(EXPERIMENT)

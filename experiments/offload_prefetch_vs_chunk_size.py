"""Expert offload: which prefetch schedule and cache policy win at which prefill chunk size?

Issue 6 asks to measure router-predicted prefetch (the next layer's router applied to the current hidden state)
against whole-layer streaming (double-buffered) across chunk sizes. This sweeps chunk size x prefetch x policy
at one expert budget and records, per run: prefill tokens/s, bytes host->device, hit rate, stall (time the GPU
waited on copies), the ratio of TTFT to the transfer floor (bytes moved / pinned host->device bandwidth
measured in the same process) and the logit difference to the all-resident prefill.

The schedules are compared as the scheduler runs them: "router" in exact mode (the ids read back per layer,
only the experts the chunk needs move; forced at every chunk size), "layer" in whole-layer mode (every expert of
the next layers streams, no ids read back; forced at every chunk size), "none" in the mode the chunk size picks
(tokens * top_k >= 4 * experts: whole-layer) with on-demand copies only.

Run: python experiments/offload_prefetch_vs_chunk_size.py [tiny|h100] [--chunk-sizes N ...] [--prefetch MODE ...]
(`tiny`, the default: the tiny preset on CPU, where the timings only exercise the bookkeeping; `h100`: qwen3.6-35b-a3b with int4 experts and a 12 GiB
budget, ~6 minutes on an H100). This script initialises the whole model on the device first, so on a GPU use it
with a preset whose experts fit there (the budget then decides what is offloaded); for experts that do not fit,
benchmarks/offload.py builds them straight into pinned host memory.
Writes results/offload_prefetch_vs_chunk_size.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import numpy as np

import hybridlm
from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner, measure_h2d_gbps


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
    max_seconds: float | None = None           # rows not started by then are recorded as skipped


# The schedule each prefetch mode is measured in (None: the mode the chunk size picks).
WHOLE_LAYER = {"router": False, "layer": True, "none": None}

EXPERIMENT = OffloadSweep()
H100 = OffloadSweep(preset="qwen3.6-35b-a3b", expert_format="int4", budget="12GiB", prompt_tokens=2048,
                    chunk_sizes=(32, 128, 512, 2048), prefetch=("router", "layer", "none"), policies=("slru",),
                    h2d_probe_bytes=512 * 2**20, max_seconds=420)
CONFIGS = {"tiny": EXPERIMENT, "h100": H100}


def run(exp: OffloadSweep, results_dir: str = "results") -> list[dict]:
    config = hybridlm.get_config(exp.preset)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = hybridlm.init_random(config, seed=0, dtype=dtype, expert_format=exp.expert_format)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, exp.prompt_tokens)
    gbps = measure_h2d_gbps(exp.h2d_probe_bytes)
    # The all-resident prefill at each chunk size: offload must not change a logit (chunking may, in bf16).
    resident = hybridlm.LayerwiseRunner(model)
    reference = {c: np.asarray(hybridlm.prefill(resident, ids, chunk_size=c).logits, np.float32)
                 for c in exp.chunk_sizes}
    host = HostExperts.from_model(model)                     # pinned host copy of the experts, shared
    budget = int(exp.budget * host.nbytes) if isinstance(exp.budget, float) else exp.budget
    rows = []
    t_start = time.perf_counter()
    for policy in exp.policies:
        for prefetch in exp.prefetch:
            offload_config = OffloadConfig(expert_budget=budget, cache_policy=policy, prefetch=prefetch,
                                           whole_layer=WHOLE_LAYER[prefetch])
            runner = OffloadedRunner(model, offload_config, host_experts=host)
            for chunk in exp.chunk_sizes:
                key = {"policy": policy, "prefetch": prefetch, "chunk_size": chunk,
                       "whole_layer": runner.uses_whole_layer(chunk)}
                if exp.max_seconds is not None and time.perf_counter() - t_start > exp.max_seconds:
                    rows.append({**key, "error": f"skipped: past max_seconds={exp.max_seconds}"})
                    continue
                try:
                    hybridlm.prefill(runner, ids, chunk_size=chunk)                # compile, warm the cache
                    result = hybridlm.prefill(runner, ids, chunk_size=chunk)
                except ValueError as e:                                           # budget too small for it
                    rows.append({**key, "error": str(e)})
                    continue
                s = runner.stats(per_layer=False)["prefill"]
                floor_s = s["bytes_h2d"] / (gbps * 1e9)
                logits, ref = np.asarray(result.logits, np.float32), reference[chunk]
                diff = np.abs(logits - ref).max()
                rows.append({**key, "budget_bytes": runner.budget, "ttft_s": result.ttft_s,
                             "tokens_per_s": result.tokens_per_s, "bytes_h2d": s["bytes_h2d"],
                             "hit_rate": s["hit_rate"], "stall_s": s["stall_s"], "floor_s": floor_s,
                             "ttft_over_floor": result.ttft_s / floor_s if floor_s else None,
                             "max_abs_logit_diff_vs_resident": float(diff),
                             "max_abs_logit_resident": float(np.abs(ref).max()),
                             "top1_agrees_with_resident": bool((logits.argmax(-1) == ref.argmax(-1)).all())})
                print({k: rows[-1][k] for k in ("policy", "prefetch", "chunk_size", "tokens_per_s", "hit_rate")})
    out = pathlib.Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"experiment": dataclasses.asdict(exp), "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "pinned_h2d_gbps": gbps}
    (out / "offload_prefetch_vs_chunk_size.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--chunk-sizes", type=int, nargs="+", help="override the configuration's chunk sizes")
    parser.add_argument("--prefetch", nargs="+", choices=sorted(WHOLE_LAYER), help="override the prefetch modes")
    args = parser.parse_args()
    exp = CONFIGS[args.config]
    if args.chunk_sizes:
        exp = dataclasses.replace(exp, chunk_sizes=tuple(args.chunk_sizes))
    if args.prefetch:
        exp = dataclasses.replace(exp, prefetch=tuple(args.prefetch))
    run(exp)

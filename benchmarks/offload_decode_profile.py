"""Where an offloaded decode step's host time goes: greedy decode with experts paged from pinned host memory,
timed, then profiled with cProfile (the Python side of each dispatch, and the waits for the device).

Builds the preset with random weights as `benchmarks/offload.py` does (trunk on the device, experts drawn,
quantized and packed into pinned host memory one layer at a time), then per policy: an `OffloadedRunner`, a
prompt prefilled in one chunk, a compiling and a timed `generate` (`offload.decode_row`) and a profiled one.
Writes per policy (and `--decode-paging` mode) tokens/s, the first step's seconds (with device paging it fills the
expert pool), hit rate, bytes copied per step and the profile's top functions by own time.

Run on the GPU machine (README, "GPU machine"), e.g.:
    python benchmarks/offload_decode_profile.py --policies lru static --out offload_decode_profile.json
CPU smoke test (tiny preset, small budget):
    JAX_PLATFORMS=cpu python benchmarks/offload_decode_profile.py --preset tiny --budget 1MiB --prompt-tokens 32 \
        --decode-tokens 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import run_header, write_json
from offload import build_host_experts, build_trunk, decode_row

import hybridlm
from hybridlm.offload import OffloadConfig, OffloadedRunner, default_host_parts


def top_functions(profile: cProfile.Profile, count: int) -> list[str]:
    """The profile's `count` functions with the most own time, as pstats prints them."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(count)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in lines[start:] if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--expert-format", choices=("bf16", "int8", "int4"), default="int4")
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--policies", nargs="+", default=["lru", "static"])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32, help="timed steps (the profiled run takes a quarter)")
    p.add_argument("--decode-paging", nargs="+", choices=("device", "host"), default=["device"],
                   help="OffloadedRunner decode_paging values to run in turn (an A/B in one process)")
    p.add_argument("--host-parts", type=int, default=default_host_parts(),
                   help="pinned buffers a layer (HostExperts parts)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled generate")
    p.add_argument("--top", type=int, default=25, help="functions listed per profile")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    config = hybridlm.get_config(a.preset)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    doc = run_header("offload_decode_profile", preset=config.name, expert_format=a.expert_format, budget=a.budget,
                     prompt_tokens=a.prompt_tokens, decode_tokens=a.decode_tokens, host_parts=a.host_parts, rows=[])
    t = time.perf_counter()
    model = build_trunk(config, dtype)
    host = build_host_experts(config, a.expert_format, dtype, parts=a.host_parts)
    doc["build_s"] = round(time.perf_counter() - t, 1)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, a.prompt_tokens)).astype(np.int32)
    for policy, paging in [(policy, paging) for policy in a.policies for paging in a.decode_paging]:
        offload_config = OffloadConfig(expert_budget=a.budget, cache_policy=policy, chunk_size=a.prompt_tokens,
                                       decode_paging=paging)
        runner = OffloadedRunner(model, offload_config, host_experts=host)
        timed = decode_row(runner, ids, a.decode_tokens + 1, True)      # a compiling call, then the timed one
        s = runner.stats(per_layer=False)["decode"]
        row = {"policy": policy, "decode_paging": paging, "decode_tokens_per_s": timed["decode_tokens_per_s"],
               "decode_s": timed["decode_s"], "first_step_s": timed["decode_first_step_s"],
               "hit_rate": timed["decode_hit_rate"], "bytes_h2d_per_step": s["bytes_h2d"] // max(1, s["chunks"]),
               # the experts read for misses alone (bytes_h2d also counts prefetches: device paging's pool fill)
               "miss_bytes_per_step": s["misses"] * runner.expert_bytes // max(1, s["chunks"]),
               "prefetched": s["prefetched"], "stall_s": timed["decode_stall_s"]}
        g = hybridlm.generate(runner, ids, max_new_tokens=16, chunk_size=a.prompt_tokens)
        row["first_16_tokens"] = g.tokens[0].tolist()     # to compare across policies and paging modes
        if not a.no_profile:
            profile = cProfile.Profile()
            profile.enable()
            g = hybridlm.generate(runner, ids, max_new_tokens=max(2, a.decode_tokens // 4) + 1,
                                  chunk_size=a.prompt_tokens)
            profile.disable()
            row["profiled_tokens_per_s"] = round(g.decode_tokens_per_s, 2)
            row["profile_note"] = "the profiled generate includes its prompt's prefill"
            row["profile_top_tottime"] = top_functions(profile, a.top)
        print({k: v for k, v in row.items() if k != "profile_top_tottime"}, flush=True)
        doc["rows"].append(row)
        del runner
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()

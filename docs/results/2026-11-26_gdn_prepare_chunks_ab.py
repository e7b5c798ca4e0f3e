"""Packed 8x8192: prepare chunks per program, interleaved rounds (wall ms, prepare/walk from the trace)."""
import dataclasses, functools, json, os, sys, statistics
from pallas_kernels import gpu_limits
gpu_limits.enable_concurrent_regions()
import jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
import gated_delta_rule as bench
from pallas_kernels.gated_delta_rule import pallas_triton, workloads
D = pallas_triton.BlockSizes.get_default()
w = workloads.Workload(name="p", seq=65536, seqlens=(8192,) * 8)
inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0)
cpps = [int(x) for x in os.environ.get("CPPS", "8 14 7 11 12").split()]
calls = {}
for c in cpps:
    fn = jax.jit(functools.partial(pallas_triton.gated_delta_rule_pallas, block_sizes=dataclasses.replace(D, prepare_chunks=c)))
    calls[c] = functools.partial(fn, **inputs)
    jax.block_until_ready(calls[c]())
ref = calls[cpps[0]]()[0].astype(jnp.float32)
for c in cpps:
    o = calls[c]()[0].astype(jnp.float32)
    print("cpp", c, "rel diff vs first", float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)))
rows = []
for rnd in range(int(os.environ.get("ROUNDS", "5"))):
    for c in cpps:
        ms = bench.wall_ms(calls[c], bench.jax_sync, reps=40)
        split = bench.kernel_split_ms(calls[c])
        row = {"round": rnd, "cpp": c, "ms": round(ms, 4), "prepare": round(split.get("gdn_prepare", 0), 4),
               "walk": round(sum(v for k, v in split.items() if "gdn_state" in k), 4)}
        print(json.dumps(row), flush=True)
        rows.append(row)
for c in cpps:
    r = [x for x in rows if x["cpp"] == c]
    print("cpp", c, "median ms", statistics.median(x["ms"] for x in r), "median prepare", statistics.median(x["prepare"] for x in r),
          "median walk", statistics.median(x["walk"] for x in r))
with open(os.path.join(os.environ["OUT"], "cpp_ab.json"), "w") as f:
    json.dump({"rows": rows, "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)

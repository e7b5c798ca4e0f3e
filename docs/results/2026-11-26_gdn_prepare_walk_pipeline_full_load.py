"""Would a prepare/walk pipeline pay at full load? batch 8x8192, P in the walk, walk_pipeline 1/2/4 (concurrent regions on)."""
import dataclasses, functools, json, os, sys
from pallas_kernels import gpu_limits
gpu_limits.enable_concurrent_regions()
import jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
import gated_delta_rule as bench
from pallas_kernels.gated_delta_rule import pallas_triton, workloads
W = workloads.Workload
D = pallas_triton.BlockSizes.get_default()
cases = [
    ("packed 8x8192 default", W(name="p", seq=65536, seqlens=(8192,) * 8), None),
    ("batch 8x8192 P in walk, 1 piece", W(name="b8", batch=8, seq=8192), {"p_in_walk": True, "walk_pipeline": 1}),
    ("batch 8x8192 P in walk, 2 pieces", W(name="b8", batch=8, seq=8192), {"p_in_walk": True, "walk_pipeline": 2}),
    ("batch 8x8192 P in walk, 4 pieces", W(name="b8", batch=8, seq=8192), {"p_in_walk": True, "walk_pipeline": 4}),
    ("batch 8x8192 P in walk, 8 pieces", W(name="b8", batch=8, seq=8192), {"p_in_walk": True, "walk_pipeline": 8}),
]
rows = []
ref = None
for rep in range(2):
    for name, w, changes in cases:
        inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0)
        bs = dataclasses.replace(D, **changes) if changes else None
        fn = jax.jit(functools.partial(pallas_triton.gated_delta_rule_pallas, block_sizes=bs))
        call = functools.partial(fn, **inputs)
        out = call()[0]
        if w.batch == 8:
            o = out.astype(jnp.float32)
            if ref is None: ref = o
            err = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
        else:
            err = None
        ms = bench.wall_ms(call, bench.jax_sync, reps=30)
        split = bench.kernel_split_ms(call)
        row = {"rep": rep, "case": name, "ms": round(ms, 4), "err_vs_1piece": err,
               "walk": round(sum(v for k, v in split.items() if "gdn_state" in k), 4),
               "prepare": round(sum(v for k, v in split.items() if "prepare" in k), 4), "kernels_ms": split}
        print(json.dumps(row), flush=True)
        rows.append(row)
with open(os.path.join(os.environ["OUT"], "pipe_probe.json"), "w") as f:
    json.dump({"rows": rows, "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)

"""One side of an A/B: packed 8x8192 (and optionally batch rows) with the pallas_kernels on PYTHONPATH."""
import functools, json, os, sys, statistics
from pallas_kernels import gpu_limits
gpu_limits.enable_concurrent_regions()
import jax, jax.numpy as jnp
import gated_delta_rule as bench
from pallas_kernels.gated_delta_rule import pallas_triton, workloads
import pallas_kernels
label = sys.argv[1]
W = workloads.Workload
cases = [("packed", W(name="p", seq=65536, seqlens=(8192,) * 8))]
if os.environ.get("ALL"):
    cases += [("T16384", W(name="b", batch=1, seq=16384)), ("T4096", W(name="b", batch=1, seq=4096))]
for name, w in cases:
    inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0)
    fn = jax.jit(pallas_triton.gated_delta_rule_pallas)
    call = functools.partial(fn, **inputs)
    out = call()
    walls = [bench.wall_ms(call, bench.jax_sync, reps=40) for _ in range(3)]
    split = bench.kernel_split_ms(call)
    xla = sum(v for k, v in split.items() if "gdn_" not in k)
    row = {"side": label, "case": name, "ms": round(statistics.median(walls), 4), "walls": [round(x, 4) for x in walls],
           "walk": round(sum(v for k, v in split.items() if "gdn_state" in k), 4),
           "prepare": round(sum(v for k, v in split.items() if "prepare" in k), 4), "xla": round(xla, 4),
           "kernels_ms": split, "path": pallas_kernels.__file__}
    print(json.dumps(row), flush=True)
    jnp.save(os.path.join(os.environ["OUT"], f"out_{label}_{name}.npy"), out[0].astype(jnp.float32)[:, :4096])

import json, sys, os, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import gmm_mosaic as gm
from grouped_matmul import rel_err
from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, reference, workloads
t0 = time.time()
shapes = [workloads.Workload(name="router_4096", m=4096, k=2048, n=512, groups=256),
          workloads.Workload(name="empty_groups", m=96, k=256, n=64, groups=16, layout="empty_groups"),
]
bad = 0
for w in shapes:
    for kind in ("int8", "int4"):
        for swiglu in (False, True):
            lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
            want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
                lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
            tri = (pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)(lhs, rhs, gs)
            try:
                got = gm.mosaic(lhs, rhs, gs, swiglu=swiglu, dequant=os.environ.get("DQ", "wgmma"))
                r = {"check": w.name, "kind": kind, "swiglu": swiglu, "err_ref": round(rel_err(got, want), 6),
                     "err_triton": rel_err(got, tri), "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))}
            except Exception as e:
                r = {"check": w.name, "kind": kind, "swiglu": swiglu, "error": repr(e)[-1500:]}
            ok = "error" not in r and r["finite"] and r["err_ref"] < 1e-2
            bad += not ok
            print(json.dumps(r), flush=True)
print("check time", time.time() - t0, "bad", bad, flush=True)
if bad:
    sys.exit(1)
configs = [tuple(int(v) for v in c.split(",")[:4]) + (c.split(",")[4],) for c in sys.argv[1:]]
rows = gm.time_rows([4096], configs)
json.dump(rows, open(os.environ["OUT"] + "/wgmma_try.json", "w"), indent=1)
print("total", time.time() - t0)

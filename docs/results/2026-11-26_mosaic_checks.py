"""GPU: gmm_mosaic (every dequant path, after the early buffer release) against the f32 reference on small
adversarial layouts and the router-skewed m = 4096, int8 and 4-bit, gmm and gmm_swiglu."""
import json, sys, time
sys.path.insert(0, "benchmarks")
import jax.numpy as jnp
import gmm_mosaic as gm
from grouped_matmul import rel_err
from pallas_kernels.grouped_matmul import reference, workloads
t0, bad, n = time.time(), 0, 0
shapes = [workloads.Workload(name="router_4096", m=4096, k=2048, n=512, groups=256),
          workloads.Workload(name="empty_groups", m=96, k=256, n=64, groups=16, layout="empty_groups"),
          workloads.Workload(name="partial", m=130, k=256, n=128, groups=8, layout="partial", routed_rows=97),
          workloads.Workload(name="all_padding", m=40, k=128, n=64, groups=4, layout="all_padding", routed_rows=0),
          workloads.Workload(name="m_below_rows", m=20, k=128, n=64, groups=4)]
for w in shapes:
    for kind in ("int8", "int4"):
        for swiglu in (False, True):
            lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
            want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
                lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
            for dq in ("f32", "bf16", "wgmma"):
                got = gm.mosaic(lhs, rhs, gs, swiglu=swiglu, dequant=dq)
                err = rel_err(got, want)
                ok = bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))) and (err <= 1e-2 or float(jnp.abs(want).max()) == 0 and err == 0)
                bad += not ok; n += 1
                print(json.dumps({"check": w.name, "kind": kind, "swiglu": swiglu, "dequant": dq, "rel_err": err, "ok": ok}), flush=True)
print(f"mosaic checks: {n - bad}/{n} passed in {time.time() - t0:.0f} s", flush=True)

"""Archived A/B (H100, 2026-11-26 21:32 UTC); ran with scripts/_tmp/pallas_triton_head.py = the committed pallas_triton.py (masked loads) beside the unmasked change (not kept).

A/B on the H100, same process: the Triton grouped matmul with weight loads masked by column (HEAD) against
unmasked where block_n divides n (the change), Triton defaults, bf16 / int8 / 4-bit, two alternating rounds."""
import json, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "scripts/_tmp")
import jax, jax.numpy as jnp, numpy as np
from grouped_matmul import timeit, rel_err
from pallas_kernels.grouped_matmul import pallas_triton, workloads
import pallas_triton_head as head
rows_out = []
def emit(r):
    print(json.dumps(r), flush=True); rows_out.append(r)
emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__})
PRODUCTS = {"gmm": (2048, 1024, False), "gate_up": (2048, 512, True), "down": (512, 2048, False)}
for m in (4096, 65536):
    for product, (k, n, swiglu) in PRODUCTS.items():
        wl = workloads.Workload(name=product, m=m, k=k, n=n, groups=256)
        for kind in ("float", "int8", "int4"):
            lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
            fs = {name: jax.jit(mod.gmm_swiglu_pallas if swiglu else mod.gmm_pallas) for name, mod in (("masked", head), ("unmasked", pallas_triton))}
            a, b = fs["masked"](lhs, rhs, gs), fs["unmasked"](lhs, rhs, gs)
            ts = {"masked": [], "unmasked": []}
            for _ in range(2):
                for name in ("masked", "unmasked"):
                    ts[name].append(timeit(fs[name], lhs, rhs, gs))
            emit({"m": m, "product": product, "weights": kind, "masked_ms": [round(t * 1e3, 4) for t in ts["masked"]],
                  "unmasked_ms": [round(t * 1e3, 4) for t in ts["unmasked"]], "rel_err": rel_err(b, a),
                  "finite": bool(jnp.all(jnp.isfinite(b.astype(jnp.float32))))})
CALLS = 16
for product, (k, n, swiglu) in PRODUCTS.items():
    if product == "gmm":
        continue
    rng = np.random.default_rng(0)
    rg = jnp.asarray(rng.choice(256, 8, replace=False), jnp.int32)
    wl = workloads.Workload(name=product, m=8 * CALLS, k=k, n=n, groups=256)
    for kind in ("int8", "int4"):
        lhs, rhs, _ = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        ts = {}
        for name, mod in (("masked", head), ("unmasked", pallas_triton), ("masked2", head), ("unmasked2", pallas_triton)):
            fn = mod.gmm_swiglu_pallas if swiglu else mod.gmm_pallas
            f = jax.jit(lambda a, b, r, fn=fn: [fn(a[c * 8:(c + 1) * 8], b, row_groups=r) for c in range(CALLS)])
            ts[name] = round(timeit(f, lhs, rhs, rg, reps=10) / CALLS * 1e6, 2)
        emit({"decode_tokens": 1, "product": product, "weights": kind, "us": ts})
json.dump(rows_out, open(sys.argv[1], "w"), indent=1)

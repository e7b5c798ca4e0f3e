"""Triton grouped matmul defaults at m = 4096 under the XLA_FLAGS of this process (ptxas register caps)."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from grouped_matmul import timeit, rel_err
from pallas_kernels.grouped_matmul import pallas_triton, workloads, reference
PRODUCTS = {"gmm": (2048, 1024, False), "gate_up": (2048, 512, True), "down": (512, 2048, False)}
out = []
for product, (k, n, swiglu) in PRODUCTS.items():
    wl = workloads.Workload(name=product, m=4096, k=k, n=n, groups=256)
    f = jax.jit(pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        got = f(lhs, rhs, gs)
        w = rhs if kind == "float" else rhs.dequantize(jnp.bfloat16)
        want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(lhs.astype(jnp.float32), w.astype(jnp.float32), gs)
        r = {"flags": os.environ.get("XLA_FLAGS", ""), "product": product, "weights": kind,
             "ms": [round(timeit(f, lhs, rhs, gs) * 1e3, 4) for _ in range(2)], "rel_err_ref": rel_err(got, want)}
        print(json.dumps(r), flush=True); out.append(r)
json.dump(out, open(sys.argv[1], "w"), indent=1)

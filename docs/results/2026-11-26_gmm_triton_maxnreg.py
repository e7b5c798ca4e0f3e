"""Archived experiment (H100, 2026-11-26 21:50-21:52 UTC).

Experiment (not a feature): Pallas' Triton module with a `ttg.maxnreg` attribute (MAXNREG env), so that the
kernel gets a register cap (3-4 programs per SM instead of 2). Times the Triton grouped matmul defaults at
m = 4096 (bf16 / int8 / 4-bit) and checks them against the reference."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from jax._src.pallas.triton import lowering as tl
from jax._src.pallas.triton import pallas_call_registration as reg
from jaxlib.mlir import ir
N = int(os.environ.get("MAXNREG", "0"))
if N:
    orig = tl.lower_jaxpr_to_triton_module
    def patched(*a, **k):
        res = orig(*a, **k)
        op = res.module.operation
        with op.context:
            op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), N)
        return res
    tl.lower_jaxpr_to_triton_module = patched
    reg.lowering.lower_jaxpr_to_triton_module = patched
from grouped_matmul import timeit, rel_err
from pallas_kernels.grouped_matmul import pallas_triton, workloads, reference
PRODUCTS = {"gmm": (2048, 1024, False), "gate_up": (2048, 512, True), "down": (512, 2048, False)}
if len(sys.argv) > 2:   # profile mode: one product and kind, a few calls
    product, kind = sys.argv[2], sys.argv[3]
    k, n, swiglu = PRODUCTS[product]
    wl = workloads.Workload(name=product, m=4096, k=k, n=n, groups=256)
    lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
    f = jax.jit(pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)
    for _ in range(4):
        jax.block_until_ready(f(lhs, rhs, gs))
    sys.exit()
out = []
for product, (k, n, swiglu) in PRODUCTS.items():
    wl = workloads.Workload(name=product, m=4096, k=k, n=n, groups=256)
    f = jax.jit(pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        got = f(lhs, rhs, gs)
        w = rhs if kind == "float" else rhs.dequantize(jnp.bfloat16)
        want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(lhs.astype(jnp.float32), w.astype(jnp.float32), gs)
        r = {"maxnreg": N, "product": product, "weights": kind, "ms": [round(timeit(f, lhs, rhs, gs) * 1e3, 4) for _ in range(2)],
             "rel_err_ref": rel_err(got, want), "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))}
        print(json.dumps(r), flush=True); out.append(r)
json.dump(out, open(sys.argv[1], "w"), indent=1)

"""Archived run (H100, 2026-11-26 21:47 UTC device clock) against docs/results/2026-11-26_gmm_mosaic_interleave_tried.patch (not kept).

H100: gmm_mosaic(wgmma_codes, interleave=True): each block's wgmmas issued as soon as it is converted (the next
block converts while they run) against all conversions first; checks against the f32 reference, then timing at
m = 4096 beside the Triton default, two alternating rounds."""
import json, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from grouped_matmul import timeit, rel_err
from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, reference, workloads
rows = []
def emit(r):
    print(json.dumps(r), flush=True); rows.append(r)
emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__})
LAYOUTS = [workloads.Workload(name="router_4096", m=4096, k=2048, n=512, groups=256),
           workloads.Workload(name="empty_groups", m=96, k=256, n=128, groups=16, layout="empty_groups"),
           workloads.Workload(name="partial", m=130, k=256, n=128, groups=8, layout="partial", routed_rows=97),
           workloads.Workload(name="g512", m=300, k=128, n=128, groups=512)]
for w in LAYOUTS:
    for kind in ("int8", "int4"):
        for swiglu in (False, True):
            lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
            want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
                lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
            pc = pallas_mosaic.permute_codes(rhs)
            got = pallas_mosaic.gmm_mosaic(lhs, rhs, gs, swiglu=swiglu, wgmma_codes=pc, interleave=True)
            emit({"check": w.name, "kind": kind, "swiglu": swiglu, "err_ref": rel_err(got, want),
                  "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))})
for product in ("gmm", "gate_up", "down"):
    swiglu = product == "gate_up"
    k, n = {"gmm": (2048, 1024), "gate_up": (2048, 512), "down": (512, 2048)}[product]
    wl = workloads.Workload(name=product, m=4096, k=k, n=n, groups=256)
    tri_fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        pc = pallas_mosaic.permute_codes(rhs) if kind != "float" else None
        fs = {"triton": jax.jit(lambda a, b, g, c: tri_fn(a, b, g))}
        if kind != "float":
            for cw in ((2, 4) if not swiglu else (2,)):
                for il in (False, True):
                    fs[f"mosaic_cw{cw}_interleave{int(il)}"] = jax.jit(lambda a, b, g, c, il=il, cw=cw: pallas_mosaic.gmm_mosaic(
                        a, b, g, swiglu=swiglu, wgmma_codes=c, interleave=il, compute_wgs=cw))
        ts = {name: [] for name in fs}
        for name, f in fs.items():
            f(lhs, rhs, gs, pc)
        for _ in range(2):
            for name, f in fs.items():
                ts[name].append(round(timeit(f, lhs, rhs, gs, pc) * 1e3, 4))
        emit({"product": product, "weights": kind, "ms": ts})
json.dump(rows, open(sys.argv[1], "w"), indent=1)

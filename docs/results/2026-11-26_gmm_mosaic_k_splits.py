"""Archived run (H100, 2026-11-26 21:36 UTC) against docs/results/2026-11-26_gmm_mosaic_k_splits_tried.patch (gmm_mosaic(k_splits=2), not kept).

H100: gmm_mosaic with each step's blocks split over two warpgroups per column tile (k_splits=2): checks against
the f32 reference, then timing at m = 4096 beside the Triton default and k_splits=1, bf16 Triton for scale."""
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
            for ks in (1, 2):
                try:
                    got = pallas_mosaic.gmm_mosaic(lhs, rhs, gs, swiglu=swiglu, wgmma_codes=pc, k_splits=ks, compute_wgs=2)
                    emit({"check": w.name, "kind": kind, "swiglu": swiglu, "k_splits": ks, "err_ref": rel_err(got, want),
                          "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))})
                except Exception as e:
                    emit({"check": w.name, "kind": kind, "swiglu": swiglu, "k_splits": ks, "error": repr(e)[-400:]})
for product in ("gate_up", "down"):
    swiglu = product == "gate_up"
    wl = workloads.Workload(name=product, m=4096, k=2048 if swiglu else 512, n=512 if swiglu else 2048, groups=256)
    tri_fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        pc = pallas_mosaic.permute_codes(rhs) if kind != "float" else None
        runs = [("triton", None)]
        if kind != "float":
            runs += [(f"mosaic_ks{ks}_cw{cw}_k{bk}_s{st}", (ks, cw, bk, st)) for ks, cw, bk, st in
                     ((1, 2, 128, 4), (1, 4, 128, 4), (2, 2, 128, 4), (2, 2, 128, 3), (2, 2, 64, 6), (2, 1, 128, 4), (2, 4, 64, 4))]
        for name, cfg in runs:
            if cfg is None:
                f = jax.jit(lambda a, b, g, c: tri_fn(a, b, g))
            else:
                ks, cw, bk, st = cfg
                f = jax.jit(lambda a, b, g, c, ks=ks, cw=cw, bk=bk, st=st: pallas_mosaic.gmm_mosaic(
                    a, b, g, swiglu=swiglu, wgmma_codes=c, k_splits=ks, compute_wgs=cw, block_k=bk, stages=st))
            try:
                f(lhs, rhs, gs, pc)
                emit({"product": product, "weights": kind, "impl": name, "ms": round(timeit(f, lhs, rhs, gs, pc) * 1e3, 4)})
            except Exception as e:
                emit({"product": product, "weights": kind, "impl": name, "error": repr(e)[-300:]})
json.dump(rows, open(sys.argv[1], "w"), indent=1)

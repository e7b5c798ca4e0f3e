"""GPU: (1) the int8 one-fma PTX is exact (compiled asm == convert, bit for bit, every code, f16 and f32 scales);
(2) gmm_mosaic with wgmma codes matches the reference; (3) A/B timing at m = 4096: Triton int8 old/new PTX,
Mosaic wgmma (new PTX), bf16 and 4-bit for scale."""
import dataclasses, json, os, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
import gmm_mosaic as gm
from grouped_matmul import rel_err, timeit
from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, reference, workloads
out = {"rows": []}
def emit(r):
    print(json.dumps(r), flush=True); out["rows"].append(r)
if os.environ.get("SMEM_MARGIN_KIB"):
    pallas_mosaic.SHARED_MEMORY = 227 * 1024 - int(os.environ["SMEM_MARGIN_KIB"]) * 1024
    print("SHARED_MEMORY", pallas_mosaic.SHARED_MEMORY, flush=True)
CONFIGS = [tuple(int(v) for v in c.split(",")) for c in sys.argv[1:]]
if not os.environ.get('SKIP_CHECKS'):
    # (1) exactness
    w = workloads.WORKLOADS["tiny_partial"]
    for bits, sd in ((8, jnp.float16), (8, jnp.float32), (4, jnp.float16)):
        for qm in ("tile", "tile_swapped"):
            lhs, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=f"int{bits}", seed=5)
            q = dataclasses.replace(q, scales=q.scales.astype(sd))
            rng = np.random.default_rng(5)
            if bits == 8:
                codes = rng.integers(-128, 128, q.values.shape).astype(np.int8); codes.reshape(-1)[:256] = np.arange(-128, 128)
            else:
                codes = rng.integers(0, 256, q.values.shape).astype(np.uint8); codes.reshape(-1)[:256] = np.arange(256)
            q = dataclasses.replace(q, values=jnp.asarray(codes))
            outs = [np.asarray(pallas_triton.gmm_pallas(lhs, q, gs, preferred_element_type=jnp.float32,
                    block_sizes=pallas_triton.BlockSizes(block_m=16, block_n=32, block_k=64, quant_mode=qm, int_to_float=itf)))
                    for itf in ("convert", "asm")]
            emit({"exact": f"int{bits}", "scales": jnp.dtype(sd).name, "quant_mode": qm,
                  "bit_equal": bool(np.array_equal(outs[0], outs[1])), "finite": bool(np.isfinite(outs[1]).all())})
    # (2) mosaic wgmma checks
    for wl in (workloads.Workload(name="router_4096", m=4096, k=2048, n=512, groups=256),
               workloads.Workload(name="empty_groups", m=96, k=256, n=64, groups=16, layout="empty_groups")):
        for kind in ("int8", "int4"):
            for swiglu in (False, True):
                lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
                want = (reference.gmm_swiglu_reference if swiglu else reference.gmm_reference)(
                    lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
                tri = (pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)(lhs, rhs, gs)
                got = gm.mosaic(lhs, rhs, gs, swiglu=swiglu, dequant="wgmma")
                emit({"check": wl.name, "kind": kind, "swiglu": swiglu, "err_ref": rel_err(got, want),
                      "triton_err_ref": rel_err(tri, want), "err_triton": rel_err(got, tri),
                      "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))})
# (3) timing
orig = pallas_triton._dequantize_asm
def old_asm(*a, **k):
    k["int8_fma"] = False
    return orig(*a, **k)
for product in ("gate_up", "down"):
    swiglu = product == "gate_up"
    wl = workloads.Workload(name=product, m=4096, k=2048 if swiglu else 512, n=512 if swiglu else 2048, groups=256)
    tri_fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
    base = None
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
        pc = pallas_mosaic.permute_codes(rhs) if kind != "float" else None
        runs = [("triton", None)]
        if kind != "float":
            runs += [(f"mosaic_wgmma_k{bk}_s{st}_wg{cw}", (bk, st, cw)) for bk, st, cw in CONFIGS]
        for rep in range(1):
            for name, cfg in runs:
                if cfg == "old":
                    pallas_triton._dequantize_asm = old_asm; jax.clear_caches()
                    f = jax.jit(lambda a, b, g, c: tri_fn(a, b, g))
                elif cfg is None:
                    pallas_triton._dequantize_asm = orig; jax.clear_caches()
                    f = jax.jit(lambda a, b, g, c: tri_fn(a, b, g))
                else:
                    bk, st, cw = cfg
                    f = jax.jit(lambda a, b, g, c, bk=bk, st=st, cw=cw: pallas_mosaic.gmm_mosaic(
                        a, b, g, swiglu=swiglu, block_k=bk, stages=st, compute_wgs=cw, wgmma_codes=c))
                o = f(lhs, rhs, gs, pc)
                t = timeit(f, lhs, rhs, gs, pc)
                if kind == "float" and rep == 0:
                    base = t
                emit({"product": product, "weights": kind, "impl": name, "rep": rep, "ms": round(t * 1e3, 4),
                      "x_bf16": round(base / t, 3)})
        pallas_triton._dequantize_asm = orig; jax.clear_caches()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/int8_fma_ab.json", "w"), indent=1)

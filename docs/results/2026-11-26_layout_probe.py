"""Is the quantized weight-bound GMM held by extra work items (groups longer than a chunk read their weights
again)? Time bf16 / int8 / 4-bit at m = 4096 with router-skewed and uniform (16 rows each) group sizes,
Triton defaults, Triton with 64-row chunks, and the Mosaic kernel with wgmma codes."""
import json, os, sys, dataclasses
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from grouped_matmul import timeit
from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, workloads
rows = []
for layout in ("router", "uniform"):
    for product in ("gate_up", "down"):
        swiglu = product == "gate_up"
        wl = workloads.Workload(name=product, m=4096, k=2048 if swiglu else 512, n=512 if swiglu else 2048, groups=256,
                                layout=layout)
        tri_fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
        base = None
        for kind in ("float", "int8", "int4"):
            lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
            bs_default = pallas_triton.BlockSizes.get_default(4096, wl.k, wl.n, 256, bits=None if kind == "float" else int(kind[3:]),
                                                              swiglu=swiglu, k_major=True)
            runs = [("triton", lambda a, b, g, c: tri_fn(a, b, g))]
            if kind != "float":
                bs64 = dataclasses.replace(bs_default, block_m=64)
                runs.append(("triton_m64", lambda a, b, g, c, bs=bs64: tri_fn(a, b, g, block_sizes=bs)))
                cfg = (128, 4, 2) if swiglu else (128, 4, 4)
                runs.append((f"mosaic_wgmma_{cfg}", lambda a, b, g, c, cfg=cfg: pallas_mosaic.gmm_mosaic(
                    a, b, g, swiglu=swiglu, block_k=cfg[0], stages=cfg[1], compute_wgs=cfg[2], wgmma_codes=c)))
            pc = pallas_mosaic.permute_codes(rhs) if kind != "float" else None
            for name, fn in runs:
                f = jax.jit(fn)
                t = timeit(f, lhs, rhs, gs, pc)
                base = t if base is None else base
                r = {"layout": layout, "product": product, "weights": kind, "impl": name, "ms": round(t * 1e3, 4),
                     "x_bf16": round(base / t, 3)}
                print(json.dumps(r), flush=True); rows.append(r)
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/layout_probe.json", "w"), indent=1)

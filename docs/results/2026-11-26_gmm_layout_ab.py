"""Archived A/B (H100, 2026-11-26 21:23-21:28 UTC). It ran against code not kept: QuantizedWeights.with_k_block (21:25, [g, k/kb, n, kb]) and then with_code_tile (21:27, [g, n/tn, k/tk, tn, tk]) with the kernel side of docs/results/2026-11-26_gmm_code_tile_and_unmasked_tried.patch; this file is its last (code_tile) version.

A/B on the H100: quantized weights k-major [g, n, k] against k-blocked [g, k/kb, n, kb] (QuantizedWeights.k_block),
Triton defaults otherwise, bf16 in the same run. Weight-bound (m = 4096), prefill (m = 65536) and decode rows."""
import json, sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from grouped_matmul import timeit, rel_err
from pallas_kernels.grouped_matmul import pallas_triton, workloads
rows_out = []
def emit(r):
    print(json.dumps(r), flush=True); rows_out.append(r)
emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__})
KBS = [tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]]
PRODUCTS = {"gmm": (2048, 1024, False), "gate_up": (2048, 512, True), "down": (512, 2048, False)}
for m in (4096, 65536):
    for product, (k, n, swiglu) in PRODUCTS.items():
        if m == 65536 and product == "gmm":
            continue
        wl = workloads.Workload(name=product, m=m, k=k, n=n, groups=256)
        f = jax.jit(pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)
        base = None
        for kind in ("float", "int8", "int4"):
            if m == 65536 and kind == "float":
                continue
            lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
            variants = [("k_major", rhs)] if kind == "float" else [("k_major", rhs)] + [(f"tile{t}", rhs.with_code_tile(t)) for t in KBS]
            ref = None
            for name, w in variants:
                out = f(lhs, w, gs)
                t = timeit(f, lhs, w, gs)
                r = {"m": m, "product": product, "weights": kind, "layout": name, "ms": round(t * 1e3, 4)}
                if kind == "float" and m == 4096:
                    base = t
                if base and m == 4096:
                    r["x_bf16"] = round(base / t, 3)
                if ref is None:
                    ref = out
                else:
                    r["rel_err_vs_k_major"] = rel_err(out, ref)
                    r["finite"] = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
                emit(r)
# decode rows: tokens x top-8 rows, one expert each; 16 calls in one executable (kernel time, not dispatch)
CALLS = 16
for tokens in (1, 8):
    for product, (k, n, swiglu) in PRODUCTS.items():
        if product == "gmm":
            continue
        rng = np.random.default_rng(0)
        rg = jnp.asarray(np.concatenate([rng.choice(256, 8, replace=False) for _ in range(tokens)]), jnp.int32)
        wl = workloads.Workload(name=product, m=8 * tokens * CALLS, k=k, n=n, groups=256)
        fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
        f = jax.jit(lambda a, b, r: [fn(a[c * 8 * tokens:(c + 1) * 8 * tokens], b, row_groups=r) for c in range(CALLS)])
        for kind in ("int8", "int4"):
            lhs, rhs, _ = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True)
            ref = None
            for name, w in [("k_major", rhs)] + [(f"tile{t}", rhs.with_code_tile(t)) for t in KBS]:
                out = f(lhs, w, rg)[0]
                t = timeit(f, lhs, w, rg, reps=10) / CALLS
                r = {"decode_tokens": tokens, "product": product, "weights": kind, "layout": name, "us": round(t * 1e6, 2)}
                if ref is None:
                    ref = out
                else:
                    r["rel_err_vs_k_major"] = rel_err(out, ref)
                emit(r)
json.dump(rows_out, open(sys.argv[1], "w"), indent=1)

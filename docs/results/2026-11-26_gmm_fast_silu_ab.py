"""A/B of gmm_swiglu's fast silu epilogue (BlockSizes.fast_silu) against the exact sigmoid, same tile shapes."""
import dataclasses, datetime, json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import jax, jax.numpy as jnp
from grouped_matmul import timeit, rel_err
from pallas_kernels import gpu_limits
from pallas_kernels.grouped_matmul import pallas_triton, workloads, reference
from pallas_kernels.grouped_matmul.pallas_triton import BlockSizes

HIDDEN, FFN, GROUPS = 2048, 512, 256
rows = []
out_path = sys.argv[1]
for m in (4096, 65536, 262144):
    w = workloads.Workload(name=f"gate_up_{m}", m=m, k=HIDDEN, n=FFN, groups=GROUPS)
    for kind in ("float", "int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=True, on_device_rng=True)
        bits = None if kind == "float" else rhs.bits
        bs = BlockSizes.get_default(m, HIDDEN, FFN, GROUPS, bits=bits, swiglu=True, k_major=bits is not None)
        bs = pallas_triton.within_shared_memory(bs, gpu_limits.shared_memory_limit(), swiglu=True, bits=bits,
                                                lhs_bytes=2, rhs_bytes=1 if bits else 2)
        fns = {}
        for fast in (True, False):
            b = dataclasses.replace(bs, fast_silu=fast)
            fns[fast] = jax.jit(lambda a, r, g, b=b: pallas_triton.gmm_swiglu_pallas(a, r, g, block_sizes=b))
        outs = {f: fns[f](lhs, rhs, gs) for f in fns}
        if m == 4096:
            dense = rhs if bits is None else rhs.dequantize(jnp.bfloat16)
            ref = reference.gmm_swiglu_reference(lhs.astype(jnp.float32), dense.astype(jnp.float32), gs)
            errs = {f: rel_err(outs[f], ref) for f in outs}
        else:
            errs = {}
        finite = {f: bool(jnp.isfinite(outs[f].astype(jnp.float32)).all()) for f in outs}
        times = {True: [], False: []}
        for r in range(6):
            order = (True, False) if r % 2 == 0 else (False, True)
            for f in order:
                times[f].append(timeit(fns[f], lhs, rhs, gs))
        row = {"m": m, "weights": kind, "config": str(bs),
               "fast_ms": [round(t * 1e3, 4) for t in times[True]],
               "exact_ms": [round(t * 1e3, 4) for t in times[False]],
               "fast_min": round(min(times[True]) * 1e3, 4), "exact_min": round(min(times[False]) * 1e3, 4),
               "rel_fast_vs_exact": rel_err(outs[True], outs[False]),
               "rel_vs_reference": {str(f): e for f, e in errs.items()}, "finite": finite}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del lhs, rhs, outs
json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "rows": rows},
          open(out_path, "w"), indent=1)

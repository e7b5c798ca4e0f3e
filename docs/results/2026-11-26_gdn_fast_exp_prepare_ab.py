"""Prepare alone (packed own grid: T diag(beta), decay factors, gamma) and the whole packed call, variants
alternating in one process: wall clock of N back-to-back calls."""
import dataclasses, os, time, json, sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.gated_delta_rule import pallas_triton as pt, workloads
x = workloads.make_inputs(workloads.QWEN35_PACKED_8X8K)
g, bt = (jnp.swapaxes(x[n].astype(jnp.float32), 1, 2) for n in ("log_decay", "beta"))
base = dataclasses.replace(pt.BlockSizes.get_default(), wy_in_state=True, p_in_walk=True, state_kernel="mosaic")
variants = {"expf": ("1", False), "ex2": ("0", True), "ex2+A": ("1", True)}
preps, calls = {}, {}
for name, (form, fe) in variants.items():
    os.environ["GDN_A_FORM"] = form
    bs = dataclasses.replace(base, prepare_fast_exp=fe)
    preps[name] = jax.jit(lambda q, k, v, g, bt, bs=bs: pt._prepare(q, k, v, g, bt, scale=0.088, chunk_size=64, group=2,
        compute_dtype=jnp.bfloat16, block_sizes=bs, interpret=False, decay_factors=True)).lower(
        x["query"], x["key"], x["value"], g, bt).compile()
    bs2 = dataclasses.replace(pt.BlockSizes.get_default(), prepare_fast_exp=fe)
    calls[name] = jax.jit(lambda x, bs=bs2: pt.gated_delta_rule_pallas(x["query"], x["key"], x["value"], x["log_decay"],
        x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"], block_sizes=bs)).lower(x).compile()
    jax.block_until_ready(preps[name](x["query"], x["key"], x["value"], g, bt)); jax.block_until_ready(calls[name](x))
outs = {n: [np.asarray(a, np.float32) for a in f(x["query"], x["key"], x["value"], g, bt)[:4]] for n, f in preps.items()}
for n in outs:
    print(n, "T max diff vs expf", float(np.abs(outs[n][0] - outs["expf"][0]).max()), "e^gamma", float(np.abs(outs[n][2] - outs["expf"][2]).max()),
          "e^(last-gamma)", float(np.abs(outs[n][1] - outs["expf"][1]).max()), "gamma", float(np.abs(outs[n][3] - outs["expf"][3]).max()))
def timeit(f, args, n):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n): r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3
res = {n: {"prep": [], "call": []} for n in variants}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
    for n in order:
        res[n]["prep"].append(timeit(preps[n], (x["query"], x["key"], x["value"], g, bt), 100))
    for n in order:
        res[n]["call"].append(timeit(calls[n], (x,), 40))
for n, r in res.items():
    print(f"{n:8s} prepare median {np.median(r['prep']):.4f} min {min(r['prep']):.4f}   call median {np.median(r['call']):.4f} min {min(r['call']):.4f}")
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/prep_ab.json", "w"))

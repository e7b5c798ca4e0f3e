"""Prepare alone (packed 8x8192 own grid: T diag(beta) and the decay factors), BlockSizes variants in rotating order."""
import dataclasses, os, time, json
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.gated_delta_rule import pallas_triton as pt, workloads, gates
x = workloads.make_inputs(workloads.QWEN35_PACKED_8X8K)
g, bt = gates.heads_major_gates(x["log_decay"], x["beta"], x["cu_seqlens"], padded=65536)
base = dataclasses.replace(pt.BlockSizes.get_default(), wy_in_state=True, p_in_walk=True, state_kernel="mosaic")
variants = {"default": {}, "warps1": {"prepare_warps": 1}, "warps4": {"prepare_warps": 4},
            "stages2": {"prepare_pipeline_stages": 2}, "stages1": {"prepare_pipeline_stages": 1},
            "chunks21": {"prepare_chunks": 21}, "chunks8": {"prepare_chunks": 8}}
fns = {}
args = (x["query"], x["key"], x["value"], g, bt)
for name, ch in variants.items():
    bs = dataclasses.replace(base, **ch)
    fns[name] = jax.jit(lambda q, k, v, g, bt, bs=bs: pt._prepare(q, k, v, g, bt, scale=0.088, chunk_size=64, group=2,
        compute_dtype=jnp.bfloat16, block_sizes=bs, interpret=False, decay_factors=True)).lower(*args).compile()
ref = [np.asarray(a, np.float32) for a in fns["default"](*args)[:4]]
for n, f in fns.items():
    o = [np.asarray(a, np.float32) for a in f(*args)[:4]]
    print(n, "same outputs:", all(np.array_equal(a, b) for a, b in zip(o, ref)))
def timeit(f, n=100):
    jax.block_until_ready(f(*args)); t = time.perf_counter()
    for _ in range(n): r = f(*args)
    jax.block_until_ready(r); return (time.perf_counter() - t) / n * 1e3
names = list(variants); res = {n: [] for n in names}
for rnd in range(14):
    order = names[rnd % len(names):] + names[:rnd % len(names)]
    for n in order:
        res[n].append(timeit(fns[n]))
        time.sleep(0.05)
for n in names:
    print(f"{n:9s} median {np.median(res[n]):.4f} min {min(res[n]):.4f}  all " + " ".join(f"{v:.3f}" for v in res[n]))
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/prep_sweep.json", "w"))

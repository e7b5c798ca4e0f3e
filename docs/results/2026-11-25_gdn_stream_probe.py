"""Probe: does XLA's stream annotation (compute_on gpu_stream:1) overlap the GDN prepare with the Mosaic walk?"""
import dataclasses, functools, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.compute_on import compute_on
from pallas_kernels.gated_delta_rule import pallas_triton as pt, pallas_mosaic as pm, workloads, api

bf16 = jnp.bfloat16
bs = dataclasses.replace(pt.BlockSizes.get_default(), wy_in_state=True, state_kernel="mosaic")
T = 16384
inp = workloads.make_inputs(workloads.QWEN35_PREFILL_16K, dtype=bf16, seed=0)
q, k, v = inp["query"], inp["key"], inp["value"]
g = jnp.swapaxes(inp["log_decay"], 1, 2); bt = jnp.swapaxes(inp["beta"], 1, 2)
init = inp["initial_state"]
scale = 128 ** -0.5
common = dict(scale=scale, chunk_size=64, group=2, compute_dtype=bf16, block_sizes=bs, interpret=False)

def prep(q, k, v, g, bt):
    w, u, gamma, p, _, _ = pt._prepare(q, k, v, g, bt, **common)
    return w, p, gamma

def walk(q, k, v, w, p, gamma, state):
    return pm.state_pass(q, k, v, w, p, gamma, state, scale=scale)

def wall_ms(fn, reps=50):
    for _ in range(3):
        jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e3

res = {}
def seg(S):
    L = T // S
    sl = lambda x, i, ax: jax.lax.slice_in_dim(x, i * L, (i + 1) * L, axis=ax)
    return [tuple(jax.block_until_ready(sl(x, i, ax)) for x, ax in ((q, 1), (k, 1), (v, 1), (g, 2), (bt, 2)))
            for i in range(S)]

from jax._src import compute_on as co, core as jcore

def on_stream(f, sid, *args):
    flat, tree = jax.tree.flatten(args)
    closed, shapes = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
    outs = co.compute_on_p.bind(*flat, jaxpr=closed, compute_type=f"gpu_stream:{sid}",
                                out_memory_spaces=(jcore.MemorySpace.Device,) * len(closed.out_avals),
                                compiler_options_json=None)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)

from jax.experimental.xla_metadata import set_xla_metadata
import contextlib

def pipelined(segs, state, stream):
    grouped = stream.endswith("group")
    stream = stream.replace("group", "")
    def prep_i(i):
        qs, ks, vs, gs, bts = segs[i]
        if stream == "dep" and i > 0:
            gs, _ = jax.lax.optimization_barrier((gs, nxt[2]))
        sid = {"each": i + 1, "alt": 1 + i % 2, "skip0": i}.get(stream, 0)
        if sid:
            return on_stream(prep, sid, qs, ks, vs, gs, bts)
        return prep(qs, ks, vs, gs, bts)
    outs = []
    nxt = prep_i(0)
    for i in range(len(segs)):
        cur = nxt
        ctx = set_xla_metadata(_scheduling_group_id=str(i + 1)) if grouped else contextlib.nullcontext()
        with ctx:
            if i + 1 < len(segs):
                nxt = prep_i(i + 1)
            o, state = walk(*segs[i][:3], *cur, state)
        outs.append(o)
    return outs, state

full = jax.jit(functools.partial(api.gated_delta_rule, implementation="pallas"))
res["flags"] = os.environ.get("XLA_FLAGS", "")
res["default_16k"] = wall_ms(lambda: full(**inp))
pw = jax.block_until_ready(jax.jit(prep)(q, k, v, g, bt))
if 0: res["prep_16k"] = wall_ms(lambda: jax.jit(prep)(q, k, v, g, bt))
if 0: res["walk_16k"] = wall_ms(lambda: jax.jit(walk)(q, k, v, *pw, init))
import os, gzip, glob, tempfile
def trace_events(fn, label):
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(3):
            out = fn()
        jax.block_until_ready(out)
    path = glob.glob(d + "/**/perfetto_trace.json.gz", recursive=True)[0]
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    ks = [e for e in ev if e.get("ph") == "X" and any(t in e.get("name", "") for t in ("gdn", "mpmd", "fusion", "prepare", "copy"))
          and e.get("dur", 0) > 2 and "pid" in e]
    ks.sort(key=lambda e: e["ts"])
    ks = ks[-12:]
    t0 = ks[0]["ts"]
    print("TRACE", label, [(e["name"][:28], e["pid"], e["tid"], round(e["ts"] - t0, 1), round(e["dur"], 1)) for e in ks], flush=True)

for S in (2, 4, 8):
    segs = seg(S)
    for stream in os.environ.get("VARIANTS", "skip0").split():
        opts = {"xla_gpu_graph_enable_concurrent_region": True} if os.environ.get("OPT") else None
        f = jax.jit(functools.partial(pipelined, stream=stream), compiler_options=opts)
        try:
            o, st = jax.block_until_ready(f(segs, init))
            res[f"pipe{S}_stream{stream}"] = wall_ms(lambda: f(segs, init))
            if S == 2:
                trace_events(lambda: f(segs, init), f"{S}{stream}")
            if S == 2 and stream == "skip0":
                txt = f.lower(segs, init).compile().as_text()
                res["hlo_has_call_start"] = "call-start" in txt or "async-start" in txt
                open("/tmp/out_hlo.txt", "w").write(txt)
            ref_o = jax.block_until_ready(full(**inp))[0]
            got = jnp.concatenate(o, axis=1)
            res[f"pipe{S}_stream{stream}_err"] = float(jnp.abs(got.astype(jnp.float32) - ref_o.astype(jnp.float32)).max())
        except Exception as e:
            res[f"pipe{S}_stream{stream}"] = f"{type(e).__name__}: {str(e)[:1500]}"
        print(res, flush=True)
print(json.dumps(res, indent=1))

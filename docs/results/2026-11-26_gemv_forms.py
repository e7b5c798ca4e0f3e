"""Decode-shaped products x[1,1,K] @ W[K,N] (bf16) in XLA: how each form compiles and how long it takes."""
import time, re, json, sys
import jax, jax.numpy as jnp
L = 20
f32, bf16 = jnp.float32, jnp.bfloat16

def forms():
    def plain(x, ws):
        return sum(((x * (1 + i / 64)).astype(bf16) @ w).astype(f32) for i, w in enumerate(ws))
    def pref32(x, ws):
        return sum(jnp.dot((x * (1 + i / 64)).astype(bf16), w, preferred_element_type=f32) for i, w in enumerate(ws))
    def two_rows(x, ws):
        out = 0
        for i, w in enumerate(ws):
            u = (x * (1 + i / 64)).astype(bf16)
            out = out + (jnp.concatenate([u, u], axis=1) @ w)[:, :1].astype(f32)
        return out
    def eight_rows(x, ws):
        out = 0
        for i, w in enumerate(ws):
            u = (x * (1 + i / 64)).astype(bf16)
            u8 = jnp.pad(u, ((0, 0), (0, 7), (0, 0)))
            out = out + (u8 @ w)[:, :1].astype(f32)
        return out
    return dict(plain=plain, eight_rows=eight_rows)

def timeit(f, *a, reps=30):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2]

rows = []
for K, N in [(4096, 2048), (2048, 4096), (2048, 256), (2048, 1024)]:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (1, 1, K), f32)
    ws = [jax.random.normal(jax.random.fold_in(kw, i), (K, N), bf16) * K**-0.5 for i in range(L)]
    ref = None
    fs = dict(forms()); fs["plain_no_strength_reduction"] = fs["plain"]
    for name, fn in fs.items():
        f = jax.jit(fn, compiler_options={"xla_gpu_enable_dot_strength_reduction": False} if name.endswith("reduction") else None)
        hlo = f.lower(x, ws).compile().as_text()
        kinds = {k: len(re.findall(k, hlo)) for k in ("input_reduce_fusion", "loop_multiply_fusion", "gemm_fusion", "__cublas", "triton")}
        t = timeit(f, x, ws)
        out = f(x, ws)
        if ref is None: ref = out
        err = float(jnp.max(jnp.abs(out - ref)))
        row = dict(K=K, N=N, form=name, us_per_product=round(t / L * 1e6, 2), GBps=round(K * N * 2 / (t / L) / 1e9), err=err, **{k: v for k, v in kinds.items() if v})
        rows.append(row); print(json.dumps(row), flush=True)

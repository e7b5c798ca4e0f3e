import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import jax, jax.numpy as jnp, numpy as np
from grouped_matmul import timeit, rel_err
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
T, HQ, HKV, D = 32768, 16, 2, 256
k0 = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(k0[0], (1, T, HQ, D), jnp.bfloat16)
k = jax.random.normal(k0[1], (1, T, HKV, D), jnp.bfloat16)
v = jax.random.normal(k0[2], (1, T, HKV, D), jnp.bfloat16)
scale = D ** -0.5
flops = 4 * T * T * D * HQ / 2
cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn"))
ref = cud(q, k, v)
t = timeit(cud, q, k, v, reps=3, trials=5)
print(json.dumps({"impl": "cudnn", "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1)}), flush=True)
for bq, bkv, steps in [(64, 64, 2), (64, 128, 2), (128, 64, 2), (64, 64, 3)]:
    try:
        cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=True)
        f = jax.jit(lambda q, k, v, cfg=cfg: am.attention((q * scale).astype(q.dtype), k, v, cfg))
        out = f(q, k, v)
        t = timeit(f, q, k, v, reps=3, trials=5)
        print(json.dumps({"impl": f"mgpu {bq}x{bkv}x{steps}", "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1),
                          "rel_err_vs_cudnn": rel_err(out, ref)}), flush=True)
    except Exception as e:
        print(json.dumps({"impl": f"mgpu {bq}x{bkv}x{steps}", "error": repr(e)[:400]}), flush=True)

import sys, math, jax, jax.numpy as jnp
sys.path.insert(0, '.')
from pallas_kernels.grouped_matmul import pallas_gemv as pg, pallas_triton as pt
from pallas_kernels.quantized import quantize_int8, quantize_int4
fmt = sys.argv[1]
E, H, F, T = 256, 2048, 512, 1
k = jax.random.split(jax.random.key(0), 3)
gu = (jax.random.normal(k[0], (E, H, 2 * F)) / math.sqrt(H)).astype(jnp.bfloat16)
dn = (jax.random.normal(k[1], (E, F, H)) / math.sqrt(F)).astype(jnp.bfloat16)
q = quantize_int8 if fmt == "int8" else quantize_int4
gu, dn = q(gu), q(dn)
x = jax.random.normal(k[2], (T, H), jnp.bfloat16)
g = jax.random.randint(jax.random.key(6), (T * 8,), 0, E)
idx = jnp.arange(T * 8, dtype=jnp.int32) // 8
h = jax.random.normal(jax.random.key(7), (T * 8, F), jnp.bfloat16)
rw = jnp.full((T, 8), 0.125, jnp.bfloat16)
fs = [jax.jit(lambda: pt.gmm_swiglu_pallas(x, gu, row_groups=g, lhs_index=idx)),
      jax.jit(lambda: pt.gmm_pallas(h, dn, row_groups=g))]
for bn, bk, w in ((8, 256, 4), (16, 256, 8), (16, 512, 4)):
    bs = pg.GemvBlocks(block_n=bn, block_k=bk, num_warps=w)
    fs.append(jax.jit(lambda bs=bs: pg.gemv_swiglu_pallas(x, gu, row_groups=g, lhs_index=idx, block_sizes=bs)))
    fs.append(jax.jit(lambda bs=bs: pg.gemv_combine_pallas(h, dn, row_groups=g, row_weights=rw, block_sizes=bs)))
for _ in range(3):
    for f in fs:
        jax.block_until_ready(f())

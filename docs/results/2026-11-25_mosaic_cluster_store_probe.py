"""Probe (H100): P formed by one CTA of a cluster of two, stored from registers into the peer CTA's shared memory
(plgpu.cluster_ref, Lane lowering semantics), then read by the peer (TMA store to GMEM)."""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

def body(q_ref, o_ref, q_smem, p_smem, loaded, ready):
    c = lax.axis_index("c")
    plgpu.copy_gmem_to_smem(q_ref.at[c], q_smem, loaded.at[0])
    plgpu.barrier_wait(loaded.at[0])
    def scores(acc):
        plgpu.wgmma(acc, q_smem, q_smem.T)
        return acc[...]
    p = pl.run_scoped(scores, plgpu.ACC((64, 64), jnp.float32)).astype(jnp.bfloat16)
    peer = plgpu.cluster_ref(p_smem, {"c": 1 - c})
    peer[...] = p
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready.at[0])
    plgpu.barrier_wait(ready.at[0])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(p_smem, o_ref.at[c])
    plgpu.wait_smem_to_gmem(0)

@jax.jit
def f(q):
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16),
        scratch_types=(plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tile), plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tile),
                       plgpu.Barrier(num_barriers=1), plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=1)),
        grid=(2,), grid_names=("c",), cluster=(2,), cluster_names=("c",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))(q)

bad = 0
for seed in range(200):
    q = jax.random.normal(jax.random.key(seed), (2, 64, 64), jnp.float32).astype(jnp.bfloat16)
    o = np.asarray(f(q), np.float32)
    want = np.einsum("cik,cjk->cij", np.asarray(q, np.float32), np.asarray(q, np.float32))
    err = max(np.abs(o[c] - want[1 - c]).max() / np.abs(want[1 - c]).max() for c in range(2))
    bad += err > 1e-2
    if seed < 2 or err > 1e-2:
        print(seed, "rel err of the peer's P", err)
print("bad", bad, "of 200")

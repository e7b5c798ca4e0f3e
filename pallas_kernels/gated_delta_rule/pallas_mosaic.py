"""Hopper state pass (the sequential walk over chunks) of the chunked gated delta rule in Pallas Mosaic GPU.

The Triton state pass (`pallas_triton._state_kernel`) keeps the state h [key_dim, block_v] as the *B* operand
of its products, so h, and every product that feeds the next one, goes through shared memory at each of the
walk's steps; on an H100 that walk is latency-bound (~1.5 us a step, 20% of the issue slots used;
docs/benchmarks.md). Here the walk runs on the transposed state h^T [block_v, key_dim] (block_v = 64, one
warpgroup's `wgmma` M), which is the *A* operand of every product on the critical path, so it never leaves
the registers:

    X^T  = V^T - (h^T K^T) diag(e^gamma)                  [block_v, c]    (V^T as I V^T: B transposed from SMEM)
    V'^T = X^T (T diag(beta))^T                           [block_v, c]    (= (U - W h)^T)
    O^T  = (h^T Q^T) diag(e^gamma) scale + V'^T P^T       [block_v, c]    -> O by one more I (O^T)^T product
    h^T <- e^gamma_last h^T + (V'^T diag(e^(gamma_last - gamma))) K     [block_v, key_dim]

with T diag(beta), P and gamma from `pallas_triton._prepare` (`wy_in_state`). A memory warpgroup streams the
chunk's Q, K, V, T diag(beta), P and gamma tiles with TMA (`emit_pipeline_warp_specialized`) while the
compute warpgroup walks. Source of the algorithm: arXiv:2412.06464 (gated delta rule), the WY / UT
representation as in flash-linear-attention; the warp-specialised pipeline as in JAX's
`pallas/ops/gpu/attention_mgpu.py`.

Hopper (sm_90) only; bf16 operands, f32 state and accumulation; chunk_size = block_v = 64, key_dim a multiple
of 64, value_dim a multiple of 64. Runs in Pallas' GPU interpreter on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64  # tokens per chunk; also the walk's rows of h^T (block_v): one warpgroup's wgmma M
BLOCK_V = 64


def supported(*, chunk_size: int, key_dim: int, value_dim: int, compute_dtype) -> str | None:
    """None where `state_pass` runs these shapes, else the reason it does not."""
    if chunk_size != CHUNK:
        return f"chunk_size={chunk_size} (the Mosaic GPU walk needs {CHUNK})"
    if key_dim % 64 or value_dim % BLOCK_V:
        return f"key_dim={key_dim}, value_dim={value_dim} (the Mosaic GPU walk needs multiples of 64)"
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        return f"compute dtype {jnp.dtype(compute_dtype).name} (the Mosaic GPU walk takes bf16)"
    return None


def _bf16_tile():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _walk_kernel(
    q_ref, k_ref, v_ref, tb_ref, p_ref, gamma_ref, init_ref,  # inputs (GMEM)
    o_ref, final_ref,  # outputs (GMEM)
    ot_smem, state_smem, state_barrier,  # scratch
    *, group, scale, max_concurrent_steps,
):
    b, bh, vb = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("vblocks")
    h = bh
    kh = lax.div(h, jnp.array(group, h.dtype))
    num_chunks = q_ref.shape[1] // CHUNK
    key_dim = q_ref.shape[3]
    cols = pl.ds(vb * BLOCK_V, BLOCK_V)
    f32, bf16 = jnp.float32, jnp.bfloat16
    wgmma_layout = plgpu.Layout.WGMMA

    def identity():  # I [64, 64] bf16 in the wgmma accumulator layout (an A operand from registers)
        i = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout)
        j = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
        return plgpu.layout_cast(jnp.where(i == j, 1.0, 0.0).astype(bf16), wgmma_layout)

    def wg(x):  # layout annotations: Mosaic GPU's layout inference runs out of search steps without them
        return plgpu.layout_cast(x, wgmma_layout)

    def zeros(shape):
        return plgpu.layout_cast(jnp.zeros(shape, f32), wgmma_layout)

    def body(_, q_smem, k_smem, v_smem, tb_smem, p_smem, gamma_smem, o_smem, carry):
        state = carry  # h^T [BLOCK_V, key_dim] f32
        state = wg(state)
        state_in = wg(state.astype(bf16))
        eye = identity()
        gamma = plgpu.load(gamma_smem, layout=wgmma_layout.reduce(0))  # [c] over the columns (tokens)
        # gamma_last as a scalar: broadcasting it as a row vector over h^T left Mosaic GPU's layout inference
        # without a solution
        gamma_last = gamma_smem[CHUNK - 1]

        def cols_vec(x):  # [c] -> [BLOCK_V, c], constant down each column
            return plgpu.layout_cast(lax.broadcast_in_dim(x, (BLOCK_V, CHUNK), [1]), wgmma_layout)

        def first(refs):  # h^T K^T, h^T Q^T, I V^T: all three issued, then waited for together
            x_ref, qh_ref, vt_ref = refs
            plgpu.wgmma(x_ref, state_in, k_smem.transpose((1, 0)))
            plgpu.wgmma(vt_ref, eye, v_smem.transpose((1, 0)))
            plgpu.wgmma(qh_ref, state_in, q_smem.transpose((1, 0)))

        shape = (BLOCK_V, CHUNK)
        kh_t, qh_t, v_t = pl.run_state(first)(tuple(plgpu.ACC.init(zeros(shape)) for _ in range(3)))
        e_gamma = cols_vec(jnp.exp(gamma))
        x_t = wg(wg(v_t) - wg(kh_t) * e_gamma)  # X^T = (V - diag(e^gamma) K h)^T

        def second(acc_ref):  # V'^T = X^T (T diag(beta))^T
            plgpu.wgmma(acc_ref, wg(x_t.astype(bf16)), tb_smem.transpose((1, 0)))

        vnew_t = pl.run_state(second)(plgpu.ACC.init(zeros(shape)))
        vnew_t = wg(vnew_t)
        vnew_in = wg(vnew_t.astype(bf16))
        decayed = wg((vnew_t * cols_vec(jnp.exp(gamma_last - gamma))).astype(bf16))
        state_scaled = wg(state * jnp.exp(gamma_last))
        out_init = wg(wg(qh_t) * (e_gamma * scale))

        def third(refs):  # h^T update and O^T, issued together
            state_ref, out_ref = refs
            plgpu.wgmma(state_ref, decayed, k_smem)
            plgpu.wgmma(out_ref, vnew_in, p_smem.transpose((1, 0)))

        state, out_t = pl.run_state(third)((plgpu.ACC.init(state_scaled), plgpu.ACC.init(out_init)))
        ot_smem[...] = wg(wg(out_t).astype(bf16))
        plgpu.commit_smem()

        def transpose(acc_ref):  # O = I (O^T)^T
            plgpu.wgmma(acc_ref, eye, ot_smem.transpose((1, 0)))

        out = pl.run_state(transpose)(plgpu.ACC.init(zeros((CHUNK, BLOCK_V))))
        o_smem[...] = wg(wg(out).astype(o_smem.dtype))
        return wg(state)

    def compute_context(pipeline):
        rows = (b, h, cols)
        plgpu.copy_gmem_to_smem(init_ref.at[rows], state_smem, state_barrier)
        plgpu.barrier_wait(state_barrier)
        state = plgpu.load(state_smem, layout=wgmma_layout)
        state = pipeline(state)
        state_smem[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, final_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    tile = _bf16_tile()
    pipeline = plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(num_chunks,),
        max_concurrent_steps=min(max_concurrent_steps, num_chunks),
        num_compute_wgs=1,
        memory_registers=40,
        wg_axis="wg",
        compute_context=compute_context,
        in_specs=[
            plgpu.BlockSpec((CHUNK, key_dim), lambda i: (i, 0), transforms=tile),  # q
            plgpu.BlockSpec((CHUNK, key_dim), lambda i: (i, 0), transforms=tile),  # k
            plgpu.BlockSpec((CHUNK, BLOCK_V), lambda i: (i, vb), transforms=tile),  # v
            plgpu.BlockSpec((CHUNK, CHUNK), lambda i: (i, 0), transforms=tile),  # T diag(beta)
            plgpu.BlockSpec((CHUNK, CHUNK), lambda i: (i, 0), transforms=tile),  # P
            plgpu.BlockSpec((CHUNK,), lambda i: (i,)),  # gamma
        ],
        out_specs=[plgpu.BlockSpec((CHUNK, BLOCK_V), lambda i: (i, vb), transforms=tile)],
    )
    pipeline(
        q_ref.at[b, :, kh, :],
        k_ref.at[b, :, kh, :],
        v_ref.at[b, :, h, :],
        tb_ref.at[b, :, h, :],
        p_ref.at[b, :, h, :],
        gamma_ref.at[b, h, :],
        o_ref.at[b, :, h, :],
    )


def _walk_kernel_split(
    q_ref, k_ref, v_ref, tb_ref, p_ref, gamma_ref, init_ref,  # inputs (GMEM)
    o_ref, final_ref,  # outputs (GMEM)
    q_smem, k_smem, v_smem, tb_smem, p_smem, g_smem,  # [stages, ...] input tiles
    h_smem, vn_smem, o_smem, state_smem,  # h^T and V'^T handed to the output warpgroup, O staging, h^T in/out
    loaded, free, h_ready, h_free, state_barrier,  # barriers
    *, group, scale, stages,
):
    # Three warpgroups: 0 walks (h^T, V'^T: the critical path), 1 forms the output from the h^T and V'^T that
    # warpgroup 0 leaves in shared memory (two buffers), 2 streams the chunk tiles with TMA (`stages` buffers).
    b, h, vb = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("vblocks")
    wg = lax.axis_index("wg")
    kh = lax.div(h, jnp.array(group, h.dtype))
    num_chunks = q_ref.shape[1] // CHUNK
    cols = pl.ds(vb * BLOCK_V, BLOCK_V)
    f32, bf16 = jnp.float32, jnp.bfloat16
    layout = plgpu.Layout.WGMMA

    def lc(x):  # layout annotations: Mosaic GPU's layout inference runs out of search steps without them
        return plgpu.layout_cast(x, layout)

    def zeros(shape):
        return lc(jnp.zeros(shape, f32))

    def tiles(n):  # (GMEM tile, SMEM buffer) of chunk n, in the order of `loaded`
        rows = pl.ds(n * CHUNK, CHUNK)
        s = lax.rem(n, stages)
        return (
            (q_ref.at[b, rows, kh, :], q_smem.at[s]),
            (k_ref.at[b, rows, kh, :], k_smem.at[s]),
            (v_ref.at[b, rows, h, cols], v_smem.at[s]),
            (tb_ref.at[b, rows, h, :], tb_smem.at[s]),
            (p_ref.at[b, rows, h, :], p_smem.at[s]),
            (gamma_ref.at[b, h, rows], g_smem.at[s]),
        )

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, num_chunks)
        def _(n):
            s = lax.rem(n, stages)

            @pl.when(n >= stages)
            def _():
                plgpu.barrier_wait(free.at[s])

            for i, (src, dst) in enumerate(tiles(n)):
                plgpu.copy_gmem_to_smem(src, dst, loaded.at[i * stages + s])

    @pl.when(wg == 0)
    def _walk():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(init_ref.at[b, h, cols], state_smem, state_barrier.at[0])
        plgpu.barrier_wait(state_barrier.at[0])
        state0 = lc(plgpu.load(state_smem, layout=layout))

        def step(n, state):
            s, hb = lax.rem(n, stages), lax.rem(n, 2)
            for i in (1, 2, 3, 5):  # k, v, T diag(beta), gamma
                plgpu.barrier_wait(loaded.at[i * stages + s])
            state = lc(state)
            state_in = lc(state.astype(bf16))
            gamma = plgpu.load(g_smem.at[s], layout=layout.reduce(0))  # over the columns (tokens)
            gamma_last = g_smem[s, CHUNK - 1]

            def first(refs):  # h^T K^T and U^T = V^T (T diag(beta))^T, issued together
                kh_ref, u_ref = refs
                plgpu.wgmma(kh_ref, state_in, k_smem.at[s].transpose((1, 0)))
                plgpu.wgmma(u_ref, v_smem.at[s].transpose((1, 0)), tb_smem.at[s].transpose((1, 0)))

            @pl.when(n >= 2)
            def _():
                plgpu.barrier_wait(h_free.at[hb])

            h_smem[hb] = state_in  # for the output warpgroup, while the products run
            shape = (BLOCK_V, CHUNK)
            kh_t, u_t = pl.run_state(first)((plgpu.ACC.init(zeros(shape)), plgpu.ACC.init(zeros(shape))))
            e_gamma = lc(lax.broadcast_in_dim(jnp.exp(gamma), shape, [1]))
            y = lc((lc(kh_t) * -e_gamma).astype(bf16))  # -(h^T K^T) diag(e^gamma)

            def second(acc_ref):  # V'^T = U^T + Y (T diag(beta))^T = (T diag(beta) (V - diag(e^gamma) K h))^T
                plgpu.wgmma(acc_ref, y, tb_smem.at[s].transpose((1, 0)))

            vnew_t = lc(pl.run_state(second)(plgpu.ACC.init(lc(u_t))))
            vn_smem[hb] = lc(vnew_t.astype(bf16))
            plgpu.commit_smem()
            plgpu.barrier_arrive(h_ready.at[hb])
            decay = lc(lax.broadcast_in_dim(jnp.exp(gamma_last - gamma), shape, [1]))
            decayed = lc((vnew_t * decay).astype(bf16))

            def third(acc_ref):  # h^T <- e^gamma_last h^T + (V'^T diag(e^(gamma_last - gamma))) K
                plgpu.wgmma(acc_ref, decayed, k_smem.at[s])

            state = pl.run_state(third)(plgpu.ACC.init(lc(state * jnp.exp(gamma_last))))
            plgpu.barrier_arrive(free.at[s])
            return lc(state)

        state = lax.fori_loop(0, num_chunks, step, state0)
        state_smem[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, final_ref.at[b, h, cols])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _output():
        plgpu.set_max_registers(232, action="increase")

        @pl.loop(0, num_chunks)
        def _(n):
            s, hb = lax.rem(n, stages), lax.rem(n, 2)
            for i in (0, 4, 5):  # q, P, gamma
                plgpu.barrier_wait(loaded.at[i * stages + s])
            plgpu.barrier_wait(h_ready.at[hb])
            gamma = plgpu.load(g_smem.at[s], layout=layout.reduce(1))  # over the rows (tokens)
            shape = (CHUNK, BLOCK_V)

            def inter(acc_ref):  # Q h
                plgpu.wgmma(acc_ref, q_smem.at[s], h_smem.at[hb].transpose((1, 0)))

            qh = lc(pl.run_state(inter)(plgpu.ACC.init(zeros(shape))))
            out0 = lc(qh * lc(lax.broadcast_in_dim(jnp.exp(gamma) * scale, shape, [0])))

            def intra(acc_ref):  # + P V'
                plgpu.wgmma(acc_ref, p_smem.at[s], vn_smem.at[hb].transpose((1, 0)))

            out = lc(pl.run_state(intra)(plgpu.ACC.init(out0)))
            plgpu.barrier_arrive(h_free.at[hb])
            plgpu.barrier_arrive(free.at[s])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy out of this buffer two chunks ago
            o_smem[hb] = lc(out.astype(o_smem.dtype))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[hb], o_ref.at[b, pl.ds(n * CHUNK, CHUNK), h, cols])

        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "max_concurrent_steps", "split", "interpret"))
def state_pass(
    q, k, v, t_beta, p, gamma, initial_state, *, scale, max_concurrent_steps=2, split=True, interpret=False
):
    """Fused state pass and output of the chunked gated delta rule (Hopper, Mosaic GPU).

    Args:
      q, k: [batch, seq, k_heads, key_dim] bf16, chunk-aligned (seq a multiple of 64).
      v: [batch, seq, v_heads, value_dim] bf16; v-head h reads q/k head h // (v_heads // k_heads).
      t_beta: [batch, seq, v_heads, 64] bf16, each chunk's T diag(beta) (the UT transform) from the prepare.
      p: [batch, seq, v_heads, 64] bf16, each chunk's scale * lower_incl(Q K^T * Gamma).
      gamma: [batch, v_heads, seq] f32, chunk-local prefix sums of the log decay.
      initial_state: [batch, v_heads, key_dim, value_dim] f32.
      scale: the query scale (P already carries it).
      max_concurrent_steps: chunks in flight in the TMA pipeline (shared-memory stages).
      interpret: run in Pallas' GPU interpreter (CPU).

    Returns:
      output [batch, seq, v_heads, value_dim] bf16 and the final state [batch, v_heads, key_dim, value_dim] f32.

    Raises:
      ValueError: shapes this kernel does not take (see `supported`).
    """
    batch, seq, k_heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    reason = supported(chunk_size=CHUNK, key_dim=key_dim, value_dim=value_dim, compute_dtype=q.dtype)
    if reason or seq % CHUNK:
        raise ValueError(f"Mosaic GPU state pass: {reason or f'seq={seq} not a multiple of {CHUNK}'}")
    init_t = jnp.swapaxes(initial_state.astype(jnp.float32), 2, 3)  # h^T [batch, v_heads, value_dim, key_dim]
    out_type = (
        jax.ShapeDtypeStruct((batch, seq, v_heads, value_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct(init_t.shape, jnp.float32),
    )
    grid = dict(grid=(batch, v_heads, value_dim // BLOCK_V), grid_names=("batch", "heads", "vblocks"),
                thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=plgpu.InterpretGPUParams() if interpret else None)
    if split:
        def gdn_state_mosaic_split(*refs):  # the kernel's name in profiles
            _walk_kernel_split(*refs, group=v_heads // k_heads, scale=scale, stages=max_concurrent_steps)

        tile, st = _bf16_tile(), max_concurrent_steps
        out, final_t = plgpu.kernel(
            gdn_state_mosaic_split,
            out_type=out_type,
            scratch_types=(
                plgpu.SMEM((st, CHUNK, key_dim), jnp.bfloat16, transforms=tile),  # q
                plgpu.SMEM((st, CHUNK, key_dim), jnp.bfloat16, transforms=tile),  # k
                plgpu.SMEM((st, CHUNK, BLOCK_V), jnp.bfloat16, transforms=tile),  # v
                plgpu.SMEM((st, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # T diag(beta)
                plgpu.SMEM((st, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # P
                plgpu.SMEM((st, CHUNK), jnp.float32),  # gamma
                plgpu.SMEM((2, BLOCK_V, key_dim), jnp.bfloat16, transforms=tile),  # h^T for the output
                plgpu.SMEM((2, BLOCK_V, CHUNK), jnp.bfloat16, transforms=tile),  # V'^T for the output
                plgpu.SMEM((2, CHUNK, BLOCK_V), jnp.bfloat16, transforms=tile),  # O staging
                plgpu.SMEM((BLOCK_V, key_dim), jnp.float32),  # h^T in and out
                plgpu.Barrier(num_barriers=6 * st, num_arrivals=1),  # loaded [6, st] (reshaped below)
                plgpu.Barrier(num_barriers=st, num_arrivals=2),  # free: both compute warpgroups done
                plgpu.Barrier(num_barriers=2, num_arrivals=1),  # h_ready
                plgpu.Barrier(num_barriers=2, num_arrivals=1),  # h_free
                plgpu.Barrier(num_barriers=1, num_arrivals=1),  # state
            ),
            num_threads=3,
            **grid,
        )(q, k, v, t_beta, p, gamma, init_t)
        return out, jnp.swapaxes(final_t, 2, 3)

    def gdn_state_mosaic(*refs):  # the kernel's name in profiles
        _walk_kernel(*refs, group=v_heads // k_heads, scale=scale, max_concurrent_steps=max_concurrent_steps)

    out, final_t = plgpu.kernel(
        gdn_state_mosaic,
        out_type=(
            jax.ShapeDtypeStruct((batch, seq, v_heads, value_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct(init_t.shape, jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((BLOCK_V, CHUNK), jnp.bfloat16, transforms=_bf16_tile()),  # O^T
            plgpu.SMEM((BLOCK_V, key_dim), jnp.float32),  # h^T in and out
            plgpu.Barrier(num_barriers=1),
        ),
        grid=(batch, v_heads, value_dim // BLOCK_V),
        grid_names=("batch", "heads", "vblocks"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v, t_beta, p, gamma, init_t)
    return out, jnp.swapaxes(final_t, 2, 3)

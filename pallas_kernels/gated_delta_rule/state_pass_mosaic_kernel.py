"""The Mosaic GPU kernel of the Hopper state pass (`state_pass_mosaic.state_pass`) of the gated delta rule.

The Triton state pass (`state_pass_triton`) keeps the state h [key_dim, block_v] as the *B* operand of its
products, so h, and every product that feeds the next one, goes through shared memory at each of the walk's
steps, and that walk is bound by latency. Here the walk runs on the transposed state h^T [block_v, key_dim]
(block_v = 64, one warpgroup's `wgmma` M), the *A* operand of every product on the critical path, so it never
leaves the registers. Per chunk (c = 64 tokens):

    U^T  = V^T (T diag(beta))^T                 [block_v, c]  (both operands transposed from SMEM)
    Y    = -(h^T K^T) diag(e^gamma)             [block_v, c]
    V'^T = U^T + Y (T diag(beta))^T             [block_v, c]  (= (T diag(beta) (V - diag(e^gamma) K h))^T)
    h^T <- e^gamma_last h^T + (V'^T diag(e^(gamma_last - gamma))) K     [block_v, key_dim]
    O    = diag(e^gamma) scale Q h + P V'       [c, block_v]  (second warpgroup, h^T and V'^T via SMEM)

with T diag(beta), P and gamma from `prepare.prepare` (`wy_in_state`), or P formed in this kernel from
the Q and K tiles it streams (p=None; the default for packed sequences on their own grid, where it saves the
prepare's P write and this kernel's P read). Packed sequences either on the
packed array's own chunks (a chunk may hold several sequences: T and P block-diagonal over them by
`gates.break_sequences`, and each sequence's walk masks the others' columns out of its state update and writes
only its own rows) or regathered chunk-aligned (see `state_pass`). Three warpgroups per program
(batch row or packed sequence, v-head, block of 64 value columns): 0 walks, 1 forms the output from the h^T
and V'^T that 0 leaves in shared memory (two buffers), 2 streams the chunk tiles with TMA (two stages, each
compute warpgroup's tiles on their own barriers); with p=None a fourth warpgroup forms P. Source of the
algorithm: arXiv:2412.06464 (gated delta rule), the WY / UT representation as in flash-linear-attention; the
warp-specialised structure as in JAX's `pallas/ops/gpu/attention_mgpu.py` (FlashAttention-3).

Hopper (sm_90) only; bf16 operands, f32 state and accumulation; chunk_size = block_v = 64, key_dim and
value_dim multiples of 64. Pallas' GPU interpreter cannot run it (its wgmma takes no register operands): the
CPU tests lower it for CUDA; the numerical checks run on an sm_90 GPU (tests skipped elsewhere).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import gates

CHUNK = gates.OWN_GRID_CHUNK  # tokens per chunk; also the walk's rows of h^T (block_v): one wgmma M
BLOCK_V = 64
# Registers per thread where a fourth warpgroup forms P (p=None): 512 in all (the register file over four
# warpgroups of 128 threads, 128 each at launch): walk 232, output 144, TMA 40, P 96, the split
# measured fastest on packed sequences (docs/performance.md).
P_OUTPUT_REGISTERS = 144
P_REGISTERS = 96


def masked_decay(rows_ref, cols_ref, keep, scale=None):
    """exp(gamma_i - gamma_j) where `keep`, 0 elsewhere: [64, 64] f32 in the WGMMA layout, as the exp of the
    difference with -inf where not `keep` (one subtraction, one select and one exp per element); with `scale`
    (a Python float), scale * exp(gamma_i - gamma_j): for scale > 0 as exp2(gamma_i log2(e) + log2(scale) -
    gamma_j log2(e)) (the scale and log2(e) applied to the [64] vectors, fewer instructions per element), else
    multiplied after the exp.

    Args:
      rows_ref, cols_ref: [64] f32 shared-memory refs, each holding the chunk's gamma (chunk-local prefix
        sums of the log decay), read over the rows and over the columns: two copies, because two loads of one
        ref in two layouts defeat Mosaic GPU's layout inference.
      keep: [64, 64] bool (WGMMA layout), on and/or below the diagonal only, where gamma_i <= gamma_j (so the
        exponent is <= 0 and the factor <= 1).
    """
    layout, shape = plgpu.Layout.WGMMA, (CHUNK, CHUNK)
    lc = functools.partial(plgpu.layout_cast, new_layout=layout)
    rows, cols = plgpu.load(rows_ref, layout=layout.reduce(1)), plgpu.load(cols_ref, layout=layout.reduce(0))
    scale_in_exp = scale is not None and scale > 0
    if scale_in_exp:
        log2e = math.log2(math.e)
        rows, cols = rows * log2e + math.log2(scale), cols * log2e
    diff = lc(lax.broadcast_in_dim(rows, shape, [0])) - lc(lax.broadcast_in_dim(cols, shape, [1]))
    exponent = lc(jnp.where(keep, lc(diff), lc(jnp.full(shape, -jnp.inf, jnp.float32))))
    decay = lc(jnp.exp2(exponent) if scale_in_exp else jnp.exp(exponent))
    return decay if scale is None or scale_in_exp else lc(decay * scale)


def scratch_types(key_dim, stages, *, packed, p_in_walk, restart=False):
    """The walk kernel's shared-memory buffers and barriers (`walk_kernel`'s scratch refs, in order)."""
    tile, st = gpu_limits.smem_tiles(2, 64), stages  # [.., 64] bf16 operand tiles
    return (
        plgpu.SMEM((st, CHUNK, key_dim), jnp.bfloat16, transforms=tile),  # q
        plgpu.SMEM((st, CHUNK, key_dim), jnp.bfloat16, transforms=tile),  # k
        plgpu.SMEM((st, CHUNK, BLOCK_V), jnp.bfloat16, transforms=tile),  # v
        plgpu.SMEM((st, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # T diag(beta)
        plgpu.SMEM((st, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # P
        plgpu.SMEM((st, CHUNK), jnp.float32),  # e^gamma for the walk
        plgpu.SMEM((st, CHUNK), jnp.float32),  # e^(gamma_last - gamma)
        plgpu.SMEM((st, CHUNK), jnp.float32),  # e^gamma for the output
        plgpu.SMEM((2, BLOCK_V, key_dim), jnp.bfloat16, transforms=tile),  # h^T for the output
        plgpu.SMEM((2, BLOCK_V, CHUNK), jnp.bfloat16, transforms=tile),  # V'^T for the output
        plgpu.SMEM((2, CHUNK, BLOCK_V), jnp.bfloat16, transforms=() if packed else tile),  # O staging
        plgpu.SMEM((key_dim, BLOCK_V), jnp.float32),  # the state's block in and out
        plgpu.Barrier(num_barriers=st, num_arrivals=5),  # loaded0: K, V, T diag(beta), both decays
        plgpu.Barrier(num_barriers=st, num_arrivals=2 if p_in_walk else 3),  # loaded1: (Q,) P, e^gamma
        plgpu.Barrier(
            num_barriers=st, num_arrivals=1 + p_in_walk
        ),  # free0: the walk (and P's) done with a stage
        plgpu.Barrier(num_barriers=st, num_arrivals=1),  # free1: the output is done with a stage
        plgpu.Barrier(num_barriers=2, num_arrivals=1),  # h_ready
        plgpu.Barrier(num_barriers=2, num_arrivals=1),  # h_free
        plgpu.Barrier(num_barriers=1, num_arrivals=1),  # state
        *(
            (
                plgpu.SMEM((st, CHUNK), jnp.float32),
                plgpu.SMEM((st, CHUNK), jnp.float32),  # gamma for P
                plgpu.Barrier(num_barriers=st, num_arrivals=3),
            )
            if p_in_walk
            else ()
        ),  # Q, gamma twice
        # restart: gamma of the walk's first and last chunk, and their barriers (each waited once)
        *(
            (plgpu.SMEM((2, CHUNK), jnp.float32), plgpu.Barrier(num_barriers=2, num_arrivals=1))
            if restart
            else ()
        ),
    )


def _own_decays(gamma_ref, first, last, layout):
    """A packed sequence's own decay factors in one chunk of the own grid, from the chunk's gamma: gamma_ref
    [64] f32 (shared memory; chunk-local prefix sums of the log decay of `gates.break_sequences`), the
    sequence's rows [first, last) of the chunk (int32 scalars, first < last). Returns e^gamma' and
    e^(gamma'_last - gamma') [64] f32 in `layout` (0 off the sequence's rows) and e^gamma'_last (a scalar),
    gamma' restarting at row first (the break added back), gamma'_last its value at row last - 1:
    `gates.decay_factors` with cu_seqlens."""
    gamma = plgpu.load(gamma_ref, layout=layout)
    token = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (CHUNK,), 0), layout)
    own = (token >= first) & (token < last)
    restart = jnp.where(first > 0, gamma_ref[jnp.maximum(first - 1, 0)] - gates.SEQUENCE_BREAK, 0.0)
    gamma_last = gamma_ref[last - 1]
    exp_gamma = jnp.where(own, jnp.exp(gamma - restart), 0.0)  # (inf off the rows, where it is not taken)
    exp_to_last = jnp.where(own, jnp.exp(gamma_last - gamma), 0.0)
    return exp_gamma, exp_to_last, jnp.exp(gamma_last - restart)


def walk_kernel(
    q_ref,
    k_ref,
    v_ref,
    tb_ref,
    p_ref,
    eg_ref,
    ed_ref,
    init_ref,
    cu_ref,
    bounds_ref,  # inputs (GMEM)
    o_ref,
    final_ref,  # outputs (GMEM)
    q_smem,
    k_smem,
    v_smem,
    tb_smem,
    p_smem,
    eg0_smem,
    ed_smem,
    eg1_smem,  # [stages, ...] input tiles
    h_smem,
    vn_smem,
    o_smem,
    state_smem,  # h^T and V'^T handed to the output warpgroup, O staging, state in/out
    loaded0,
    loaded1,
    free0,
    free1,
    h_ready,
    h_free,
    state_barrier,  # barriers
    *p_scratch,  # p_in_walk: gamma [stages, 64] f32 twice (SMEM: rows, columns) and their barrier with Q's;
    # restart: then gamma [2, 64] f32 of the walk's first and last chunk and their two barriers
    group,
    scale,
    stages,
    packed,
    chunk_offset=0,
    p_in_walk=False,
    restart=False,
):
    # Three warpgroups: 0 walks (h^T, V'^T: the critical path), 1 forms the output from the h^T and V'^T that
    # warpgroup 0 leaves in shared memory (two buffers), 2 streams the chunk tiles with TMA (`stages` buffers;
    # each compute warpgroup's tiles on their own barriers, so that warpgroup 0 never waits for 1's).
    row, h, vb = lax.axis_index("rows"), lax.axis_index("heads"), lax.axis_index("vblocks")
    # row: a batch row, or with `packed` a sequence (tokens [start, end) of the packed output), whose chunks
    # [lo, hi) it walks: "own_grid", the packed array's own chunks (the first and last may hold other
    # sequences' tokens too); "regathered", chunk-aligned copies (bounds_ref: each sequence's chunk range)
    # chunk_offset (batch rows): q, k, v and the output are the whole sequence, the prepare's tiles
    # (T diag(beta), P, the decays) one piece of it starting at that chunk (`walk_pipeline.pipelined_walk`)
    # p_in_walk: p_ref holds gamma [b, v_heads, t] f32 instead of P, and a fourth warpgroup forms each chunk's
    # P = scale lower_incl(Q K^T * exp(gamma_i - gamma_j)) from the Q and K tiles warpgroup 2 streams, into
    # p_smem
    # restart (own grid, p_in_walk): eg_ref, ed_ref hold the chunk grid's decay factors
    # (`gates.decay_factors(gamma)`); in the walk's first and last chunk warpgroups 0 and 1 form the
    # sequence's own (restarting at its first token, ending at its last) from that chunk's gamma
    # (`_own_decays`)
    b = 0 if packed else row
    start, end = (cu_ref[row], cu_ref[row + 1]) if packed else (0, 0)
    if packed == "own_grid":
        lo = lax.div(start, CHUNK)
        hi = jnp.where(end > start, lax.div(end + CHUNK - 1, CHUNK), lo)
    elif packed == "regathered":
        lo, hi = bounds_ref[row], bounds_ref[row + 1]
    else:
        lo, hi = 0, tb_ref.shape[1] // CHUNK

    def own_rows(n):  # chunk n's first row in the packed output, and its rows [first, last) of this sequence
        if packed == "own_grid":
            return n * CHUNK, jnp.maximum(start - n * CHUNK, 0), jnp.minimum(end - n * CHUNK, CHUNK)
        row0 = start + (n - lo) * CHUNK
        return row0, 0, jnp.minimum(end - row0, CHUNK)

    # own grid: the walk's chunks in three parts (first, stop, which): its first chunk (which 0), the middle
    # ones (None: all their tokens its own) and its last (1; empty when the first is also the last)
    walk_parts = (
        ((lo, jnp.minimum(lo + 1, hi), 0), (lo + 1, hi - 1, None), (jnp.maximum(hi - 1, lo + 1), hi, 1))
        if packed == "own_grid"
        else None
    )
    wg = lax.axis_index("wg")
    kh = lax.div(h, jnp.array(group, h.dtype))
    cols = pl.ds(vb * BLOCK_V, BLOCK_V)
    f32, bf16 = jnp.float32, jnp.bfloat16
    layout = plgpu.Layout.WGMMA

    def lc(x):  # layout annotations: Mosaic GPU's layout inference runs out of search steps without them
        return plgpu.layout_cast(x, layout)

    if restart:
        ends_smem, ends_loaded = p_scratch[3:]

    def own_decays(n, which, axis):  # restart: (e^gamma', e^(gamma'_last - gamma'), e^gamma'_last) of chunk n
        plgpu.barrier_wait(ends_loaded.at[which])
        _, first, last = own_rows(n)
        return _own_decays(ends_smem.at[which], first, last, layout.reduce(axis))

    if p_in_walk:  # a fourth warpgroup forms P
        gm_rows_smem, gm_cols_smem, qg_loaded = p_scratch[:3]

        def form_p(n):  # chunk n's P from its Q, K and gamma tiles, into p_smem; then P counts as loaded
            s = lax.rem(n - lo, stages)
            plgpu.barrier_wait(loaded0.at[s])  # K (with the walk's other tiles)
            plgpu.barrier_wait(qg_loaded.at[s])  # Q, gamma
            shape = (CHUNK, CHUNK)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[s], k_smem.at[s].transpose((1, 0)))  # Q K^T
                i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
                j = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
                decay = masked_decay(gm_rows_smem.at[s], gm_cols_smem.at[s], lc(i >= j), scale)
                return lc(lc(acc_ref[...]) * decay)

            p = lc(pl.run_scoped(scores, plgpu.ACC(shape, f32)).astype(bf16))
            plgpu.barrier_arrive(
                free0.at[s]
            )  # done with K (the TMA warpgroup refills its stage once the walk is too)
            p_smem[s] = p
            plgpu.commit_smem()
            plgpu.barrier_arrive(loaded1.at[s])

        @pl.when(wg == 3)
        def _p():
            plgpu.set_max_registers(P_REGISTERS, action="decrease")

            @pl.loop(lo, hi)
            def _(n):
                s = lax.rem(n - lo, stages)
                pl.when(n - lo >= stages)(functools.partial(plgpu.barrier_wait, free1.at[s]))  # P's buffer
                form_p(n)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        if restart:  # gamma of the walk's first and last chunk (the same chunk: only the first)
            for first_n, stop_n, which in walk_parts[::2]:
                pl.when(first_n < stop_n)(
                    functools.partial(
                        plgpu.copy_gmem_to_smem,
                        p_ref.at[b, h, pl.ds(first_n * CHUNK, CHUNK)],
                        ends_smem.at[which],
                        ends_loaded.at[which],
                    )
                )

        @pl.loop(lo, hi)
        def _(n):
            rows, s = pl.ds(n * CHUNK, CHUNK), lax.rem(n - lo, stages)
            tokens = pl.ds((n + chunk_offset) * CHUNK, CHUNK)
            # packed: q, k, v past the array's end (its last chunk) read as zeros (TMA)
            walk_tiles = (  # warpgroup 0's: K, V, T diag(beta), e^gamma, e^(gamma_last - gamma)
                (k_ref.at[b, tokens, kh, :], k_smem),
                (v_ref.at[b, tokens, h, cols], v_smem),
                (tb_ref.at[b, rows, h, :], tb_smem),
                (eg_ref.at[b, h, rows], eg0_smem),
                (ed_ref.at[b, h, rows], ed_smem),
            )
            if p_in_walk:  # warpgroup 1's: Q and gamma (for P, formed here), e^gamma
                gamma_tiles = ((p_ref.at[b, h, rows], gm_rows_smem), (p_ref.at[b, h, rows], gm_cols_smem))
                output_tiles = (
                    (((q_ref.at[b, tokens, kh, :], q_smem), *gamma_tiles), qg_loaded),
                    (((eg_ref.at[b, h, rows], eg1_smem),), loaded1),
                )
            else:  # warpgroup 1's: Q, P, e^gamma
                output_tiles = (
                    (
                        (
                            (q_ref.at[b, tokens, kh, :], q_smem),
                            (p_ref.at[b, rows, h, :], p_smem),
                            (eg_ref.at[b, h, rows], eg1_smem),
                        ),
                        loaded1,
                    ),
                )
            pl.when(n - lo >= stages)(functools.partial(plgpu.barrier_wait, free0.at[s]))
            for src, dst in walk_tiles:
                plgpu.copy_gmem_to_smem(src, dst.at[s], loaded0.at[s])
            pl.when(n - lo >= stages)(functools.partial(plgpu.barrier_wait, free1.at[s]))
            for tiles, loaded in output_tiles:
                for src, dst in tiles:
                    plgpu.copy_gmem_to_smem(src, dst.at[s], loaded.at[s])

    @pl.when(wg == 0)
    def _walk():
        plgpu.set_max_registers(232, action="increase")
        # the state h [key_dim, value_dim] in GMEM; state_smem its [key_dim, 64] block, read and written as
        # h^T through a transposed view (WGMMA_TRANSPOSED: one shuffle from and to the walk's layout)
        plgpu.copy_gmem_to_smem(init_ref.at[row, h, :, cols], state_smem, state_barrier.at[0])
        plgpu.barrier_wait(state_barrier.at[0])
        state0 = lc(plgpu.load(state_smem.T, (), layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False))
        shape = (BLOCK_V, CHUNK)

        def step(n, state, which=0):
            # which (own grid, `walk_parts`): the walk's first (0) or last (1) chunk, or None, a chunk
            # strictly between them (all its own tokens)
            boundary = which is not None
            s, hb = lax.rem(n - lo, stages), lax.rem(n - lo, 2)
            plgpu.barrier_wait(loaded0.at[s])
            state = lc(state)
            state_in = lc(state.astype(bf16))
            # e^gamma and e^(gamma_last - gamma) over the columns (tokens), e^gamma_last as a scalar
            if restart and boundary:  # the sequence's own factors, other tokens' 0 (the prepare's not loaded)
                exp_gamma, exp_to_last, exp_last = own_decays(n, which, 0)
            else:
                exp_gamma = plgpu.load(eg0_smem.at[s], layout=layout.reduce(0))
                exp_to_last = plgpu.load(ed_smem.at[s], layout=layout.reduce(0))
                if packed == "own_grid" and boundary:  # only the own sequence's tokens update the state, its
                    # decay ends there
                    _, first, last = own_rows(n)
                    token = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (CHUNK,), 0), layout.reduce(0))
                    exp_to_last = jnp.where((token >= first) & (token < last), exp_to_last, 0.0)
                    exp_last = eg0_smem[s, last - 1]
                else:
                    exp_last = eg0_smem[s, CHUNK - 1]

            def products(kh_ref, u_ref):  # the first two products, with the elementwise work while they run
                plgpu.wgmma(kh_ref, state_in, k_smem.at[s].transpose((1, 0)))  # h^T K^T
                plgpu.wgmma(u_ref, v_smem.at[s].transpose((1, 0)), tb_smem.at[s].transpose((1, 0)))  # U^T

                @pl.when(n - lo >= 2)
                def _():
                    plgpu.barrier_wait(h_free.at[hb])

                h_smem[hb] = state_in  # h^T for the output warpgroup
                e_gamma = lc(lax.broadcast_in_dim(exp_gamma, shape, [1]))
                y = lc((lc(kh_ref[...]) * -e_gamma).astype(bf16))  # -(h^T K^T) diag(e^gamma)
                # V'^T = U^T + Y (T diag(beta))^T = (T diag(beta) (V - diag(e^gamma) K h))^T
                plgpu.wgmma(u_ref, y, tb_smem.at[s].transpose((1, 0)))
                decay = lc(lax.broadcast_in_dim(exp_to_last, shape, [1]))
                state_scaled = lc(state * exp_last)
                return lc(u_ref[...]), decay, state_scaled

            vnew_t, decay, state_scaled = pl.run_scoped(
                products, plgpu.ACC(shape, f32), plgpu.ACC(shape, f32)
            )
            decayed = lc((vnew_t * decay).astype(bf16))
            vnew_in = lc(vnew_t.astype(bf16))

            def third(acc_ref):  # h^T <- e^gamma_last h^T + (V'^T diag(e^(gamma_last - gamma))) K
                plgpu.wgmma(acc_ref, decayed, k_smem.at[s])
                vn_smem[hb] = vnew_in  # V'^T for the output warpgroup, while the product runs
                plgpu.commit_smem()
                plgpu.barrier_arrive(h_ready.at[hb])

            state = pl.run_state(third)(plgpu.ACC.init(state_scaled))
            plgpu.barrier_arrive(free0.at[s])
            return lc(state)

        # the mask only in the first and last chunk: the step is the walk's critical path
        if packed == "own_grid":
            state = state0
            for first_n, stop_n, which in walk_parts:
                state = lax.fori_loop(first_n, stop_n, functools.partial(step, which=which), state)
        else:
            state = lax.fori_loop(lo, hi, step, state0)
        state_smem.T[...] = plgpu.layout_cast(state, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, final_ref.at[row, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _output():
        plgpu.set_max_registers(P_OUTPUT_REGISTERS if p_in_walk else 232, action="increase")
        shape = (CHUNK, BLOCK_V)

        def output_step(n, which=None):  # which: with restart, the walk's first (0) or last (1) chunk
            s, hb = lax.rem(n - lo, stages), lax.rem(n - lo, 2)
            plgpu.barrier_wait(loaded1.at[s])
            if p_in_walk:
                plgpu.barrier_wait(p_scratch[2].at[s])  # Q (P's is loaded1 above: formed by warpgroup 3)
            plgpu.barrier_wait(h_ready.at[hb])
            # e^gamma over the rows (tokens): the prepare's, or in the walk's first and last chunk its own
            exp_gamma = (
                plgpu.load(eg1_smem.at[s], layout=layout.reduce(1))
                if which is None
                else own_decays(n, which, 1)[0]
            )

            def inter(acc_ref):  # Q h, scaled by rows
                plgpu.wgmma(acc_ref, q_smem.at[s], h_smem.at[hb].transpose((1, 0)))
                row_scale = lc(lax.broadcast_in_dim(exp_gamma * scale, shape, [0]))
                return lc(lc(acc_ref[...]) * row_scale)

            out0 = pl.run_scoped(inter, plgpu.ACC(shape, f32))

            def intra(acc_ref):  # + P V'
                plgpu.wgmma(acc_ref, p_smem.at[s], vn_smem.at[hb].transpose((1, 0)))

            out = lc(pl.run_state(intra)(plgpu.ACC.init(out0)))
            plgpu.barrier_arrive(h_free.at[hb])
            plgpu.barrier_arrive(free1.at[s])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy out of this buffer two chunks ago
            out = lc(out.astype(o_smem.dtype))
            if not packed:
                o_smem[hb] = out
                plgpu.commit_smem()
                tokens = pl.ds((n + chunk_offset) * CHUNK, CHUNK)
                plgpu.copy_smem_to_gmem(o_smem.at[hb], o_ref.at[b, tokens, h, cols])
                return
            # packed: the rows of the walk's own sequence, straight to the packed output (any token offset: O
            # staged untiled), a whole chunk with one copy, a chunk shared with other sequences (or partial)
            # row by row
            row0, first, last = own_rows(n)
            o_smem[hb] = out
            plgpu.commit_smem()
            whole = (first == 0) & (last == CHUNK)

            @pl.when(whole)
            def _():
                plgpu.copy_smem_to_gmem(o_smem.at[hb], o_ref.at[0, pl.ds(row0, CHUNK), h, cols])

            @pl.when(jnp.logical_not(whole))
            def _():
                for r in range(CHUNK):
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[hb, pl.ds(r, 1)],
                        o_ref.at[0, pl.ds(row0 + r, 1), h, cols],
                        predicate=(r >= first) & (r < last),
                    )

        if restart:  # the first and last chunk with the sequence's own factors
            for first_n, stop_n, which in walk_parts:
                pl.loop(first_n, stop_n)(functools.partial(output_step, which=which))
        else:
            pl.loop(lo, hi)(output_step)
        plgpu.wait_smem_to_gmem(0)

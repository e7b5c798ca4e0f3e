"""Hopper prepare of the chunked gated delta rule in Pallas Mosaic GPU: each chunk's UT transform T diag(beta).

The Triton prepare (`pallas_triton._prepare_dense_kernel`) is bound by its instructions on an H100: its
triangular inverse is a chain of small `mma.sync` products whose operands change layout through shared memory
(docs/benchmarks.md: 0.449 ms of the packed 8 x 8192 call, ~0.19 of it the inverse). Here every product is
one Hopper `wgmma` on the whole [64, 64] chunk tile, its left operand in registers, so a product costs a few
instructions whatever its size, and the kernel streams K with TMA while the tensor cores work. Per chunk
(c = 64 tokens) and v-head, for the `group` v-heads of one k-head (one warpgroup each, one K tile):

    A = strict_lower(diag(beta) K K^T * exp(gamma_i - gamma_j))          one [64, 64, key_dim] wgmma
    T = (I + A)^-1                                                       ten [64, 64, 64] wgmmas
    out = T diag(beta)                                                   bf16, TMA to GMEM

The inverse is `pallas_triton._unit_lower_inverse` with bf16 operands (`BlockSizes.inverse_bf16`), product for
product: the 4-row diagonal blocks by (I - a)(I + a^2), then two levels that merge 4 blocks each (16, 64
rows), N = T L, T <- (I - N)(I + N^2) T. Every factor stays of order 1 (its error against the f32 recurrence
was FLA's on an H100, 2026-11-23). Source of the algorithm: arXiv:2412.06464 (gated delta rule), the UT
transform as in flash-linear-attention's `chunk_scaled_dot_kkt` + `solve_tril`.

Measured on an H100 (2026-11-25, docs/benchmarks.md): T bit for bit the Triton whole-tile prepare's, but
slower (packed 8 x 8192: 0.54-0.56 ms against 0.445-0.47 for the Triton prepare): each warpgroup's chunk is a
chain of eleven dependent wgmmas, and at 245 registers a thread one program of two warpgroups fills an SM. So
it is opt-in (`pallas_triton.BlockSizes.mosaic_prepare`), for packed sequences on their own grid.

Hopper (sm_90) only; bf16 K, chunk_size 64, key_dim a multiple of 64. Lowered on the CPU for an abstract H100
in the tests; its numbers are checked on an H100 (`benchmarks/gdn_mosaic_prepare.py`, and the Hopper tests in
tests/pallas_kernels/test_gated_delta_rule_mosaic_prepare.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import pallas_mosaic

CHUNK = 64
MAX_GROUP = 2  # v-heads per k-head this kernel takes (one warpgroup each): the models' 32 / 16


def supported(*, chunk_size: int, key_dim: int, group: int, dtype) -> str | None:
    """None where `prepare` runs these shapes, else the reason it does not."""
    if chunk_size != CHUNK:
        return f"chunk_size={chunk_size} (the Mosaic GPU prepare needs {CHUNK})"
    if key_dim % 64:
        return f"key_dim={key_dim} (the Mosaic GPU prepare needs a multiple of 64)"
    if not 1 <= group <= MAX_GROUP:
        return f"{group} v-heads per k-head (the Mosaic GPU prepare takes 1 to {MAX_GROUP})"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"dtype {jnp.dtype(dtype).name} (the Mosaic GPU prepare takes bf16)"
    return None


def _prepare_kernel(
    k_ref, gamma_ref, beta_ref,  # inputs (GMEM)
    out_ref,  # output (GMEM)
    k_smem, gamma_rows, gamma_cols, beta_rows, beta_cols,  # [streams * stages, ...] input tiles
    operand_smem, out_smem,  # [streams * group, 64, 64] bf16: each warpgroup's wgmma B operand, output staging
    loaded, free,  # [streams * stages] barriers
    *, group, chunks_per_program, stages, num_chunks, streams,
):
    # `streams` independent chains per program, each of `group` warpgroups (one per v-head) on its own K
    # tiles: stream r takes the program's chunks r, r + streams, ... (the chains' wgmma latencies overlap)
    row, kh, block = lax.axis_index("rows"), lax.axis_index("kheads"), lax.axis_index("blocks")
    wg_all = lax.axis_index("wg")
    stream, wg = lax.div(wg_all, group), lax.rem(wg_all, group)  # wg: the v-head kh * group + wg
    h = kh * group + wg
    first = block * chunks_per_program + stream
    count = lax.div(jnp.minimum(chunks_per_program, num_chunks - block * chunks_per_program) - stream + streams - 1,
                    streams)  # this stream's chunks: first + streams * i for i < count
    f32, bf16 = jnp.float32, jnp.bfloat16
    layout = plgpu.Layout.WGMMA
    shape = (CHUNK, CHUNK)

    def lc(x):  # layout annotations: Mosaic GPU's layout inference runs out of search steps without them
        return plgpu.layout_cast(x, layout)

    def slot(i):  # the stream's stage of its i-th chunk
        return stream * stages + lax.rem(i, stages)

    def issue(i):  # warpgroup 0 of the stream: its i-th chunk's K and every v-head's gamma and beta (twice: two
        # layouts)
        s, rows = slot(i), pl.ds((first + streams * i) * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(k_ref.at[row, rows, kh, :], k_smem.at[s], loaded.at[s])
        for w in range(group):
            for src, dst in ((gamma_ref, gamma_rows), (gamma_ref, gamma_cols), (beta_ref, beta_rows),
                             (beta_ref, beta_cols)):
                plgpu.copy_gmem_to_smem(src.at[row, kh * group + w, rows], dst.at[s, w], loaded.at[s])

    @pl.when(wg == 0)
    def _():
        for i in range(stages):
            pl.when(i < count)(functools.partial(issue, jnp.int32(i)))

    i_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
    j_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    zero = lc(jnp.zeros(shape, f32))

    def eye():
        return lc(jnp.where(lc(i_idx == j_idx), lc(jnp.ones(shape, f32)), zero))

    def block_mask(lo, hi):  # inside the hi-row diagonal blocks, outside the lo-row ones (lo, hi powers of 2)
        same_hi = lc(lax.shift_right_logical(i_idx, hi.bit_length() - 1)
                     == lax.shift_right_logical(j_idx, hi.bit_length() - 1))
        if lo == 1:
            return same_hi
        return lc(same_hi & lc(lax.shift_right_logical(i_idx, lo.bit_length() - 1)
                               != lax.shift_right_logical(j_idx, lo.bit_length() - 1)))

    def mm(x, y):  # x @ y, [64, 64] f32: x (registers) and y (through SMEM) rounded to bf16, f32 accumulation
        operand_smem[wg_all] = lc(y.astype(bf16))
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, lc(x.astype(bf16)), operand_smem.at[wg_all])
            return lc(acc_ref[...])

        return pl.run_scoped(product, plgpu.ACC(shape, f32))

    def factor(x):  # (I - x)(I + x^2) = (I + x)^-1 for x^4 = 0 (`pallas_triton._squaring_inverse`, nilpotency 4)
        power = mm(x, x)
        return mm(lc(eye() - x), lc(eye() + power))

    @pl.loop(0, count)
    def _(i):
        s, n = slot(i), first + streams * i
        plgpu.barrier_wait(loaded.at[s])

        def scores(acc_ref):  # A and beta over the columns, from stage s
            plgpu.wgmma(acc_ref, k_smem.at[s], k_smem.at[s].transpose((1, 0)))  # K K^T
            # (one SMEM copy per layout: two loads of one ref in two layouts defeat layout inference)
            beta_i = lc(lax.broadcast_in_dim(plgpu.load(beta_rows.at[s, wg], layout=layout.reduce(1)), shape, [0]))
            beta_j = plgpu.load(beta_cols.at[s, wg], layout=layout.reduce(0))
            strict = lc(i_idx > j_idx)
            # <= 1 on the strict lower triangle, 0 elsewhere (so A is strictly lower with no second mask)
            decay = pallas_mosaic.masked_decay(gamma_rows.at[s, wg], gamma_cols.at[s, wg], strict)
            a = lc(lc(lc(acc_ref[...]) * beta_i) * decay)
            return a, beta_j

        a, beta_j = pl.run_scoped(scores, plgpu.ACC(shape, f32))
        plgpu.barrier_arrive(free.at[s])

        @pl.when((wg == 0) & (i + stages < count))  # refill stage s once every warpgroup is done with it
        def _():
            plgpu.barrier_wait(free.at[s])
            issue(i + stages)

        t = factor(lc(jnp.where(block_mask(1, 4), a, zero)))  # the 4-row diagonal blocks
        for lo, hi in ((4, 16), (16, 64)):  # merge 4 blocks: N = T L, T <- (I + N)^-1 T
            n_mat = mm(t, lc(jnp.where(block_mask(lo, hi), a, zero)))
            t = mm(factor(n_mat), t)
        t_beta = lc(lc(t * lc(lax.broadcast_in_dim(beta_j, shape, [1]))).astype(bf16))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the copy out of this buffer one chunk ago
        out_smem[wg_all] = t_beta
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg_all], out_ref.at[row, pl.ds(n * CHUNK, CHUNK), h, :])

    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("group", "chunks_per_program", "stages", "streams"))
def prepare(k, gamma, beta, *, group, chunks_per_program=8, stages=2, streams=2):
    """Each chunk's T diag(beta) = (I + strict_lower(diag(beta) K K^T * Gamma))^-1 diag(beta) (Hopper).

    Args:
      k: [batch, seq, k_heads, key_dim] bf16, L2-normalised keys; seq a multiple of 8 (TMA's 8-row tiles),
        rows past seq (up to t) read as zeros.
      gamma: [batch, v_heads, t] f32, chunk-local prefix sums of the log decay (t a multiple of 64, >= seq);
        packed sequences on their own chunk grid take those of `pallas_mosaic.break_sequences`, which keep
        each chunk's sequences apart in T.
      beta: [batch, v_heads, t] f32, zero past seq.
      group: v_heads // k_heads (v-head h reads k-head h // group), 1 or 2.
      chunks_per_program: chunks each program walks (its TMA pipeline runs through them).
      stages: K tiles in flight per stream (shared-memory stages).
      streams: independent chains per program, each of `group` warpgroups with its own K tiles (their
        products' latencies overlap); the program has streams * group warpgroups.

    Returns:
      [batch, t, v_heads, 64] bf16, what `pallas_triton._prepare` writes as T diag(beta) (`wy_in_state`)
      with the whole-tile inverse (`inverse_slabs=False`, `inverse_bf16`).

    Raises:
      ValueError: shapes this kernel does not take (`supported`), or that disagree.
    """
    batch, seq, k_heads, key_dim = k.shape
    v_heads, t = gamma.shape[1:]
    reason = supported(chunk_size=CHUNK, key_dim=key_dim, group=group, dtype=k.dtype)
    if reason:
        raise ValueError(f"Mosaic GPU prepare: {reason}")
    if (v_heads != k_heads * group or gamma.shape != (batch, v_heads, t) or beta.shape != gamma.shape
            or t % CHUNK or seq % 8 or not 0 < seq <= t):
        raise ValueError(f"Mosaic GPU prepare: k {k.shape}, gamma {gamma.shape}, beta {beta.shape}, group {group}: "
                         "need gamma and beta [batch, k_heads * group, t], t a multiple of 64 >= seq, seq a "
                         "positive multiple of 8")
    if min(chunks_per_program, stages, streams) < 1 or streams * group > 4:
        raise ValueError(f"chunks_per_program={chunks_per_program}, stages={stages}, streams={streams} must be >= 1 "
                         f"and streams * group ({streams * group} warpgroups) <= 4")
    num_chunks = t // CHUNK
    cpp = min(chunks_per_program, num_chunks)

    def gdn_prepare_mosaic(*refs):  # the kernel's name in profiles
        _prepare_kernel(*refs, group=group, chunks_per_program=cpp, stages=stages, num_chunks=num_chunks,
                        streams=streams)

    tile = gpu_limits.smem_tiles(2, CHUNK)  # (the walk's bf16 tiles)
    slots, wgs = streams * stages, streams * group
    vector = lambda: plgpu.SMEM((slots, group, CHUNK), jnp.float32)
    return plgpu.kernel(
        gdn_prepare_mosaic,
        out_type=jax.ShapeDtypeStruct((batch, t, v_heads, CHUNK), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((slots, CHUNK, key_dim), jnp.bfloat16, transforms=tile),  # K
            vector(), vector(), vector(), vector(),  # gamma (rows, columns), beta (rows, columns)
            plgpu.SMEM((wgs, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # B operands
            plgpu.SMEM((wgs, CHUNK, CHUNK), jnp.bfloat16, transforms=tile),  # output staging
            plgpu.Barrier(num_barriers=slots, num_arrivals=1 + 4 * group),  # loaded: K, gamma, beta
            plgpu.Barrier(num_barriers=slots, num_arrivals=group),  # free: the stream's warpgroups done with it
        ),
        grid=(batch, k_heads, -(-num_chunks // cpp)),
        grid_names=("rows", "kheads", "blocks"),
        num_threads=wgs,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(k, gamma, beta)

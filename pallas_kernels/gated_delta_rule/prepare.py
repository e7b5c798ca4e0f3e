"""Prepare stage of the chunked gated delta rule: the WY factors of every chunk, one Triton kernel.

Per chunk (c tokens) and v-head, as flash-linear-attention's `chunk_gated_delta_rule_fwd` (spec §9):
    gamma = chunk-local cumsum of g;   A = strict_lower(diag(beta) K K^T * Gamma);   T = (I + A)^-1
    W = T diag(beta e^gamma) K,   U = T diag(beta) V,   P = scale lower_incl(Q K^T * Gamma)
With `wy_in_state` it writes T diag(beta) [c, c] instead of W and U (the state pass forms U - W h from it).
The inverse is blocked for stability: 4-row diagonal blocks inverted exactly by repeated squaring, merged 4 at
a time (`unit_lower_inverse`), inside 16-row slabs solved by forward block substitution (`slab_inverse`).
Products take the input dtype and accumulate in f32 (f32 inputs: IEEE f32); bf16 inputs give the inverse's
products bf16 operands.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_limits, tuning
from pallas_kernels.gated_delta_rule.common import TRANS_B, dot, load_rows, token_rows
from pallas_kernels.triton_math import LOG2_E, exp2_approx

# Rows per diagonal block that `unit_lower_inverse` inverts by repeated squaring; larger blocks merge 4 at a
# time. Squaring a whole 16-row block is exact in real numbers but not in floating point: with correlated keys
# (A entries near 1) its powers reach C(15, 7) ~ 6 400 and cancel; 4-row squaring and 4-block merges keep
# every factor of order 1 with the same 10 products for a 64-row chunk.
SQUARING_BLOCK = 4


def _identity(s):
    i = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
    return jnp.where(i == jax.lax.broadcasted_iota(jnp.int32, (s, s), 1), 1.0, 0.0)


def _squaring_inverse(a, exact, nilpotency, cast):
    """(I + a)^-1 for a strictly lower-triangular f32 tile with a^nilpotency == 0 (a power of two), by the
    exact product (I - a)(I + a^2)(I + a^4)...: log2(nilpotency) factors."""
    eye = _identity(a.shape[0])
    inv = eye - a
    power = a
    for _ in range(max(nilpotency.bit_length() - 2, 0)):  # factors (I + a^2), (I + a^4), ...
        power = dot(cast(power), cast(power), exact=exact)
        inv = dot(cast(inv), cast(eye + power), exact=exact)
    return inv


def unit_lower_inverse(a, exact, operand_dtype=None):
    """(I + a)^-1 for a strictly lower-triangular [s, s] f32 tile (s a power of two), block by block: the
    `SQUARING_BLOCK`-row diagonal blocks D by repeated squaring, then levels of 4x larger blocks:
        (I + A_level) = (I + D)(I + N),  N = (I + D)^-1 L   (L: A inside the level's blocks, outside D's),
        N is strictly block-lower over <= 4 blocks, so (I + N)^-1 = (I - N)(I + N^2);
        T = (I + N)^-1 (I + D)^-1.
    `operand_dtype` (e.g. bf16): the products' operands are rounded to it (f32 accumulation, f32 result)."""
    s = a.shape[0]
    cast = (lambda x: x) if operand_dtype is None else (lambda x: x.astype(operand_dtype))
    i = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
    lo = min(SQUARING_BLOCK, s)
    t = _squaring_inverse(jnp.where(i // lo == j // lo, a, 0.0), exact, lo, cast)
    while lo < s:
        hi = min(4 * lo, s)
        inside = jnp.logical_and(i // hi == j // hi, i // lo != j // lo)
        n_mat = dot(cast(t), cast(jnp.where(inside, a, 0.0)), exact=exact)
        t = dot(cast(_squaring_inverse(n_mat, exact, hi // lo, cast)), cast(t), exact=exact)
        lo = hi
    return t


def slab_inverse(a, exact, operand_dtype=None, slab=16):
    """(I + a)^-1 for a strictly lower-triangular [s, s] f32 tile (s a power of two >= slab) as s // slab row
    slabs [slab, s] f32, by forward block substitution (as FLA's `solve_tril` merges its 16x16 blocks):
        T_d = D_d (E_d - sum_{m < d} A_dm T_m),   D_d = (I + A_dd)^-1 by `unit_lower_inverse`,
    A_dm the [slab, slab] blocks of a, E_d rows d * slab .. of the identity: about a tenth of the
    multiply-adds of `unit_lower_inverse` on the whole tile. The blocks come from splitting the register tile
    (`jnp.split`, which Pallas Triton lowers for power-of-two parts). `operand_dtype`: as in
    `unit_lower_inverse`."""
    s = a.shape[0]
    n = s // slab
    cast = (lambda x: x) if operand_dtype is None else (lambda x: x.astype(operand_dtype))
    blocks = [jnp.split(r, n, axis=1) for r in jnp.split(a, n, axis=0)] if n > 1 else [[a]]
    i = jax.lax.broadcasted_iota(jnp.int32, (slab, s), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (slab, s), 1)
    slabs = []
    for d in range(n):
        x = jnp.where(j == i + d * slab, 1.0, 0.0)  # E_d
        for m in range(d):
            x = x - dot(cast(blocks[d][m]), cast(slabs[m]), exact=exact)
        slabs.append(dot(cast(unit_lower_inverse(blocks[d][d], exact, operand_dtype)), cast(x), exact=exact))
    return slabs


def _prepare_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    src_ref,
    len_ref,
    w_ref,
    u_ref,
    gamma_ref,
    p_ref,
    q_out_ref,
    k_out_ref,
    *,
    chunk_size,
    group,
    compute_dtype,
    scale,
    with_p,
    in_place,
    wy_in_state,
    chunks_per_program,
    prefetch_rows,
    valid_rows,
    chunk_offset,
    decay_factors,
    gamma_in_p,
    fast_exp,
):
    # q_ref/k_ref [b, t, k_heads, key_dim]; v_ref [b, t, v_heads, value_dim]; g_ref/beta_ref [b, v_heads, t]
    # f32. Outputs as `prepare` returns them. Program (batch*v_heads, chunk block) walks chunks_per_program
    # chunks in a loop (the last block clamped to the last chunk, which it then redoes: identical writes).
    # in_place: q, k, v are the packed arrays, read from token src_ref[n] (len_ref[n] rows; the rest zeros),
    # and the chunk-aligned q, k tiles are copied to q_out_ref/k_out_ref (by the first v-head of each group).
    # valid_rows: q, k hold that many tokens; the rows past them read as zeros. chunk_offset: the outputs are
    # one piece of the sequence, from that chunk of the inputs on. decay_factors: gamma_ref takes e^gamma and
    # u_ref e^(gamma_last - gamma); gamma_in_p: p_ref takes gamma (the walk forms P). fast_exp: the decays by
    # `exp2_approx` of log2(e)-scaled gamma (compiled bf16 only).
    exact = compute_dtype == jnp.float32
    inv_dtype = None if exact else jnp.bfloat16
    c = chunk_size
    block, bh = pl.program_id(1), pl.program_id(0)  # the v-heads of one chunk block launch side by side
    v_heads = v_ref.shape[2]
    b, h = bh // v_heads, bh % v_heads

    def one_chunk(n, src_len=None):
        rows = pl.ds(n * c, c)
        tokens, mask = token_rows(n + chunk_offset, c, src_ref, len_ref, in_place, src_len)
        if valid_rows is not None:  # the last chunk runs past the arrays' end
            mask = (n + chunk_offset) * c + jax.lax.broadcasted_iota(jnp.int32, (c,), 0) < valid_rows
        key_dim, value_dim = k_ref.shape[3], v_ref.shape[3]
        k = load_rows(k_ref, (b, tokens, h // group, slice(None)), mask, (c, key_dim))  # [c, key_dim]
        in_rows = pl.ds((n + chunk_offset) * c, c)  # g, beta: the whole sequence
        gamma = jnp.cumsum(g_ref[b, h, in_rows], axis=0)  # [c] f32, chunk-local prefix sum
        beta = beta_ref[b, h, in_rows]
        gamma2 = gamma * LOG2_E if fast_exp else None
        if decay_factors:
            last = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1, gamma, 0.0))
            if fast_exp:
                gamma_ref[b, h, rows] = exp2_approx(gamma2)
                u_ref[b, h, rows] = exp2_approx((last - gamma) * LOG2_E)
            else:
                gamma_ref[b, h, rows] = jnp.exp(gamma)
                u_ref[b, h, rows] = jnp.exp(last - gamma)
            if gamma_in_p:
                p_ref[b, h, rows] = gamma
        else:
            gamma_ref[b, h, rows] = gamma
        i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        incl, strict = i >= j, i > j
        if fast_exp and not with_p:  # beta and the mask in A's exponent: beta_i e^(gamma_i - gamma_j) =
            # 2^(gamma2_i + log2(beta_i) - gamma2_j), -inf (-> 0) off the strict lower triangle and for beta 0
            rows_exp = gamma2 + jnp.log2(beta)
            exponent = jnp.where(strict, rows_exp[:, None] - gamma2[None, :], -jnp.inf)
            a = dot(k, k, TRANS_B, exact) * exp2_approx(exponent)
        else:  # exp(gamma_i - gamma_j) on and below the diagonal (<= 1), 1 above
            if fast_exp:  # one ex2.approx per element, log2(e) applied to the [c] vector
                gamma_diff = exp2_approx(jnp.where(incl, gamma2[:, None] - gamma2[None, :], 0.0))
            else:
                gamma_diff = jnp.exp(jnp.where(incl, gamma[:, None] - gamma[None, :], 0.0))
            a = jnp.where(strict, (beta[:, None] * dot(k, k, TRANS_B, exact)) * gamma_diff, 0.0)
        if with_p:
            q = load_rows(q_ref, (b, tokens, h // group, slice(None)), mask, (c, key_dim))
            p = jnp.where(incl, dot(q, k, TRANS_B, exact) * gamma_diff, 0.0) * scale
            p_ref[b, rows, h, :] = p.astype(p_ref.dtype)
            if in_place:

                @pl.when(h % group == 0)
                def _():
                    q_out_ref[b, rows, h // group, :] = q.astype(q_out_ref.dtype)
                    k_out_ref[b, rows, h // group, :] = k.astype(k_out_ref.dtype)

        slab = min(16, c)
        t_slabs = slab_inverse(
            a, exact, inv_dtype, slab
        )  # T as row slabs, each written (or multiplied) alone
        slab_rows = [pl.ds(n * c + d * slab, slab) for d in range(len(t_slabs))]
        if wy_in_state:
            for t_d, rows_d in zip(t_slabs, slab_rows, strict=True):
                w_ref[b, rows_d, h, :] = (t_d * beta[None, :]).astype(w_ref.dtype)
            if in_place:
                v = load_rows(v_ref, (b, tokens, h, slice(None)), mask, (c, value_dim))
                u_ref[b, rows, h, :] = v.astype(u_ref.dtype)
            return
        rhs_w = (k.astype(jnp.float32) * (beta * jnp.exp(gamma))[:, None]).astype(compute_dtype)
        v = load_rows(v_ref, (b, tokens, h, slice(None)), mask, (c, value_dim))
        rhs_u = (v.astype(jnp.float32) * beta[:, None]).astype(compute_dtype)
        for t_d, rows_d in zip(t_slabs, slab_rows, strict=True):
            w_ref[b, rows_d, h, :] = dot(t_d.astype(compute_dtype), rhs_w, exact=exact).astype(w_ref.dtype)
            u_ref[b, rows_d, h, :] = dot(t_d.astype(compute_dtype), rhs_u, exact=exact).astype(u_ref.dtype)

    num_chunks, first = gamma_ref.shape[2] // c, block * chunks_per_program
    if chunks_per_program == 1:
        one_chunk(first)
    else:  # a loop: Triton's software pipeline loads the next chunk's tiles during this one's products
        if prefetch_rows:  # the program's chunk offsets and lengths, loaded once before the loop
            span = src_ref.shape[0] - num_chunks  # a power of 2 >= chunks_per_program (padded by `prepare`)
            lane = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
            srcs, lens = src_ref[pl.ds(first, span)], len_ref[pl.ds(first, span)]

        def body(i, carry):
            src_len = None
            if prefetch_rows:
                src_len = tuple(jnp.sum(jnp.where(lane == i, x, 0)) for x in (srcs, lens))
            one_chunk(jnp.minimum(first + i, num_chunks - 1), src_len)
            return carry

        jax.lax.fori_loop(0, chunks_per_program, body, 0)


# Prepare programs an SM holds at once (2 warps: their registers and shared memory) where no tuning table
# ("gated_delta_rule.prepare", "programs_per_sm") says: what `prepare_chunks_per_program` sizes waves by.
PREPARE_PROGRAMS_PER_SM = 6


def prepare_chunks_per_program(
    chunks: int | None, num_chunks: int, rows: int, *, fit: bool = True, sm_count: int | None = None
) -> int:
    """Chunks each prepare program walks (`Config.prepare_chunks`), at most num_chunks // 16 (>= 1).

    chunks None (auto): with `fit`, the c in 8..24 that minimises ceil(programs / slots) * c, the prepare's
    time in chunk steps when its programs run in whole waves (programs = rows * ceil(num_chunks / c), slots =
    SMs * `PREPARE_PROGRAMS_PER_SM`); the smallest c of equals. Without `fit`, 8: `prepare` fits only the
    prepare whose occupancy `PREPARE_PROGRAMS_PER_SM` describes (T diag(beta) alone, compiled, the whole
    input).

    Raises:
      ValueError: chunks < 1.
    """
    cap = max(1, num_chunks // 16)
    if chunks is not None:
        if chunks < 1:
            raise ValueError(f"Config.prepare_chunks={chunks} must be >= 1")
        return min(chunks, cap)
    if not fit or cap <= 8:
        return min(8, cap)
    per_sm = tuning.lookup("gated_delta_rule.prepare").get("programs_per_sm", PREPARE_PROGRAMS_PER_SM)
    slots = (sm_count or gpu_limits.sm_count()) * per_sm
    return min(range(8, min(24, cap) + 1), key=lambda c: (-(-rows * -(-num_chunks // c) // slots) * c, c))


def _check_rows(k, g, chunk_size, padded, token_rows, valid_rows, chunk_offset, piece):
    """Raises ValueError where `prepare`'s piece (chunk_offset, num_chunks) or valid_rows misfit q, k, g."""
    num_chunks = padded // chunk_size
    if piece and (
        token_rows is not None
        or valid_rows is not None
        or chunk_offset < 0
        or padded < chunk_size
        or (chunk_offset * chunk_size + padded) > min(k.shape[1], g.shape[2])
    ):
        raise ValueError(
            f"prepare: chunk_offset={chunk_offset}, num_chunks={num_chunks} need no token_rows or "
            "valid_rows, and q, k, g holding those chunks"
        )
    if valid_rows is not None and (
        token_rows is not None or not valid_rows < padded == k.shape[1] + (-k.shape[1]) % chunk_size
    ):
        raise ValueError(
            f"prepare: valid_rows={valid_rows} needs no token_rows, and q, k of that many rows, "
            f"fewer than the chunk-aligned {padded}"
        )


def prepare(
    q, k, v, g, bt, *, scale, chunk_size, group, compute_dtype, config, interpret, token_rows=None,
    valid_rows=None, chunk_offset=0, num_chunks=None, decay_factors=False, p_in_walk=False,
):  # fmt: skip
    """The WY factors of every chunk; t = g's chunk-aligned length (or num_chunks * chunk_size).

    Args:
      q, k: [b, seq, k_heads, key_dim], v: [b, seq, v_heads, value_dim] in the compute dtype; chunk-aligned
        unless `token_rows`. g, bt: [b, v_heads, t'] f32 log decays and betas, chunk-aligned.
      scale: the query scale (P carries it). chunk_size, group (v_heads // k_heads), compute_dtype: static.
      config: `config.Config` with `wy_in_state` resolved. interpret: the Pallas interpreter.
      token_rows: None, or (chunk_src, chunk_len) [num_chunks] int32: where each chunk's rows lie in the
        packed q, k, v (read in place; chunk-aligned copies of q and k are written for the state pass).
      valid_rows: q, k hold that many tokens, fewer than t; the rest read as zeros (no token_rows).
      chunk_offset, num_chunks: static; the outputs cover num_chunks chunks from chunk chunk_offset on.
      decay_factors (wy_in_state, no token_rows): the third output is e^gamma and the second
        e^(gamma_last - gamma) [b, v_heads, t] f32, the Mosaic GPU walk's decay factors.
      p_in_walk: the Mosaic GPU walk forms P: no P here (with decay_factors, gamma in its place).

    Returns:
      Six arrays (dummies [1] where unused): W [b, t, v_heads, key_dim] (wy_in_state: T diag(beta)
      [b, t, v_heads, chunk_size]); U [b, t, v_heads, value_dim] (wy_in_state: the chunk-aligned v with
      token_rows); gamma [b, v_heads, t] f32; P [b, t, v_heads, chunk_size]; the chunk-aligned q and k.

    Raises:
      ValueError: decay_factors, chunk_offset, num_chunks or valid_rows with inputs that do not take them.
    """
    batch, _, k_heads, key_dim = k.shape
    piece = chunk_offset != 0 or num_chunks is not None
    padded = g.shape[2] if num_chunks is None else num_chunks * chunk_size
    qk_shape = (batch, padded, k_heads, key_dim) if token_rows is not None else (1,)
    v_heads, value_dim = v.shape[2:]
    wy_in_state = config.wy_in_state
    num_chunks = padded // chunk_size
    with_p = not p_in_walk
    # fitted to the SMs where measured: T diag(beta) alone (no P, W, U), the whole input at once, compiled
    fit = wy_in_state and not with_p and not piece and not interpret
    chunks_per_program = prepare_chunks_per_program(
        config.prepare_chunks, num_chunks, batch * v_heads, fit=fit
    )
    prefetch_rows = token_rows is not None and chunks_per_program > 1
    if prefetch_rows:  # each program reads a power-of-2 span of offsets and lengths from its first chunk
        span = 1 << (chunks_per_program - 1).bit_length()
        token_rows = tuple(jnp.concatenate([x, jnp.repeat(x[-1:], span)]) for x in token_rows)
    w_shape = (batch, padded, v_heads, chunk_size if wy_in_state else key_dim)
    u_shape = (1,) if wy_in_state and token_rows is None else (batch, padded, v_heads, value_dim)
    u_dtype = compute_dtype
    if decay_factors:
        if not (wy_in_state and token_rows is None):
            raise ValueError("prepare: decay_factors needs wy_in_state and no token_rows")
        u_shape, u_dtype = (batch, v_heads, padded), jnp.float32
    p_shape = (batch, padded, v_heads, chunk_size) if with_p else (1,)
    p_dtype = compute_dtype
    if p_in_walk and decay_factors:  # the walk's P mask needs gamma itself (e^gamma underflows)
        p_shape, p_dtype = (batch, v_heads, padded), jnp.float32
    _check_rows(k, g, chunk_size, padded, token_rows, valid_rows, chunk_offset, piece)
    return pl.pallas_call(
        functools.partial(
            _prepare_kernel,
            chunk_size=chunk_size,
            group=group,
            compute_dtype=compute_dtype,
            scale=scale,
            with_p=with_p,
            in_place=token_rows is not None,
            wy_in_state=wy_in_state,
            chunks_per_program=chunks_per_program,
            prefetch_rows=prefetch_rows,
            valid_rows=valid_rows,
            chunk_offset=chunk_offset,
            decay_factors=decay_factors,
            gamma_in_p=p_in_walk and decay_factors,
            fast_exp=not interpret and compute_dtype != jnp.float32,
        ),
        out_shape=(
            jax.ShapeDtypeStruct(w_shape, compute_dtype),
            jax.ShapeDtypeStruct(u_shape, u_dtype),
            jax.ShapeDtypeStruct((batch, v_heads, padded), jnp.float32),
            jax.ShapeDtypeStruct(p_shape, p_dtype),
            jax.ShapeDtypeStruct(qk_shape, compute_dtype),
            jax.ShapeDtypeStruct(qk_shape, compute_dtype),
        ),
        grid=(batch * v_heads, pl.cdiv(num_chunks, chunks_per_program)),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.prepare_warps or (1 if wy_in_state and not with_p else 2),
            num_stages=config.prepare_pipeline_stages or (2 if with_p else None),
        ),
        interpret=interpret,
        name="gdn_prepare",
    )(q, k, v, g, bt, *(token_rows or (jnp.zeros((1,), jnp.int32),) * 2))

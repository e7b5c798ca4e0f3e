"""State pass of the chunked gated delta rule in Pallas Triton (any GPU the Triton lowering takes).

One program per (batch row, v-head, block of value columns) walks the chunks in order, the state
h [key_dim, block_v] in f32 registers, and writes each chunk's output (spec §9):
    V' = U - W h                      (with `wy_in_state`: T diag(beta) (V - diag(e^gamma) K h))
    O  = diag(e^gamma) scale Q h + P V'
    h <- e^{gamma_C} h + K^T diag(e^{gamma_C - gamma}) V'
The chunk's decays scale the [chunk, block_v] products rather than the [chunk, key_dim] tiles, so Q and K go
to the tensor cores as loaded. Packed sequences: h restarts from the sequence's initial state at its first
chunk and is stored after its last; with token rows the output is written where the tokens lie.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule.common import TRANS_A, dot, store_rows, token_rows


def _state_kernel(
    q_ref,
    k_ref,
    w_ref,
    u_ref,
    gamma_ref,
    p_ref,
    init_ref,
    chunk_seq_ref,
    chunk_first_ref,
    chunk_last_ref,
    src_ref,
    len_ref,
    states_ref,
    v_new_ref,
    o_ref,
    final_ref,
    *,
    chunk_size,
    group,
    block_v,
    packed,
    scale,
    compute_dtype,
    in_place,
    wy_in_state,
):
    # o_ref [b, t, v_heads, value_dim]; init/final [num_states, v_heads, key_dim, value_dim] f32; chunk_*
    # [num_chunks] int32 (packed: sequence of each chunk, opens it, closes it). in_place: o_ref is the packed
    # output [1, seq, ...], chunk n's rows written from token src_ref[n] (len_ref[n] of them); q and k stay
    # chunk-aligned (the prepare's copies: masked loads at data-dependent rows would not be pipelined).
    # wy_in_state: w_ref is T diag(beta) [b, t, v_heads, c] and u_ref the chunk-aligned V.
    # states_ref, v_new_ref: [1] placeholders (the call's outputs stay those of the unfused form).
    del states_ref, v_new_ref
    c = chunk_size
    exact = compute_dtype == jnp.float32
    bh, vb = pl.program_id(0), pl.program_id(1)
    v_heads = u_ref.shape[2]
    b, h = bh // v_heads, bh % v_heads
    cols = pl.ds(vb * block_v, block_v)

    def step(n, state):  # state [key_dim, block_v] f32
        rows = pl.ds(n * c, c)
        t = {  # the chunk's tiles, loaded at each use
            "u": lambda: u_ref[b, rows, h, cols],
            "w": lambda: w_ref[b, rows, h, :],
            "gamma": lambda: gamma_ref[b, h, rows],
            "gamma_last": lambda: gamma_ref[b, h, n * c + c - 1],
            "k": lambda: k_ref[b, rows, h // group, :],
            "q": lambda: q_ref[b, rows, h // group, :],
            "p": lambda: p_ref[b, rows, h, :],
        }
        if packed:
            sid = chunk_seq_ref[n]
            state = jax.lax.cond(chunk_first_ref[n] != 0, lambda: init_ref[sid, h, :, cols], lambda: state)
        state_in = state.astype(compute_dtype)
        gamma, gamma_last = t["gamma"](), t["gamma_last"]()
        if wy_in_state:  # V' = T diag(beta) (V - diag(e^gamma) K h), i.e. U - W h without W and U
            x = t["u"]().astype(jnp.float32) - jnp.exp(gamma)[:, None] * dot(t["k"](), state_in, exact=exact)
            x_in = x.astype(compute_dtype)
            v_new = dot(t["w"](), x_in, exact=exact)
        else:
            v_new = t["u"]().astype(jnp.float32) - dot(t["w"](), state_in, exact=exact)
        v_new_in = v_new.astype(compute_dtype)  # [c, block_v]
        inter = dot(t["q"](), state_in, exact=exact) * (jnp.exp(gamma) * scale)[:, None]
        out = inter + dot(t["p"](), v_new_in, exact=exact)
        tokens, mask = token_rows(n, c, src_ref, len_ref, in_place)
        store_rows(o_ref, (b, tokens, h, cols), out.astype(o_ref.dtype), mask)
        v_decayed = (v_new * jnp.exp(gamma_last - gamma)[:, None]).astype(compute_dtype)
        update = dot(t["k"](), v_decayed, TRANS_A, exact)
        state = jnp.exp(gamma_last) * state + update
        if packed:

            @pl.when(chunk_last_ref[n] != 0)
            def _():
                final_ref[sid, h, :, cols] = state

        return state

    state = init_ref[b, h, :, cols] if not packed else jnp.zeros((init_ref.shape[2], block_v), jnp.float32)
    state = jax.lax.fori_loop(0, gamma_ref.shape[2] // c, step, state)
    if not packed:
        final_ref[b, h, :, cols] = state


def state_pass(
    q,
    k,
    w,
    u,
    gamma,
    p,
    initial_state,
    chunk_flags,
    *,
    packed,
    scale,
    out_dtype,
    chunk_size,
    group,
    compute_dtype,
    config,
    interpret,
    token_rows=None,
    out_seq=None,
):
    """The sequential walk and the output.

    Args:
      q, k: [b, t, k_heads, key_dim] chunk-aligned, compute dtype. w, u: `prepare.prepare`'s first two
        outputs (with `config.wy_in_state`: T diag(beta) and the chunk-aligned v). gamma: [b, v_heads, t] f32.
        p: [b, t, v_heads, chunk_size]. initial_state: [num_states, v_heads, key_dim, value_dim] f32.
      chunk_flags: packed: (sequence, opens, closes) [num_chunks] int32 of each chunk; else dummies.
      config: `config.Config` (state_block_v, state_warps, state_stages, wy_in_state).
      token_rows: (chunk_src, chunk_len) as for `prepare.prepare`: the output is then written packed
        [1, out_seq, ...] where the tokens lie.

    Returns:
      (output [b, t or out_seq, v_heads, value_dim] in out_dtype, final state f32 like initial_state).
    """
    batch, _, v_heads, value_dim = u.shape
    padded = gamma.shape[2]
    block_v = min(config.state_block_v, value_dim)
    dummy = jax.ShapeDtypeStruct((1,), compute_dtype)
    out_shape = (
        dummy,
        dummy,
        jax.ShapeDtypeStruct((batch, out_seq or padded, v_heads, value_dim), out_dtype),
        jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
    )
    rows = initial_state.shape[0] if not packed else batch
    _, _, out, final_state = pl.pallas_call(
        functools.partial(
            _state_kernel,
            chunk_size=chunk_size,
            group=group,
            block_v=block_v,
            packed=packed,
            scale=scale,
            compute_dtype=compute_dtype,
            in_place=token_rows is not None,
            wy_in_state=config.wy_in_state,
        ),
        out_shape=out_shape,
        grid=(rows * v_heads, value_dim // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=config.state_warps, num_stages=config.state_stages),
        interpret=interpret,
        name="gdn_state",
        # Packed: sequences that own no chunk keep their initial state, so final starts as a copy of it.
        input_output_aliases={6: 3} if packed else {},
    )(q, k, w, u, gamma, p, initial_state, *chunk_flags, *(token_rows or (chunk_flags[0],) * 2))
    return out, final_state

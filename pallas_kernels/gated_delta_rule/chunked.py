"""Pure-JAX chunked gated delta rule (WY / UT-transform form, spec §9): runs anywhere; default off-GPU.

Einsum letters: b batch, n num_chunks, c/i/j position in a chunk, h k_heads, g group (v_heads // k_heads),
k key_dim, v value_dim.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import common

_HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret"))
def gated_delta_rule_chunked(
    query,
    key,
    value,
    log_decay,
    beta,
    *,
    initial_state=None,
    scale=None,
    chunk_size=64,
    cu_seqlens=None,
    interpret=None,
):
    """Chunked gated delta rule: chunk-parallel WY form plus a lax.scan over chunks carrying the state.

    Per chunk of C tokens (gamma = log-decay prefix sum restarting at the chunk start):
        A = strict_lower(diag(beta) K K^T * exp(gamma_i - gamma_j));  T = (I + A)^-1 (triangular solve)
        W = T diag(beta exp(gamma)) K;  U = T diag(beta) V
        V' = U - W S;  O = (Q exp(gamma)) S + lower_incl(Q K^T * exp(gamma_i - gamma_j)) V'
        S <- exp(gamma_C) S + (K exp(gamma_C - gamma))^T V'
    Source: arXiv:2412.06464 §3; spec §9 and Appendix A (`gdn_chunked`).

    Args:
      query, key: [batch, seq, k_heads, key_dim], already L2-normalised; bf16 or f32.
      value: [batch, seq, v_heads, value_dim]; value head h reads q/k head h // (v_heads // k_heads).
      log_decay: [batch, seq, v_heads], g <= 0, any float dtype (used in f32).
      beta: [batch, seq, v_heads], in [0, 1], any float dtype (used in f32).
      initial_state: [batch or num_seqs, v_heads, key_dim, value_dim] f32, or None for zeros.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      chunk_size: tokens per chunk (any positive int here).
      cu_seqlens: optional int32 [num_seqs + 1] packed-sequence offsets (batch == 1).
      interpret: unused here; kept so all implementations share a signature.

    Returns:
      output: [batch, seq, v_heads, value_dim] in value.dtype.
      final_state: [batch or num_seqs, v_heads, key_dim, value_dim] float32.

    Raises:
      ValueError: shapes that disagree.
    """
    del interpret
    dims = common.check_shapes(query, key, value, log_decay, beta, initial_state, cu_seqlens)
    batch, seq, k_heads, key_dim, v_heads, value_dim, num_states = dims
    group = v_heads // k_heads
    c = chunk_size
    scale = key_dim**-0.5 if scale is None else scale
    layout = None if cu_seqlens is None else common.packed_layout(cu_seqlens, seq, c)

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    q, k, v, g, bt = common.pad_to_chunks(
        f32(query) * scale, f32(key), f32(value), f32(log_decay), f32(beta), c, layout
    )
    n = k.shape[1] // c
    q = q.reshape(batch, n, c, k_heads, key_dim).transpose(0, 1, 3, 2, 4)  # [b, n, h, c, k]
    k = k.reshape(batch, n, c, k_heads, key_dim).transpose(0, 1, 3, 2, 4)
    v = v.reshape(batch, n, c, k_heads, group, value_dim).transpose(0, 1, 3, 4, 2, 5)  # [b, n, h, g, c, v]
    g = g.reshape(batch, n, c, k_heads, group).transpose(0, 1, 3, 4, 2)  # [b, n, h, g, c]
    bt = bt.reshape(batch, n, c, k_heads, group).transpose(0, 1, 3, 4, 2)

    w, u, qk, q_decayed, k_decayed, chunk_decay = _chunk_factors(q, k, v, g, bt)

    state_shape = (num_states, k_heads, group, key_dim, value_dim)
    init = (
        jnp.zeros(state_shape, jnp.float32)
        if initial_state is None
        else f32(initial_state).reshape(state_shape)
    )
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (w, u, k_decayed, chunk_decay))  # chunk-major
    final_state, chunk_states, v_new = _walk_chunks(init, xs, layout)
    chunk_states = jnp.moveaxis(chunk_states, 0, 1)  # [b, n, h, g, k, v]
    v_new = jnp.moveaxis(v_new, 0, 1)  # [b, n, h, g, c, v]
    out = _einsum("bnhgck,bnhgkv->bnhgcv", q_decayed, chunk_states) + _einsum(
        "bnhgij,bnhgjv->bnhgiv", qk, v_new
    )
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(batch, n * c, v_heads, value_dim)
    out = common.unpad_output(out, seq, layout)
    return out.astype(value.dtype), final_state.reshape(num_states, v_heads, key_dim, value_dim)


def _chunk_factors(q, k, v, g, bt):
    """Intra-chunk WY factors, all chunks in parallel.

    Args: q, k [b, n, h, c, k]; v [b, n, h, g, c, v]; g, bt [b, n, h, g, c] (f32; q already scaled).
    Returns: w [b, n, h, g, c, k], u [b, n, h, g, c, v], the masked decayed Q K^T [b, n, h, g, i, j], Q and K
    decayed to the chunk start and end [b, n, h, g, c, k], and the whole-chunk decay [b, n, h, g].
    """
    c, key_dim = k.shape[-2], k.shape[-1]
    gamma = jnp.cumsum(g, axis=-1)  # [b, n, h, g, c]
    lower = jnp.tril(jnp.ones((c, c), bool))
    diff = gamma[..., :, None] - gamma[..., None, :]  # [b, n, h, g, i, j]
    decay_ij = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # masked before exp
    kk = _einsum("bnhik,bnhjk->bnhij", k, k)[:, :, :, None]  # [b, n, h, 1, i, j]
    a = jnp.tril(bt[..., :, None] * kk * decay_ij, -1)
    rhs = jnp.concatenate(
        [
            (bt * jnp.exp(gamma))[..., None] * k[:, :, :, None],  # [b, n, h, g, c, k]
            bt[..., None] * v,
        ],
        axis=-1,
    )  # [b, n, h, g, c, v]
    eye = jnp.eye(c, dtype=jnp.float32)
    wu = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    w, u = wu[..., :key_dim], wu[..., key_dim:]
    qk = _einsum("bnhik,bnhjk->bnhij", q, k)[:, :, :, None] * decay_ij  # [b, n, h, g, i, j]
    q_decayed = q[:, :, :, None] * jnp.exp(gamma)[..., None]  # [b, n, h, g, c, k]
    k_decayed = k[:, :, :, None] * jnp.exp(gamma[..., -1:] - gamma)[..., None]  # [b, n, h, g, c, k]
    return w, u, qk, q_decayed, k_decayed, jnp.exp(gamma[..., -1])


def _walk_chunks(init, xs, layout):
    """The sequential part: a lax.scan over chunks carrying the state [b, h, g, k, v] from `init`.

    xs = (w, u, k_decayed, chunk_decay), chunk-major. With a packed `layout` the state restarts from the
    sequence's initial state at its first chunk and is stored as its final state after its last.
    Returns the final states, each chunk's start state [n, b, h, g, k, v] and V' [n, b, h, g, c, v].
    """

    def advance(state, w_n, u_n, kd_n, decay_n):  # state [b, h, g, k, v]
        v_new = u_n - _einsum("bhgck,bhgkv->bhgcv", w_n, state)
        state_out = decay_n[..., None, None] * state + _einsum("bhgck,bhgcv->bhgkv", kd_n, v_new)
        return state_out, v_new

    if layout is None:

        def step(state, x):
            state_out, v_new = advance(state, *x)
            return state_out, (state, v_new)

        final_state, (chunk_states, v_new) = jax.lax.scan(step, init, xs)
        return final_state, chunk_states, v_new

    def step_packed(carry, x):
        state, finals = carry  # [1, h, g, k, v], [s, ...]
        x, sid, first, last = x
        state = jnp.where(first, init[sid][None], state)
        state_out, v_new = advance(state, *x)
        finals = finals.at[sid].set(jnp.where(last, state_out[0], finals[sid]))
        return (state_out, finals), (state, v_new)

    carry0 = (jnp.zeros((1,) + init.shape[1:], jnp.float32), init)
    xs = (xs, layout.chunk_seq, layout.chunk_first, layout.chunk_last)
    (_, final_state), (chunk_states, v_new) = jax.lax.scan(step_packed, carry0, xs)
    return final_state, chunk_states, v_new

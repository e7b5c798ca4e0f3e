"""Token-by-token gated delta rule in float32: the oracle for every faster implementation.

Einsum letters: b batch, t seq, h k_heads, g group (v_heads // k_heads), k key_dim, v value_dim.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import common

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret"))
def gated_delta_rule_reference(
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
    """Token-by-token gated delta rule: the oracle for every faster implementation.

    Per value head, with state S of shape [key_dim, value_dim] kept in float32:
        S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = scale * S^T q_t
    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464; spec §4.5 and Appendix A.

    Args:
      query, key: [batch, seq, k_heads, key_dim], already L2-normalised along key_dim; bf16 or f32.
      value: [batch, seq, v_heads, value_dim]; value head h reads q/k head h // (v_heads // k_heads).
      log_decay: [batch, seq, v_heads], natural-log decay g <= 0, any float dtype (used in f32).
      beta: [batch, seq, v_heads], write strength in [0, 1], any float dtype (used in f32).
      initial_state: [batch, v_heads, key_dim, value_dim] f32 (leading dim num_seqs with cu_seqlens), or None
        for zeros.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      chunk_size: unused here (the recurrence has no chunks); kept so all implementations share a signature.
      cu_seqlens: optional int32 [num_seqs + 1] offsets of packed sequences (batch must be 1); the state
        restarts from initial_state[i] at cu_seqlens[i].
      interpret: unused here; kept so all implementations share a signature.

    Returns:
      output: [batch, seq, v_heads, value_dim] in value.dtype.
      final_state: [batch or num_seqs, v_heads, key_dim, value_dim] float32.

    Raises:
      ValueError: shapes that disagree (see `common.check_shapes`).
    """
    del chunk_size, interpret
    dims = common.check_shapes(query, key, value, log_decay, beta, initial_state, cu_seqlens)
    batch, seq, k_heads, key_dim, v_heads, value_dim, num_states = dims
    group = v_heads // k_heads
    scale = key_dim**-0.5 if scale is None else scale

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    q = f32(query) * scale  # [b, t, h, k]
    k = f32(key)
    v = f32(value).reshape(batch, seq, k_heads, group, value_dim)  # [b, t, h, g, v]
    g = f32(log_decay).reshape(batch, seq, k_heads, group)
    bt = f32(beta).reshape(batch, seq, k_heads, group)
    state_shape = (num_states, k_heads, group, key_dim, value_dim)
    if initial_state is None:
        init = jnp.zeros(state_shape, jnp.float32)
    else:
        init = f32(initial_state).reshape(state_shape)

    def update(state, q_t, k_t, v_t, g_t, b_t):  # state [b, h, g, k, v]
        state = state * jnp.exp(g_t)[..., None, None]
        delta = b_t[..., None] * (v_t - jnp.einsum("bhk,bhgkv->bhgv", k_t, state, precision=_HIGHEST))
        state = state + jnp.einsum("bhk,bhgv->bhgkv", k_t, delta, precision=_HIGHEST)
        return state, jnp.einsum("bhk,bhgkv->bhgv", q_t, state, precision=_HIGHEST)

    def time_major(x):
        return jnp.moveaxis(x, 1, 0)

    xs = tuple(map(time_major, (q, k, v, g, bt)))
    if cu_seqlens is None:

        def step(state, x):
            return update(state, *x)

        final_state, output = jax.lax.scan(step, init, xs)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        positions = jnp.arange(seq, dtype=jnp.int32)
        seq_id = jnp.searchsorted(cu[1:], positions, side="right").astype(jnp.int32)  # [t]
        seq_id = jnp.minimum(seq_id, num_states - 1)
        is_first = positions == cu[seq_id]
        is_last = positions == cu[seq_id + 1] - 1

        def step(carry, x):
            state, finals = carry  # [1, h, g, k, v], [n, h, g, k, v]
            (q_t, k_t, v_t, g_t, b_t), sid, first, last = x
            state = jnp.where(first, init[sid][None], state)
            state, o_t = update(state, q_t, k_t, v_t, g_t, b_t)
            finals = finals.at[sid].set(jnp.where(last, state[0], finals[sid]))
            return (state, finals), o_t

        carry0 = (jnp.zeros((1,) + state_shape[1:], jnp.float32), init)
        (_, final_state), output = jax.lax.scan(step, carry0, (xs, seq_id, is_first, is_last))
    output = jnp.moveaxis(output, 0, 1).reshape(batch, seq, v_heads, value_dim)
    return output.astype(value.dtype), final_state.reshape(num_states, v_heads, key_dim, value_dim)


@functools.partial(jax.jit, static_argnames=("scale",))
def gated_delta_rule_step_reference(query, key, value, log_decay, beta, state, *, scale=None):
    """One decode step of the gated delta rule (same equation as `gated_delta_rule_reference`, seq = 1).

    Source: arXiv:2412.06464; spec §4.5 and §8.

    Args:
      query, key: [batch, k_heads, key_dim], already L2-normalised; bf16 or f32.
      value: [batch, v_heads, value_dim].
      log_decay, beta: [batch, v_heads], any float dtype (used in f32).
      state: [batch, v_heads, key_dim, value_dim] float32.
      scale: multiplies the query; defaults to key_dim ** -0.5.

    Returns:
      output: [batch, v_heads, value_dim] in value.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: shapes that disagree.
    """
    common.check_step_shapes(query, key, value, log_decay, beta, state)
    batch, k_heads, key_dim = key.shape
    _, v_heads, value_dim = value.shape
    group = v_heads // k_heads
    scale = key_dim**-0.5 if scale is None else scale

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    q = f32(query) * scale  # [b, h, k]
    k = f32(key)
    v = f32(value).reshape(batch, k_heads, group, value_dim)
    g = f32(log_decay).reshape(batch, k_heads, group)
    b = f32(beta).reshape(batch, k_heads, group)
    s = f32(state).reshape(batch, k_heads, group, key_dim, value_dim) * jnp.exp(g)[..., None, None]
    delta = b[..., None] * (v - jnp.einsum("bhk,bhgkv->bhgv", k, s, precision=_HIGHEST))
    s = s + jnp.einsum("bhk,bhgv->bhgkv", k, delta, precision=_HIGHEST)
    out = jnp.einsum("bhk,bhgkv->bhgv", q, s, precision=_HIGHEST)
    return (
        out.reshape(batch, v_heads, value_dim).astype(value.dtype),
        s.reshape(batch, v_heads, key_dim, value_dim),
    )


def decode_inputs_reference(
    mixed, conv_state, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, *, k_heads, key_dim
):
    """The gated-delta-rule inputs of one decode token from a Gated DeltaNet layer's raw projections, as the
    layer computes them (HF `Qwen3_5MoeGatedDeltaNet`; spec §4): the causal depthwise conv with SiLU (in f32,
    rounded to the activation dtype), q and k L2-normalised, g = -exp(A_log) softplus(a + dt_bias), beta =
    sigmoid(b).

    Args:
      mixed: [batch, conv_dim]; conv_state: [batch, conv_kernel - 1, conv_dim]; conv_weight: [conv_kernel,
        conv_dim]; decay_input, beta_input: [batch, v_heads]; log_decay_rate, dt_bias: [v_heads].

    Returns:
      (query, key [batch, k_heads, key_dim], value [batch, v_heads, value_dim] in mixed.dtype, log_decay,
      beta [batch, v_heads] float32).
    """
    f32 = jnp.float32
    batch = mixed.shape[0]
    kernel = conv_weight.shape[0]
    w = conv_weight.astype(f32)
    out = 0.0
    for j in range(kernel - 1):  # taps in the order of the layer's window formula (same rounding)
        out = out + conv_state[:, j].astype(f32) * w[j]
    out = out + mixed.astype(f32) * w[kernel - 1]
    conv = jax.nn.silu(out).astype(mixed.dtype)
    kq = k_heads * key_dim

    def l2(x):  # the layer's l2_normalize: eps inside the root
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    query = l2(conv[:, :kq].reshape(batch, k_heads, key_dim))
    key = l2(conv[:, kq : 2 * kq].reshape(batch, k_heads, key_dim))
    v_heads = decay_input.shape[1]
    value = conv[:, 2 * kq :].reshape(batch, v_heads, (conv.shape[1] - 2 * kq) // v_heads)
    log_decay = -jnp.exp(log_decay_rate.astype(f32)) * jax.nn.softplus(
        decay_input.astype(f32) + dt_bias.astype(f32)
    )
    beta = jax.nn.sigmoid(beta_input.astype(f32))
    return query, key, value, log_decay, beta


def gated_delta_rule_decode_reference(
    mixed,
    conv_state,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    *,
    k_heads,
    key_dim,
    scale=None,
):
    """One decode step of a Gated DeltaNet layer from its raw projections: `decode_inputs_reference`, then
    `gated_delta_rule_step_reference`. Arguments and returns as in
    `decode_step.gated_delta_rule_decode_triton`."""
    inputs = decode_inputs_reference(
        mixed,
        conv_state,
        conv_weight,
        decay_input,
        beta_input,
        log_decay_rate,
        dt_bias,
        k_heads=k_heads,
        key_dim=key_dim,
    )
    return gated_delta_rule_step_reference(*inputs, state, scale=scale)


def gated_delta_rule_decode_tokens_reference(
    mixed,
    conv_state,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    *,
    k_heads,
    key_dim,
    scale=None,
):
    """`gated_delta_rule_decode_reference` token after token (mixed [batch, tokens, conv_dim], decay_input and
    beta_input [batch, tokens, v_heads]), each token's conv window shifted by the one before: (output [batch,
    tokens, v_heads, value_dim], the states [tokens, batch, v_heads, key_dim, value_dim] after each token)."""
    outs, states = [], []
    for t in range(mixed.shape[1]):
        out, state = gated_delta_rule_decode_reference(
            mixed[:, t],
            conv_state,
            conv_weight,
            decay_input[:, t],
            beta_input[:, t],
            log_decay_rate,
            dt_bias,
            state,
            k_heads=k_heads,
            key_dim=key_dim,
            scale=scale,
        )
        conv_state = jnp.concatenate(
            [conv_state[:, 1:], mixed[:, t : t + 1].astype(conv_state.dtype)], axis=1
        )
        outs.append(out)
        states.append(state)
    return jnp.stack(outs, axis=1), jnp.stack(states)


def gated_delta_rule_decode_tree_reference(
    mixed,
    windows,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    parents,
    *,
    k_heads,
    key_dim,
    scale=None,
):
    """`gated_delta_rule_decode_reference` node after node of a token tree (mixed [batch, nodes, conv_dim],
    windows [batch, nodes, conv_kernel - 1, conv_dim] each node's conv window, parents [nodes] int32, -1 at
    the root), each node from its parent's state: (output [batch, nodes, v_heads, value_dim], the states
    [nodes, batch, v_heads, key_dim, value_dim] after each node)."""
    outs, states = [], []
    for i in range(mixed.shape[1]):
        before = state
        if i:
            slots = jnp.stack(states)
            before = jnp.where(parents[i] >= 0, slots[jnp.maximum(parents[i], 0)], state)
        out, after = gated_delta_rule_decode_reference(
            mixed[:, i],
            windows[:, i],
            conv_weight,
            decay_input[:, i],
            beta_input[:, i],
            log_decay_rate,
            dt_bias,
            before,
            k_heads=k_heads,
            key_dim=key_dim,
            scale=scale,
        )
        outs.append(out)
        states.append(after)
    return jnp.stack(outs, axis=1), jnp.stack(states)

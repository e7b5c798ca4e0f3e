"""One decode step of the gated delta rule as one Pallas kernel (Triton lowering): the fused recurrent update.

Per (batch row, v-head, block of value columns), with the state tile S [key_dim, block_v] in f32:

    S <- e^g S;   u = beta (v - S^T k);   S <- S + k u^T;   o = scale S^T q

The state is read once and written once (in place: the kernel's state output aliases its input), where the
pure-JAX step (`reference.gated_delta_rule_step_reference`) reads it three times through XLA's fusions. At
decode, one token per sequence, the step moves the state and little else (Qwen3.5/3.6: 32 v-heads x 128 x 128
f32 = 2 MiB per sequence and layer each way), so it is bound by memory bandwidth; its products are vector
reductions, not tensor-core work. Same scheme as flash-linear-attention's `fused_recurrent_gated_delta_rule`
(one token); source of the recurrence: arXiv:2412.06464, spec §4.5 and §8.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import common


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, group, scale, block_v):
    # q_ref/k_ref [batch, k_heads, key_dim]; v_ref/o_ref [batch, v_heads, value_dim]; g_ref/beta_ref
    # [batch, v_heads] f32; s_ref/s_out_ref [batch, v_heads, key_dim, value_dim] f32 (aliased).
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    k = k_ref[b, h // group, :].astype(jnp.float32)  # [key_dim]
    q = q_ref[b, h // group, :].astype(jnp.float32) * scale
    v = v_ref[b, h, cols].astype(jnp.float32)  # [block_v]
    s = s_ref[b, h, :, cols] * jnp.exp(g_ref[b, h])  # [key_dim, block_v]
    u = beta_ref[b, h] * (v - jnp.sum(k[:, None] * s, axis=0))  # [block_v]
    s = s + k[:, None] * u[None, :]
    o_ref[b, h, cols] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)
    s_out_ref[b, h, :, cols] = s


def _check_tiles(**dims: int) -> None:
    """Raises ValueError naming a dimension that is not a power of two >= 16 (the kernels' tile shapes)."""
    for name, x in dims.items():
        if x & (x - 1) or x < 16:
            raise ValueError(f"{name}={x} must be a power of two >= 16 for the Pallas step kernel")


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "interpret"))
def gated_delta_rule_step_triton(
    query, key, value, log_decay, beta, state, *, scale=None, block_v=32, interpret=None
):
    """One decode step of the gated delta rule, fused in one Pallas (Triton) kernel.

    Args:
      query, key: [batch, k_heads, key_dim], already L2-normalised; bf16 or f32. key_dim a power of 2 >= 16.
      value: [batch, v_heads, value_dim], v_heads a multiple of k_heads (v-head h reads q/k head
        h // (v_heads // k_heads)); value_dim a power of 2 >= 16.
      log_decay, beta: [batch, v_heads]; any float dtype (used in f32).
      state: [batch, v_heads, key_dim, value_dim] float32; updated in place when the caller donates it.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      block_v: value columns per program (a power of 2; capped at value_dim): batch x v_heads x
        value_dim / block_v programs.
      interpret: run in the Pallas interpreter; None = only when no GPU is present.

    Returns:
      output: [batch, v_heads, value_dim] in value.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: shapes that disagree, or key_dim / value_dim / block_v that are not powers of two.
    """
    common.check_step_shapes(query, key, value, log_decay, beta, state)
    batch, k_heads, key_dim = key.shape
    _, v_heads, value_dim = value.shape
    block_v = min(block_v, value_dim)
    _check_tiles(key_dim=key_dim, value_dim=value_dim, block_v=block_v)
    scale = key_dim**-0.5 if scale is None else scale
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_step_kernel, group=v_heads // k_heads, scale=scale, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct(value.shape, value.dtype), jax.ShapeDtypeStruct(state.shape, f32)),
        grid=(batch, v_heads, value_dim // block_v),
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="gdn_step",
    )(query, key, value, log_decay.astype(f32), beta.astype(f32), state.astype(f32))


def _softplus(x):
    # log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|) (jax.nn.softplus's value)
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _conv_silu(mixed_ref, conv_ref, weight_ref, b, t, start, n, kernel, dtype, tree):
    """silu(causal depthwise conv) of channels [start, start + n) of row b for token t of the call (static),
    in f32, rounded through `dtype` as the layer's activations are: sum_j window[j] w[j] with the window's
    last row the token itself, earlier rows the call's previous tokens or, before the first, the conv history
    (a tree: the node's own window, conv_ref [batch, nodes, kernel - 1, conv_dim]); taps in order."""
    ch = pl.ds(start, n)
    out = jnp.zeros((n,), jnp.float32)
    for j in range(kernel - 1):
        src = t - (kernel - 1) + j  # static: a history row (src < 0) or an earlier token of the call
        if tree:
            row = conv_ref[b, t, j, ch]
        else:
            row = conv_ref[b, kernel - 1 + src, ch] if src < 0 else mixed_ref[b, src, ch]
        out = out + row.astype(jnp.float32) * weight_ref[j, ch].astype(jnp.float32)
    out = out + mixed_ref[b, t, ch].astype(jnp.float32) * weight_ref[kernel - 1, ch].astype(jnp.float32)
    return (out * jax.nn.sigmoid(out)).astype(dtype).astype(jnp.float32)


def _l2_normalize(x, dtype):
    # the layer's l2_normalize (eps inside the root), its output rounded through the activation dtype
    return (x * jax.lax.rsqrt(jnp.sum(x * x) + 1e-6)).astype(dtype).astype(jnp.float32)


def _decode_kernel(*refs, k_heads, key_dim, group, scale, block_v, kernel, tokens, keep_all, tree, interpret):
    # refs: mixed_ref [batch, tokens, conv_dim]; conv_ref [batch, kernel - 1, conv_dim] (a tree: [batch,
    # tokens, kernel - 1, conv_dim], each node's window); weight_ref [kernel, conv_dim]; a_ref / b_ref [batch,
    # tokens, v_heads] f32; rate_ref / bias_ref [v_heads] f32; s_ref [batch, v_heads, key_dim, value_dim] f32;
    # a tree: parents_ref [tokens] int32 (-1 at the root); then o_ref [batch, tokens, v_heads, value_dim];
    # s_out_ref: keep_all, the state after each token [tokens, batch, v_heads, key_dim, value_dim]; else the
    # last one, like s_ref (aliased). The state tile stays in registers from token to token; a tree node
    # starts from its parent's state, read back from s_out_ref.
    mixed_ref, conv_ref, weight_ref, a_ref, b_ref, rate_ref, bias_ref, s_ref = refs[:8]
    parents_ref = refs[8] if tree else None
    o_ref, s_out_ref = refs[-2:]
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dtype = mixed_ref.dtype
    kh = h // group
    value_dim = o_ref.shape[3]
    cols = pl.ds(vb * block_v, block_v)
    decay_rate, bias = jnp.exp(rate_ref[h]), bias_ref[h]
    s = initial = s_ref[b, h, :, cols]  # [key_dim, block_v]
    for t in range(tokens):
        if tree and t:
            if not interpret:  # the parent's state was stored by this program's threads: make it visible
                plgpu.debug_barrier()
            parent = parents_ref[t]
            s = jnp.where(parent >= 0, s_out_ref[jnp.maximum(parent, 0), b, h, :, cols], initial)
        conv = functools.partial(
            _conv_silu, mixed_ref, conv_ref, weight_ref, b, t, kernel=kernel, dtype=dtype, tree=tree
        )
        q = _l2_normalize(conv(kh * key_dim, key_dim), dtype) * scale  # [key_dim]
        k = _l2_normalize(conv((k_heads + kh) * key_dim, key_dim), dtype)
        v = conv(2 * k_heads * key_dim + h * value_dim + vb * block_v, block_v)  # [block_v]
        g = -decay_rate * _softplus(a_ref[b, t, h] + bias)
        beta = jax.nn.sigmoid(b_ref[b, t, h])
        s = s * jnp.exp(g)
        u = beta * (v - jnp.sum(k[:, None] * s, axis=0))
        s = s + k[:, None] * u[None, :]
        o_ref[b, t, h, cols] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)
        if keep_all:
            s_out_ref[t, b, h, :, cols] = s
    if not keep_all:
        s_out_ref[b, h, :, cols] = s


def _check_decode_shapes(
    mixed,
    conv_state,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    k_heads,
    key_dim,
    tree=False,
):
    """Raises ValueError naming an input whose shape disagrees with the others (mixed [batch, tokens, C])."""
    batch, v_heads, state_key_dim, value_dim = state.shape
    tokens = mixed.shape[1]
    kernel = conv_weight.shape[0]
    conv_dim = 2 * k_heads * key_dim + v_heads * value_dim
    expected = {
        "mixed": (mixed.shape, (batch, tokens, conv_dim)),
        "conv_state": (conv_state.shape, (batch, *((tokens,) if tree else ()), kernel - 1, conv_dim)),
        "conv_weight": (conv_weight.shape, (kernel, conv_dim)),
        "decay_input": (decay_input.shape, (batch, tokens, v_heads)),
        "beta_input": (beta_input.shape, (batch, tokens, v_heads)),
        "log_decay_rate": (log_decay_rate.shape, (v_heads,)),
        "dt_bias": (dt_bias.shape, (v_heads,)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name}.shape={tuple(got)}, expected {want} (state.shape={state.shape})")
    if state_key_dim != key_dim or v_heads % k_heads:
        raise ValueError(f"state.shape={state.shape} does not fit k_heads={k_heads}, key_dim={key_dim}")


def _decode_call(args, *, k_heads, key_dim, scale, block_v, interpret, keep_all, parents=None):
    """The kernel over args = (mixed [batch, tokens, C], conv_state, conv_weight, decay_input, beta_input
    [batch, tokens, v_heads], log_decay_rate, dt_bias, state): (output [batch, tokens, v_heads, value_dim],
    the state after each token [tokens, ...] if keep_all, else after the last, in place)."""
    mixed, conv_state, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state = args
    tree = parents is not None
    _check_decode_shapes(*args, k_heads, key_dim, tree)
    if tree and parents.shape != (mixed.shape[1],):
        raise ValueError(f"parents must be [nodes] = [{mixed.shape[1]}], got shape {parents.shape}")
    batch, v_heads, _, value_dim = state.shape
    tokens = mixed.shape[1]
    block_v = min(block_v, value_dim)
    _check_tiles(key_dim=key_dim, value_dim=value_dim, block_v=block_v)
    scale = key_dim**-0.5 if scale is None else scale
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    f32 = jnp.float32
    kernel_fn = functools.partial(
        _decode_kernel,
        k_heads=k_heads,
        key_dim=key_dim,
        group=v_heads // k_heads,
        scale=scale,
        block_v=block_v,
        kernel=conv_weight.shape[0],
        tokens=tokens,
        keep_all=keep_all,
        tree=tree,
        interpret=interpret,
    )
    states = (tokens, *state.shape) if keep_all else state.shape
    return pl.pallas_call(
        kernel_fn,
        out_shape=(
            jax.ShapeDtypeStruct((batch, tokens, v_heads, value_dim), mixed.dtype),
            jax.ShapeDtypeStruct(states, f32),
        ),
        grid=(batch, v_heads, value_dim // block_v),
        input_output_aliases={} if keep_all else {7: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="gdn_decode_tree" if tree else "gdn_decode_tokens" if keep_all else "gdn_decode",
    )(
        mixed,
        conv_state,
        conv_weight,
        decay_input.astype(f32),
        beta_input.astype(f32),
        log_decay_rate.astype(f32),
        dt_bias.astype(f32),
        state.astype(f32),
        *(() if parents is None else (parents.astype(jnp.int32),)),
    )


@functools.partial(jax.jit, static_argnames=("k_heads", "key_dim", "scale", "block_v", "interpret"))
def gated_delta_rule_decode_triton(
    mixed,
    conv_state,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    *,
    k_heads: int,
    key_dim: int,
    scale=None,
    block_v=32,
    interpret=None,
):
    """One decode step of a Gated DeltaNet layer from its raw projections, in one Pallas (Triton) kernel: the
    causal depthwise conv with SiLU, the L2 norm of q and k, the gates, and the delta-rule update
    (`gated_delta_rule_step`), so that a decode step runs one kernel where XLA runs several small fusions.

    Per (batch row, v-head, block of value columns); the conv of the head's q and k channels is recomputed by
    each of its programs (a few hundred multiply-adds), the state tile is read and written once.

    Args:
      mixed: [batch, conv_dim] the token's pre-conv [q | k | v] projections (activation dtype), conv_dim =
        2 * k_heads * key_dim + v_heads * value_dim.
      conv_state: [batch, conv_kernel - 1, conv_dim] the previous tokens' pre-conv inputs.
      conv_weight: [conv_kernel, conv_dim]; tap conv_kernel - 1 multiplies the current token.
      decay_input, beta_input: [batch, v_heads] the `a` and `b` projections (any float dtype).
      log_decay_rate, dt_bias: [v_heads] A_log and dt_bias: g = -exp(A_log) softplus(a + dt_bias),
        beta = sigmoid(b).
      state: [batch, v_heads, key_dim, value_dim] float32; updated in place when the caller donates it.
      k_heads, key_dim: the q/k heads and their size (static); v_heads and value_dim follow from state.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      block_v: value columns per program (a power of two, capped at value_dim).
      interpret: run in the Pallas interpreter; None = only when no GPU is present.

    Returns:
      output [batch, v_heads, value_dim] in mixed.dtype, new_state float32.

    Raises:
      ValueError: shapes that disagree, or key_dim / value_dim / block_v that are not powers of two >= 16.

    Source: arXiv:2412.06464; HF `Qwen3_5MoeGatedDeltaNet` (conv, norms, gates); spec §4.
    """
    args = (
        mixed[:, None],
        conv_state,
        conv_weight,
        decay_input[:, None],
        beta_input[:, None],
        log_decay_rate,
        dt_bias,
        state,
    )
    if mixed.ndim != 2:
        raise ValueError(f"mixed must be [batch, conv_dim], got shape {mixed.shape}")
    out, new_state = _decode_call(
        args,
        k_heads=k_heads,
        key_dim=key_dim,
        scale=scale,
        block_v=block_v,
        interpret=interpret,
        keep_all=False,
    )
    return out[:, 0], new_state


@functools.partial(jax.jit, static_argnames=("k_heads", "key_dim", "scale", "block_v", "interpret"))
def gated_delta_rule_decode_tokens_triton(
    mixed,
    conv_state,
    conv_weight,
    decay_input,
    beta_input,
    log_decay_rate,
    dt_bias,
    state,
    *,
    k_heads: int,
    key_dim: int,
    scale=None,
    block_v=32,
    interpret=None,
):
    """A few tokens of one sequence through a Gated DeltaNet layer in one Pallas (Triton) kernel, keeping the
    state after each (a speculative verify): `gated_delta_rule_decode_triton` token after token, each token's
    conv window the tokens before it (then the conv history), the state tile kept in registers between tokens.

    Args:
      mixed: [batch, tokens, conv_dim]; decay_input, beta_input: [batch, tokens, v_heads]; the rest as
        `gated_delta_rule_decode_triton` (conv_state: the inputs before the first token; state: before it).

    Returns:
      output [batch, tokens, v_heads, value_dim] in mixed.dtype, and the states [tokens, batch, v_heads,
      key_dim, value_dim] float32 (entry t: after token t).

    Raises:
      ValueError: as `gated_delta_rule_decode_triton`.
    """
    if mixed.ndim != 3:
        raise ValueError(f"mixed must be [batch, tokens, conv_dim], got shape {mixed.shape}")
    args = (mixed, conv_state, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state)
    return _decode_call(
        args,
        k_heads=k_heads,
        key_dim=key_dim,
        scale=scale,
        block_v=block_v,
        interpret=interpret,
        keep_all=True,
    )


@functools.partial(jax.jit, static_argnames=("k_heads", "key_dim", "scale", "block_v", "interpret"))
def gated_delta_rule_decode_tree_triton(
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
    k_heads: int,
    key_dim: int,
    scale=None,
    block_v=32,
    interpret=None,
):
    """The nodes of a token tree through a Gated DeltaNet layer in one Pallas (Triton) kernel (a tree
    verify): node i from its parent's state (the root from `state`), each node's conv window given, the state
    after every node kept.

    Args:
      mixed: [batch, nodes, conv_dim]; decay_input, beta_input: [batch, nodes, v_heads].
      windows: [batch, nodes, conv_kernel - 1, conv_dim] each node's conv window (its ancestors' pre-conv
        inputs, then the history), oldest first.
      parents: [nodes] int32, -1 at the root, parents[i] < i.
      The rest as `gated_delta_rule_decode_triton`.

    Returns:
      output [batch, nodes, v_heads, value_dim] in mixed.dtype, and the states [nodes, batch, v_heads,
      key_dim, value_dim] float32 (entry i: after node i's root path).

    Raises:
      ValueError: as `gated_delta_rule_decode_triton`, or parents not [nodes].
    """
    if mixed.ndim != 3:
        raise ValueError(f"mixed must be [batch, nodes, conv_dim], got shape {mixed.shape}")
    args = (mixed, windows, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state)
    return _decode_call(
        args,
        k_heads=k_heads,
        key_dim=key_dim,
        scale=scale,
        block_v=block_v,
        interpret=interpret,
        keep_all=True,
        parents=parents,
    )

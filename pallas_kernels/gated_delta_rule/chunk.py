"""Chunked gated delta rule in Pallas: gates -> prepare (WY factors) -> state pass (and output), as
flash-linear-attention's `chunk_gated_delta_rule_fwd` (spec §9). Per chunk of c tokens and v-head:
    gates:      g, beta heads-major [batch, v_heads, t] f32 (`gates.arrange`)
    prepare:    T = (I + strict_lower(diag(beta) K K^T * Gamma))^-1, P = scale lower_incl(Q K^T * Gamma)
    state pass: V' = T diag(beta) (V - diag(e^gamma) K h);  O = diag(e^gamma) scale Q h + P V';
                h <- e^{gamma_C} h + K^T diag(e^{gamma_C - gamma}) V'
The state pass is the backend: "triton" (`state_pass_triton`, any GPU and the interpreter) or "mosaic"
(`state_pass_mosaic`, Hopper). Packed sequences are regathered so each starts a chunk, or (Mosaic GPU walk,
packed length a multiple of 8, TMA's row tiles) stay on the packed array's own chunk grid.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import (
    common,
    gates,
    prepare,
    state_pass_mosaic,
    state_pass_triton,
    walk_pipeline,
)
from pallas_kernels.gated_delta_rule import config as config_lib

BACKENDS = ("triton", "mosaic")


@functools.partial(
    jax.jit, static_argnames=("backend", "scale", "chunk_size", "interpret", "config", "max_seqlen")
)
def gated_delta_rule_pallas(
    query,
    key,
    value,
    log_decay,
    beta,
    *,
    backend,
    initial_state=None,
    scale=None,
    chunk_size=64,
    cu_seqlens=None,
    max_seqlen=None,
    interpret=None,
    config=None,
):
    """The gated delta rule by the Pallas stages; arguments and results as `api.gated_delta_rule`.

    Args:
      backend: "triton" or "mosaic", the state pass.
      max_seqlen: static bound on packed sequences' lengths: they run as a zero-padded batch, one walk each
        (a longer sequence makes the whole output and final state NaN).
      interpret: the Pallas interpreter; None = only when no GPU is present.
      config: `config.Config`; None = the device's tuned defaults (`config.resolve`).

    Raises:
      ValueError: shapes that disagree; chunk_size, key_dim or value_dim not a power of two >= 16.
      NotImplementedError: "mosaic" where `state_pass_mosaic.refusal` gives a reason.
    """
    inputs = (query, key, value, log_decay, beta)
    dims = common.check_shapes(*inputs, initial_state, cu_seqlens)
    _, seq, _, key_dim, v_heads, value_dim, num_states = dims
    if cu_seqlens is not None and max_seqlen is not None:  # packed -> padded batch, one walk per sequence
        static = dict(backend=backend, scale=scale, chunk_size=chunk_size, interpret=interpret, config=config)
        run = functools.partial(gated_delta_rule_pallas, **static)
        return common.run_as_padded_batch(run, inputs, initial_state, cu_seqlens, max_seqlen, chunk_size)
    for name, x in (("chunk_size", chunk_size), ("key_dim", key_dim), ("value_dim", value_dim)):
        if not common.is_pow2(x) or x < 16:
            raise ValueError(f"{name}={x} must be a power of two >= 16 for the Pallas Triton kernels")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose from {BACKENDS}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    compute_dtype = jnp.float32 if jnp.float32 in (query.dtype, key.dtype, value.dtype) else jnp.bfloat16
    sizes = dict(chunk_size=chunk_size, key_dim=key_dim, value_dim=value_dim, compute_dtype=compute_dtype)
    packed, mosaic = cu_seqlens is not None, backend == "mosaic"
    own_grid = packed and mosaic and seq % 8 == 0 and seq > 0
    config = config_lib.resolve(
        config, backend, packed=packed, own_grid=own_grid, interpret=interpret, **sizes
    )
    reason = mosaic and state_pass_mosaic.refusal(config, interpret=interpret, **sizes)
    if reason:
        raise NotImplementedError(f"the Mosaic GPU state pass does not take {reason}")
    arranged = gates.arrange(
        *inputs,
        cu_seqlens,
        chunk_size=chunk_size,
        compute_dtype=compute_dtype,
        own_grid=own_grid,
        interpret=interpret,
    )
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, key_dim, value_dim), jnp.float32)
    initial_state = initial_state.astype(jnp.float32)
    scale = key_dim**-0.5 if scale is None else scale
    common_args = dict(chunk_size=chunk_size, compute_dtype=compute_dtype, config=config, interpret=interpret)
    out, final_state = run_stages(
        *arranged, initial_state, cu_seqlens, mosaic=mosaic, scale=scale, out_dtype=value.dtype, **common_args
    )
    return (out if packed else common.unpad_output(out, seq, None)), final_state


def run_stages(q, k, v, g, bt, layout, initial_state, cu_seqlens, *, mosaic, scale, out_dtype, **common_args):
    """Prepare and state pass on the arranged inputs (q, k, v, g, beta, layout of `gates.arrange`); returns
    (output, final state)."""
    common_args["group"] = v.shape[2] // k.shape[2]
    packed, regathered = cu_seqlens is not None, layout is not None
    token_rows = (layout.chunk_src, layout.chunk_len) if regathered else None
    if regathered:  # the sequence each chunk holds, whether it opens it, closes it
        chunk_flags = (
            layout.chunk_seq,
            *(x.astype(jnp.int32) for x in (layout.chunk_first, layout.chunk_last)),
        )
    else:
        chunk_flags = (jnp.zeros((1,), jnp.int32),) * 3
    config = common_args["config"]
    valid_rows = q.shape[1] if token_rows is None and q.shape[1] < g.shape[2] else None
    num_chunks = g.shape[2] // common_args["chunk_size"]
    pieces = walk_pipeline.num_pieces(config, num_chunks) if mosaic and not packed else 1
    if pieces > 1 and valid_rows is None:
        return walk_pipeline.pipelined_walk(
            q, k, v, g, bt, initial_state, pieces=pieces, scale=scale, **common_args
        )
    # the Mosaic GPU walk takes its decay factors from the prepare (batch rows; own grid with P in the walk)
    p_in_walk = mosaic and config.p_in_walk and token_rows is None
    decay_factors = mosaic and (not packed or p_in_walk)
    options = dict(
        token_rows=token_rows, valid_rows=valid_rows, decay_factors=decay_factors, p_in_walk=p_in_walk
    )
    w, u, gamma, p, q_aligned, k_aligned = prepare.prepare(
        q, k, v, g, bt, scale=scale, **options, **common_args
    )
    decays = (gamma, u) if decay_factors else None
    if p_in_walk:  # no P; gamma itself for the walk's P mask (with decay_factors the prepare wrote it as p)
        gamma, p = (p if decay_factors else gamma), None
    if config.wy_in_state and token_rows is None:  # w is T diag(beta); the state pass reads V for U
        u = v
    out_seq = None
    if token_rows is not None:  # the state pass reads the chunk-aligned copies, writes the packed output
        q, k, out_seq = q_aligned, k_aligned, q.shape[1]
    if mosaic:
        gamma = None if decays and not p_in_walk else gamma
        walk = dict(scale=scale, out_seq=out_seq, max_concurrent_steps=config.mosaic_stages, decays=decays)
        cu, bounds = jnp.asarray(cu_seqlens, jnp.int32) if packed else None, layout and layout.chunk_start
        return state_pass_mosaic.state_pass(q, k, u, w, p, gamma, initial_state, cu, bounds, **walk)
    rows = dict(packed=packed, scale=scale, out_dtype=out_dtype, token_rows=token_rows, out_seq=out_seq)
    return state_pass_triton.state_pass(
        q, k, w, u, gamma, p, initial_state, chunk_flags, **rows, **common_args
    )

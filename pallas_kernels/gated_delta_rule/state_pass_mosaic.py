"""Hopper state pass (the sequential walk over chunks) of the chunked gated delta rule in Pallas Mosaic GPU:
the host side (shape checks, refusals, the launch); the kernel and its algorithm are in
`state_pass_mosaic_kernel`. Hopper (sm_90) only; bf16 operands, f32 state; chunk_size 64, key_dim and
value_dim multiples of 64.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import gates
from pallas_kernels.gated_delta_rule.state_pass_mosaic_kernel import (
    BLOCK_V,
    CHUNK,
    scratch_types,
    walk_kernel,
)

__all__ = ["BLOCK_V", "CHUNK", "refusal", "shared_memory_bytes", "state_pass", "supported"]

# Shared memory a block may use on sm_90, in bytes.
SHARED_MEMORY_LIMIT = gpu_limits.SHARED_MEMORY_BY_ARCH["9.0"]


def shared_memory_bytes(key_dim: int, stages: int = 2, p_in_walk: bool = True) -> int:
    """Bytes of shared memory `state_pass`'s buffers (`scratch_types`) take, its barriers and their alignment
    (1.4-3.9 KB) not counted. key_dim 128, 2 stages: 215 552."""
    return sum(
        math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
        for t in scratch_types(key_dim, stages, packed=None, p_in_walk=p_in_walk)
        if not isinstance(t, plgpu.Barrier)
    )


def supported(*, chunk_size: int, key_dim: int, value_dim: int, compute_dtype, stages: int = 2) -> str | None:
    """None where `state_pass` (with `stages` TMA stages) runs these shapes, else the reason it does not."""
    if chunk_size != CHUNK:
        return f"chunk_size={chunk_size} (the Mosaic GPU walk needs {CHUNK})"
    if key_dim % 64 or value_dim % BLOCK_V:
        return f"key_dim={key_dim}, value_dim={value_dim} (the Mosaic GPU walk needs multiples of 64)"
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        return f"compute dtype {jnp.dtype(compute_dtype).name} (the Mosaic GPU walk takes bf16)"
    need = shared_memory_bytes(key_dim, stages) + 6144  # + barriers and alignment (1.4-3.9 KB), with a margin
    if need > SHARED_MEMORY_LIMIT:
        return (
            f"key_dim={key_dim} with {stages} stages (~{need} bytes of shared memory, over sm_90's "
            f"{SHARED_MEMORY_LIMIT})"
        )
    return None


def refusal(
    config, *, interpret: bool, chunk_size: int, key_dim: int, value_dim: int, compute_dtype
) -> str | None:
    """Why `state_pass` cannot run this call (None: it can): shapes (`supported`, with
    `config.mosaic_stages`), the W, U form of the prepare (`config.wy_in_state` False), the Pallas
    interpreter, or a device other than an sm_90 GPU."""
    reason = supported(
        chunk_size=chunk_size,
        key_dim=key_dim,
        value_dim=value_dim,
        compute_dtype=compute_dtype,
        stages=config.mosaic_stages,
    )
    if reason is None and not config.wy_in_state:
        reason = "Config.wy_in_state=False (the walk takes T diag(beta))"
    if reason is None and interpret:
        reason = "the Pallas interpreter (its wgmma takes no register operands)"
    if reason is None and not gpu_limits.is_hopper():
        reason = "a device other than an sm_90 GPU (wgmma)"
    return reason


def _check_inputs(
    q,
    v,
    t_beta,
    p,
    gamma,
    initial_state,
    cu_seqlens,
    chunk_bounds,
    *,
    out_seq,
    max_concurrent_steps,
    chunk_offset,
    out,
    decays,
):
    """`state_pass`'s argument checks; returns (packed layout: None, "own_grid" or "regathered", whether the
    walk forms P, whether it restarts the decay factors). Raises ValueError naming what disagrees."""
    batch, seq, _, key_dim = q.shape
    value_dim = v.shape[3]
    packed = None if cu_seqlens is None else "own_grid" if chunk_bounds is None else "regathered"
    t = -(-seq // CHUNK) * CHUNK
    if chunk_offset or out is not None:  # one piece of the chunks
        if packed:
            raise ValueError("state_pass: chunk_offset and out take batch rows, not packed sequences")
        t = t_beta.shape[1]
        if chunk_offset < 0 or chunk_offset * CHUNK + t > seq:
            raise ValueError(
                f"state_pass: chunks {chunk_offset} .. {chunk_offset} + {t // CHUNK} past seq={seq}"
            )
    if out is not None and (out.shape != v.shape or out.dtype != jnp.bfloat16):
        raise ValueError(f"state_pass: out {out.shape} {out.dtype} must be bf16 of v's shape {v.shape}")
    reason = supported(
        chunk_size=CHUNK,
        key_dim=key_dim,
        value_dim=value_dim,
        compute_dtype=q.dtype,
        stages=max_concurrent_steps,
    )
    if reason or (seq % CHUNK and packed != "own_grid"):
        raise ValueError(f"Mosaic GPU state pass: {reason or f'seq={seq} not a multiple of {CHUNK}'}")
    p_in_walk = p is None
    if p_in_walk and gamma is None:
        raise ValueError("state_pass: p=None (P formed in the walk) needs gamma")
    if (not p_in_walk and (decays is None) == (gamma is None)) or (
        decays is not None and packed == "regathered"
    ):
        raise ValueError("state_pass: pass gamma or (batch rows, own grid) decays, one of the two")
    restart = packed == "own_grid" and decays is not None
    if restart and not p_in_walk:
        raise ValueError("state_pass: decays on the own grid need p=None and gamma (the walk restarts them)")
    gamma_shape = gamma.shape if decays is None else decays[0].shape
    if (
        t_beta.shape[1] != t
        or (not p_in_walk and p.shape[1] != t)
        or gamma_shape[2] != t
        or (decays is not None and decays[1].shape != gamma_shape)
        or (gamma is not None and gamma.shape != gamma_shape)
    ):
        raise ValueError(
            f"t_beta {t_beta.shape}, p {None if p_in_walk else p.shape}, gamma/decays {gamma_shape}: "
            f"need {t} tokens (seq {seq} rounded up to chunks)"
        )
    rows = (initial_state.shape[0] + 1,)
    if packed and (
        batch != 1
        or cu_seqlens.shape != rows
        or (chunk_bounds is not None and (chunk_bounds.shape != rows or out_seq is None))
    ):
        raise ValueError(
            f"packed: cu_seqlens {cu_seqlens.shape} (and regathered, chunk_bounds and out_seq) need "
            "batch 1 and one entry per initial state + 1"
        )
    return packed, p_in_walk, restart


@functools.partial(jax.jit, static_argnames=("scale", "out_seq", "max_concurrent_steps", "chunk_offset"))
def state_pass(
    q, k, v, t_beta, p, gamma, initial_state, cu_seqlens=None, chunk_bounds=None, *, scale, out_seq=None,
    max_concurrent_steps=2, chunk_offset=0, out=None, decays=None,
):  # fmt: skip
    """Fused state pass and output of the chunked gated delta rule (Hopper, Mosaic GPU).

    Three layouts: batch rows; packed sequences on the packed array's own chunk grid (cu_seqlens) or
    regathered chunk-aligned (cu_seqlens and chunk_bounds); packed outputs are written in place.

    Args:
      q, k: [batch, seq, k_heads, key_dim] bf16; seq a multiple of 64 for batch rows and regathered, any for
        the own grid (not a multiple of 8: q, k, v are copied 8-row aligned, TMA's tiles needing whole tiles).
      v: [batch, seq, v_heads, value_dim] bf16; v-head h reads q/k head h // (v_heads // k_heads).
      t_beta: [batch, t, v_heads, 64] bf16, each chunk's T diag(beta) (the UT transform) from the prepare;
        t = seq rounded up to chunks. Own grid: the chunks of the packed array itself (chunk n = tokens [64 n,
        64 n + 64), whatever sequences they belong to), from the log decay of `gates.break_sequences` (T
        block-diagonal over the chunk's sequences), and zero columns past seq (beta = 0 there).
      p: [batch, t, v_heads, 64] bf16, each chunk's scale * lower_incl(Q K^T * Gamma) (own grid:
        block-diagonal like T); None: a fourth warpgroup of the kernel forms it from the Q and K tiles the
        kernel streams and gamma (which must then be given, with or without `decays`), so that the prepare
        neither reads Q nor writes P.
      gamma: [batch, v_heads, t] f32, chunk-local prefix sums of the log decay (own grid: of
        `gates.break_sequences`); None with `decays` (and p given).
      initial_state: [batch, v_heads, key_dim, value_dim] f32, or packed [num_seqs, ...].
      cu_seqlens: None, or packed sequences (batch == 1): int32 [num_seqs + 1] token offsets in the packed
        output (and own grid: in q, k, v), cu[-1] == the packed length. One walk per sequence over its chunks
        (own grid: those holding its tokens, other sequences' tokens masked off), from its initial state.
      chunk_bounds: with cu_seqlens, regathered: int32 [num_seqs + 1], sequence i owning chunks
        chunk_bounds[i] .. chunk_bounds[i + 1] - 1 of the chunk-aligned q, k, v, t_beta, p, gamma.
      scale: the query scale (P already carries it).
      out_seq: regathered: the packed output's length (static).
      max_concurrent_steps: chunks in flight in the TMA pipeline (shared-memory stages).
      chunk_offset: batch rows only: t_beta, p and gamma hold one piece of the sequence, its chunks from
        this one on (static; `walk_pipeline.pipelined_walk`); q, k, v (and `out`) the whole sequence.
      out: batch rows only: a `jax.Ref` [batch, seq, v_heads, value_dim] bf16 taking the piece's output
        rows in place (the other rows untouched); None: a new output array.
      decays: batch rows or the own grid: (e^gamma, e^(gamma_last - gamma)) [batch, v_heads, t] f32 of the
        chunk grid (`gates.decay_factors(gamma)`), from the prepare; gamma is then None, unless p is None.
        Own grid: p must be None; each walk restarts them in its first and last chunk from gamma. None:
        formed here from gamma (XLA, every token; own grid with cu_seqlens).

    Returns:
      output [batch, seq, v_heads, value_dim] bf16 (regathered: [1, out_seq, ...]; with `out`, None) and the
      final state [batch or num_seqs, v_heads, key_dim, value_dim] f32.

    Raises:
      ValueError: shapes this kernel does not take (see `supported`), or that disagree.
    """
    batch, seq, k_heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    static = dict(out_seq=out_seq, max_concurrent_steps=max_concurrent_steps, chunk_offset=chunk_offset)
    packed, p_in_walk, restart = _check_inputs(
        q, v, t_beta, p, gamma, initial_state, cu_seqlens, chunk_bounds, out=out, decays=decays, **static
    )
    own = packed == "own_grid"
    exp_gamma, exp_to_last = decays or gates.decay_factors(gamma, cu_seqlens if own else None, seq)
    init = initial_state.astype(jnp.float32)
    cu = jnp.zeros((2,), jnp.int32) if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    # chunk_bounds is read only when regathered; else cu stands in for it (no zeros kernel for packed
    # sequences)
    bounds = cu if chunk_bounds is None else jnp.asarray(chunk_bounds, jnp.int32)
    out_rows = out_seq if packed == "regathered" else seq
    # TMA into 8-row tiles needs whole tiles in GMEM too: copies of q, k, v (the output is untiled)
    if seq % 8:
        q, k, v = (jnp.pad(x, [(0, 0), (0, (-seq) % 8), (0, 0), (0, 0)]) for x in (q, k, v))

    def gdn_state_mosaic(*refs):  # the kernel's name in profiles (the output ref the 11th either way)
        walk_kernel(*refs, group=v_heads // k_heads, scale=scale, stages=max_concurrent_steps, **layout)

    layout = dict(packed=packed, chunk_offset=chunk_offset, p_in_walk=p_in_walk, restart=restart)
    final_type = jax.ShapeDtypeStruct(init.shape, jnp.float32)
    out_type = (
        (final_type,)
        if out is not None
        else (jax.ShapeDtypeStruct((batch, out_rows, v_heads, value_dim), jnp.bfloat16), final_type)
    )
    scratch = scratch_types(
        key_dim, max_concurrent_steps, packed=packed, p_in_walk=p_in_walk, restart=restart
    )
    operands = (q, k, v, t_beta, gamma if p_in_walk else p, exp_gamma, exp_to_last, init, cu, bounds)
    outs = plgpu.kernel(
        gdn_state_mosaic,
        out_type=out_type,
        scratch_types=scratch,
        grid=(init.shape[0], v_heads, value_dim // BLOCK_V),
        grid_names=("rows", "heads", "vblocks"),
        num_threads=4 if p_in_walk else 3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands, *(() if out is None else (out,)))
    out_array, final = (None, *outs) if out is not None else outs
    return out_array, final

"""The gates as the kernels read them: one Pallas Triton pass from the caller's [batch, seq, v_heads] layout.

The prepare reads each chunk's log decay and beta as contiguous [chunk] rows of a [batch, v_heads, t] f32
array (t: seq padded to whole chunks). XLA forms them with two transposes, and on the packed array's own chunk
grid a third kernel for the sequence breaks (`break_sequences`), which it does not fuse into the
transposes: three launches over the same tokens. `heads_major_gates` does all of it in one. `arrange` puts
every input in the layout the prepare and the state pass read.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import common

# Tokens per chunk of the packed array's own grid (the Mosaic GPU walk's chunk).
OWN_GRID_CHUNK = 64
BLOCK_TOKENS = 256  # tokens per program (fewer above 32 v-heads)
# Packed sequences compared per token (a [tokens, sequences] compare per program); more go through XLA.
MAX_SEQS = 64


def _gates_kernel(g_ref, beta_ref, cu_ref, g_out_ref, beta_out_ref, *, seq, heads, num_seqs, block):
    # g_ref, beta_ref [batch, seq, heads] (any float); cu_ref int32 [num_seqs + 1] (num_seqs 0: unused);
    # g_out_ref, beta_out_ref [batch, heads, t] f32. Program (token block i, batch row b).
    i, b = pl.program_id(0), pl.program_id(1)
    width = pl.next_power_of_2(heads)
    token = i * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    head = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    inside = (token[:, None] < seq) & (head[None, :] < heads)
    rows, cols = pl.ds(i * block, block), pl.ds(0, width)
    g = plgpu.load(g_ref.at[b, rows, cols], mask=inside, other=0).astype(jnp.float32)  # [block, width]
    beta = plgpu.load(beta_ref.at[b, rows, cols], mask=inside, other=0).astype(jnp.float32)
    if num_seqs:  # -SEQUENCE_BREAK at each sequence's first token that is not a chunk's first row
        lane = jax.lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(num_seqs),), 0)
        starts = plgpu.load(cu_ref.at[pl.ds(0, lane.shape[0])], mask=lane < num_seqs, other=0)
        breaks = (lane < num_seqs) & (starts % OWN_GRID_CHUNK != 0) & (starts < seq)
        hit = jnp.max(jnp.where((token[:, None] == starts[None, :]) & breaks[None, :], 1, 0), axis=1)
        g = g - jnp.where(hit > 0, SEQUENCE_BREAK, 0.0)[:, None]
    out_mask = head[:, None] < heads
    out_cols = pl.ds(i * block, block)
    plgpu.store(g_out_ref.at[b, cols, out_cols], g.T, mask=out_mask)
    plgpu.store(beta_out_ref.at[b, cols, out_cols], beta.T, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("padded", "interpret"))
def heads_major_gates(log_decay, beta, cu_seqlens=None, *, padded: int, interpret: bool = False):
    """(log_decay, beta) [batch, seq, v_heads] -> [batch, v_heads, padded] f32, zeros past seq, in one kernel.

    Args:
      log_decay, beta: [batch, seq, v_heads], any float dtype.
      cu_seqlens: None, or int32 [num_seqs + 1] offsets of packed sequences (batch == 1): the log decay then
        gets -`SEQUENCE_BREAK` at each sequence's first token that is not a chunk's first row,
        as `own_grid_gates` (the XLA form, bit for bit) adds it.
      padded: the output length (seq padded to whole chunks), a multiple of 16 and >= seq.
      interpret: run in the Pallas interpreter.

    Returns:
      (log_decay, beta) [batch, v_heads, padded] float32.

    Raises:
      ValueError: padded < seq or not a multiple of 16, or cu_seqlens with batch > 1.
    """
    batch, seq, heads = log_decay.shape
    if padded < seq or padded % 16:
        raise ValueError(f"padded={padded} must be a multiple of 16 and >= seq={seq}")
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got {batch}")
    # the largest power of two dividing padded, at most 256 tokens and 8192 elements a tile (32 v-heads: 256)
    block = min(BLOCK_TOKENS, max(16, 8192 // pl.next_power_of_2(heads)), padded & -padded)
    num_seqs = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cu = jnp.zeros((1,), jnp.int32) if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    out = jax.ShapeDtypeStruct((batch, heads, padded), jnp.float32)
    return pl.pallas_call(
        functools.partial(_gates_kernel, seq=seq, heads=heads, num_seqs=num_seqs, block=block),
        out_shape=(out, out),
        grid=(padded // block, batch),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_gates",
    )(log_decay, beta, cu)


def arrange(
    query, key, value, log_decay, beta, cu_seqlens, *, chunk_size, compute_dtype, own_grid, interpret
):
    """The inputs as the prepare and the state pass read them.

    Batch rows: q, k, v [batch, t, heads, dim] in the compute dtype, zero-padded to whole chunks. Packed
    sequences (cu_seqlens) on their own chunk grid (`own_grid`, the Mosaic GPU walk): q, k, v as they lie.
    Otherwise regathered so that every sequence starts a chunk: g and beta are, q, k, v stay packed (the
    prepare reads them in place by `layout`).

    Returns:
      (q, k, v, g, beta, layout): g, beta [batch, v_heads, t] f32, t whole chunks (own grid: with the
      sequence breaks of `break_sequences`); layout: `common.PackedLayout` or None.
    """
    seq, c = key.shape[1], chunk_size
    packed = cu_seqlens is not None
    layout = common.packed_layout(cu_seqlens, seq, c) if packed and not own_grid else None
    q, k, v = (x.astype(compute_dtype) for x in (query, key, value))
    g, bt = log_decay.astype(jnp.float32), beta.astype(jnp.float32)
    if layout is None and (not packed or cu_seqlens.shape[0] - 1 <= MAX_SEQS):  # one kernel, heads-major
        if not own_grid:
            q, k, v, *_ = common.pad_to_chunks(q, k, v, g, bt, c, None)
        padded = q.shape[1] if not own_grid else -(-seq // c) * c
        g, bt = heads_major_gates(
            log_decay, beta, cu_seqlens if own_grid else None, padded=padded, interpret=interpret
        )
        return q, k, v, g, bt, layout
    if own_grid:  # (chunk_size is the walk's 64)
        g, bt = own_grid_gates(g, bt, cu_seqlens)
    else:
        g, bt = (common.regather(x, layout) for x in (g, bt))
    return q, k, v, jnp.swapaxes(g, 1, 2), jnp.swapaxes(bt, 1, 2), layout


# Packed sequences on their own chunk grid: the log decay at each sequence's first token inside a chunk (not a
# chunk's first row) is lowered by this much, so that exp(gamma_i - gamma_j) = exp(<= -256) = 0 in f32 for
# every token j of an earlier sequence in the chunk: the prepare's T and P come out block-diagonal over the
# chunk's sequences with no mask. Within a sequence the offsets cancel, at an f32 rounding cost of ~256 m *
# 6e-8 in the exponent after m breaks in the chunk (1.5e-5 relative per break, under bf16's 4e-3);
# `decay_factors` (and the walk in each sequence's first and last chunk, `state_pass_mosaic`) add them back
# for the walk's own factors.
SEQUENCE_BREAK = 256.0


def break_sequences(log_decay, cu_seqlens, seq):
    """log_decay [1, t, v_heads] f32 (t = seq rounded up to chunks) with -SEQUENCE_BREAK added at each packed
    sequence's first token that is not a chunk's first row (cu_seqlens int32 [num_seqs + 1]). The compiled
    call takes this form only beyond `gates.MAX_SEQS` sequences (`gates.heads_major_gates` does it in its
    kernel below that), so it scatters the penalty rather than comparing every token with every start."""
    t = log_decay.shape[1]
    starts = jnp.asarray(cu_seqlens, jnp.int32)[:-1]
    inside = (starts % OWN_GRID_CHUNK != 0) & (starts < seq)
    penalty = jnp.zeros((t,), jnp.float32).at[jnp.where(inside, starts, t)].set(-SEQUENCE_BREAK, mode="drop")
    return log_decay + penalty[None, :, None]


def own_grid_gates(log_decay, beta, cu_seqlens=None):
    """The gates as the prepare and the walk take them on the packed array's own chunk grid, in XLA (before
    the heads-major transpose). `gates.heads_major_gates` does the same and the transpose in one kernel; this
    form serves more than `gates.MAX_SEQS` sequences, and is the kernel's test reference.

    Args:
      log_decay, beta: [batch, seq, v_heads], any float dtype.
      cu_seqlens: None (batch rows), or packed sequences' int32 [num_seqs + 1] token offsets (batch == 1).

    Returns:
      (log_decay, beta) [batch, t, v_heads] f32, zero-padded to t = seq rounded up to chunks; with cu_seqlens
      the log decay of `break_sequences`.
    """
    seq = log_decay.shape[1]
    pad = [(0, 0), (0, -(-seq // OWN_GRID_CHUNK) * OWN_GRID_CHUNK - seq), (0, 0)]
    g, bt = (jnp.pad(x.astype(jnp.float32), pad) for x in (log_decay, beta))
    return (g if cu_seqlens is None else break_sequences(g, cu_seqlens, seq)), bt


def decay_factors(gamma, cu_seqlens=None, seq=None):
    """The walk's decays as factors, once per token (XLA) instead of once per token and value block in the
    walk.

    Args:
      gamma: [batch, v_heads, t] f32, chunk-local prefix sums of the log decay (t a multiple of 64).
      cu_seqlens: None, or packed sequences (batch == 1) on the packed array's chunk grid: int32
        [num_seqs + 1] token offsets (cu[-1] == seq <= t); a chunk may then hold several sequences'
        tokens, and gamma sums the log decay of `break_sequences`.
      seq: with cu_seqlens, the packed length.

    Returns:
      (e^gamma', e^(gamma'_last - gamma')) [batch, v_heads, t] f32: gamma' the prefix sum from the start of
      the token's sequence or chunk, whichever is later, gamma'_last its value at the last token of the same
      sequence in the same chunk (for batch rows: gamma and the chunk's last gamma).
    """
    if cu_seqlens is None:
        gamma_last = jnp.repeat(gamma[:, :, OWN_GRID_CHUNK - 1 :: OWN_GRID_CHUNK], OWN_GRID_CHUNK, axis=2)
        return jnp.exp(gamma), jnp.exp(gamma_last - gamma)
    t = gamma.shape[2]
    ranges = common.grid_ranges(cu_seqlens, seq, t, OWN_GRID_CHUNK)
    token = jnp.arange(t, dtype=jnp.int32)
    before = jnp.take(gamma, jnp.maximum(ranges.first - 1, 0), axis=2)  # gamma just before the restart
    restart = jnp.where(ranges.first > token - token % OWN_GRID_CHUNK, before - SEQUENCE_BREAK, 0.0)
    return jnp.exp(gamma - restart), jnp.exp(jnp.take(gamma, ranges.last, axis=2) - gamma)

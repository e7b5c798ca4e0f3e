"""The gates as the kernels read them: one Pallas Triton pass from the caller's [batch, seq, v_heads] layout.

The prepare reads each chunk's log decay and beta as contiguous [chunk] rows of a [batch, v_heads, t] f32 array
(t: seq padded to whole chunks). XLA forms them with two transposes, and on the packed array's own chunk grid a
third kernel for the sequence breaks (`state_pass_mosaic.break_sequences`), which it does not fuse into the
transposes: three launches over the same tokens. `heads_major_gates` does all of it in one. `arrange` puts
every input in the layout the prepare and the state pass read.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import common, state_pass_mosaic

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
        breaks = (lane < num_seqs) & (starts % state_pass_mosaic.CHUNK != 0) & (starts < seq)
        hit = jnp.max(jnp.where((token[:, None] == starts[None, :]) & breaks[None, :], 1, 0), axis=1)
        g = g - jnp.where(hit > 0, state_pass_mosaic.SEQUENCE_BREAK, 0.0)[:, None]
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
        gets -`state_pass_mosaic.SEQUENCE_BREAK` at each sequence's first token that is not a chunk's first row,
        as `state_pass_mosaic.own_grid_gates` (the XLA form, bit for bit) adds it.
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
      sequence breaks of `state_pass_mosaic.break_sequences`); layout: `common.PackedLayout` or None.
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
        g, bt = state_pass_mosaic.own_grid_gates(g, bt, cu_seqlens)
    else:
        g, bt = (common.regather(x, layout) for x in (g, bt))
    return q, k, v, jnp.swapaxes(g, 1, 2), jnp.swapaxes(bt, 1, 2), layout

"""What the stages of the chunked gated delta rule share: shape checks, the chunk-aligned layout of packed
sequences, and the tile helpers of the Triton kernels."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# jnp.searchsorted's method for token / chunk -> sequence of packed inputs: its default, "scan", runs as an
# XLA while loop on the GPU; "scan_unrolled" makes the same O(n log num_seqs) comparisons with no loop.
SEARCH = "scan_unrolled"

PLAIN = (((1,), (0,)), ((), ()))  # dot_general dims for a b
TRANS_A = (((0,), (0,)), ((), ()))  # dot_general dims for a^T b
TRANS_B = (((1,), (1,)), ((), ()))  # dot_general dims for a b^T


def dot(a, b, dims=PLAIN, exact=False):
    """2-D product accumulated in f32. exact=True (f32 inputs) keeps f32 operands in IEEE f32; otherwise f32
    operands run as TF32 (Triton's default). bf16 operands are unaffected."""
    precision = jax.lax.Precision.HIGHEST if exact else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def token_rows(n, chunk_size, src_ref, len_ref, in_place, src_len=None):
    """Rows of chunk n in the token-ordered arrays (q, k, v, the output): (pl.ds, row mask or None).
    In place (packed sequences read where they lie): from the chunk's first packed token, the rows past the
    chunk's length (the next sequence, or past the array's end) masked off. src_len: the chunk's (first
    token, length) already in registers, else read from src_ref, len_ref."""
    if not in_place:
        return pl.ds(n * chunk_size, chunk_size), None
    src, length = src_len if src_len is not None else (src_ref[n], len_ref[n])
    mask = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) < length
    return pl.ds(src, chunk_size), mask


def load_rows(ref, idx, mask, shape):
    """The [rows, cols] tile ref[idx]; rows off `mask` read as zeros and are never accessed."""
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=jnp.broadcast_to(mask[:, None], shape), other=0)


def store_rows(ref, idx, value, mask):
    """ref[idx] = value ([rows, cols]), rows off `mask` left untouched."""
    if mask is None:
        ref[idx] = value
    else:
        plgpu.store(ref.at[idx], value, mask=jnp.broadcast_to(mask[:, None], value.shape))


def check_shapes(query, key, value, log_decay, beta, initial_state, cu_seqlens):
    """Validates prefill shapes; returns (batch, seq, k_heads, key_dim, v_heads, value_dim, num_states).

    Raises:
      ValueError: naming the shapes that disagree.
    """
    if query.ndim != 4 or query.shape != key.shape:
        raise ValueError(
            f"query and key must both be [batch, seq, k_heads, key_dim]; got query.shape="
            f"{query.shape} and key.shape={key.shape}"
        )
    batch, seq, k_heads, key_dim = key.shape
    if value.ndim != 4 or value.shape[:2] != (batch, seq):
        raise ValueError(
            f"value must be [batch, seq, v_heads, value_dim] with batch, seq of key.shape="
            f"{key.shape}; got value.shape={value.shape}"
        )
    v_heads, value_dim = value.shape[2:]
    if v_heads % k_heads:
        raise ValueError(
            f"v_heads={v_heads} (value.shape={value.shape}) is not a multiple of k_heads="
            f"{k_heads} (key.shape={key.shape})"
        )
    for name, x in (("log_decay", log_decay), ("beta", beta)):
        if x.shape != (batch, seq, v_heads):
            raise ValueError(f"{name}.shape={x.shape} must be [batch, seq, v_heads]={(batch, seq, v_heads)}")
    num_states = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs batch == 1 (packed sequences); got key.shape={key.shape}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [num_seqs + 1] with num_seqs >= 1; got {cu_seqlens.shape}")
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (num_states, v_heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state.shape={initial_state.shape} must be [batch or num_seqs, v_heads, key_dim,"
            f" value_dim]={(num_states, v_heads, key_dim, value_dim)}"
        )
    return batch, seq, k_heads, key_dim, v_heads, value_dim, num_states


def check_step_shapes(query, key, value, log_decay, beta, state):
    """Validates decode-step shapes. Raises ValueError naming the shapes that disagree."""
    if query.ndim != 3 or query.shape != key.shape:
        raise ValueError(
            f"query and key must both be [batch, k_heads, key_dim]; got query.shape={query.shape}"
            f" and key.shape={key.shape}"
        )
    batch, k_heads, key_dim = key.shape
    if value.ndim != 3 or value.shape[0] != batch or value.shape[1] % k_heads:
        raise ValueError(
            f"value must be [batch, v_heads, value_dim] with v_heads a multiple of k_heads; got "
            f"value.shape={value.shape}, key.shape={key.shape}"
        )
    _, v_heads, value_dim = value.shape
    for name, x in (("log_decay", log_decay), ("beta", beta)):
        if x.shape != (batch, v_heads):
            raise ValueError(f"{name}.shape={x.shape} must be [batch, v_heads]={(batch, v_heads)}")
    if state.shape != (batch, v_heads, key_dim, value_dim):
        raise ValueError(
            f"state.shape={state.shape} must be [batch, v_heads, key_dim, value_dim]="
            f"{(batch, v_heads, key_dim, value_dim)}"
        )


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each token of a packed batch lands when every sequence starts on a chunk boundary.

    All arrays are traced int32/bool, sized by static bounds:
      gather: [num_chunks * chunk_size] source token of each padded slot (0 where the slot is padding).
      valid: [num_chunks * chunk_size] bool, False for padding slots.
      scatter: [seq] padded slot of each source token.
      chunk_seq: [num_chunks] sequence index of each chunk.
      chunk_first / chunk_last: [num_chunks] bool, chunk opens / closes its (non-empty) sequence.
      chunk_src: [num_chunks] int32, packed token of each chunk's first slot (0 for a chunk of no tokens).
      chunk_len: [num_chunks] int32, tokens in each chunk (<= chunk_size; slots past it are padding).
      chunk_start: [num_seqs + 1] int32, first chunk of each sequence (its last: chunk_start[i + 1] - 1), then
        the chunks used in all.
    """

    gather: jax.Array
    valid: jax.Array
    scatter: jax.Array
    chunk_seq: jax.Array
    chunk_first: jax.Array
    chunk_last: jax.Array
    chunk_src: jax.Array
    chunk_len: jax.Array
    chunk_start: jax.Array


def num_packed_chunks(seq: int, num_seqs: int, chunk_size: int) -> int:
    """Static upper bound on sum_i ceil(len_i / chunk_size) over num_seqs sequences of seq tokens in all."""
    return max(1, (seq + num_seqs * (chunk_size - 1)) // chunk_size)


def packed_layout(cu_seqlens, seq: int, chunk_size: int) -> PackedLayout:
    """Chunk-aligned layout of packed sequences (cu_seqlens: int32 [num_seqs + 1], cu[-1] == seq)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    num_seqs = cu.shape[0] - 1
    num_chunks = num_packed_chunks(seq, num_seqs, chunk_size)
    lengths = cu[1:] - cu[:-1]  # [num_seqs]
    chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
    chunk_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(chunks_per_seq)]).astype(jnp.int32)
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    chunk_seq = token_sequences(chunk_start, chunk)  # the same search over the sequences' chunk offsets
    offset_in_seq = chunk - chunk_start[chunk_seq]  # [num_chunks]
    chunk_first = (offset_in_seq == 0) & (lengths[chunk_seq] > 0)
    chunk_last = (offset_in_seq == chunks_per_seq[chunk_seq] - 1) & (lengths[chunk_seq] > 0)
    slot = jnp.arange(num_chunks * chunk_size, dtype=jnp.int32)
    slot_seq = chunk_seq[slot // chunk_size]
    pos = slot - chunk_start[slot_seq] * chunk_size  # position inside its sequence
    valid = (pos >= 0) & (pos < lengths[slot_seq])
    gather = jnp.where(valid, cu[slot_seq] + pos, 0)
    token = jnp.arange(seq, dtype=jnp.int32)
    token_seq = token_sequences(cu, token)
    scatter = chunk_start[token_seq] * chunk_size + token - cu[token_seq]
    chunk_len = jnp.clip(lengths[chunk_seq] - offset_in_seq * chunk_size, 0, chunk_size).astype(jnp.int32)
    chunk_src = jnp.where(chunk_len > 0, cu[chunk_seq] + offset_in_seq * chunk_size, 0).astype(jnp.int32)
    return PackedLayout(
        gather,
        valid,
        scatter.astype(jnp.int32),
        chunk_seq,
        chunk_first,
        chunk_last,
        chunk_src,
        chunk_len,
        chunk_start,
    )


def token_sequences(cu, token):
    """The packed sequence (int32) of each index in `token`, for offsets cu int32 [num_seqs + 1] (clipped to
    the last sequence past cu[-1]; empty sequences own no index). Also chunks, given chunk offsets."""
    found = jnp.searchsorted(cu[1:], token, side="right", method=SEARCH)
    return jnp.clip(found, 0, cu.shape[0] - 2).astype(jnp.int32)


class GridRanges(NamedTuple):
    """Packed sequences on the packed array's own chunk grid (chunk n = tokens [n c, n c + c), a chunk may
    hold the end of one sequence and the start of the next): per token slot t < padded (padded a multiple of
    c)."""

    first: jax.Array  # int32 [padded]: the first token of t's sequence in t's chunk (t >= seq: the chunk's)
    last: jax.Array  # int32 [padded]: the last token of t's sequence in t's chunk (t >= seq: t)


def grid_ranges(cu_seqlens, seq: int, padded: int, chunk_size: int) -> GridRanges:
    """`GridRanges` of packed sequences (cu_seqlens: int32 [num_seqs + 1], cu[-1] == seq <= padded)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    token = jnp.arange(padded, dtype=jnp.int32)
    found = token_sequences(cu, token)
    chunk_first = token - token % chunk_size
    first = jnp.maximum(cu[found], chunk_first)
    last = jnp.minimum(cu[found + 1], chunk_first + chunk_size) - 1
    inside = token < seq
    return GridRanges(jnp.where(inside, first, chunk_first), jnp.where(inside, last, token))


def pad_to_chunks(query, key, value, log_decay, beta, chunk_size: int, layout: PackedLayout | None):
    """Pads seq to whole chunks (zeros: q=k=v=0, g=0, beta=0 leave the state unchanged).

    With a packed layout (batch == 1) the tokens are regathered so that every sequence starts a chunk.
    Returns the five arrays with seq replaced by num_chunks * chunk_size.
    """
    arrays = (query, key, value, log_decay, beta)
    if layout is None:
        seq = key.shape[1]
        pad = (-seq) % chunk_size
        if seq == 0 or pad:
            pad = pad if seq else chunk_size
            arrays = tuple(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in arrays)
        return arrays

    return tuple(regather(x, layout) for x in arrays)


def regather(x, layout: PackedLayout):
    """x [1, seq, ...] in packed order -> [1, num_chunks * chunk_size, ...], every sequence starting a chunk
    (zeros in the padding slots)."""
    y = jnp.take(x, layout.gather, axis=1)
    mask = layout.valid.reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(mask, y, jnp.zeros((), x.dtype))


def unpad_output(output, seq: int, layout: PackedLayout | None):
    """Inverse of `pad_to_chunks` for the output [batch, padded_seq, v_heads, value_dim]."""
    if layout is None:
        return output[:, :seq]
    return jnp.take(output, layout.scatter, axis=1)


def packed_to_batch(arrays, cu_seqlens, max_len: int):
    """Packed sequences [1, seq, ...] -> a padded batch [num_seqs, max_len, ...] (zeros past each length).

    Zero padding (q=k=v=0, g=0, beta=0) leaves a state unchanged, so each row's final state is its
    sequence's. Returns (arrays, overflow): overflow is a bool scalar, True when a sequence is longer than
    max_len (its tail would be dropped)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    lengths = cu[1:] - cu[:-1]  # [num_seqs]
    pos = jnp.arange(max_len, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]  # [num_seqs, max_len]
    seq = arrays[0].shape[1]
    src = jnp.clip(cu[:-1, None] + pos[None, :], 0, max(seq - 1, 0))

    def gather(x):
        y = jnp.take(x[0], src, axis=0)  # [num_seqs, max_len, ...]
        return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), y, jnp.zeros((), x.dtype))

    return tuple(map(gather, arrays)), jnp.any(lengths > max_len)


def batch_to_packed(output, cu_seqlens, seq: int):
    """Inverse of `packed_to_batch` for the output [num_seqs, max_len, ...] -> [1, seq, ...]."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    num_seqs, max_len = output.shape[:2]
    token = jnp.arange(seq, dtype=jnp.int32)
    token_seq = token_sequences(cu, token)
    flat = output.reshape((num_seqs * max_len,) + output.shape[2:])
    index = jnp.clip(token_seq * max_len + token - cu[token_seq], 0, num_seqs * max_len - 1)
    return jnp.take(flat, index, axis=0)[None]


def run_as_padded_batch(run, inputs, initial_state, cu_seqlens, max_seqlen: int, chunk_size: int):
    """Packed sequences run as a zero-padded batch, one walk per sequence.

    Args:
      run: `run(q, k, v, g, beta, initial_state=...)` -> (output, final state) on the batch.
      inputs: (query, key, value, log_decay, beta), packed [1, seq, ...].
      max_seqlen: static bound (tokens) on the sequences' lengths, rounded up to whole chunks.

    Returns:
      The output repacked [1, seq, ...] and the final states; both NaN where a sequence is longer than
      max_seqlen.

    Raises:
      ValueError: max_seqlen < 1.
    """
    if max_seqlen < 1:
        raise ValueError(f"max_seqlen={max_seqlen} must be >= 1")
    max_len = -(-max_seqlen // chunk_size) * chunk_size
    batched, overflow = packed_to_batch(inputs, cu_seqlens, max_len)
    out, final_state = run(*batched, initial_state=initial_state)
    out = batch_to_packed(out, cu_seqlens, inputs[0].shape[1])
    nan = jnp.asarray(jnp.nan, jnp.float32)
    return jnp.where(overflow, nan.astype(out.dtype), out), jnp.where(overflow, nan, final_state)

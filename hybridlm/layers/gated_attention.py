"""Gated full attention of Qwen3.5 / Qwen3-Next (spec §5).

q and an output gate come from one projection laid out per head as [q (head_dim) | gate (head_dim)]; q and k
get zero-centred RMSNorm over head_dim, then partial NeoX RoPE; GQA causal attention with softmax in float32;
the output is multiplied by sigmoid(gate) before o_proj. Source: HF `Qwen3_5MoeAttention.forward`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybridlm.config import ModelConfig
from hybridlm.layers.linear import linear
from hybridlm.layers.norms import rms_norm
from hybridlm.layers.rope import apply_partial_rope, rope_cos_sin
from hybridlm.state import KVCache


def _resolve(implementation: str | None, dtype) -> str | None:
    if implementation is None and jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return implementation


def _attention(q, k, v, *, implementation, is_causal=False, kv_lengths=None, mask=None):
    """jax.nn.dot_product_attention returning (out [b, t, heads, hd], logsumexp [b, t, heads] float32).

    implementation None: cuDNN on a GPU for bf16 / fp16 inputs, else XLA. (JAX's own None picks XLA when the
    logsumexp is asked for, several times slower than cuDNN for long prefill chunks.) mask: None, or [t, s]
    bool, the keys each query sees.
    """
    implementation = _resolve(implementation, q.dtype)
    out, lse = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=None if mask is None else mask[None, None],
        is_causal=is_causal,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
        return_residual=True,
    )
    lse = lse if lse.shape == q.shape[:3] else jnp.swapaxes(lse, 1, 2)  # BTN or BNT depending on backend
    return out, lse.astype(jnp.float32)


def merge_cached_block(q, cache: KVCache, start, block: int, implementation, j, carry):
    """Online-softmax merge of q's attention to cached block j (keys [j * block, (j + 1) * block), those
    before `start` valid) into carry = (acc [b, t, heads, hd] float32, normalised output so far; lse [b, t,
    heads]). A block with no valid key weighs 0."""
    acc, run_lse = carry
    batch = q.shape[0]
    keys = jax.lax.dynamic_slice_in_dim(cache.key, j * block, block, axis=1)
    values = jax.lax.dynamic_slice_in_dim(cache.value, j * block, block, axis=1)
    lengths = jnp.full((batch,), jnp.clip(start - j * block, 0, block), jnp.int32)
    o_j, lse_j = _attention(q, keys, values, implementation=implementation, kv_lengths=lengths)
    live = lengths[:, None, None] > 0
    lse_j = jnp.where(live, lse_j, -jnp.inf)
    o_j = jnp.where(live[..., None], o_j.astype(jnp.float32), 0.0)
    new_lse = jnp.logaddexp(run_lse, lse_j)
    acc = acc * jnp.exp(run_lse - new_lse)[..., None] + o_j * jnp.exp(lse_j - new_lse)[..., None]
    return acc, new_lse


# Decode (one query per sequence) attends through this implementation when none is named: cuDNN's flash
# attention with one query and key lengths is not repeatable bit for bit (two greedy decodes of the same
# tokens can diverge), and the XLA form is only a few small fusions for one query.
DECODE_IMPLEMENTATION = "xla"

# Fewer queries than this (a decode step, a speculative verify; prefill chunks have at least 16) read the
# whole cache as one block through DECODE_IMPLEMENTATION: blocks of their own length would be thousands.
MIN_BLOCK_QUERIES = 16

# With cuDNN, cached blocks are unrolled up to this count; beyond it a loop with a traced trip count runs
# (whose predicate XLA's GPU runtime reads back to the host on every iteration: dispatch then waits for the
# device).
MAX_UNROLLED_BLOCKS = 16


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache,
    start: jax.Array,
    *,
    implementation: str | None = None,
    static_blocks: bool | None = None,
    self_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a chunk over the cached prefix [0, start) and itself.

    The chunk attends to itself with an aligned causal mask, and to the prefix block by block; the partial
    softmaxes are merged by their log-sum-exp (online softmax, FlashAttention-2 §3.1.1). Blocks have the
    chunk's length when it divides the cache capacity (decode, seq=1, reads the whole cache as one block).
    Every call is a plain `jax.nn.dot_product_attention` (cuDNN flash attention on GPU) and no [seq, capacity]
    mask is built.

    With cuDNN the block loop has a static trip count (unrolled): capacity / block blocks, or, beyond
    MAX_UNROLLED_BLOCKS of them, fewer longer blocks that divide the capacity (cuDNN skips a block's invalid
    keys, so a longer block costs no more work). A block at or past `start` has zero valid keys and is merged
    with weight 0. A loop over the ceil(start / block) blocks with a traced trip count would make XLA's GPU
    runtime read the loop predicate back to the host, so dispatching the program would wait for the device
    (unrolled, the host does not block and the device time per call is lower too). With the XLA
    implementation (CPU; not bfloat16 on GPU), where an empty block would cost a full block, that loop is
    used.

    Args:
      q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim] of this chunk (post-RoPE).
      cache: the KV cache *before* this chunk was written (positions >= start are ignored).
      start: absolute position of the chunk's first token (int32 scalar, may be traced).
      implementation: passed to `jax.nn.dot_product_attention` (None, "xla" or "cudnn"); None with one query
        per sequence (decode): `DECODE_IMPLEMENTATION`.
      static_blocks: force the static (True) or the traced (False) trip count; None: static with cuDNN, and
        for one query per sequence (its one block, whichever the implementation).
      self_mask: None (causal), or [seq, seq] bool: which of the chunk's tokens each of its queries sees (a
        token tree's ancestor mask, `GatedAttention.verify_tree`). A masked chunk reads the cache as one
        block through DECODE_IMPLEMENTATION unless `implementation` is named, as a speculative verify does.

    Returns:
      [batch, seq, heads, head_dim] in q.dtype.
    """
    seq = q.shape[1]
    # decode, speculative verifies and token trees: the cache as one block
    few = seq < MIN_BLOCK_QUERIES or self_mask is not None
    if few and implementation is None:
        implementation = DECODE_IMPLEMENTATION
    if static_blocks is None:  # one block: no loop either way
        static_blocks = few or _resolve(implementation, q.dtype) == "cudnn"
    out, lse = _attention(q, k, v, implementation=implementation, is_causal=self_mask is None, mask=self_mask)
    blocks = cache.capacity // seq if not few and cache.capacity % seq == 0 else 1
    if static_blocks and blocks > MAX_UNROLLED_BLOCKS:
        # a short chunk over a long cache (a resumed conversation turn) keeps the unrolled form
        blocks = max(d for d in range(1, MAX_UNROLLED_BLOCKS + 1) if blocks % d == 0)
    block = cache.capacity // blocks

    merge_block = functools.partial(merge_cached_block, q, cache, start, block, implementation)
    carry = (out.astype(jnp.float32), lse)
    if static_blocks and blocks <= MAX_UNROLLED_BLOCKS:
        for j in range(blocks):
            carry = merge_block(j, carry)
    else:
        carry = jax.lax.fori_loop(0, (start + block - 1) // block, merge_block, carry)
    return carry[0].astype(q.dtype)


def _write_rows(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
    """The cache with one token a sequence written at its own position: k, v [batch, 1, kv_heads, head_dim],
    positions [batch] int32 (a position past the capacity writes nothing)."""
    rows = jnp.arange(k.shape[0])
    return KVCache(
        key=cache.key.at[rows, positions].set(k[:, 0].astype(cache.key.dtype), mode="drop"),
        value=cache.value.at[rows, positions].set(v[:, 0].astype(cache.value.dtype), mode="drop"),
    )


class GatedAttention(nnx.Module):
    """GQA attention with q/k RMSNorm, partial RoPE and a sigmoid output gate."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        a, h = config.attention, config.hidden_dim
        self.config = config
        normal = nnx.initializers.normal(stddev=0.02)

        def p(shape):
            return nnx.Param(normal(rngs.params(), shape, dtype))

        self.q_proj = p(
            (h, a.num_heads * 2 * a.head_dim)
        )  # [hidden, heads * (q | gate)], per-head interleave
        self.k_proj = p((h, a.num_kv_heads * a.head_dim))  # [hidden, kv_heads*head_dim]
        self.v_proj = p((h, a.num_kv_heads * a.head_dim))
        self.o_proj = p((a.num_heads * a.head_dim, h))  # [heads*head_dim, hidden]
        self.q_norm = nnx.Param(jnp.zeros((a.head_dim,), dtype))  # zero-centred (1 + w)
        self.k_norm = nnx.Param(jnp.zeros((a.head_dim,), dtype))

    def __call__(
        self, x: jax.Array, cache: KVCache | None = None, start: jax.Array | int = 0
    ) -> tuple[jax.Array, KVCache | None]:
        """Attention over a chunk.

        Args:
          x: [batch, seq, hidden] normalised input.
          cache: KV cache holding positions [0, start); None: the chunk is a whole sequence starting at 0.
          start: absolute position of x[:, 0] (int32 scalar, may be traced), or [batch] int32, one position a
            sequence, for one token a sequence (a decode step of sequences at different positions).

        Returns:
          out [batch, seq, hidden], and the cache with this chunk's keys/values written at [start, start+seq)
          (None when no cache was given). Padding rows of a last chunk are written too; positions past the
          prompt are overwritten by decode before any query can see them.
        """
        batch, seq, _ = x.shape
        per_row = jnp.ndim(start) == 1
        if per_row and (seq != 1 or cache is None):
            raise ValueError(f"per-sequence positions take one token a sequence and a cache, got seq={seq}")
        positions = (start[:, None] if per_row else start) + jnp.arange(seq)  # [seq] or [batch, seq]
        q, gate, k, v = self._project(x, positions)

        impl = self.config.attention_implementation
        if cache is None:
            out, _ = _attention(q, k, v, implementation=impl, is_causal=True)
            new_cache = None
        else:
            out = cached_attention(q, k, v, cache, jnp.asarray(start, jnp.int32), implementation=impl)
            new_cache = (
                _write_rows(cache, k, v, start)
                if per_row
                else KVCache(
                    key=jax.lax.dynamic_update_slice_in_dim(
                        cache.key, k.astype(cache.key.dtype), start, axis=1
                    ),
                    value=jax.lax.dynamic_update_slice_in_dim(
                        cache.value, v.astype(cache.value.dtype), start, axis=1
                    ),
                )
            )
        return self._gated_output(out, gate, x.dtype), new_cache

    def verify_tree(
        self, x: jax.Array, cache: KVCache, start, depth: jax.Array, ancestors: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the nodes of a token tree (a tree verify), writing nothing to the cache.

        Node i sits at absolute position start + depth[i] and attends to the cache [0, start) and to the nodes
        `ancestors` marks (its root path, itself included): SpecInfer's tree attention (Miao et al.,
        arXiv:2305.09781, §4.2), the ancestor-only mask of DDTree (Ringel, Romano, arXiv:2604.12989).
        Siblings share a position, so the nodes' keys and values are returned for the accepted path to be
        written once known (`engine.tree_verify.commit_tree`).

        Args:
          x: [batch, nodes, hidden] normalised input of the nodes.
          cache: KV cache holding positions [0, start).
          start: absolute position of the root (int32 scalar, may be traced).
          depth: [nodes] int32, each node's depth (root 0).
          ancestors: [nodes, nodes] bool, ancestors[i, j]: node j is node i or one of its ancestors.

        Returns:
          out [batch, nodes, hidden], and the nodes' (keys, values) [batch, nodes, kv_heads, head_dim] (keys
          after q/k norm and RoPE at their positions), in x.dtype.
        """
        nodes = x.shape[1]
        if depth.shape != (nodes,) or ancestors.shape != (nodes, nodes):
            raise ValueError(
                f"expected depth [nodes] and ancestors [nodes, nodes] for {nodes} nodes, got {depth.shape} "
                f"and {ancestors.shape}"
            )
        q, gate, k, v = self._project(x, start + depth)
        out = cached_attention(
            q,
            k,
            v,
            cache,
            jnp.asarray(start, jnp.int32),
            implementation=self.config.attention_implementation,
            self_mask=ancestors,
        )
        return self._gated_output(out, gate, x.dtype), (k, v)

    def _project(self, x: jax.Array, positions: jax.Array):
        """(q, gate [b, t, heads, head_dim], k, v [b, t, kv_heads, head_dim]) of x [b, t, hidden]: q and k
        normalised and rotated to `positions` ([t] or [b, t] int)."""
        a, eps = self.config.attention, self.config.rms_norm_eps
        batch, seq, _ = x.shape
        qg = linear(x, self.q_proj.get_value()).reshape(batch, seq, a.num_heads, 2 * a.head_dim)
        q, gate = qg[..., : a.head_dim], qg[..., a.head_dim :]
        k = linear(x, self.k_proj.get_value()).reshape(batch, seq, a.num_kv_heads, a.head_dim)
        v = linear(x, self.v_proj.get_value()).reshape(batch, seq, a.num_kv_heads, a.head_dim)
        q, k = rms_norm(q, self.q_norm[...], eps), rms_norm(k, self.k_norm[...], eps)
        cos, sin = rope_cos_sin(positions, a.rotary_dim, a.rope_theta)
        return apply_partial_rope(q, cos, sin), gate, apply_partial_rope(k, cos, sin), v

    def _gated_output(self, out: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        """o_proj(out * sigmoid(gate)): out, gate [b, t, heads, head_dim] -> [b, t, hidden]."""
        a = self.config.attention
        batch, seq = out.shape[:2]
        out = out.reshape(batch, seq, a.num_heads * a.head_dim) * jax.nn.sigmoid(
            gate.reshape(batch, seq, a.num_heads * a.head_dim).astype(jnp.float32)
        ).astype(dtype)
        return linear(out, self.o_proj.get_value())

"""Sparse MoE of Qwen3.5-MoE / Qwen3-Next: softmax top-k routing, SwiGLU experts, sigmoid-gated shared expert.

    p = softmax(u W_router) over all experts (float32);  w, ids = top_k(p);  w /= sum(w)  (spec §6)
    out = sum_j w_j expert_{ids_j}(u) + sigmoid(u . w_shared_gate) shared_expert(u)

The routed part never computes every expert for every token: token copies are sorted by expert
(dispatch), run through two grouped matmuls (GMM: `gmm_swiglu` then `gmm`), and un-permuted and combined.
A few copies (a decode step) skip the sort: each (token, expert) row names its expert (`row_groups`).
Source: HF `Qwen3_5MoeSparseMoeBlock.forward`, `Qwen3_5MoeTopKRouter.forward`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hybridlm.config import ModelConfig, MoEConfig
from hybridlm.layers.linear import linear
from pallas_kernels import tuning
from pallas_kernels.grouped_matmul import gmm, gmm_swiglu
from pallas_kernels.q4_k import Q4KExperts
from pallas_kernels.quantized import QuantizedWeights

# The thresholds below are fallbacks: a device's tuning table (`pallas_kernels.tuning`, op "moe") overrides
# them by their lower-case names.
TUNING_OP = "moe"

# From this many tokens on, route_top_k selects its k experts by k rounds of argmax instead of jax.lax.top_k,
# which XLA runs as a sort of every row on the GPU (slower than the argmax rounds for long chunks only). Same
# ids and weights, ties included.
ARGMAX_TOP_K_MIN_TOKENS = 32768

# Up to this many tokens route_top_k ranks the experts by pairwise comparison (`top_k_by_rank`: an
# [tokens, experts, experts] compare-and-count that XLA fuses into one or two kernels) instead of
# jax.lax.top_k's sort, a kernel of its own that costs several small fusions' time at decode. Same ids and
# weights, ties included.
RANK_TOP_K_MAX_TOKENS = 16

# Up to this many token copies (tokens x top_k) `routed_experts` runs the grouped matmuls on the copies in
# (token, slot) order with each row's expert given (`row_groups`): no sort, no inverse permutation, and the
# combine a plain weighted sum. Each copy then reads its expert's weights alone, so larger batches sort
# (quantized experts cost fewer bytes a read, so they stay unsorted longer).
UNSORTED_MAX_ROWS = 64
UNSORTED_MAX_ROWS_QUANTIZED = 128


def _threshold(name: str) -> int:
    """The device's measured value of the module constant `name`, else the constant."""
    return tuning.lookup(TUNING_OP).get(name.lower(), globals()[name])


def top_k_by_argmax(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis as k rounds of argmax, each masking out the index it found.

    Returns the same values and int32 indices as `jax.lax.top_k` (largest first; among equal values the lower
    index first, as argmax returns the first maximum). x must hold no -inf (the mask value) and no NaN.
    """
    col = jnp.arange(x.shape[-1], dtype=jnp.int32)
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1).astype(jnp.int32)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        indices.append(i)
        x = jnp.where(col == i[..., None], -jnp.inf, x)
    return jnp.stack(values, -1), jnp.stack(indices, -1)


def top_k_by_rank(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis by ranks: rank_i = #{j : x_j > x_i, or x_j == x_i and j < i}, then
    the entry of rank r is the r-th largest.

    Returns the same values and int32 indices as `jax.lax.top_k` (largest first; among equal values the lower
    index first). Costs [..., n, n] comparisons: for few rows. x must hold no NaN.
    """
    n = x.shape[-1]
    col = jnp.arange(n, dtype=jnp.int32)
    # x stored once: a fusion that recomputed x's producer (a softmax) for the two operands could round x_i
    # one way and x_j another, and two entries would share a rank
    x = jax.lax.optimization_barrier(x)
    xi, xj = x[..., :, None], x[..., None, :]  # [..., i, j]
    before = (xj > xi) | ((xj == xi) & (col[None, :] < col[:, None]))
    rank = jnp.sum(before, axis=-1, dtype=jnp.int32)  # [..., n], a permutation of [0, n)
    onehot = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, n]
    indices = jnp.sum(jnp.where(onehot, col, 0), axis=-1, dtype=jnp.int32)
    values = jnp.sum(jnp.where(onehot, x[..., None, :], 0), axis=-1, dtype=x.dtype)  # one nonzero term: exact
    return values, indices


def route_top_k(
    router_logits: jax.Array, top_k: int, *, normalize: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in float32, then top-k, optionally renormalised.

    Args:
      router_logits: [tokens, experts].
      top_k: experts per token.
      normalize: divide the k probabilities by their sum.

    Returns:
      weights [tokens, top_k] in router_logits.dtype, expert ids [tokens, top_k] int32 (by decreasing weight).
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # in [0, 1]: no -inf
    if router_logits.shape[0] <= _threshold("RANK_TOP_K_MAX_TOKENS"):
        weights, ids = top_k_by_rank(probs, top_k)
    elif router_logits.shape[0] >= _threshold("ARGMAX_TOP_K_MIN_TOKENS"):
        weights, ids = top_k_by_argmax(probs, top_k)
    else:
        weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(router_logits.dtype), ids.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dispatch:
    """Token copies sorted by expert; padding copies go past the last group and are dropped by the GMM."""

    order: jax.Array  # [tokens*top_k] int32: flat copy index (token*top_k + j) at each sorted row
    group_sizes: jax.Array  # [experts] int32: rows per expert (padding excluded)


def dispatch(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> Dispatch:
    """Sorts the (token, slot) copies by expert id.

    Args:
      expert_ids: [tokens, top_k] int32.
      num_experts: number of experts (groups).
      valid: [tokens] bool; invalid (padding) tokens are sent to a virtual group past the last expert.
    """
    ids = expert_ids
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, num_experts)
    flat = ids.reshape(-1)  # [tokens*top_k]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[flat].add(1)[:num_experts]
    return Dispatch(order=order, group_sizes=group_sizes)


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    gate_up,
    down,
    *,
    valid: jax.Array | None = None,
    implementation: str | None = None,
    sort: bool | None = None,
) -> jax.Array:
    """Sum over each token's top-k experts of weight * SwiGLU expert(x), through sort-by-expert + GMM.

    Args:
      x: [tokens, hidden].
      weights, expert_ids: [tokens, top_k] from `route_top_k`.
      gate_up: [experts, hidden, 2*ffn] (gate columns first), or a `QuantizedWeights` or `Q4KExperts` of that
        shape.
      down: [experts, ffn, hidden], or a `QuantizedWeights` or `Q4KExperts`.
      valid: [tokens] bool, padding tokens get zero output; None: all valid.
      implementation: grouped-matmul implementation (see `pallas_kernels.grouped_matmul.gmm`).
      sort: sort the token copies by expert (True) or run them in (token, slot) order with each row's expert
        named (False; decode); None: sort above `UNSORTED_MAX_ROWS` copies (`UNSORTED_MAX_ROWS_QUANTIZED` with
        quantized experts; the device's tuning table may set either).

    Returns:
      [tokens, hidden] in x.dtype.
    """
    tokens, top_k = expert_ids.shape
    num_experts = gate_up.shape[0]
    if isinstance(gate_up, Q4KExperts):
        sort = False  # only the matrix-vector kernel reads Q4_K rows in place, each row's expert named
    if sort is None:
        quantized = isinstance(gate_up, QuantizedWeights)
        sort = tokens * top_k > _threshold(
            "UNSORTED_MAX_ROWS_QUANTIZED" if quantized else "UNSORTED_MAX_ROWS"
        )
    if sort:  # copies sorted by expert; the GMM gathers their token rows of x itself
        d = dispatch(expert_ids, num_experts, valid)
        groups = {"group_sizes": d.group_sizes}
        token_of_row = d.order // top_k
    else:  # copies in (token, slot) order, each row's expert named (out of range: a zero row)
        ids = expert_ids if valid is None else jnp.where(valid[:, None], expert_ids, num_experts)
        groups = {"row_groups": ids.reshape(-1)}
        token_of_row = jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k
    # [tokens*top_k, ffn], then [tokens*top_k, hidden]
    h = gmm_swiglu(x, gate_up, **groups, lhs_index=token_of_row, implementation=implementation)
    y = gmm(h.astype(x.dtype), down, **groups, implementation=implementation)
    # un-permute by gathering through the inverse permutation (a scatter of int32 indices, not of rows)
    if sort:
        inverse = jnp.zeros_like(d.order).at[d.order].set(jnp.arange(d.order.shape[0], dtype=jnp.int32))
        y = y[inverse]
    out = jnp.einsum(
        "tk,tkh->th",
        weights.astype(y.dtype),
        y.reshape(tokens, top_k, -1),
        preferred_element_type=jnp.float32,
    )
    return out.astype(x.dtype)


def swiglu(x: jax.Array, gate_up, down) -> jax.Array:
    """Dense SwiGLU MLP: down(silu(x W_gate) * (x W_up)); gate_up [hidden, 2*ffn], down [ffn, hidden] (arrays,
    or `QuantizedWeights` [1, ...] of those shapes: `linear`)."""
    h = linear(x, gate_up)
    ffn = h.shape[-1] // 2
    return linear(jax.nn.silu(h[..., :ffn]) * h[..., ffn:], down)


class SparseMoE(nnx.Module):
    """Router + routed experts + shared expert."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        m: MoEConfig = config.moe
        h = config.hidden_dim
        self.config = config
        normal = nnx.initializers.normal(stddev=0.02)

        def p(shape):
            return nnx.Param(normal(rngs.params(), shape, dtype))

        self.router = p((h, m.num_experts))  # [hidden, experts]
        self.experts_gate_up = p((m.num_experts, h, 2 * m.expert_ffn_dim))  # [experts, hidden, 2*ffn]
        self.experts_down = p((m.num_experts, m.expert_ffn_dim, h))  # [experts, ffn, hidden]
        self.shared_gate_up = p((h, 2 * m.shared_ffn_dim))  # [hidden, 2*shared_ffn]
        self.shared_down = p((m.shared_ffn_dim, h))  # [shared_ffn, hidden]
        self.shared_token_gate = p((h,))  # [hidden]
        # None, or the mesh whose "expert" axis the routed experts are split over (`hybridlm.sharding`);
        # static: part of the module's graph
        self.expert_mesh = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [tokens, hidden] -> (weights [tokens, top_k], expert ids [tokens, top_k] int32)."""
        m = self.config.moe
        return route_top_k(linear(x, self.router[...]), m.top_k, normalize=m.normalize_top_k)

    def experts(
        self, x: jax.Array, weights: jax.Array, expert_ids: jax.Array, valid: jax.Array | None = None
    ) -> jax.Array:
        """Routed + shared experts for routed tokens: [tokens, hidden] -> [tokens, hidden]. With an
        `expert_mesh` the routed experts run split over its devices (`hybridlm.sharding.expert_parallel`)."""
        args = (x, weights, expert_ids, self.experts_gate_up.get_value(), self.experts_down.get_value())
        impl = self.config.moe_implementation
        if self.expert_mesh is None:
            routed = routed_experts(*args, valid=valid, implementation=impl)
        else:
            from hybridlm.sharding import expert_parallel

            routed = expert_parallel(
                self.expert_mesh, routed_experts, *args, valid=valid, implementation=impl
            )
        shared = swiglu(x, self.shared_gate_up.get_value(), self.shared_down.get_value())
        shared_gate = jax.nn.sigmoid((x @ self.shared_token_gate[...]).astype(jnp.float32)).astype(x.dtype)
        return routed + shared_gate[:, None] * shared

    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]; valid: [batch, seq] bool or None."""
        batch, seq, hidden = x.shape
        flat = x.reshape(batch * seq, hidden)
        weights, ids = self.route(flat)
        out = self.experts(flat, weights, ids, None if valid is None else valid.reshape(-1))
        return out.reshape(batch, seq, hidden)


class DenseMLP(nnx.Module):
    """SwiGLU MLP of the dense Qwen3.5 variants (GGUF arch `qwen35`)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        h, f = config.hidden_dim, config.dense_ffn_dim
        normal = nnx.initializers.normal(stddev=0.02)
        self.gate_up = nnx.Param(normal(rngs.params(), (h, 2 * f), dtype))  # [hidden, 2*ffn]
        self.down = nnx.Param(normal(rngs.params(), (f, h), dtype))  # [ffn, hidden]

    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        return swiglu(x, self.gate_up.get_value(), self.down.get_value())

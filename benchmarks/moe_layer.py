"""The sparse-MoE layer at one prefill chunk, split into its stages (where does the MoE time go?).

  route     router matmul, softmax over experts, top-k, renormalise         [tokens, hidden] -> ids, weights
  dispatch  sort the token copies by expert, group sizes                    -> [tokens*top_k] token ids
  gate_up   gmm_swiglu (fused SwiGLU), gathering its token rows itself       -> [tokens*top_k, ffn]
  down      gmm                                                              -> [tokens*top_k, hidden]
  combine   inverse permutation, gather, weighted sum over top-k             -> [tokens, hidden]
  shared    shared expert (dense SwiGLU) and its sigmoid gate
  layer     route + routed experts + shared expert in one program (XLA may overlap or fuse stages: it can be
            less than the sum)
Random weights (normal / sqrt(fan_in)) and hidden states: router-skewed enough for a realistic spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import hybridlm
from hybridlm.layers import moe as moe_lib
from pallas_kernels.grouped_matmul import gmm, gmm_swiglu
from pallas_kernels.quantized import quantize_int4, quantize_int8


def preset(name: str):
    return hybridlm.get_config(name)


def build(config, tokens: int, expert_format: str, dtype, seed: int = 0):
    m, h = config.moe, config.hidden_dim
    keys = jax.random.split(jax.random.key(seed), 7)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    x = normal(keys[0], (tokens, h), 1.0 / 4)  # hidden states of std ~2 (post-norm scale)
    router = normal(keys[1], (h, m.num_experts), h)
    gate_up = normal(keys[2], (m.num_experts, h, 2 * m.expert_ffn_dim), h)
    down = normal(keys[3], (m.num_experts, m.expert_ffn_dim, h), m.expert_ffn_dim)
    if expert_format == "int8":
        gate_up, down = quantize_int8(gate_up), quantize_int8(down)
    elif expert_format == "int4":
        gate_up, down = quantize_int4(gate_up), quantize_int4(down)
    shared = (
        normal(keys[4], (h, 2 * m.shared_ffn_dim), h),
        normal(keys[5], (m.shared_ffn_dim, h), m.shared_ffn_dim),
        normal(keys[6], (h,), h),
    )
    return x, router, gate_up, down, shared


def stages(config, implementation):
    m = config.moe

    @jax.jit
    def route(x, router):
        return moe_lib.route_top_k(x @ router, m.top_k, normalize=m.normalize_top_k)

    @jax.jit
    def dispatch(ids):  # the sort; the rows' gather is fused into gate_up (lhs_index), as in the layer
        d = moe_lib.dispatch(ids, m.num_experts)
        return d.order // m.top_k, d.order, d.group_sizes

    @jax.jit
    def gate_up_fn(x, token_of_row, gate_up, group_sizes):
        return gmm_swiglu(x, gate_up, group_sizes, lhs_index=token_of_row, implementation=implementation)

    @jax.jit
    def down_fn(h, down, group_sizes):
        return gmm(h, down, group_sizes, implementation=implementation)

    @jax.jit
    def combine(y, order, weights):
        tokens, top_k = weights.shape
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
        per_token = y[inverse].reshape(tokens, top_k, -1)
        return jnp.einsum(
            "tk,tkh->th", weights.astype(y.dtype), per_token, preferred_element_type=jnp.float32
        ).astype(y.dtype)

    @jax.jit
    def shared_fn(x, shared_gate_up, shared_down, token_gate):
        out = moe_lib.swiglu(x, shared_gate_up, shared_down)
        return jax.nn.sigmoid((x @ token_gate).astype(jnp.float32)).astype(x.dtype)[:, None] * out

    @jax.jit
    def layer(x, router, gate_up, down, shared_gate_up, shared_down, token_gate):
        weights, ids = moe_lib.route_top_k(x @ router, m.top_k, normalize=m.normalize_top_k)
        routed = moe_lib.routed_experts(x, weights, ids, gate_up, down, implementation=implementation)
        return routed + shared_fn(x, shared_gate_up, shared_down, token_gate)

    return route, dispatch, gate_up_fn, down_fn, combine, shared_fn, layer


def stage_times(config, tokens: int, expert_format: str, implementation, seconds_of: Callable) -> dict:
    """Milliseconds of each stage and of the whole layer (`seconds_of(call)` times a thunk), their shares, and
    the spread of the group sizes.

    Raises:
      FloatingPointError: the layer's output has NaN or Inf.
    """
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    x, router, gate_up, down, shared = build(config, tokens, expert_format, dtype)
    route, dispatch, gate_up_fn, down_fn, combine, shared_fn, layer = stages(config, implementation)
    weights, ids = route(x, router)
    token_of_row, order, group_sizes = dispatch(ids)
    h = gate_up_fn(x, token_of_row, gate_up, group_sizes)
    y = down_fn(h, down, group_sizes)
    calls = {
        "route": lambda: route(x, router),
        "dispatch": lambda: dispatch(ids),
        "gate_up": lambda: gate_up_fn(x, token_of_row, gate_up, group_sizes),
        "down": lambda: down_fn(h, down, group_sizes),
        "combine": lambda: combine(y, order, weights),
        "shared": lambda: shared_fn(x, *shared),
    }
    ms = {name: seconds_of(call) * 1e3 for name, call in calls.items()}
    staged_sum = sum(ms.values())
    whole = seconds_of(lambda: layer(x, router, gate_up, down, *shared)) * 1e3
    out = layer(x, router, gate_up, down, *shared)
    if not bool(jnp.isfinite(out.astype(jnp.float32)).all()):
        raise FloatingPointError("MoE layer output has NaN/Inf")
    sizes = jax.device_get(group_sizes)
    return {
        **{f"{k}_ms": v for k, v in ms.items()},
        "sum_of_stages_ms": staged_sum,
        "layer_ms": whole,
        "permute_and_combine_share": (ms["dispatch"] + ms["combine"]) / staged_sum,
        "group_size_min": int(sizes.min()),
        "group_size_max": int(sizes.max()),
        "empty_groups": int((sizes == 0).sum()),
    }

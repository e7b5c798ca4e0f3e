"""Whole sparse-MoE layer at one prefill chunk, split into its stages: where does the MoE time go?

Issue 5 asks for the whole-MoE-layer time (dispatch + both grouped matmuls + combine) beside the GMM figures,
and whether the permute / combine dominate. Stages, each its own jitted function timed alone, then the whole
layer as the model runs it (one jit, so XLA may overlap or fuse stages: it can be less than the sum):

  route     router matmul, softmax over experts, top-k, renormalise         [tokens, hidden] -> ids, weights
  dispatch  sort the token copies by expert, group sizes                    -> [tokens*top_k] token ids
  gate_up   gmm_swiglu (fused SwiGLU), gathering its token rows itself       -> [tokens*top_k, ffn]
  down      gmm                                                              -> [tokens*top_k, hidden]
  combine   inverse permutation, gather, weighted sum over top-k             -> [tokens, hidden]
  shared    shared expert (dense SwiGLU) and its sigmoid gate
  layer     SparseMoE.route + SparseMoE.experts, one jit

Timing: 3 warm-up calls, then the wall clock over --reps back-to-back calls closed by one synchronisation.
Random weights (normal / sqrt(fan_in)), random hidden states: router-skewed enough for a realistic spread.

usage: XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/moe_layer.py
           [--preset qwen3.6-35b-a3b] [--tokens 8192] [--expert-formats bf16 int8 int4] [--out F]
       (--preset tiny --tokens 64 runs on the CPU as a smoke test, with the reference GMM.)
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json

import hybridlm
from hybridlm.layers import moe as moe_lib
from pallas_kernels.grouped_matmul import gmm, gmm_swiglu
from pallas_kernels.quantized import quantize_int4, quantize_int8


def wall_ms(fn, *args, reps: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e3


def build(config, tokens: int, expert_format: str, dtype, seed: int = 0):
    m, h = config.moe, config.hidden_dim
    keys = jax.random.split(jax.random.key(seed), 7)
    normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
    x = normal(keys[0], (tokens, h), 1.0 / 4)                        # hidden states of std ~2 (post-norm scale)
    router = normal(keys[1], (h, m.num_experts), h)
    gate_up = normal(keys[2], (m.num_experts, h, 2 * m.expert_ffn_dim), h)
    down = normal(keys[3], (m.num_experts, m.expert_ffn_dim, h), m.expert_ffn_dim)
    if expert_format == "int8":
        gate_up, down = quantize_int8(gate_up), quantize_int8(down)
    elif expert_format == "int4":
        gate_up, down = quantize_int4(gate_up), quantize_int4(down)
    shared = (normal(keys[4], (h, 2 * m.shared_ffn_dim), h), normal(keys[5], (m.shared_ffn_dim, h), m.shared_ffn_dim),
              normal(keys[6], (h,), h))
    return x, router, gate_up, down, shared


def stages(config, implementation):
    m = config.moe

    @jax.jit
    def route(x, router):
        return moe_lib.route_top_k(x @ router, m.top_k, normalize=m.normalize_top_k)

    @jax.jit
    def dispatch(ids):   # the sort; the rows' gather is fused into gate_up (lhs_index), as in the layer
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
        return jnp.einsum("tk,tkh->th", weights.astype(y.dtype), per_token,
                          preferred_element_type=jnp.float32).astype(y.dtype)

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


def run(config, tokens: int, expert_format: str, reps: int, implementation) -> dict:
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    x, router, gate_up, down, shared = build(config, tokens, expert_format, dtype)
    route, dispatch, gate_up_fn, down_fn, combine, shared_fn, layer = stages(config, implementation)
    weights, ids = route(x, router)
    token_of_row, order, group_sizes = dispatch(ids)
    h = gate_up_fn(x, token_of_row, gate_up, group_sizes)
    y = down_fn(h, down, group_sizes)
    ms = {
        "route": wall_ms(route, x, router, reps=reps),
        "dispatch": wall_ms(dispatch, ids, reps=reps),
        "gate_up": wall_ms(gate_up_fn, x, token_of_row, gate_up, group_sizes, reps=reps),
        "down": wall_ms(down_fn, h, down, group_sizes, reps=reps),
        "combine": wall_ms(combine, y, order, weights, reps=reps),
        "shared": wall_ms(shared_fn, x, *shared, reps=reps),
    }
    staged_sum = sum(ms.values())
    whole = wall_ms(layer, x, router, gate_up, down, *shared, reps=reps)
    out = layer(x, router, gate_up, down, *shared)
    if not bool(jnp.isfinite(out.astype(jnp.float32)).all()):
        raise FloatingPointError("MoE layer output has NaN/Inf")
    sizes = jax.device_get(group_sizes)
    return {"expert_format": expert_format, "tokens": tokens, "stage_ms": {k: round(v, 4) for k, v in ms.items()},
            "stage_share": {k: round(v / staged_sum, 3) for k, v in ms.items()},
            "sum_of_stages_ms": round(staged_sum, 4), "layer_ms": round(whole, 4),
            "permute_and_combine_share": round((ms["dispatch"] + ms["combine"]) / staged_sum, 3),
            "group_sizes": {"min": int(sizes.min()), "max": int(sizes.max()), "empty": int((sizes == 0).sum())}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--expert-formats", nargs="+", choices=("bf16", "int8", "int4"), default=["bf16", "int8", "int4"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--implementation", default=None, help="grouped matmul: reference | pallas (default: auto)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    config = hybridlm.get_config(args.preset)
    doc = run_header("moe_layer", preset=args.preset, hidden=config.hidden_dim, experts=config.moe.num_experts,
                     top_k=config.moe.top_k, expert_ffn=config.moe.expert_ffn_dim, rows=[])
    for fmt in args.expert_formats:
        doc["rows"].append(run(config, args.tokens, fmt, args.reps, args.implementation))
        print(json.dumps(doc["rows"][-1]), flush=True)
    write_json(doc, args.out)
    return doc


if __name__ == "__main__":
    main()

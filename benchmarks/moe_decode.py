"""Decode-size routed MoE: the token copies sorted by expert against run unsorted with each row's expert named.

A decode step sends each of a few tokens to top-8 of 256 experts. `moe.routed_experts` either sorts the
(token, slot) copies by expert (dispatch, the grouped matmuls on sorted rows, the inverse permutation) or, up to
`moe.UNSORTED_MAX_ROWS` copies (`UNSORTED_MAX_ROWS_QUANTIZED` with quantized experts), runs the grouped matmuls on the copies as they come with each row's expert given
(`row_groups`). This times route + routed experts (the shared expert left out) over `--layers` layers, each with
its own weights (unrolled in one jitted function: a scan over stacked weights would copy each layer's slice, and
one layer repeated would be served from L2), per weight format, token count and path; "active" bytes are the
distinct experts the routing picked (their gate_up and down weights, scales included), over the time. It also
checks that both paths give the same outputs. --gemv-max-rows 0 8 times the unsorted path with each value of
`pallas_gemv.MAX_ROWS` in turn (0: the tensor-core row kernels only; an A/B of the matrix-vector kernels). Each
timed call runs the layers `REPEAT` times, so that the host's dispatch of the call is not what is timed. With
--sweep it times the unsorted path's two kernels alone over tile shapes (`pallas_triton.BlockSizes`, block_n x
block_k); with --gemv-sweep, the tensor-core row kernels against the matrix-vector kernels per `GemvBlocks`.

usage (GPU machine): python benchmarks/moe_decode.py [--formats bf16 int8 int4] [--tokens 1 4 8 16]
    [--layers 8] [--gemv-max-rows 0 8] [--sweep | --gemv-sweep] [--out moe_decode.json]
(--preset tiny --layers 2 --tokens 1 3 runs on the CPU as a smoke test, in the Pallas interpreter.)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import gemv_max_rows, run_header, write_json
from grouped_matmul import rel_err, timeit

import hybridlm
from hybridlm.layers import moe as moe_lib
from pallas_kernels.grouped_matmul import pallas_gemv, pallas_triton, reference
from pallas_kernels.grouped_matmul.pallas_gemv import GemvBlocks
from pallas_kernels.grouped_matmul.pallas_triton import BlockSizes
from pallas_kernels.quantized import QuantizedWeights, quantize_int4, quantize_int8


def layer_weights(config, layers: int, fmt: str):
    """Per layer: (gate_up, down, router), each layer's own arrays."""
    m, h = config.moe, config.hidden_dim
    out = []
    for layer in range(layers):
        k = jax.random.split(jax.random.key(layer), 3)
        gate_up = (jax.random.normal(k[0], (m.num_experts, h, 2 * m.expert_ffn_dim)) / math.sqrt(h)).astype(jnp.bfloat16)
        down = (jax.random.normal(k[1], (m.num_experts, m.expert_ffn_dim, h)) / math.sqrt(m.expert_ffn_dim)
                ).astype(jnp.bfloat16)
        if fmt != "bf16":
            quantize = quantize_int8 if fmt == "int8" else quantize_int4
            gate_up, down = quantize(gate_up), quantize(down)
        router = (jax.random.normal(k[2], (h, m.num_experts)) / math.sqrt(h)).astype(jnp.bfloat16)
        out.append(jax.block_until_ready((gate_up, down, router)))
    return out


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantizedWeights) else w.size * w.dtype.itemsize


# The layers run this many times per timed call, so that the host's dispatch of one call (weights of 8 layers as
# arguments) is spread over enough device work not to be what is timed.
REPEAT = 4


@functools.partial(jax.jit, static_argnames=("top_k", "sort", "repeat"))
def decode_layers(x, weights, *, top_k: int, sort: bool, repeat: int = 1):
    """x [tokens, hidden] through each layer's route + routed experts (a residual sum), `repeat` times over the
    layers; returns (x, the first pass's ids)."""
    all_ids = []
    for _ in range(repeat):
        for gate_up, down, router in weights:
            w, ids = moe_lib.route_top_k(x @ router, top_k)
            y = moe_lib.routed_experts(x, w, ids, gate_up, down, sort=sort)
            x = (x + 0.1 * y).astype(x.dtype)
            all_ids.append(ids)
    return x, jnp.stack(all_ids[:len(weights)])


def layer_rows(config, fmt: str, weights, tokens_list, max_rows_list=(pallas_gemv.MAX_ROWS,),
               repeat: int = REPEAT) -> list[dict]:
    m = config.moe
    per_expert = (nbytes(weights[0][0]) + nbytes(weights[0][1])) / m.num_experts
    rows = []
    for tokens in tokens_list:
        x = jax.random.normal(jax.random.key(99), (tokens, config.hidden_dim), jnp.bfloat16)
        outs = {}
        for sort, max_rows in [(True, pallas_gemv.MAX_ROWS)] + [(False, v) for v in max_rows_list]:
            f = functools.partial(decode_layers, top_k=m.top_k, sort=sort, repeat=repeat)
            with gemv_max_rows(max_rows):
                out, ids = f(x, weights)
                t = timeit(f, x, weights) / len(weights) / repeat
            outs[sort] = out
            ids = np.asarray(ids)
            active = float(np.mean([len(np.unique(ids[i])) for i in range(len(weights))]))
            path = "sorted" if sort else f"unsorted, gemv up to {max_rows} rows"
            row = {"weights": fmt, "tokens": tokens, "path": path,
                   "us_per_layer": round(t * 1e6, 2), "active_experts": active,
                   "active_MB": round(active * per_expert / 1e6, 2),
                   "active_GBps": round(active * per_expert / t / 1e9, 1),
                   "finite": bool(jnp.isfinite(out.astype(jnp.float32)).all())}
            if not sort:
                row["rel_diff_vs_sorted"] = rel_err(outs[False], outs[True])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def kernel_inputs(config, tokens: int):
    """(x [tokens, hidden], random experts of the tokens * top_k rows, each row's token, the rows' SwiGLU output
    [tokens * top_k, ffn]) for timing the two products alone."""
    m = config.moe
    x = jax.random.normal(jax.random.key(5), (tokens, config.hidden_dim), jnp.bfloat16)
    groups = jax.random.randint(jax.random.key(6), (tokens * m.top_k,), 0, m.num_experts)
    token_of_row = jnp.arange(tokens * m.top_k, dtype=jnp.int32) // m.top_k
    hidden = jax.random.normal(jax.random.key(7), (tokens * m.top_k, m.expert_ffn_dim), jnp.bfloat16)
    return x, groups, token_of_row, hidden


def sweep_rows(config, fmt: str, weights, tokens_list) -> list[dict]:
    """The unsorted path's kernels alone (gmm_swiglu with the token gather, then gmm) per tile shape."""
    convert = "convert" if fmt == "bf16" else "asm"
    configs = [None] + [BlockSizes(block_m=pallas_triton.ROW_BLOCK_M, block_n=bn, block_k=bk, num_warps=4,
                                   num_stages=3, int_to_float=convert) for bn in (32, 64, 128) for bk in (128, 256)]
    rows = []
    for tokens in tokens_list:
        x, groups, token_of_row, hidden = kernel_inputs(config, tokens)
        for product in ("gate_up", "down"):
            for bs in configs:
                if product == "gate_up":
                    f = jax.jit(lambda a, ws, g, t, bs=bs: [pallas_triton.gmm_swiglu_pallas(
                        a, w[0], row_groups=g, lhs_index=t, block_sizes=bs) for w in ws])
                    args = (x, weights, groups, token_of_row)
                else:
                    f = jax.jit(lambda a, ws, g, bs=bs: [pallas_triton.gmm_pallas(a, w[1], row_groups=g, block_sizes=bs)
                                                         for w in ws])
                    args = (hidden, weights, groups)
                name = "default" if bs is None else f"{bs.block_n}x{bs.block_k}"
                row = {"sweep": product, "weights": fmt, "tokens": tokens, "config": name}
                try:
                    row["us"] = round(timeit(f, *args) / len(weights) * 1e6, 2)
                except Exception as e:  # noqa: BLE001  (a tile the device refuses: recorded, not fatal)
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def gemv_configs(quick: bool) -> list[GemvBlocks]:
    """Matrix-vector kernel shapes for --gemv-sweep: unrolled k over block_n x block_k at 4 warps, then warps and
    the pipelined loop at the middle shapes."""
    if quick:
        return [GemvBlocks()]
    out = [GemvBlocks(block_n=bn, block_k=bk) for bn in (4, 8, 16) for bk in (256, 512)]
    out += [GemvBlocks(block_n=bn, block_k=256, num_warps=8) for bn in (8, 16)]
    out += [GemvBlocks(block_n=8, block_k=256, unroll=False, num_stages=3)]
    return out


def sweep_gemv(config, fmt: str, weights, tokens_list, quick: bool = False) -> list[dict]:
    """The unsorted path's two products per layer (gmm_swiglu with the token gather; gmm, then the weighted combine
    in XLA): the tensor-core row kernels against the matrix-vector kernels (`pallas_gemv`) per `GemvBlocks`, each
    checked against the reference. Each timed call runs `REPEAT` inputs through 8 layers."""
    m = config.moe
    rows = []
    for tokens in tokens_list:
        x, groups, token_of_row, hidden = kernel_inputs(config, tokens)
        xs = [x] + [x * (1 + 0.01 * r) for r in range(1, REPEAT)]   # distinct inputs: no call is a repeat of one
        hs = [hidden] + [hidden * (1 + 0.01 * r) for r in range(1, REPEAT)]
        rw = jax.nn.softmax(jax.random.normal(jax.random.key(8), (tokens, m.top_k)), axis=-1).astype(jnp.bfloat16)
        ref = {"gate_up": reference.gmm_swiglu_reference(x, weights[0][0], row_groups=groups, lhs_index=token_of_row),
               "down": jnp.einsum("ts,tsn->tn", rw.astype(jnp.float32), reference.gmm_reference(
                   hidden, weights[0][1], row_groups=groups, preferred_element_type=jnp.float32).reshape(
                       tokens, m.top_k, -1)).astype(jnp.bfloat16)}
        for product in ("gate_up", "down"):
            for bs in [None] + gemv_configs(quick):
                if product == "gate_up":
                    def f(a, ws, g, t, bs=bs):
                        return [pallas_triton.gmm_swiglu_pallas(a, w[0], row_groups=g, lhs_index=t) if bs is None else
                                pallas_gemv.gemv_swiglu_pallas(a, w[0], row_groups=g, lhs_index=t, block_sizes=bs)
                                for w in ws]
                else:   # the down product, then the weighted combine in XLA (as `moe.routed_experts` does)
                    def f(a, ws, g, c, bs=bs):
                        down = [pallas_triton.gmm_pallas(a, w[1], row_groups=g) if bs is None else
                                pallas_gemv.gemv_pallas(a, w[1], row_groups=g, block_sizes=bs) for w in ws]
                        return [jnp.einsum("ts,tsn->tn", c, y.reshape(c.shape[0], c.shape[1], -1),
                                           preferred_element_type=jnp.float32).astype(a.dtype) for y in down]
                f = jax.jit(lambda xs, *rest, f=f: [y for a in xs for y in f(a, *rest)])   # REPEAT inputs
                args = (xs, weights, groups, token_of_row) if product == "gate_up" else (hs, weights, groups, rw)
                name = ("rows (tensor cores)" if bs is None else
                        f"gemv {bs.block_n}x{bs.block_k} w{bs.num_warps}" + ("" if bs.unroll else f" loop s{bs.num_stages}"))
                row = {"sweep": product, "weights": fmt, "tokens": tokens, "config": name}
                try:
                    row["rel_err"] = rel_err(f(*args)[0], ref[product])
                    row["us"] = round(timeit(f, *args) / len(weights) / REPEAT * 1e6, 2)
                except Exception as e:  # noqa: BLE001  (a shape the device refuses: recorded, not fatal)
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--formats", nargs="+", choices=("bf16", "int8", "int4"), default=["bf16", "int8", "int4"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--layers", type=int, default=8, help="layers, each with its own weights")
    p.add_argument("--sweep", action="store_true", help="instead: the unsorted path's kernels per tile shape")
    p.add_argument("--gemv-max-rows", type=int, nargs="+", default=[pallas_gemv.MAX_ROWS],
                   help="pallas_gemv.MAX_ROWS values for the unsorted path (0: the tensor-core row kernels)")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="instead: the row kernels against the matrix-vector kernels per GemvBlocks")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    config = hybridlm.get_config(args.preset)
    doc = run_header("moe_decode", preset=args.preset, layers=args.layers,
                     unsorted_max_rows=moe_lib.UNSORTED_MAX_ROWS,
                     unsorted_max_rows_quantized=moe_lib.UNSORTED_MAX_ROWS_QUANTIZED, rows=[])
    for fmt in args.formats:
        weights = layer_weights(config, args.layers, fmt)
        if args.gemv_sweep:
            doc["rows"] += sweep_gemv(config, fmt, weights, args.tokens, quick=args.preset == "tiny")
        else:
            doc["rows"] += (sweep_rows(config, fmt, weights, args.tokens) if args.sweep else layer_rows(
                config, fmt, weights, args.tokens, args.gemv_max_rows, repeat=1 if args.preset == "tiny" else REPEAT))
        del weights
    write_json(doc, args.out, echo=False)
    return doc


if __name__ == "__main__":
    main()

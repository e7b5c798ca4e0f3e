"""Tile-shape sweep of our grouped matmul on the MoE layer's two products at prefill sizes, per weight format.

The prefill runs `gmm_swiglu` (gate_up: k = hidden, 2 * ffn columns) then `gmm` (down: k = ffn); rows are
tokens x top-8, so a prefill chunk of 8192 tokens gives m = 65536 and one of 32768 gives m = 262144. For
each (product, m, weight format) this times the default tile shape and the candidates below, by the method of
grouped_matmul.py (median of trials of back-to-back calls), and checks each output against the default's.
With --gather it also times the MoE dispatch's row gather as a separate XLA gather followed by gmm_swiglu
against the gather fused into the kernel (`lhs_index`), on token rows x [m / 8, hidden], and checks that both
give the same output.

usage (GPU machine): python benchmarks/gmm_tiles.py [--m 65536 262144] [--formats int8] [--out tiles.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json
from grouped_matmul import config_name, parse_config, rel_err, timeit

from pallas_kernels.grouped_matmul import pallas_triton, workloads
from pallas_kernels.grouped_matmul.pallas_triton import BlockSizes

HIDDEN, FFN, GROUPS = 2048, 512, 256   # Qwen3.5/3.6-35B-A3B experts


def candidates(swiglu: bool, quantized: bool, rows_per_group: float = 1024.0) -> list[BlockSizes | None]:
    """None (the default) first, then the shapes tried; the SwiGLU kernel holds two accumulators. Groups of
    <= 64 rows (small chunks: weight-read bound) get small m-tiles."""
    out: list[BlockSizes | None] = [None]
    if rows_per_group <= 64:
        return out + [
            BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4),
            BlockSizes(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4),
            BlockSizes(block_m=32, block_n=256, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=16, block_n=256, block_k=128, num_warps=8, num_stages=3),
            BlockSizes(block_m=32, block_n=128, block_k=128, num_warps=8, num_stages=3),
            BlockSizes(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4),
            BlockSizes(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="tile_swapped"),
        ]
    if quantized:
        out += [
            BlockSizes(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3),
            BlockSizes(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=4),
            BlockSizes(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=4),
            BlockSizes(block_m=128, block_n=32, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=256, block_n=64, block_k=64, num_warps=8, num_stages=2),
            BlockSizes(block_m=256, block_n=32, block_k=64, num_warps=8, num_stages=3),
            BlockSizes(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
            BlockSizes(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3, quant_mode="tile_swapped"),
        ]
        if not swiglu:
            out += [BlockSizes(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3)]
        else:
            out += [BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]
    else:
        out += [BlockSizes(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3),
                BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]
    return out


def schedule_rows(ms: list[int]) -> list[dict]:
    """make_schedule (the work-item list every call builds from group_sizes) per searchsorted method: alone, and
    the whole int8 gmm_swiglu call (weight-bound at small m) that builds it."""
    out = []
    for m in ms:
        w = workloads.Workload(name=f"gate_up_{m}", m=m, k=HIDDEN, n=FFN, groups=GROUPS)
        lhs, rhs, gs = workloads.make_inputs(w, weights="int8", swiglu=True, on_device_rng=True)
        block_m = BlockSizes.get_default(m, HIDDEN, FFN, GROUPS, bits=8, swiglu=True, k_major=True).block_m
        want, default = None, pallas_triton.SCHEDULE_SEARCH
        for method in ("scan", "scan_unrolled", "compare_all", "sort"):
            pallas_triton.SCHEDULE_SEARCH = method      # read when gmm_swiglu_pallas is traced
            jax.clear_caches()
            f = jax.jit(lambda g, method=method, m=m, block_m=block_m: pallas_triton.make_schedule(g, m, block_m,
                                                                                          search=method))
            call = jax.jit(pallas_triton.gmm_swiglu_pallas)
            got = f(gs)
            want = got if want is None else want
            row = {"schedule": method, "m": m, "block_m": block_m, "ms": round(timeit(f, gs) * 1e3, 4),
                   "gmm_swiglu_int8_ms": round(timeit(call, lhs, rhs, gs) * 1e3, 4),
                   "same_as_scan": all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))}
            print(json.dumps(row), flush=True)
            out.append(row)
        pallas_triton.SCHEDULE_SEARCH = default
        jax.clear_caches()
    return out


def gather_rows(m: int, kind: str) -> list[dict]:
    """gmm_swiglu on rows x[index] (index: sorted copy -> token, as the MoE dispatch makes it): separate
    gather vs fused (`lhs_index`)."""
    top_k = 8
    w = workloads.Workload(name=f"gather_{m}", m=m, k=HIDDEN, n=FFN, groups=GROUPS)
    _, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=True, on_device_rng=True)
    x = jax.random.normal(jax.random.PRNGKey(7), (m // top_k, HIDDEN), jnp.bfloat16)
    index = (jax.random.permutation(jax.random.PRNGKey(8), m) // top_k).astype(jnp.int32)
    separate = jax.jit(lambda x, b, g, i: pallas_triton.gmm_swiglu_pallas(x[i], b, g))
    fused = jax.jit(lambda x, b, g, i: pallas_triton.gmm_swiglu_pallas(x, b, g, lhs_index=i))
    want = separate(x, rhs, gs, index)
    out = []
    for name, f in (("separate_gather", separate), ("fused_gather", fused)):
        t = timeit(f, x, rhs, gs, index)
        row = {"product": "gate_up", "m": m, "weights": kind, "config": name, "ms": round(t * 1e3, 4),
               "tflops": round(2 * w.flops / t / 1e12, 1),
               "rel_err_vs_default": round(rel_err(f(x, rhs, gs, index), want), 6)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[65536, 262144], help="routed rows (tokens x top-k)")
    p.add_argument("--formats", nargs="+", default=["int8"], choices=("float", "int8", "int4"))
    p.add_argument("--products", nargs="*", default=["gate_up", "down"], choices=("gate_up", "down"),
                   help="products to sweep (none: only --gather)")
    p.add_argument("--gather", action="store_true", help="also time the fused dispatch gather (gate_up)")
    p.add_argument("--configs", nargs="+", default=None,
                   help="quantized weights: these tile shapes (grouped_matmul.parse_config names, e.g. default "
                        "32x128x64w4s4swp) instead of the candidate lists")
    p.add_argument("--schedule", action="store_true",
                   help="also time make_schedule alone, per searchsorted method")
    p.add_argument("--kn", action="store_true",
                   help="quantized codes stored [groups, k, n] (the layout before 2026-11-25) instead of k-major")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    if args.schedule:
        rows += schedule_rows(args.m)
    if args.gather:
        for m in args.m:
            for kind in args.formats:
                rows += gather_rows(m, kind)
    for m in args.m:
        for product in args.products:
            swiglu = product == "gate_up"
            w = workloads.Workload(name=f"{product}_{m}", m=m, k=HIDDEN if swiglu else FFN,
                                   n=FFN if swiglu else HIDDEN, groups=GROUPS)
            fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
            flops = w.flops * (2 if swiglu else 1)
            for kind in ["float"] + [f for f in args.formats if f != "float"]:
                lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
                if args.kn and kind != "float":
                    rhs = jax.block_until_ready(rhs.with_k_major(False))
                want = None
                if kind not in args.formats:
                    configs = [None]
                elif args.configs:
                    configs = [parse_config(c) for c in args.configs]
                else:
                    configs = candidates(swiglu, kind != "float", m / GROUPS)
                for bs in configs:
                    try:
                        f = jax.jit(lambda a, b, g, bs=bs, fn=fn: fn(a, b, g, block_sizes=bs))
                        out = f(lhs, rhs, gs)
                        want = out if want is None else want
                        t = timeit(f, lhs, rhs, gs)
                        nbytes = rhs.nbytes
                        row = {"product": product, "m": m, "weights": kind, "config": config_name(bs),
                               "k_major": kind != "float" and not args.kn,
                               "ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1),
                               "weight_GBps": round(nbytes / t / 1e9, 1),
                               "rel_err_vs_default": round(rel_err(out, want), 6)}
                    except Exception as e:  # noqa: BLE001
                        row = {"product": product, "m": m, "weights": kind, "config": config_name(bs),
                               "error": repr(e)[:300]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del lhs, rhs
    doc = run_header("gmm_tiles", rows=rows)
    write_json(doc, args.out, echo=False)


if __name__ == "__main__":
    main()

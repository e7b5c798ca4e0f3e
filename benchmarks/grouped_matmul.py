"""Grouped matmul: ours (Pallas Triton) beside tokamax.ragged_dot, JAX ragged_dot_mgpu and a dense matmul.

One process, one GPU, the same router-skewed group sizes (workloads.py). For each workload it times every
implementation, checks that the outputs agree (relative Frobenius error against the first peer that ran),
writes one JSON document with the device, JAX version and date to --out, and prints a short table.

usage (GPU machine; tokamax needs its wheels and benchmarks/peers_stub on PYTHONPATH):
  python benchmarks/grouped_matmul.py [--workloads a,b] [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import run_header, write_json

from pallas_kernels.grouped_matmul import pallas_triton, workloads
from pallas_kernels.grouped_matmul.pallas_triton import BlockSizes


def timeit(f, *args, reps: int = 10, trials: int = 7) -> float:
    """Median over trials of the mean time of `reps` back-to-back calls, in seconds (one sync per trial)."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / reps)
    return float(np.median(ts))


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the memory ceiling of this run)."""
    x = jnp.ones((512 * 2**20,), jnp.float32)  # 2 GiB
    f = jax.jit(lambda v: v * 1.0001)
    t = timeit(f, x, reps=5, trials=5)
    return 2 * x.nbytes / t


def dense_peak() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16) * 0.01
    t = timeit(jax.jit(lambda x, y: x @ y), a, a, reps=5, trials=5)
    return 2 * 8192**3 / t


def peers():
    out = {}
    try:
        import tokamax
        out["tokamax.ragged_dot"] = lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="mosaic")
    except Exception as e:  # noqa: BLE001
        print("tokamax unavailable:", repr(e)[:300], flush=True)
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
        out["jax.ragged_dot_mgpu"] = lambda a, b, g: ragged_dot_mgpu.ragged_dot(
            a, b, group_sizes=g, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
            grid_block_n=1)
    except Exception as e:  # noqa: BLE001
        print("ragged_dot_mgpu unavailable:", repr(e)[:300], flush=True)
    return out


# Tile shapes tried for ours (the default first). Weight-bound shapes get small m-tiles.
CONFIGS_COMPUTE = [
    None,
    BlockSizes(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4),
    BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
    BlockSizes(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3),
    BlockSizes(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3),
]
CONFIGS_WEIGHT = [
    None,
    BlockSizes(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4),
    BlockSizes(block_m=32, block_n=256, block_k=64, num_warps=4, num_stages=4),
    BlockSizes(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
    BlockSizes(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=5),
]
CONFIGS_QUANT = [
    None,
    BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="block"),
    BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="scale_after_dot"),
    BlockSizes(block_m=32, block_n=64, block_k=64, num_warps=2, num_stages=4),
    BlockSizes(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="tile_swapped"),
]
CONFIGS_QUANT_PREFILL = [
    None,
    BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    BlockSizes(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    BlockSizes(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3),
    BlockSizes(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, quant_mode="tile_swapped"),
    BlockSizes(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4),
]
CONFIGS_SWIGLU = [
    None,
    BlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    BlockSizes(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
]


def parse_config(name: str) -> BlockSizes | None:
    """Inverse of `config_name`: "default" -> None, "32x128x64w4s4swpmg" -> BlockSizes(...)."""
    if name == "default":
        return None
    mo = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(swp|blk|sad)?(mg|as|ab)?(xs)?", name)
    if not mo:
        raise ValueError(f"config {name!r}: expected MxNxKwWsS[swp|blk|sad][mg|as|ab][xs], e.g. 32x128x64w4s4swpmg "
                         f"(xs: the exact silu, fast_silu=False)")
    m, n, k, w, st = (int(v) for v in mo.groups()[:5])
    mode = {None: "tile", "swp": "tile_swapped", "blk": "block", "sad": "scale_after_dot"}[mo.group(6)]
    return BlockSizes(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st, quant_mode=mode,
                      int_to_float={None: "convert", "mg": "magic", "as": "asm", "ab": "asm_bf16"}[mo.group(7)],
                      fast_silu=mo.group(8) is None)


def config_name(bs):
    return "default" if bs is None else (f"{bs.block_m}x{bs.block_n}x{bs.block_k}"
                                         f"w{bs.num_warps}s{bs.num_stages}"
                                         + {"tile": "", "tile_swapped": "swp", "block": "blk",
                                            "scale_after_dot": "sad"}[bs.quant_mode]
                                         + {"convert": "", "magic": "mg", "asm": "as", "asm_bf16": "ab"}[bs.int_to_float]
                                         + ("" if bs.fast_silu else "xs"))


def run_workload(w: workloads.Workload, peer_fns, quick: bool, rows: list, hbm: float, only_quant=False):
    weight_bound = "weight_bound" in w.tags
    lhs, rhs, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, on_device_rng=True)
    base = {"workload": w.name, "M": w.m, "K": w.k, "N": w.n, "G": w.groups}
    weight_bytes = w.groups * w.k * w.n * 2

    def record(impl, config, t, err=None, weights="bf16", nbytes=weight_bytes):
        row = dict(base, impl=impl, config=config, weights=weights, ms=round(t * 1e3, 4),
                   tflops=round(w.flops / t / 1e12, 1), weight_GBps=round(nbytes / t / 1e9, 1),
                   weight_bw_frac=round(nbytes / t / hbm, 3), rel_err=None if err is None else round(err, 5))
        rows.append(row)
        print(json.dumps(row), flush=True)

    f_dense = jax.jit(lambda a, b: a @ b[0])
    record("dense_same_flops", "", timeit(f_dense, lhs, rhs))
    ref_out = None
    for name, fn in ({} if only_quant else peer_fns).items():
        try:
            f = jax.jit(fn)
            out = f(lhs, rhs, gs)
            err = None if ref_out is None else rel_err(out, ref_out)
            ref_out = out if ref_out is None else ref_out
            record(name, "default", timeit(f, lhs, rhs, gs), err)
        except Exception as e:  # noqa: BLE001
            print(f"{name} failed on {w.name}: {repr(e)[:400]}", flush=True)
    configs = CONFIGS_WEIGHT if weight_bound else CONFIGS_COMPUTE
    for bs in configs[:1] if quick or only_quant else configs:
        try:
            f = jax.jit(lambda a, b, g, bs=bs: pallas_triton.gmm_pallas(a, b, g, block_sizes=bs))
            out = f(lhs, rhs, gs)
            err = None if ref_out is None else rel_err(out, ref_out)
            record("ours.gmm", config_name(bs), timeit(f, lhs, rhs, gs), err)
            if ref_out is None:
                ref_out = out
        except Exception as e:  # noqa: BLE001
            print(f"ours {config_name(bs)} failed on {w.name}: {repr(e)[:1500]}", flush=True)

    if True:   # quantized weights: same problem, fewer weight bytes (tile shapes swept where weight-bound)
        f_bf16 = jax.jit(lambda a, b, g: pallas_triton.gmm_pallas(a, b, g))
        for kind in ("int8", "int4"):
            _, q, _ = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=kind, on_device_rng=True)
            want = f_bf16(lhs, q.dequantize(jnp.bfloat16), gs)
            sweep = CONFIGS_QUANT if weight_bound else CONFIGS_QUANT_PREFILL
            for bs in sweep[:1] if quick else sweep:
                try:
                    f = jax.jit(lambda a, b, g, bs=bs: pallas_triton.gmm_pallas(a, b, g, block_sizes=bs))
                    out = f(lhs, q, gs)
                    record("ours.gmm", config_name(bs), timeit(f, lhs, q, gs), rel_err(out, want),
                           weights=kind, nbytes=q.nbytes)
                except Exception as e:  # noqa: BLE001
                    print(f"ours {kind} {config_name(bs)} failed: {repr(e)[:1500]}", flush=True)

    if w.name == "prefill_gate_up" and not only_quant:   # fused SwiGLU vs gmm + separate activation
        ffn = w.n // 2

        def unfused(a, b, g):
            h = pallas_triton.gmm_pallas(a, b, g)
            return (jax.nn.silu(h[:, :ffn].astype(jnp.float32)) * h[:, ffn:]).astype(a.dtype)

        f_unfused = jax.jit(unfused)
        want = f_unfused(lhs, rhs, gs)
        record("ours.gmm+silu*up", "default", timeit(f_unfused, lhs, rhs, gs))
        for bs in CONFIGS_SWIGLU[:1] if quick else CONFIGS_SWIGLU:
            try:
                f = jax.jit(lambda a, b, g, bs=bs: pallas_triton.gmm_swiglu_pallas(a, b, g, block_sizes=bs))
                out = f(lhs, rhs, gs)
                record("ours.gmm_swiglu", config_name(bs), timeit(f, lhs, rhs, gs), rel_err(out, want))
            except Exception as e:  # noqa: BLE001
                print(f"swiglu {config_name(bs)} failed: {repr(e)[:1500]}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="prefill_gate_up,prefill_down,small_gate_up")
    parser.add_argument("--quick", action="store_true", help="default tile shapes only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-quant", action="store_true", help="skip peers, bf16 sweeps and SwiGLU")
    parser.add_argument("--profile", action="store_true",
                        help="run ours once per weight format on small_gate_up (for ncu) and exit")
    args = parser.parse_args()
    if args.profile:
        w = workloads.WORKLOADS["small_gate_up"]
        for kind in ("float", "int8", "int4"):
            lhs, rhs, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=kind, on_device_rng=True)
            jax.block_until_ready(pallas_triton.gmm_pallas(lhs, rhs, gs))
        return
    dev = jax.devices()[0]
    hbm = copy_bandwidth()
    peak = dense_peak()
    print(f"device {dev.device_kind}; copy {hbm / 1e9:.0f} GB/s; dense bf16 {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    peer_fns = peers()
    rows: list = []
    for name in args.workloads.split(","):
        run_workload(workloads.WORKLOADS[name], peer_fns, args.quick, rows, hbm, args.only_quant)
    doc = run_header("grouped_matmul", copy_GBps=round(hbm / 1e9, 1), dense_8192_tflops=round(peak / 1e12, 1),
                     workloads={n: dataclasses.asdict(workloads.WORKLOADS[n]) for n in args.workloads.split(",")},
                     rows=rows)
    write_json(doc, args.out, echo=False)
    # Short table last (the tail of the output is what comes back first).
    print("\nworkload            impl                  config              weights    ms   TFLOP/s  "
          "wGB/s  rel_err")
    for r in rows:
        print(f"{r['workload']:19s} {r['impl']:21s} {r['config']:19s} {r['weights']:6s} {r['ms']:8.3f} "
              f"{r['tflops']:7.1f} {r['weight_GBps']:7.0f}  {r['rel_err']}")


if __name__ == "__main__":
    main()

"""Runs one grouped-matmul configuration a few times, for a profiler (ncu / nsys) to look at.

usage (GPU machine): ncu --kernel-name regex:gmm --launch-skip 2 --launch-count 1 \
    python benchmarks/profile_gmm.py --product gate_up --m 4096 --weights int8
With --mosaic it runs `pallas_mosaic.gmm_mosaic` (Hopper, quantized weights) instead of the Triton kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from grouped_matmul import parse_config

from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, workloads
from pallas_kernels.quantized import QuantizedWeights

HIDDEN, FFN, GROUPS = 2048, 512, 256   # Qwen3.5/3.6-35B-A3B experts


def save(path, lhs, rhs, gs):
    arrays = {"lhs": lhs.astype(jnp.float32), "gs": gs}
    if isinstance(rhs, QuantizedWeights):
        arrays.update(values=rhs.values, scales=rhs.scales, bits=rhs.bits, k_major=rhs.k_major)
        if rhs.offsets is not None:
            arrays["offsets"] = rhs.offsets
    else:
        arrays["rhs"] = rhs.astype(jnp.float32)
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})


def load(path):
    z = np.load(path)
    lhs, gs = jnp.asarray(z["lhs"], jnp.bfloat16), jnp.asarray(z["gs"])
    if "rhs" in z:
        return lhs, jnp.asarray(z["rhs"], jnp.bfloat16), gs
    rhs = QuantizedWeights(values=jnp.asarray(z["values"]), scales=jnp.asarray(z["scales"]),
                           offsets=jnp.asarray(z["offsets"]) if "offsets" in z else None, bits=int(z["bits"]),
                           k_major=bool(z["k_major"]))
    return lhs, rhs, gs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--product", default="gate_up", choices=("gate_up", "down"))
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--weights", default="int8", choices=("float", "int8", "int4"))
    p.add_argument("--config", default="default",
                   help="tile shape as grouped_matmul.config_name writes it (e.g. 32x128x64w4s3swpmg); default tile")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--cache", default=None,
                   help="directory: save the inputs there on the first run, load them on later runs (so that a "
                        "profiled run only copies arrays to the device; ncu crashed in quantize_int8's program)")
    p.add_argument("--mosaic", action="store_true", help="the Hopper Mosaic GPU kernel (quantized weights only)")
    p.add_argument("--compute-wgs", type=int, default=None, help="with --mosaic: compute warpgroups")
    p.add_argument("--mosaic-config", default=None,
                   help="with --mosaic: block_k,stages (default: gmm_mosaic's)")
    p.add_argument("--wgmma-codes", action="store_true",
                   help="with --mosaic: the codes permuted to the wgmma register layout (pallas_mosaic.permute_codes)")
    p.add_argument("--kn", action="store_true",
                   help="quantized codes stored [groups, k, n] (the layout before 2026-11-25) instead of k-major")
    a = p.parse_args()
    swiglu = a.product == "gate_up"
    w = workloads.Workload(name=a.product, m=a.m, k=HIDDEN if swiglu else FFN, n=FFN if swiglu else HIDDEN,
                           groups=GROUPS)
    path = a.cache and os.path.join(a.cache, f"{a.product}_{a.m}_{a.weights}.npz")
    if path and os.path.exists(path):
        lhs, rhs, gs = load(path)
    else:
        lhs, rhs, gs = workloads.make_inputs(w, weights=a.weights, swiglu=swiglu, on_device_rng=True)
        if path:
            save(path, lhs, rhs, gs)
            print("saved", path)
            return
    if a.kn and isinstance(rhs, QuantizedWeights):
        rhs = rhs.with_k_major(False)
    bs = parse_config(a.config)
    fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
    f = jax.jit(lambda x, r, g: fn(x, r, g, block_sizes=bs))
    codes = None
    if a.mosaic:
        tiling = {}
        if a.mosaic_config:
            block_k, stages = (int(v) for v in a.mosaic_config.split(","))
            tiling = {"block_k": block_k, "stages": stages}
        codes = pallas_mosaic.permute_codes(rhs) if a.wgmma_codes else None
        f = jax.jit(lambda x, r, g, c: pallas_mosaic.gmm_mosaic(x, r, g, swiglu=swiglu, compute_wgs=a.compute_wgs,
                                                                wgmma_codes=c, **tiling))
    else:
        f = jax.jit(lambda x, r, g, c, f=f: f(x, r, g))
    for _ in range(a.calls):
        jax.block_until_ready(f(lhs, rhs, gs, codes))
    print("ran", a, flush=True)


if __name__ == "__main__":
    main()

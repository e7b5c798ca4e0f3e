"""The Hopper quantized grouped matmul (`pallas_mosaic.gmm_mosaic`) beside the Triton kernel, weight-read bound.

One run on the GPU machine: (1) checks `gmm_mosaic` against the f32 reference on the dequantized weights and
against the Triton kernel, on router-skewed and adversarial group layouts (empty groups, one group, rows of
no group, 512 groups), int8 and 4-bit, gmm and gmm_swiglu; (2) times, at the MoE layer's weight-read-bound
sizes (m = 4096 routed rows = 512 tokens x top-8, 256 experts, hidden 2048, ffn 512), the bf16 Triton kernel,
the quantized Triton kernel (defaults) and `gmm_mosaic` per configuration (dequantized by Mosaic GPU's own
conversion, "f32" / "bf16", or from codes stored in the wgmma register layout, "wgmma": `permute_codes`, done
once outside the timing), by the method of grouped_matmul.py (median of trials of back-to-back calls).

usage (GPU machine): python benchmarks/gmm_mosaic.py [--m 4096] [--out gmm_mosaic.json]
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
import numpy as np
from bench_io import run_header, write_json
from grouped_matmul import copy_bandwidth, rel_err, timeit

from pallas_kernels.grouped_matmul import pallas_mosaic, pallas_triton, reference, workloads

HIDDEN, FFN, GROUPS = 2048, 512, 256


def mosaic(lhs, rhs, gs, *, dequant, wgmma_codes=None, **kw):
    """`gmm_mosaic`; dequant "wgmma": the codes in the wgmma register layout (`permute_codes`, computed here
    unless given)."""
    if dequant != "wgmma":
        return pallas_mosaic.gmm_mosaic(lhs, rhs, gs, dequant=dequant, **kw)
    if wgmma_codes is None:
        wgmma_codes = pallas_mosaic.permute_codes(rhs)
    return pallas_mosaic.gmm_mosaic(lhs, rhs, gs, wgmma_codes=wgmma_codes, **kw)


def check_rows() -> list[dict]:
    rows = []
    shapes = [
        workloads.Workload(name="router_4096", m=4096, k=HIDDEN, n=FFN, groups=GROUPS),
        workloads.Workload(name="router_small", m=200, k=256, n=128, groups=8),
        workloads.Workload(name="empty_groups", m=96, k=256, n=64, groups=16, layout="empty_groups"),
        workloads.Workload(name="one_group", m=77, k=128, n=64, groups=4, layout="one_group"),
        workloads.Workload(name="partial", m=130, k=256, n=128, groups=8, layout="partial", routed_rows=97),
        workloads.Workload(name="all_padding", m=40, k=128, n=64, groups=4, layout="all_padding", routed_rows=0),
        workloads.Workload(name="g512", m=300, k=128, n=64, groups=512),
        workloads.Workload(name="m_below_rows", m=20, k=128, n=64, groups=4),
    ]
    for w in shapes:
        for kind in ("int8", "int4"):
            for swiglu in (False, True):
                lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
                ref_fn = reference.gmm_swiglu_reference if swiglu else reference.gmm_reference
                want = ref_fn(lhs.astype(jnp.float32), rhs.dequantize(jnp.bfloat16).astype(jnp.float32), gs)
                tri = (pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas)(lhs, rhs, gs)
                for dequant in ("f32", "bf16", "wgmma"):
                    got = mosaic(lhs, rhs, gs, swiglu=swiglu, dequant=dequant)
                    finite = bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))
                    row = {"check": w.name, "weights": kind, "swiglu": swiglu, "dequant": dequant,
                           "finite": finite, "rel_err_vs_reference": round(rel_err(got, want), 6),
                           "triton_rel_err_vs_reference": round(rel_err(tri, want), 6),
                           "rel_err_vs_triton": round(rel_err(got, tri), 6)}
                    row["ok"] = finite and row["rel_err_vs_reference"] <= 1e-2
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def time_rows(ms: list[int], configs: list[tuple]) -> list[dict]:
    rows = []
    for m in ms:
        for product in ("gate_up", "down"):
            swiglu = product == "gate_up"
            w = workloads.Workload(name=f"{product}_{m}", m=m, k=HIDDEN if swiglu else FFN,
                                   n=FFN if swiglu else HIDDEN, groups=GROUPS)
            tri_fn = pallas_triton.gmm_swiglu_pallas if swiglu else pallas_triton.gmm_pallas
            base = None
            for kind in ("float", "int8", "int4"):
                lhs, rhs, gs = workloads.make_inputs(w, weights=kind, swiglu=swiglu, on_device_rng=True)
                nbytes = rhs.nbytes if kind != "float" else rhs.size * 2
                runs = [("triton_default", jax.jit(lambda a, b, g, pc, f=tri_fn: f(a, b, g)))]
                pc = None
                if kind != "float":
                    pc = pallas_mosaic.permute_codes(rhs)   # a stored layout: permuted once, outside the timing
                    runs += [(f"mosaic_k{bk}_s{st}_wg{cw}_c{cps}_{dq}", jax.jit(
                        lambda a, b, g, pc, bk=bk, st=st, cw=cw, cps=cps, dq=dq, sw=swiglu: mosaic(
                            a, b, g, swiglu=sw, block_k=bk, stages=st, compute_wgs=cw, ctas_per_sm=cps,
                            dequant=dq, wgmma_codes=pc))) for bk, st, cw, cps, dq in configs]
                want = None
                for name, f in runs:
                    try:
                        out = f(lhs, rhs, gs, pc)
                        want = out if want is None else want
                        t = timeit(f, lhs, rhs, gs, pc)
                        if kind == "float":
                            base = t
                        row = {"product": product, "m": m, "weights": kind, "impl": name, "ms": round(t * 1e3, 4),
                               "weight_GBps": round(nbytes / t / 1e9, 1),
                               "x_bf16_triton": None if base is None else round(base / t, 3),
                               "rel_err_vs_triton": round(rel_err(out, want), 6)}
                    except Exception as e:  # noqa: BLE001
                        row = {"product": product, "m": m, "weights": kind, "impl": name, "error": repr(e)[-600:]}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                del lhs, rhs
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[4096])
    p.add_argument("--configs", nargs="+",
                   default=["128,4,2,1,wgmma", "128,4,4,1,wgmma", "64,6,4,1,wgmma", "128,4,2,1,f32", "128,4,4,1,f32"],
                   help="block_k,stages,compute_wgs,ctas_per_sm,dequant for gmm_mosaic (dequant f32, bf16, or wgmma: "
                        "the codes in the wgmma register layout)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split(",")[:4]) + tuple(c.split(",")[4:]) for c in args.configs]
    rows = [] if args.no_check else check_rows()
    hbm = copy_bandwidth()
    print(json.dumps({"copy_GBps": round(hbm / 1e9, 1)}), flush=True)
    rows += time_rows(args.m, configs)
    doc = run_header("gmm_mosaic", copy_GBps=round(hbm / 1e9, 1), rows=rows)
    write_json(doc, args.out, echo=False)
    bad = [r for r in rows if "check" in r and not r["ok"]]
    print(f"checks failed: {len(bad)}", flush=True)
    np.testing.assert_equal(len(bad), 0)


if __name__ == "__main__":
    main()

"""The CUDA quantized grouped matmul (`benchmarks/cuda_gmm`, an experiment) beside the Pallas kernels, weight-read
bound: does a kernel with the register budget and the instruction schedule in hand reach the proportional speed
(int8 ~1.9x, 4-bit ~3.2x bf16) that the Pallas kernels miss (1.5-1.6x, docs/benchmarks_gmm.md)?

One run on the GPU machine, every built configuration (`cuda_gmm.CONFIGS`):
1. exactness: with lhs = the identity (one group of k rows) the output is the group's dequantized bf16 weights,
   which must equal `QuantizedWeights.dequantize(bf16)` bit for bit (int8 and 4-bit, first and last group), or,
   for the opt-in bf16 arithmetic (4-bit), its emulation (`bf16_arith_weights`);
2. accuracy on router-skewed and adversarial group layouts (one group, empty groups, rows of no group, first
   and last only) against the f32 reference on the dequantized weights (for the bf16 arithmetic: on its own
   weights, `bf16_arith_weights`; its error against the exact weights is reported beside), with the Pallas
   kernel's error against the exact weights; the
   SwiGLU epilogue against `gmm_swiglu`'s reference; and group sizes adding up past m (the kernel clamps them);
3. times (median of trials of back-to-back calls, grouped_matmul.timeit) at `--ms` routed rows, k = 2048,
   n = 1024, 256 groups: the Pallas `gmm` with bf16, int8 and 4-bit weights (defaults) and the CUDA kernel per
   configuration and arithmetic, with the run's copy bandwidth;
4. with `--products`, the MoE layer's two expert products (gate_up with SwiGLU, down) at those m.

usage (GPU machine, nvcc at /usr/local/cuda/bin/nvcc or $NVCC):
    python benchmarks/gmm_cuda.py [--ms 1024,4096] [--products 4096] [--out F.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json
from cuda_gmm import CONFIGS, build, gmm_dequant, repack
from grouped_matmul import copy_bandwidth, rel_err, timeit

from pallas_kernels.grouped_matmul import pallas_triton, reference, workloads
from pallas_kernels.quantized import quantize_int4, quantize_int8

K, N, GROUPS = 2048, 1024, 256


def exactness(rows: list) -> None:
    w = jax.random.normal(jax.random.PRNGKey(3), (GROUPS, K, N), jnp.float32) * K**-0.5
    eye = jnp.eye(K, dtype=jnp.bfloat16)
    q8, q4 = quantize_int8(w), quantize_int4(w)
    for name, q, arith in (("int8", q8, "exact"), ("int4", q4, "exact"), ("int4", q4, "bf16")):
        packed = repack(q, arith)
        want = q.dequantize(jnp.bfloat16) if arith == "exact" else bf16_arith_weights(q)
        for g, c in [(g, c) for g in (0, GROUPS - 1) for c in CONFIGS]:
            gs = jnp.zeros((GROUPS,), jnp.int32).at[g].set(K)
            got = gmm_dequant(eye, packed, gs, config=c)
            differing = int(jnp.sum(lax_bits(got) != lax_bits(want[g])))
            row = {"check": "exact_dequant", "weights": name, "arith": arith, "group": g, "config": c,
                   "bitwise_equal": differing == 0, "differing": differing,
                   "max_abs_diff": float(jnp.max(jnp.abs(got.astype(jnp.float32) - want[g].astype(jnp.float32))))}
            rows.append(row)
            print(row, flush=True)


def bf16_arith_weights(q):
    """The weights of arith="bf16": q * bf16(s) + bf16(m), rounded to bf16 (through f32, where the sum of a 4-bit
    code times an 8-bit scale and an 8-bit offset is almost always exact)."""
    groups, k, n = q.shape
    codes = q.codes().astype(jnp.float32).reshape(groups, k // 32, 32, n)
    s = q.scales.astype(jnp.bfloat16).astype(jnp.float32)[:, :, None]
    m = q.offsets.astype(jnp.bfloat16).astype(jnp.float32)[:, :, None]
    return (codes * s + m).reshape(groups, k, n).astype(jnp.bfloat16)


def lax_bits(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16)


def accuracy(rows: list, *, swiglu: bool = False) -> None:
    """Every configuration on router-skewed and adversarial layouts against the f32 reference on the dequantized
    weights (for the bf16 arithmetic, on its own weights; the error against the exact weights beside), with the
    Pallas kernel's error against the exact weights. swiglu: the SwiGLU epilogue (`repack(swiglu=True)`, swap
    configurations) against `gmm_swiglu`'s reference, beside the Pallas `gmm_swiglu`."""
    if swiglu:
        layouts, n, seed = ("router", "partial", "empty_groups"), N // 2, 9
        ref, pallas_fn = reference.gmm_swiglu_reference, pallas_triton.gmm_swiglu_pallas
    else:
        layouts, n, seed = ("router", "one_group", "empty_groups", "partial", "first_last"), N, 5
        ref, pallas_fn = reference.gmm_reference, pallas_triton.gmm_pallas
    prefix = "swiglu_" if swiglu else ""
    for layout in layouts:
        wl = workloads.Workload(name=f"{prefix or 'check_'}{layout}", m=1536, k=K, n=n, groups=GROUPS, layout=layout,
                                routed_rows=1200 if layout == "partial" else None)
        for kind, arith in (("int8", "exact"), ("int4", "exact"), ("int4", "bf16")):
            lhs, q, gs = workloads.make_inputs(wl, weights=kind, swiglu=swiglu, on_device_rng=True, seed=seed)
            exact_w = q.dequantize(jnp.bfloat16)
            want = ref(lhs, exact_w if arith == "exact" else bf16_arith_weights(q), gs,
                       preferred_element_type=jnp.float32)
            want_exact = ref(lhs, exact_w, gs, preferred_element_type=jnp.float32)
            packed = repack(q, arith, swiglu=swiglu)
            pallas = pallas_fn(lhs, q, gs)
            routed = int(jnp.sum(gs))
            for c in [c for c in CONFIGS if c[3] or not swiglu]:
                got = gmm_dequant(lhs, packed, gs, config=c)
                row = {"check": "accuracy", "layout": prefix + layout, "weights": kind, "arith": arith, "config": c,
                       "m": wl.m, "routed": routed, "rel_err_cuda": round(rel_err(got, want), 6),
                       "rel_err_pallas": round(rel_err(pallas, want_exact), 6),
                       "rel_err_cuda_vs_exact_weights": round(rel_err(got, want_exact), 6),
                       "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))),
                       "tail_zero": bool(jnp.all(got[routed:] == 0))}
                rows.append(row)
                print(row, flush=True)


def overflow(rows: list) -> None:
    """Group sizes adding up to more than m (the last group 100 rows too long): the kernel clamps the rows to m,
    so the output is that of the sizes cut back to m, and nothing is read or written past x / out."""
    wl = workloads.Workload(name="check_overflow", m=1536, k=K, n=N, groups=GROUPS)
    lhs, q, gs = workloads.make_inputs(wl, weights="int4", on_device_rng=True, seed=7)
    want = reference.gmm_reference(lhs, q.dequantize(jnp.bfloat16), gs, preferred_element_type=jnp.float32)
    packed = repack(q)
    got = gmm_dequant(lhs, packed, gs.at[-1].add(100))
    # a negative size (group 0: -5) shifts every offset below 0 for group 0 only: its rows are none
    neg = gmm_dequant(lhs, packed, gs.at[0].set(-5))
    row = {"check": "overflow", "rel_err_cuda": round(rel_err(got, want), 6),
           "finite": bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))) & jnp.all(jnp.isfinite(
               neg.astype(jnp.float32))))}
    rows.append(row)
    print(row, flush=True)


def timings(rows: list, hbm: float, ms: list[int]) -> None:
    for m in ms:
        wl = workloads.Workload(name=f"gmm_{m}", m=m, k=K, n=N, groups=GROUPS)
        lhs, rhs, gs = workloads.make_inputs(wl, on_device_rng=True)
        base = {"m": m, "k": K, "n": N, "groups": GROUPS}

        def record(impl, weights, config, t, nbytes, base=base, **extra):
            row = dict(base, impl=impl, weights=weights, config=config, ms=round(t * 1e3, 4),
                       weight_GBps=round(nbytes / t / 1e9, 1), weight_bw_frac=round(nbytes / t / hbm, 3), **extra)
            rows.append(row)
            print(row, flush=True)

        f_pallas = jax.jit(pallas_triton.gmm_pallas)
        t_bf16 = timeit(f_pallas, lhs, rhs, gs)
        record("pallas", "bf16", "default", t_bf16, rhs.nbytes)
        for kind in ("int8", "int4"):
            _, q, _ = workloads.make_inputs(wl, weights=kind, on_device_rng=True)
            t = timeit(f_pallas, lhs, q, gs)
            record("pallas", kind, "default", t, q.nbytes, vs_bf16=round(t_bf16 / t, 3))
            want = f_pallas(lhs, q, gs)
            for arith in ("exact",) if kind == "int8" else ("exact", "bf16"):
                packed = repack(q, arith)
                jax.block_until_ready(packed)
                for c in CONFIGS:
                    f = jax.jit(lambda a, p, g, c=c: gmm_dequant(a, p, g, config=c))
                    out = f(lhs, packed, gs)
                    t = timeit(f, lhs, packed, gs)
                    record("cuda", kind if arith == "exact" else kind + "-bf16arith", "mt{}_st{}_ks{}_sw{}".format(*c),
                           t, q.nbytes, vs_bf16=round(t_bf16 / t, 3), rel_diff_vs_pallas=round(rel_err(out, want), 6))


def expert_products(rows: list, ms: list[int]) -> None:
    """The MoE layer's two expert products at the weight-read-bound sizes (hidden 2048, ffn 512, 256 experts):
    gate_up with SwiGLU (Pallas: the fused `gmm_swiglu`; CUDA: `gmm_dequant` with the SwiGLU epilogue, and
    for comparison unfused: the 1024 columns, then silu(gate) * up in XLA, in one jit) and down (k = 512,
    n = 2048), each time and their sum."""
    ffn = N // 2
    for m in ms:
        wl = workloads.Workload(name=f"moe_{m}", m=m, k=K, n=2 * ffn, groups=GROUPS)
        lhs, w_gu, gs = workloads.make_inputs(wl, on_device_rng=True)
        wl_down = workloads.Workload(name=f"down_{m}", m=m, k=ffn, n=K, groups=GROUPS)
        h, w_down, _ = workloads.make_inputs(wl_down, on_device_rng=True, seed=2)
        pallas_gu = jax.jit(pallas_triton.gmm_swiglu_pallas)
        pallas_down = jax.jit(pallas_triton.gmm_pallas)

        def cuda_gu_unfused(a, p, g):
            y = gmm_dequant(a, p, g).astype(jnp.float32)
            return (jax.nn.silu(y[:, :ffn]) * y[:, ffn:]).astype(jnp.bfloat16)

        cuda_gu_unfused, cuda_gu = jax.jit(cuda_gu_unfused), jax.jit(gmm_dequant)
        t_gu, t_down = timeit(pallas_gu, lhs, w_gu, gs), timeit(pallas_down, h, w_down, gs)
        base = {"check": "expert_products", "m": m}
        row = dict(base, impl="pallas", weights="bf16", gate_up_ms=round(t_gu * 1e3, 4),
                   down_ms=round(t_down * 1e3, 4), sum_ms=round((t_gu + t_down) * 1e3, 4))
        rows.append(row)
        print(row, flush=True)
        for kind, arith in (("int8", "exact"), ("int4", "exact"), ("int4", "bf16")):
            _, q_gu, _ = workloads.make_inputs(wl, weights=kind, on_device_rng=True)
            _, q_down, _ = workloads.make_inputs(wl_down, weights=kind, on_device_rng=True, seed=2)
            if arith == "exact":
                tp_gu, tp_down = timeit(pallas_gu, lhs, q_gu, gs), timeit(pallas_down, h, q_down, gs)
                row = dict(base, impl="pallas", weights=kind, gate_up_ms=round(tp_gu * 1e3, 4),
                           down_ms=round(tp_down * 1e3, 4), sum_ms=round((tp_gu + tp_down) * 1e3, 4))
                rows.append(row)
                print(row, flush=True)
            p_gu, p_down = repack(q_gu, arith, swiglu=True), repack(q_down, arith)
            p_gu_unfused = repack(q_gu, arith)
            want_gu, got_gu = pallas_gu(lhs, q_gu, gs), cuda_gu(lhs, p_gu, gs)
            want_down, got_down = pallas_down(h, q_down, gs), gmm_dequant(h, p_down, gs)
            tc_gu, tc_down = timeit(cuda_gu, lhs, p_gu, gs), timeit(gmm_dequant, h, p_down, gs)
            tc_gu_unfused = timeit(cuda_gu_unfused, lhs, p_gu_unfused, gs)
            row = dict(base, impl="cuda", weights=kind if arith == "exact" else kind + "-bf16arith",
                       gate_up_ms=round(tc_gu * 1e3, 4), down_ms=round(tc_down * 1e3, 4),
                       sum_ms=round((tc_gu + tc_down) * 1e3, 4),
                       gate_up_unfused_ms=round(tc_gu_unfused * 1e3, 4),
                       rel_diff_vs_pallas=[round(rel_err(got_gu, want_gu), 6), round(rel_err(got_down, want_down), 6)],
                       finite=bool(jnp.all(jnp.isfinite(got_gu.astype(jnp.float32)))))
            rows.append(row)
            print(row, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="4096,1024,2048,8192")
    ap.add_argument("--profile", default=None, metavar="BITS,M,MT,ST,KS,SW",
                    help="only run this CUDA configuration 5 times (for ncu)")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--products", default="", help="also time the MoE layer's two expert products at these m")
    args = ap.parse_args()
    t0 = time.time()
    build()
    print(f"built in {time.time() - t0:.1f} s", flush=True)
    if args.profile:
        bits, m, *config = (int(v) for v in args.profile.split(","))
        wl = workloads.Workload(name=f"gmm_{m}", m=m, k=K, n=N, groups=GROUPS)
        lhs, q, gs = workloads.make_inputs(wl, weights="int8" if bits == 8 else "int4", on_device_rng=True)
        packed = repack(q)
        for _ in range(5):
            jax.block_until_ready(gmm_dequant(lhs, packed, gs, config=tuple(config)))
        return
    doc = run_header("gmm_cuda")
    rows: list = []
    if not args.no_checks:
        exactness(rows)
        accuracy(rows)
        accuracy(rows, swiglu=True)
        overflow(rows)
    hbm = copy_bandwidth()
    doc["copy_GBps"] = round(hbm / 1e9, 1)
    print("copy GB/s", doc["copy_GBps"], flush=True)
    timings(rows, hbm, [int(x) for x in args.ms.split(",") if x])
    if args.products:
        expert_products(rows, [int(x) for x in args.products.split(",")])
    doc["rows"] = rows
    write_json(doc, args.out, echo=False)


if __name__ == "__main__":
    main()

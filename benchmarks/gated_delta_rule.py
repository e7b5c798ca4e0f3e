"""Times our gated delta rule (Pallas Triton) beside flash-linear-attention's chunk_gated_delta_rule.

Both get identical bf16 inputs (q, k L2-normalised, 16 k-heads, 32 v-heads, K = V = 128, f32 log-decay, beta
rounded to bf16, f32 initial state in, final state out). Timing, the same for both: warm up, then the wall
clock over `--reps` back-to-back calls ended by one synchronisation (launch overhead hidden behind the
previous call's GPU work); FLA is also timed with triton.testing.do_bench (CUDA events, median) as its own
benchmarks do. Outputs are compared (max |ours - FLA| / max |FLA|). Prints one JSON document last.

usage: XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/gated_delta_rule.py [--workloads ...] [--check]
"""

import argparse
import dataclasses
import datetime
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta_rule import _common, api, pallas_triton, reference, workloads


def wall_ms(fn, sync, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        sync(fn())
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(out)
    return (time.perf_counter() - start) / reps * 1e3


def jax_sync(x):
    jax.block_until_ready(x)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check_against_reference() -> list[dict]:
    """Small shapes on the GPU: the compiled Pallas kernels against the f32 reference."""
    rows = []
    cases = [
        ("f32-seq130", jnp.float32, None),
        ("bf16-seq130", jnp.bfloat16, None),
        ("f32-packed", jnp.float32, (5, 70, 0, 64, 1)),
    ]
    for name, dtype, seqlens in cases:
        inputs = workloads.make_inputs(workloads.TINY, dtype=dtype, seed=1, seqlens=seqlens)
        as_f32 = {
            n: (x if x is None or n == "cu_seqlens" else x.astype(jnp.float32)) for n, x in inputs.items()
        }
        want = reference.gated_delta_rule_reference(**as_f32)
        got = api.gated_delta_rule(**inputs, implementation="pallas")
        rows.append(
            {
                "check": name,
                "output_rel_err": rel_err(got[0], want[0]),
                "state_rel_err": rel_err(got[1], want[1]),
            }
        )
        print(rows[-1], flush=True)
    return rows


def prepare_time(inputs, reps, block_sizes) -> float:
    """Time of stage 1 alone (the chunk-parallel WY preparation) on pre-padded inputs, in ms."""
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    layout = None
    if "cu_seqlens" in inputs:
        layout = _common.packed_layout(inputs["cu_seqlens"], k.shape[1], 64)
    q, k, v, g, bt = _common.pad_to_chunks(
        q, k, v, inputs["log_decay"], inputs["beta"].astype(jnp.float32), 64, layout
    )
    g, bt = jnp.swapaxes(g, 1, 2), jnp.swapaxes(bt, 1, 2)
    prepare = jax.jit(
        functools.partial(
            pallas_triton._prepare,
            scale=k.shape[-1] ** -0.5,
            chunk_size=64,
            group=v.shape[2] // k.shape[2],
            compute_dtype=jnp.bfloat16,
            block_sizes=block_sizes,
            interpret=False,
        )
    )
    return round(wall_ms(lambda: prepare(q, k, v, g, bt), jax_sync, reps), 4)


def bench_workload(workload, reps, fla, block_variants) -> list[dict]:
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=0)
    inputs["beta"] = inputs["beta"].astype(jnp.bfloat16).astype(jnp.float32)
    cu = inputs.get("cu_seqlens")
    rows = []
    base = {
        "workload": workload.name,
        "seq": workload.seq,
        "seqlens": workload.seqlens,
        "k_heads": workload.k_heads,
        "v_heads": workload.v_heads,
        "key_dim": workload.key_dim,
    }
    ours_out = None
    for label, block_sizes in block_variants.items():
        fn = jax.jit(
            functools.partial(pallas_triton.gated_delta_rule_pallas, interpret=False, block_sizes=block_sizes)
        )
        call = functools.partial(fn, **inputs)
        try:
            ms = wall_ms(call, jax_sync, reps)
            out = call()
            row = {
                **base,
                "impl": f"ours.pallas[{label}]",
                "ms": round(ms, 4),
                "prepare_ms": prepare_time(inputs, reps, block_sizes),
            }
        except Exception as e:  # noqa: BLE001  a variant that fails to compile must not end the run
            print(f"variant {label} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        if ours_out is None:
            ours_out = out
            ours_ms = ms
        else:
            row["output_rel_err_vs_first"] = rel_err(out[0], ours_out[0])
            ours_ms = min(ours_ms, ms)
        rows.append(row)
        print(row, flush=True)
    if fla is None or ours_out is None:
        return rows
    torch, chunk_gated_delta_rule, do_bench = fla
    to_torch = lambda x, dt: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(dt)
    tq, tk, tv = (to_torch(inputs[n], torch.bfloat16) for n in ("query", "key", "value"))
    tg = to_torch(inputs["log_decay"], torch.float32)
    tb = to_torch(inputs["beta"], torch.bfloat16)
    th0 = to_torch(inputs["initial_state"], torch.float32)
    tcu = None if cu is None else torch.from_numpy(np.asarray(cu)).cuda().long()
    fla_fn = lambda: chunk_gated_delta_rule(
        tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True, cu_seqlens=tcu
    )
    fla_wall = wall_ms(fla_fn, lambda _: torch.cuda.synchronize(), reps)
    fla_bench = do_bench(fla_fn, warmup=25, rep=100, return_mode="median")
    fo, fs = fla_fn()
    fo = fo.float().cpu().numpy()
    fs = fs.float().cpu().numpy()
    rows.append(
        {
            **base,
            "impl": "fla.chunk_gated_delta_rule",
            "ms": round(fla_wall, 4),
            "do_bench_median_ms": round(fla_bench, 4),
            "best_ours_ms": round(ours_ms, 4),
            "best_ours_speedup_over_fla": round(fla_wall / ours_ms, 3),
            "output_rel_err_ours_vs_fla": rel_err(ours_out[0], fo),
            "state_rel_err_ours_vs_fla": rel_err(ours_out[1], fs),
        }
    )
    print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--workloads", nargs="+", default=["qwen35_prefill_4k", "qwen35_prefill_16k", "qwen35_packed_8x8k"]
    )
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--check", action="store_true", help="compare the compiled kernels with the reference"
    )
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["unfused:32", "unfused:16:8", "fused:16:8"],
        help="kernel variants to time: {unfused,fused}:STATE_BLOCK_V[:SEGMENTS], e.g. unfused:32 fused:16:8",
    )
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args()
    result = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rows": [],
    }
    if args.check:
        result["checks"] = check_against_reference()
    fla = None
    if not args.no_fla:
        import torch
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        fla = (torch, chunk_gated_delta_rule, triton.testing.do_bench)
        result["torch"] = torch.__version__
    default = pallas_triton.BlockSizes.get_default()
    variants = {}
    for variant in args.variants:
        kind, block_v, *segments = variant.split(":")
        variants[variant] = dataclasses.replace(
            default,
            fuse_output=kind == "fused",
            state_block_v=int(block_v),
            segments=int(segments[0]) if segments else 1,
        )
    for name in args.workloads:
        result["rows"] += bench_workload(workloads.WORKLOADS[name], args.reps, fla, variants)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()

"""Times our gated delta rule (Pallas Triton) beside flash-linear-attention's chunk_gated_delta_rule.

Both get identical bf16 inputs (q, k L2-normalised, 16 k-heads, 32 v-heads, K = V = 128, f32 log-decay, beta
rounded to bf16, f32 initial state in, final state out). Timing, the same for both: warm up, then the wall
clock over `--reps` back-to-back calls ended by one synchronisation (launch overhead hidden behind the
previous call's GPU work); FLA is also timed with triton.testing.do_bench (CUDA events, median) as its own
benchmarks do. Outputs are compared (max |ours - FLA| / max |FLA|). Prints one JSON document last.

Kernel variants (`--variants`), each timed on every workload in the same process, side by side:
  KIND:STATE_BLOCK_V[:SEGMENTS][:KEY=VALUE...]   KIND is unfused or fused (`fuse_output`); KEY is any
  `pallas_triton.BlockSizes` field or one of the short names prepare (prepare_kernel), combine
  (segment_combine), prefetch (state_prefetch), chunk (the chunk_size argument, default 64).
  E.g. `fused:32` (today's default), `unfused:16:8:prepare=dense:combine=pallas:prefetch=1` (segments
  also split packed sequences: a segment restarts at each sequence's first chunk). A variant listed twice
  is timed once (row "same_as"). Every variant after the first is compared with the first (output /
  final-state rel. err.); `--budget-s` (150, the checks not counted) is shared out over the workloads, and a workload whose share is
  spent starts no new variant (its rows say "skipped"), so that the run stays short.

usage (on the GPU machine; FLA from the wheel the repo carries, torch and triton are preinstalled there):
  python3 -m pip install --no-deps --no-index .whl/fla/fla_core-0.6.0-py3-none-any.whl
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/gated_delta_rule.py [--check] [--json F]
"""

import argparse
import dataclasses
import functools
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import trace_summary
from bench_io import run_header, write_json

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import api, pallas_triton, reference, workloads

START = time.monotonic()
# Today's default first (the reference for the *_vs_first errors: dense prepare with bf16 inverse products by
# 16-row slabs, the pipelined Mosaic GPU walk on an H100, state_block_v 32 and 3 pipeline stages, one sequential
# walk, output fused into the state pass, the decays scaling the products, the WY factors formed in the state
# pass from T except for packed sequences read in place), then the options. Measured on an H100
# (docs/benchmarks.md, docs/benchmarks_gdn.md): W and U written by the prepare (wy_in_state=0, the default until
# 2026-11-24) 12% slower at T=16384; TF32 inverse products 15-17% slower, 2 stages 10-20% slower (both the
# defaults until 2026-11-23; 2 stages 30% slower with T too); sub_blocks prepare 12-19% slower in stage 1; the
# separate output kernel (unfused) 10-12% slower; prefetch no gain on one sequence, 20% loss packed; segments
# slower; chunk=128 exceeds shared memory, and so do 4 stages and state_block_v 64 with T; chunk=32,
# prepare_warps=8 (also with T), state_warps=8 slower; one prepare program per chunk 4-11% slower in the prepare
# than 8 chunks per program.
DEFAULT_VARIANTS = [
    "fused:32",
    "fused:32:inverse_slabs=0",   # the whole-tile triangular inverse (the default before 2026-11-25 11:00 UTC)
    "fused:32:walk_pipeline=1",   # one prepare launch, then one walk (no pipeline)
    "fused:32:wy_in_state=1",   # T on packed sequences too (V copied chunk-aligned by the prepare)
    "fused:32:p_in_walk=0",   # the prepare writes P (packed: the default before 2026-11-25 15:10 UTC)
    "fused:32:p_in_walk=1",   # the walk kernel forms P in a fourth warpgroup (batch rows too)
    "fused:32:prepare_fast_exp=0",   # libdevice expf for the prepare's decay (the default before 2026-11-26 12:00)
    "fused:32:prepare_warps=2",   # 2 warps for the prepare of T alone too (the default before 2026-11-26 12:45)
]
# --check: every new option at once on the tiny shapes (seq 130 = 3 chunks = 3 segments), against the
# f32 reference; f32 inputs take the IEEE products (and the 3xTF32 segment combine).
CHECK_VARIANTS = [
    "unfused:16:3:combine=pallas:prefetch=1",
    "fused:16:3:combine=pallas:prefetch=1",
    "unfused:32:prepare=sub_blocks",
]


def fla_call(inputs, torch, chunk_gated_delta_rule):
    """A thunk calling FLA's chunk_gated_delta_rule on torch copies of `inputs` (`workloads.make_inputs`): q, k,
    v, beta bf16, the log decay and the initial state f32, cu_seqlens int64 where packed; it returns (output,
    final state) as torch tensors."""
    to_torch = lambda x, dt: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(dt)
    tq, tk, tv = (to_torch(inputs[n], torch.bfloat16) for n in ("query", "key", "value"))
    tg = to_torch(inputs["log_decay"], torch.float32)
    tb = to_torch(inputs["beta"], torch.bfloat16)
    th0 = to_torch(inputs["initial_state"], torch.float32)
    cu = inputs.get("cu_seqlens")
    tcu = None if cu is None else torch.from_numpy(np.asarray(cu)).cuda().long()
    return lambda: chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True,
                                          cu_seqlens=tcu)


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


def check_against_reference(variants=None) -> list[dict]:
    """Small shapes on the GPU: the compiled Pallas kernels (the default, then each of `variants`, a dict of
    label -> (BlockSizes, chunk_size)) against the f32 reference."""
    rows = []
    cases = [
        ("f32-seq130", jnp.float32, None, 0.0),
        ("bf16-seq130", jnp.bfloat16, None, 0.0),
        ("f32-packed", jnp.float32, (5, 70, 0, 64, 1), 0.0),
        # keys at cosine ~0.9, beta 1, almost no decay: the hard case for the triangular inverse (TF32 products)
        ("f32-correlated-keys", jnp.float32, None, 0.9),
        ("bf16-correlated-keys", jnp.bfloat16, None, 0.9),
        # the model's head dims (the Mosaic GPU walk takes multiples of 64 only), two batch rows
        ("bf16-seq200-dim128", jnp.bfloat16, None, 0.0),
        ("bf16-packed-dim128", jnp.bfloat16, (70, 0, 130), 0.0),
    ]
    dim128 = dataclasses.replace(workloads.TINY, name="tiny128", seq=200, batch=2, key_dim=128, value_dim=128)
    for name, dtype, seqlens, key_cosine in cases:
        inputs = workloads.make_inputs(
            (dataclasses.replace(dim128, batch=1) if seqlens else dim128) if "dim128" in name else workloads.TINY,
            dtype=dtype, seed=1, seqlens=seqlens,
            key_cosine=key_cosine,
        )
        if key_cosine:
            inputs = workloads.hard_gates(inputs)
        as_f32 = {
            n: (x if x is None or n == "cu_seqlens" else x.astype(jnp.float32)) for n, x in inputs.items()
        }
        want = reference.gated_delta_rule_reference(**as_f32)
        runs = {"default": functools.partial(api.gated_delta_rule, **inputs, implementation="pallas")}
        for label, (block_sizes, chunk_size) in (variants or {}).items():
            runs[label] = functools.partial(
                pallas_triton.gated_delta_rule_pallas,
                **inputs,
                block_sizes=block_sizes,
                chunk_size=chunk_size,
                interpret=False,
            )
        for label, run in runs.items():
            row = {"check": name, "variant": label}
            try:
                got = run()
                row["output_rel_err"] = rel_err(got[0], want[0])
                row["state_rel_err"] = rel_err(got[1], want[1])
            except Exception as e:  # noqa: BLE001  report, go on
                row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def kernel_split_ms(call, calls: int = 10) -> dict[str, float]:
    """Device time per call (ms) of each kernel `call` launches (gdn_prepare, gdn_state, XLA's padding and
    layout fusions), from a profiler trace of `calls` calls: the kernels' own durations, launch gaps not
    counted, unlike the wall-clock total."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        trace = next(pathlib.Path(d).rglob("perfetto_trace.json.gz"))
        kernels = trace_summary.summarize(trace, top=16).get("top_kernels_ms", {})
    return {name: round(ms / calls, 4) for name, ms in kernels.items()}


def parse_variant(spec: str, default) -> tuple[object, int]:
    """'KIND:STATE_BLOCK_V[:SEGMENTS][:KEY=VALUE...]' -> (BlockSizes, chunk_size); see the docstring."""
    aliases = {
        "prepare": "prepare_kernel",
        "combine": "segment_combine",
        "block_v": "state_block_v",
        "prefetch": "state_prefetch",
    }
    fields = {f.name: f for f in dataclasses.fields(default)}
    kind, block_v, *rest = spec.split(":")
    if kind not in ("unfused", "fused"):
        raise ValueError(f"variant {spec!r}: kind must be unfused or fused")
    changes = {"fuse_output": kind == "fused", "state_block_v": int(block_v)}
    chunk_size = 64
    for item in rest:
        if "=" not in item:
            changes["segments"] = int(item)
            continue
        name, value = item.split("=", 1)
        if name == "chunk":
            chunk_size = int(value)
            continue
        name = aliases.get(name, name)
        if name not in fields:
            raise ValueError(f"variant {spec!r}: unknown field {name!r}; choose from {sorted(fields)}")
        current = getattr(default, name)
        if current is None and "int" in str(fields[name].type):  # int | None
            changes[name] = None if value.lower() in ("auto", "none") else int(value)
        elif isinstance(current, bool) or current is None:  # bool or bool | None (auto)
            changes[name] = None if value.lower() == "auto" else value.lower() in ("1", "true", "yes")
        else:
            changes[name] = type(current)(value)
    return dataclasses.replace(default, **changes), chunk_size


def reference_outputs(inputs):
    """The token-by-token f32 recurrence on the same (bf16-rounded) inputs, IEEE f32 products."""
    as_f32 = {n: (x if x is None or n == "cu_seqlens" else x.astype(jnp.float32)) for n, x in inputs.items()}
    with jax.default_matmul_precision("highest"):
        return jax.block_until_ready(jax.jit(reference.gated_delta_rule_reference)(**as_f32))


def bench_workload(
    workload, reps, fla, block_variants, deadline=float("inf"), key_cosine=0.0, with_reference=False,
    split=True,
) -> list[dict]:
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=0, key_cosine=key_cosine)
    if key_cosine:
        inputs = workloads.hard_gates(inputs)
    want = reference_outputs(inputs) if with_reference else None

    def vs_reference(row, out):  # ours or FLA's (output, final state) against the f32 recurrence
        if want is not None:
            row["output_rel_err_vs_reference"] = rel_err(out[0], want[0])
            row["state_rel_err_vs_reference"] = rel_err(out[1], want[1])
    inputs["beta"] = inputs["beta"].astype(jnp.bfloat16).astype(jnp.float32)
    rows = []
    base = {
        "workload": workload.name,
        "seq": workload.seq,
        "seqlens": workload.seqlens,
        "k_heads": workload.k_heads,
        "v_heads": workload.v_heads,
        "key_dim": workload.key_dim,
        "key_cosine": key_cosine,
    }
    ours_out = None
    seen = {}
    for label, (block_sizes, chunk_size) in block_variants.items():
        if (block_sizes, chunk_size) in seen:
            rows.append({**base, "impl": f"ours.pallas[{label}]", "same_as": seen[block_sizes, chunk_size]})
            continue
        seen[block_sizes, chunk_size] = label
        if time.monotonic() > deadline:
            rows.append({**base, "impl": f"ours.pallas[{label}]", "skipped": "--budget-s reached"})
            print(rows[-1], flush=True)
            continue
        fn = jax.jit(
            functools.partial(
                pallas_triton.gated_delta_rule_pallas,
                interpret=False,
                block_sizes=block_sizes,
                chunk_size=chunk_size,
            )
        )
        call = functools.partial(fn, **inputs)
        start = time.monotonic()
        try:
            ms = wall_ms(call, jax_sync, reps)
            out = call()
            row = {**base, "impl": f"ours.pallas[{label}]", "ms": round(ms, 4)}
            if split:
                row["kernels_ms"] = kernel_split_ms(call)
        except Exception as e:  # noqa: BLE001  a variant that fails to compile must not end the run
            print(f"variant {label} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            rows.append(
                {**base, "impl": f"ours.pallas[{label}]", "failed": f"{type(e).__name__}: {str(e)[:300]}"}
            )
            continue
        row["compile_and_time_s"] = round(time.monotonic() - start, 1)
        vs_reference(row, out)
        if ours_out is None:
            ours_out = out
            ours_ms = ms
        else:
            row["output_rel_err_vs_first"] = rel_err(out[0], ours_out[0])
            row["state_rel_err_vs_first"] = rel_err(out[1], ours_out[1])
            if max(row["output_rel_err_vs_first"], row["state_rel_err_vs_first"]) <= 2e-2:   # bf16 bound
                ours_ms = min(ours_ms, ms)
            else:
                row["wrong_output"] = True   # not counted as ours' best
        rows.append(row)
        print(row, flush=True)
    # Packed sequences as a padded batch (max_seqlen): one walk per sequence, all in parallel (8 x 32 x 4 = 1 024
    # programs for 8 sequences). With 3 stages one program fills an SM's shared memory; fewer stages may let
    # two or more share an SM, which only pays when there are more programs than SMs.
    for stages in (None, 2, 1) if workload.seqlens and ours_out is not None else ():
        if time.monotonic() >= deadline:
            break
        block_sizes = None if stages is None else dataclasses.replace(
            pallas_triton.BlockSizes.get_default(), state_stages=stages)
        fn = jax.jit(
            functools.partial(
                pallas_triton.gated_delta_rule_pallas, interpret=False, max_seqlen=max(workload.seqlens),
                block_sizes=block_sizes,
            )
        )
        call = functools.partial(fn, **inputs)
        label = ("ours.pallas[default, packed as padded batch (max_seqlen)]" if stages is None
                 else f"ours.pallas[state_stages={stages}, packed as padded batch (max_seqlen)]")
        try:
            ms = wall_ms(call, jax_sync, reps)
            out = call()
            row = {**base, "impl": label, "ms": round(ms, 4)}
            row["output_rel_err_vs_first"] = rel_err(out[0], ours_out[0])
            row["state_rel_err_vs_first"] = rel_err(out[1], ours_out[1])
            if max(row["output_rel_err_vs_first"], row["state_rel_err_vs_first"]) <= 2e-2:
                ours_ms = min(ours_ms, ms)
            else:
                row["wrong_output"] = True
        except Exception as e:  # noqa: BLE001
            row = {**base, "impl": label, "failed": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(row, flush=True)
    if fla is None or ours_out is None:
        return rows
    torch, chunk_gated_delta_rule, do_bench = fla
    fla_fn = fla_call(inputs, torch, chunk_gated_delta_rule)
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
    vs_reference(rows[-1], (fo, fs))
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
        default=DEFAULT_VARIANTS,
        help="kernel variants to time: {unfused,fused}:STATE_BLOCK_V[:SEGMENTS][:KEY=VALUE...] (docstring)",
    )
    parser.add_argument(
        "--check-variants",
        nargs="*",
        default=CHECK_VARIANTS,
        help="with --check: variants checked against the reference besides the default",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="seconds for the timed workloads (after the checks), shared out over them: a workload starts no"
        " new variant once its share is spent",
    )
    parser.add_argument(
        "--key-cosine",
        type=float,
        default=0.0,
        help="timed workloads: keys at about this cosine to each other, with beta 1 and log-decay -1e-3"
        " (the hard case for the triangular inverse; 0 = independent keys, the usual inputs)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also compare every timed output (ours and FLA) with the token-by-token f32 recurrence",
    )
    parser.add_argument(
        "--no-concurrent-regions", action="store_true",
        help="leave XLA_FLAGS as they are (by default the run adds --xla_gpu_graph_enable_concurrent_region=true,"
        " which the pipelined walk, BlockSizes.walk_pipeline, needs to overlap its launches)",
    )
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument(
        "--no-split", action="store_true",
        help="skip the per-kernel split (a profiler trace; leave it out under ncu, which holds the counters)"
    )
    args = parser.parse_args()
    if not args.no_concurrent_regions:
        gpu_limits.enable_concurrent_regions()   # before the first computation starts the backend
    result = run_header("gated_delta_rule", xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[])
    default = pallas_triton.BlockSizes.get_default()
    if args.check:
        checks = {variant: parse_variant(variant, default) for variant in args.check_variants}
        result["checks"] = check_against_reference(checks)
    fla = None
    if not args.no_fla:
        import torch
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        fla = (torch, chunk_gated_delta_rule, triton.testing.do_bench)
        result["torch"] = torch.__version__
    variants = {variant: parse_variant(variant, default) for variant in args.variants}
    timing_start = time.monotonic()   # --budget-s covers the timed workloads, not the checks or imports
    for i, name in enumerate(args.workloads):  # each workload gets its share of the time left
        deadline = time.monotonic() + (timing_start + args.budget_s - time.monotonic()) / (len(args.workloads) - i)
        result["rows"] += bench_workload(
            workloads.WORKLOADS[name],
            args.reps,
            fla,
            variants,
            deadline,
            key_cosine=args.key_cosine,
            with_reference=args.reference,
            split=not args.no_split,
        )
    result["total_s"] = round(time.monotonic() - START, 1)
    write_json(result, args.json)   # printed last, as the docstring promises


if __name__ == "__main__":
    main()

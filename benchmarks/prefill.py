"""End-to-end chunked prefill (TTFT, tokens/s, per-phase time) of a full-size preset with random weights.

Run on the GPU machine, e.g.:
    python benchmarks/prefill.py --preset qwen3.6-35b-a3b --expert-format int8 --prompt-tokens 8192 32768
Prints a header JSON object (device, JAX version, date, configuration), one per (prompt, chunk size), and a final
one: the header with the results.
Compilation is excluded: every configuration is run once untimed, then `--repeats` timed runs (median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import run_header

import hybridlm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--expert-format", choices=("bf16", "int8", "int4"), default="int8")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--attention", default="cudnn", help="jax.nn.dot_product_attention implementation (or 'xla')")
    p.add_argument("--gdn", default=None, help="gated delta rule implementation (default: pallas on GPU)")
    p.add_argument("--gmm", default=None, help="grouped matmul implementation (default: pallas on GPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also one profiled pass per configuration")
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="one more prefill per configuration under jax.profiler.trace (perfetto trace under "
                        "DIR/<tokens>_<chunk>; summary of the kernels' device time: benchmarks/trace_summary.py)")
    a = p.parse_args(argv)

    config = hybridlm.get_config(a.preset)
    config = dataclasses.replace(config, attention_implementation=None if a.attention == "none" else a.attention,
                                 gdn_implementation=a.gdn, moe_implementation=a.gmm,
                                 **({"num_layers": a.num_layers} if a.num_layers else {}))
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    t0 = time.perf_counter()
    model = hybridlm.init_random(config, seed=0, dtype=dtype,
                                 expert_format=None if a.expert_format == "bf16" else a.expert_format)
    jax.block_until_ready(jax.tree_util.tree_leaves(model))
    init_s = time.perf_counter() - t0
    runner = hybridlm.LayerwiseRunner(model)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model))
    header = run_header("prefill", preset=config.name, num_layers=config.num_layers, dtype=a.dtype,
                        expert_format=a.expert_format, attention=a.attention, gdn=a.gdn or "default",
                        gmm=a.gmm or "default", weight_bytes=weight_bytes, init_s=round(init_s, 1))
    print(json.dumps(header), flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for tokens in a.prompt_tokens:
        ids = rng.integers(0, config.vocab_size, (1, tokens)).astype(np.int32)
        for chunk in a.chunk_sizes:
            if chunk > tokens:
                continue
            row = {"prompt_tokens": tokens, "chunk_size": chunk}
            try:
                t = time.perf_counter()
                hybridlm.prefill(runner, ids, chunk_size=chunk)          # compile + warm-up
                row["first_call_s"] = round(time.perf_counter() - t, 2)
                times = [hybridlm.prefill(runner, ids, chunk_size=chunk).ttft_s for _ in range(a.repeats)]
                row["ttft_s"] = round(statistics.median(times), 4)
                row["tokens_per_s"] = round(tokens / statistics.median(times), 1)
                if a.profile:
                    prof = hybridlm.prefill(runner, ids, chunk_size=chunk, profile=True)
                    row["phase_seconds"] = {k: round(v, 4) for k, v in prof.phase_seconds.items()}
                if a.trace:   # no Python function events: they would slow the host side being measured
                    options = jax.profiler.ProfileOptions()
                    options.python_tracer_level = 0
                    with jax.profiler.trace(f"{a.trace}/{tokens}_{chunk}", create_perfetto_trace=True,
                                            profiler_options=options):
                        hybridlm.prefill(runner, ids, chunk_size=chunk)
            except Exception as e:  # noqa: BLE001 - report and go on to the next configuration
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({**header, "results": rows}))


if __name__ == "__main__":
    main()

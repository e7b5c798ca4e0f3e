"""Whole-model decode (tokens/s after a prompt) of a full-size preset with random weights, all weights resident.

Two ways to run one decode step, timed in the same run:
- "one_program": `LayerwiseRunner.decode_step`, every layer and the head in one jitted program (what
  `hybridlm.generate` and `hybridlm.decode_step` use);
- "layerwise": `LayerwiseRunner.decode_step_layerwise`, three programs per layer (mixer, router, experts), the
  seams the offload runner pages experts at, then the head.
Each step feeds the greedy token of the step before (argmax on the device, no host sync inside the loop). Also
reported: `hybridlm.generate`'s own decode tokens/s (greedy sampling included), and the host time to enqueue the
steps (when it nears the total, the host's dispatch is the bound, not the device).

With --gemv-max-rows 0 8 each mode runs once per value of `pallas_gemv.MAX_ROWS` (0: one token's expert products
on the tensor-core kernels), an A/B of the matrix-vector kernels in one process; likewise --decode-attention xla
cudnn for the attention layers' decode step (`gated_attention.DECODE_IMPLEMENTATION`). `same_tokens_as_first`
counts the leading greedy tokens that agree with the first configuration.

usage (GPU machine): python benchmarks/decode.py [--expert-formats int8 int4] [--prompt-tokens 512]
    [--new-tokens 128] [--gemv-max-rows 8] [--decode-attention xla cudnn] [--out decode.json]
Compilation is excluded (each mode runs once untimed); tokens/s is the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import gemv_max_rows, preset_config, run_header, traced_constant, write_json

import hybridlm
from hybridlm.engine import sample
from hybridlm.layers import gated_attention
from pallas_kernels.grouped_matmul import pallas_gemv

MODES = ("one_program", "layerwise")


def decode_loop(runner, mode: str, ids: np.ndarray, new_tokens: int, trace: str | None = None) -> dict:
    """Prefills `ids`, then `new_tokens` greedy steps; seconds of the steps (the prefill excluded). With `trace`
    the steps (not the prefill) run under jax.profiler.trace, writing a perfetto trace under that directory."""
    step = runner.decode_step if mode == "one_program" else runner.decode_step_layerwise
    pre = hybridlm.prefill(runner, ids, chunk_size=ids.shape[1], max_new_tokens=new_tokens)
    states, logits, pos = pre.states, pre.logits, ids.shape[1]
    if trace:   # no Python function events: they would slow the host side being measured
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        with jax.profiler.trace(trace, create_perfetto_trace=True, profiler_options=options):
            for i in range(new_tokens):
                logits, states = step(sample(logits, None), states, pos + i)
            jax.block_until_ready(logits)
        return {}
    tokens = []
    t0 = time.perf_counter()
    for i in range(new_tokens):
        token = sample(logits, None)                        # greedy
        tokens.append(token)
        logits, states = step(token, states, pos + i)
    enqueued = time.perf_counter() - t0
    jax.block_until_ready(logits)
    total = time.perf_counter() - t0
    return {"seconds": total, "enqueue_seconds": enqueued, "tokens": np.asarray(jnp.stack(tokens, axis=1))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--expert-formats", nargs="+", choices=("bf16", "int8", "int4"), default=["int8", "int4"])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also 16 one-program steps under jax.profiler.trace (perfetto trace under DIR/<format>; "
                        "kernel time: benchmarks/trace_summary.py)")
    p.add_argument("--gemv-max-rows", type=int, nargs="+", default=[pallas_gemv.MAX_ROWS],
                   help="pallas_gemv.MAX_ROWS values to time in turn (0: the routed experts on the tensor-core "
                        "kernels; an A/B of the matrix-vector kernels in one process)")
    p.add_argument("--decode-attention", nargs="+", choices=("xla", "cudnn"),
                   default=[gated_attention.DECODE_IMPLEMENTATION],
                   help="gated_attention.DECODE_IMPLEMENTATION values to time in turn (an A/B in one process)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    config = preset_config(a.preset, a.num_layers)
    doc = run_header("decode", preset=config.name, num_layers=config.num_layers, batch=a.batch,
                     prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, repeats=a.repeats, rows=[])
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (a.batch, a.prompt_tokens)).astype(np.int32)
    for fmt in a.expert_formats:
        model = hybridlm.init_random(config, seed=0, dtype=jnp.bfloat16,
                                     expert_format=None if fmt == "bf16" else fmt)
        runner = hybridlm.LayerwiseRunner(model)
        first_tokens = {}
        for mode, max_rows, attention in [(mode, v, at) for mode in a.modes for v in a.gemv_max_rows
                                          for at in a.decode_attention]:
            row = {"expert_format": fmt, "mode": mode, "gemv_max_rows": max_rows, "decode_attention": attention}
            with gemv_max_rows(max_rows), traced_constant(gated_attention, "DECODE_IMPLEMENTATION", attention):
                t = time.perf_counter()
                decode_loop(runner, mode, ids, 2)                                 # compile + warm-up
                row["first_call_s"] = round(time.perf_counter() - t, 2)
                runs = [decode_loop(runner, mode, ids, a.new_tokens) for _ in range(a.repeats)]
            seconds = statistics.median(r["seconds"] for r in runs)
            row["tokens_per_s"] = round(a.batch * a.new_tokens / seconds, 1)
            row["ms_per_step"] = round(seconds / a.new_tokens * 1e3, 3)
            row["enqueue_ms_per_step"] = round(statistics.median(r["enqueue_seconds"] for r in runs)
                                               / a.new_tokens * 1e3, 3)
            if first_tokens:   # the same greedy continuation as the first configuration (leading tokens)
                want = next(iter(first_tokens.values()))
                row["same_tokens_as_first"] = int((runs[0]["tokens"] == want).all(axis=0).cumprod().sum())
            first_tokens[mode, max_rows, attention] = runs[0]["tokens"]
            doc["rows"].append(row)
            print(row, flush=True)
        if a.trace:
            decode_loop(runner, "one_program", ids, 16, trace=f"{a.trace}/{fmt}")
        hybridlm.generate(runner, ids, max_new_tokens=2)                          # its sampling compiles
        gen = hybridlm.generate(runner, ids, max_new_tokens=a.new_tokens)
        row = {"expert_format": fmt, "mode": "generate", "tokens_per_s": round(gen.decode_tokens_per_s, 1),
               "ttft_s": round(gen.prefill.ttft_s, 4)}
        doc["rows"].append(row)
        print(row, flush=True)
        del model, runner
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()

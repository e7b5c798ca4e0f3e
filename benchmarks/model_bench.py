"""Whole-model benchmarks with all weights on the device: chunked prefill (TTFT) and decode (tokens/s).

A preset with random weights (`hybridlm.init_random`); llama.cpp's `llama-bench` beside it on a GGUF file of
the same architecture when `--llama-bench PATH --gguf F` are given. Compilation is excluded: each
configuration runs once untimed, then `--repeats` timed runs (median).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import hybridlm
from benchmarks import common, peers, traces
from benchmarks.common import Recorder
from hybridlm.engine import sample


def add_model_arguments(p: argparse.ArgumentParser, expert_formats: list[str], llama: bool = True) -> None:
    """Arguments shared by prefill, decode and offload: the model, and (`llama`) the llama.cpp peer."""
    p.add_argument("--preset", default="qwen3.6-35b-a3b", help="a name of hybridlm.PRESETS")
    p.add_argument(
        "--expert-format",
        nargs="+",
        choices=("bf16", "int8", "int4"),
        default=expert_formats,
        help="routed experts' storage, each value a configuration in turn",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="one more run per configuration under jax.profiler.trace (perfetto trace under DIR/...), "
        "summarised in the record (device compute, copies, gaps, top kernels)",
    )
    if not llama:
        return
    p.add_argument(
        "--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench, run beside ours"
    )
    p.add_argument("--gguf", default=None, metavar="F", help="the GGUF file llama-bench runs")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '-ot exps=CPU'")


def model_config(args: argparse.Namespace, **changes):
    config = hybridlm.get_config(args.preset)
    if args.num_layers:
        changes["num_layers"] = args.num_layers
    return dataclasses.replace(config, **changes) if changes else config


def model_dtype(args: argparse.Namespace):
    if args.dtype is None:
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(args.dtype)


def expert_format_arg(fmt: str) -> str | None:
    return None if fmt == "bf16" else fmt


def traced_summary(directory: str, run) -> dict:
    """Runs `run()` under a profiler trace written to `directory`; the summary (`traces.summarize`)."""
    with common.profiler_trace(directory):
        jax.block_until_ready(run())
    files = traces.trace_files(directory)
    return traces.summarize(files[-1], top=20) if files else {}


def llama_record(rec: Recorder, args: argparse.Namespace, workload: str, params: dict, **bench) -> None:
    """llama-bench beside ours when --llama-bench and --gguf are given; a skipped record when only one is."""
    if not (args.llama_bench or args.gguf):
        return
    if not (args.llama_bench and args.gguf):
        rec.skip(workload, "llama.cpp", "needs both --llama-bench and --gguf")
        return
    try:
        r = peers.llama_bench(args.llama_bench, args.gguf, extra=shlex.split(args.llama_args), **bench)
    except (OSError, RuntimeError, ValueError) as e:
        rec.skip(workload, "llama.cpp", f"{type(e).__name__}: {str(e)[:300]}")
        return
    figures = {"tokens_per_s": r["tokens_per_s"], "tokens_per_s_stddev": r["tokens_per_s_stddev"]}
    if bench.get("prompt_tokens"):
        figures["ttft_s"] = bench["prompt_tokens"] / r["tokens_per_s"]
    rec.emit(
        workload,
        "llama.cpp",
        figures,
        params={
            **params,
            "gguf": args.gguf,
            "llama_bench_args": r["args"],
            "build_commit": r["build_commit"],
        },
    )


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, ["int8"])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument(
        "--chunk-size", type=int, nargs="+", default=[4096, 8192], help="prefill chunk sizes (tokens)"
    )
    p.add_argument(
        "--attention",
        default=None,
        help="attention implementation: xla | cudnn (default: cuDNN for prefill chunks on a GPU)",
    )
    p.add_argument("--gdn", default=None, help="gated delta rule implementation= (default: the best)")
    p.add_argument("--gmm", default=None, help="grouped matmul implementation= (default: the best)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills after the untimed first (median)")
    p.add_argument("--profile", action="store_true", help="also one synchronised pass: seconds per phase")


def run_prefill(args: argparse.Namespace, rec: Recorder) -> None:
    """TTFT and prefill tokens/s per (expert format, prompt length, chunk size)."""
    config = model_config(
        args,
        attention_implementation=args.attention,
        gdn_implementation=args.gdn,
        moe_implementation=args.gmm,
    )
    for fmt in args.expert_format:
        start = time.perf_counter()
        model = hybridlm.init_random(
            config, seed=0, dtype=model_dtype(args), expert_format=expert_format_arg(fmt)
        )
        jax.block_until_ready(jax.tree_util.tree_leaves(model))
        base = {
            "preset": config.name,
            "num_layers": config.num_layers,
            "expert_format": fmt,
            "attention": args.attention or "default",
            "gdn": args.gdn or "default",
            "gmm": args.gmm or "default",
            "weight_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(model)),
            "init_s": round(time.perf_counter() - start, 1),
        }
        runner = hybridlm.LayerwiseRunner(model)
        for tokens in args.prompt_tokens:
            ids = common.random_ids(config.vocab_size, (1, tokens))
            workload = f"{config.name}_prefill_{tokens}"
            for chunk in args.chunk_size:
                if chunk > tokens:
                    continue
                params = {**base, "prompt_tokens": tokens, "chunk_size": chunk}
                _prefill_one(rec, args, runner, ids, chunk, workload, params)
            llama_record(rec, args, workload, {**base, "prompt_tokens": tokens}, prompt_tokens=tokens)
        del model, runner


def _prefill_one(
    rec: Recorder, args, runner, ids: np.ndarray, chunk: int, workload: str, params: dict
) -> None:
    tokens = ids.shape[1]
    try:
        start = time.perf_counter()
        hybridlm.prefill(runner, ids, chunk_size=chunk)  # compile + warm-up
        figures = {"first_call_s": time.perf_counter() - start}
        ttft = statistics.median(
            hybridlm.prefill(runner, ids, chunk_size=chunk).ttft_s for _ in range(args.repeats)
        )
        figures |= {"ttft_s": ttft, "tokens_per_s": tokens / ttft}
        if args.profile:
            phases = hybridlm.prefill(runner, ids, chunk_size=chunk, profile=True).phase_seconds
            figures |= {f"phase_s:{k}": v for k, v in phases.items()}
        extra = {}
        if args.trace:
            extra["trace_summary"] = traced_summary(
                f"{args.trace}/{workload}_{params['expert_format']}_{chunk}",
                lambda: hybridlm.prefill(runner, ids, chunk_size=chunk).logits,
            )
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: report, go on with the next configuration
        rec.skip(workload, "hybridlm", f"{type(e).__name__}: {str(e)[:300]}")
        return
    rec.emit(workload, "hybridlm", figures, params=params, **extra)


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, ["int8", "int4"])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=DECODE_MODES,
        default=list(DECODE_MODES),
        help="one_program: every layer in one jitted step (what generate runs); layerwise: three programs "
        "a layer (the offload seams); generate: hybridlm.generate, sampling included",
    )
    p.add_argument("--repeats", type=int, default=3)


DECODE_MODES = ("one_program", "layerwise", "generate")


def decode_loop(runner, mode: str, ids: np.ndarray, new_tokens: int) -> dict:
    """Prefills `ids`, then `new_tokens` greedy steps fed the argmax of the step before (no host sync inside
    the loop); seconds of the steps and of their enqueueing by the host, and the tokens [batch, new_tokens].
    """
    step = runner.decode_step if mode == "one_program" else runner.decode_step_layerwise
    pre = hybridlm.prefill(runner, ids, chunk_size=ids.shape[1], max_new_tokens=new_tokens)
    states, logits, pos = pre.states, pre.logits, ids.shape[1]
    tokens = []
    start = time.perf_counter()
    for i in range(new_tokens):
        token = sample(logits, None)  # greedy
        tokens.append(token)
        logits, states = step(token, states, pos + i)
    enqueued = time.perf_counter() - start
    jax.block_until_ready(logits)
    return {
        "seconds": time.perf_counter() - start,
        "enqueue_seconds": enqueued,
        "tokens": np.asarray(jnp.stack(tokens, axis=1)),
    }


def run_decode(args: argparse.Namespace, rec: Recorder) -> None:
    """Greedy decode tokens/s after a prompt, per expert format and mode."""
    config = model_config(args)
    ids = common.random_ids(config.vocab_size, (args.batch, args.prompt_tokens))
    for fmt in args.expert_format:
        model = hybridlm.init_random(
            config, seed=0, dtype=model_dtype(args), expert_format=expert_format_arg(fmt)
        )
        _decode_modes(rec, args, hybridlm.LayerwiseRunner(model), ids, fmt)
        del model


def _decode_modes(rec: Recorder, args: argparse.Namespace, runner, ids: np.ndarray, fmt: str) -> None:
    config = runner.config
    workload = f"{config.name}_decode_{args.prompt_tokens}+{args.new_tokens}"
    params = {
        "preset": config.name,
        "num_layers": config.num_layers,
        "expert_format": fmt,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    first_tokens = None
    for mode in args.modes:
        figures = decode_figures(runner, mode, ids, args.new_tokens, args.repeats, first_tokens)
        tokens = figures.pop("tokens", None)
        first_tokens = tokens if first_tokens is None else first_tokens
        extra = {}
        if args.trace and mode == "one_program":
            extra["trace_summary"] = traced_summary(
                f"{args.trace}/{workload}_{fmt}",
                lambda: decode_loop(runner, "one_program", ids, 16)["tokens"],
            )
        rec.emit(workload, f"hybridlm.{mode}", figures, params={**params, "mode": mode}, **extra)
    llama_record(rec, args, workload, params, new_tokens=args.new_tokens)


def decode_figures(runner, mode: str, ids: np.ndarray, new_tokens: int, repeats: int, first_tokens) -> dict:
    """tokens/s of one decode mode (median of `repeats` after an untimed run), with the greedy tokens agreeing
    with `first_tokens` (leading tokens)."""
    batch = ids.shape[0]
    if mode == "generate":
        hybridlm.generate(runner, ids, max_new_tokens=2)  # its sampling compiles
        gen = hybridlm.generate(runner, ids, max_new_tokens=new_tokens)
        return {"tokens_per_s": gen.decode_tokens_per_s, "ttft_s": gen.prefill.ttft_s}
    start = time.perf_counter()
    decode_loop(runner, mode, ids, 2)  # compile + warm-up
    figures = {"first_call_s": time.perf_counter() - start}
    runs = [decode_loop(runner, mode, ids, new_tokens) for _ in range(repeats)]
    seconds = statistics.median(r["seconds"] for r in runs)
    figures |= {
        "tokens_per_s": batch * new_tokens / seconds,
        "ms_per_step": seconds / new_tokens * 1e3,
        "enqueue_ms_per_step": statistics.median(r["enqueue_seconds"] for r in runs) / new_tokens * 1e3,
        "tokens": runs[0]["tokens"],
    }
    if first_tokens is not None:
        figures["same_tokens_as_first"] = int((runs[0]["tokens"] == first_tokens).all(axis=0).cumprod().sum())
    return figures

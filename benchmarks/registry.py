"""The registry of benchmarks: name -> arguments + run function, and the named workloads each one measures.

    python -m benchmarks list
    python -m benchmarks gdn --workloads qwen35_prefill_16k qwen35_packed_8x8k [--implementations ...]
    python -m benchmarks gmm --workloads prefill_gate_up [--weights bf16 int8 int4] [--no-peers]
    python -m benchmarks prefill --preset qwen3.6-35b-a3b --expert-format int4 --prompt-tokens 32768 \
        --chunk-size 32768 [--gguf F --llama-bench PATH]
    python -m benchmarks decode --preset qwen3.6-35b-a3b --expert-format int4 --prompt-tokens 512 \
        --new-tokens 128
    python -m benchmarks offload --expert-format int4 --budget 12GiB --policy static --prompt-tokens 32768
    python -m benchmarks make-gguf --preset qwen3.6-35b-a3b --out F.gguf [--experts q4_k --trunk q8_0]

In Python (the experiments and tests): `records = registry.run("prefill", ["--preset", "tiny", ...])`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from benchmarks import kernels, make_gguf, model_bench, offload_bench, traces
from benchmarks.common import Recorder

# The kernels' implementation names known to the benchmarks (`gdn-step` times every one by default; the others
# time "default", the api's choice for the device, unless --implementations names some).
IMPLEMENTATIONS = {
    "gdn": ("reference", "chunked", "triton", "mosaic"),
    "gdn-step": ("reference", "triton"),
    "gmm": ("reference", "triton", "gemv"),
}


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark: `add_arguments(parser)` declares its knobs, `run(args, recorder)` measures."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Recorder], None]
    workloads: Callable[[], list[str]]


def _gdn_workloads() -> list[str]:
    from pallas_kernels.gated_delta_rule import workloads

    return sorted(workloads.WORKLOADS)


def _gmm_workloads() -> list[str]:
    from pallas_kernels.grouped_matmul import workloads

    return sorted(workloads.WORKLOADS)


def _presets() -> list[str]:
    from hybridlm.config import PRESETS

    return sorted(PRESETS)


BENCHMARKS: dict[str, Benchmark] = {
    "gdn": Benchmark(
        "gated delta rule prefill, ours beside flash-linear-attention",
        kernels.add_gdn_arguments,
        kernels.run_gdn,
        _gdn_workloads,
    ),
    "gdn-step": Benchmark(
        "gated delta rule decode step, ours beside FLA's fused recurrent kernel",
        kernels.add_gdn_step_arguments,
        kernels.run_gdn_step,
        _gdn_workloads,
    ),
    "gmm": Benchmark(
        "grouped matmul, ours beside tokamax.ragged_dot, ragged_dot_mgpu and a dense matmul",
        kernels.add_gmm_arguments,
        kernels.run_gmm,
        _gmm_workloads,
    ),
    "moe": Benchmark(
        "the sparse-MoE layer at one prefill chunk, stage by stage",
        kernels.add_moe_arguments,
        kernels.run_moe,
        _presets,
    ),
    "head": Benchmark(
        "the lm head of a decode step or a verify, bfloat16 against kept Q8_0 blocks",
        kernels.add_head_arguments,
        kernels.run_head,
        _presets,
    ),
    "expert-decode": Benchmark(
        "one layer's routed experts at a decode step: resident, gathered out of the pool, Q4_K read in place",
        kernels.add_expert_decode_arguments,
        kernels.run_expert_decode,
        _presets,
    ),
    "prefill": Benchmark(
        "whole-model chunked prefill, all weights resident (llama-bench beside it)",
        model_bench.add_prefill_arguments,
        model_bench.run_prefill,
        _presets,
    ),
    "decode": Benchmark(
        "whole-model greedy decode, all weights resident (llama-bench beside it)",
        model_bench.add_decode_arguments,
        model_bench.run_decode,
        _presets,
    ),
    "offload": Benchmark(
        "prefill and decode with experts paged from pinned host memory",
        offload_bench.add_offload_arguments,
        offload_bench.run_offload,
        _presets,
    ),
    "h2d": Benchmark(
        "pinned host -> device copies of a layer of experts",
        offload_bench.add_h2d_arguments,
        offload_bench.run_h2d,
        lambda: [],
    ),
}


def parser() -> argparse.ArgumentParser:
    """`python -m benchmarks NAME [args]`: one subcommand per benchmark, plus `list`, `trace-summary` and
    `make-gguf`."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="benchmark", required=True)
    sub.add_parser("list", help="the benchmarks, their workloads and implementations")
    summary = sub.add_parser("trace-summary", help="summarise perfetto traces (from --trace DIR)")
    summary.add_argument(
        "dirs", nargs="+", help="trace files, or directories searched for perfetto_trace.json.gz"
    )
    summary.add_argument(
        "--gap-ms", type=float, default=0.2, help="report compute-stream gaps longer than this"
    )
    summary.add_argument("--top", type=int, default=12)
    make_gguf.add_arguments(sub.add_parser("make-gguf", help=make_gguf.HELP))
    for name, bench in BENCHMARKS.items():
        s = sub.add_parser(name, help=bench.help)
        bench.add_arguments(s)
        s.add_argument("--out", default=None, metavar="FILE", help="also append the JSON lines to FILE")
    return p


def run(name: str, argv: list[str] = (), *, echo: bool = True) -> list[dict]:
    """Runs benchmark `name` with CLI arguments `argv` (`--out FILE` among them appends there too).

    Returns:
      its records (see `common.Recorder`).

    Raises:
      KeyError: unknown benchmark name.
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    argv = list(argv)
    args = parser().parse_args([name, *argv])
    recorder = Recorder(name, argv, out=args.out, echo=echo)
    BENCHMARKS[name].run(args, recorder)
    return recorder.records


def listing() -> list[dict]:
    """One entry per benchmark: name, help, workloads (or presets), known implementations."""
    return [
        {
            "name": name,
            "help": b.help,
            "workloads": b.workloads(),
            "implementations": IMPLEMENTATIONS.get(name),
        }
        for name, b in BENCHMARKS.items()
    ]


def trace_summaries(dirs: list[str], gap_ms: float, top: int) -> list[dict]:
    """`traces.summarize` of every perfetto trace under `dirs`.

    Raises:
      FileNotFoundError: no trace under them.
    """
    files = [f for d in dirs for f in traces.trace_files(d)]
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {', '.join(dirs)}")
    return [traces.summarize(f, gap_ms, top) for f in files]

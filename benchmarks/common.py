"""What every benchmark shares: the JSON-lines record, the timers, errors between outputs, profiler traces.

A record is one measurement:
    {"name": "gdn", "workload": "qwen35_prefill_16k", "implementation": "default", "figures": {"ms": 1.2},
     "params": {...}, "device": "...", "jax_version": "0.11.2", "date": "...",
     "command": "python -m benchmarks ..."}
Every figure's key ends in its unit (`_ms`, `_s`, `_per_s`, `_gbps`, `_tflops`, `_bytes`, a bare `ms`) or is a
ratio / count. A peer that is not installed gives one record with "skipped" (the reason) and no figures.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import pathlib
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np


class Recorder:
    """Writes records as JSON lines to stdout (if `echo`) and to `out` (appended, flushed per line).

    Args:
      name: the benchmark's registry name.
      argv: its arguments, for the record's "command".
      out: file to append the JSON lines to, or None.
      echo: print each record to stdout.
    """

    def __init__(self, name: str, argv: list[str], out: str | None = None, echo: bool = True):
        self.name = name
        self.command = shlex.join(["python", "-m", "benchmarks", name, *argv])
        self.out = pathlib.Path(out) if out else None
        self.echo = echo
        self.records: list[dict] = []
        self._header: dict | None = None

    def header(self) -> dict:
        """Device kind, JAX version, date (UTC): read at the first record, after the benchmark started JAX."""
        if self._header is None:
            self._header = {
                "device": jax.devices()[0].device_kind,
                "jax_version": jax.__version__,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": self.command,
            }
        return self._header

    def emit(self, workload: str, implementation: str, figures: dict | None = None, **fields) -> dict:
        """Appends and writes one record; `figures` maps unit-suffixed names to numbers (5 digits kept)."""
        record = {
            "name": self.name,
            "workload": workload,
            "implementation": implementation,
            "figures": {k: _round(v) for k, v in (figures or {}).items() if v is not None},
            **fields,
            **self.header(),
        }
        self.records.append(record)
        line = json.dumps(record)
        if self.echo:
            print(line, flush=True)
        if self.out:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with self.out.open("a") as f:
                f.write(line + "\n")
        return record

    def skip(self, workload: str, implementation: str, reason: str) -> dict:
        """A record of a measurement not made (a peer not installed, a failure), with the reason."""
        return self.emit(workload, implementation, skipped=reason)


def _round(v):
    if isinstance(v, float) and math.isfinite(v):
        return float(f"{v:.5g}")
    return v


def implementation_arg(label: str) -> str | None:
    """A CLI implementation name as the api's `implementation=` ("default" -> None: the device's best)."""
    return None if label == "default" else label


def jax_sync(out) -> None:
    jax.block_until_ready(out)


def time_calls(
    fn: Callable, sync: Callable = jax_sync, *, reps: int, trials: int = 1, warmup: int = 3
) -> float:
    """Seconds per call: `warmup` synchronised calls (compilation), then `trials` trials of `reps`
    back-to-back calls closed by one synchronisation (launch overhead hidden behind the previous call's device
    work); the median over trials of each trial's mean."""
    for _ in range(warmup):
        sync(fn())
    means = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn()
        sync(out)
        means.append((time.perf_counter() - start) / reps)
    return statistics.median(means)


def median_seconds(fn: Callable, repeats: int) -> float:
    """Median wall seconds of `repeats` synchronised calls of `fn` after one untimed call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float32 (NaN where `got` is not finite)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


@contextlib.contextmanager
def profiler_trace(directory: str | pathlib.Path):
    """jax.profiler.trace writing a perfetto trace under `directory`, without Python function events (they
    would slow the host side being measured)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(directory), create_perfetto_trace=True, profiler_options=options):
        yield


def traced_run(trace_dir: str | None, out: str | None, name: str, fn: Callable) -> None:
    """With a trace directory: fn() once more under the profiler (its result waited for), the perfetto trace
    under trace_dir/name and a summary of it (`benchmarks.traces.summarize`) as a JSON line; else nothing."""
    if not trace_dir:
        return
    from benchmarks import traces

    directory = pathlib.Path(trace_dir) / name
    with profiler_trace(directory):
        jax.block_until_ready(fn())
    for f in traces.trace_files(directory):
        summary = traces.summarize(f, top=25)
        summary.pop("host_threads", None)
        emit_line(out, {"what": "trace", "run": name, **summary})


def kernel_split_ms(call: Callable, calls: int = 10, top: int = 16) -> dict[str, float]:
    """Device milliseconds per call of each kernel `call` launches, from a profiler trace of `calls` calls
    (the kernels' own durations, launch gaps not counted)."""
    from benchmarks import traces

    with tempfile.TemporaryDirectory() as d:
        with profiler_trace(d):
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        files = sorted(pathlib.Path(d).rglob("perfetto_trace.json.gz"))
        kernels = traces.summarize(files[0], top=top).get("top_kernels_ms", {}) if files else {}
    return {name: round(ms / calls, 4) for name, ms in kernels.items()}


def random_ids(vocab_size: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, shape).astype(np.int32)


def add_model_source_args(p) -> None:
    """--gguf FILE or --preset NAME (random weights), and --budget, for the benchmarks of the user's path."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf")
    source.add_argument("--preset", help="random weights of a preset (e.g. tiny)")
    p.add_argument("--budget", default=None, help="offload experts beyond this budget, e.g. 12GiB (--gguf)")


def runner_and_tokenizer(args):
    """(runner, tokenizer) of `add_model_source_args`' options: the GGUF file with its experts kept
    quantized (offloaded beyond --budget) and its own tokenizer, or a preset's random weights and Qwen's."""
    import hybridlm
    from hybridlm.tokenizer import Tokenizer

    if not args.gguf:
        model = hybridlm.init_random(hybridlm.get_config(args.preset), seed=0)
        return hybridlm.LayerwiseRunner(model), Tokenizer()
    from hybridlm.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    if args.budget:
        from hybridlm.offload import OffloadConfig, OffloadedRunner, load_offloaded

        model, host = load_offloaded(args.gguf, parts=1, progress=False)
        runner = OffloadedRunner(model, OffloadConfig(expert_budget=args.budget), host_experts=host)
    else:
        runner = hybridlm.LayerwiseRunner(hybridlm.load(args.gguf, keep_quantized="experts", progress=False))
    return runner, tokenizer_from_gguf(args.gguf) or Tokenizer()


def emit_line(out: str | None, record: dict) -> None:
    """Prints `record` with the device and JAX version as one JSON line, and appends it to `out` if given."""
    line = json.dumps({**record, "device": jax.devices()[0].device_kind, "jax_version": jax.__version__})
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")

"""Our gated delta rule and flash-linear-attention's, in short bursts and sustained, with the GPU's SM clock,
power draw and throttle reasons sampled beside them (nvidia-smi every 20 ms).

`gated_delta_rule.py` times 50 back-to-back calls (~60 ms for the packed batch); the GPU keeps its full clock
that long. Run for seconds, a call that draws more power than the board's limit is slowed by the clock the
driver then lowers (throttle reason 0x4, the software power cap). This script shows which regime each call
is in: for each workload, ours and FLA's calls each in a burst of 50 and sustained for ~2.5 s of GPU time,
idle 1.5 s between phases.

usage (GPU machine, FLA installed from .whl/ as in gpu_session.sh):
  PYTHONPATH=/tmp/site:. python3 benchmarks/gdn_sustained_clock.py --out $OUT/sustained.json [--smi-csv F]

Writes JSON: one row per phase (impl, workload, reps, ms per call, SM clock min / mean MHz, max power W,
fraction of samples with the software power cap active), the device and the date.
"""

import argparse
import datetime
import functools
import os
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json

from pallas_kernels.gated_delta_rule import pallas_triton, workloads

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4


def read_samples(path):
    """(unix time, SM clock MHz, power W, throttle reasons) per nvidia-smi line."""
    samples = []
    with open(path) as lines:
        for line in lines:
            fields = [x.strip() for x in line.split(",")]
            try:
                t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
                samples.append((t.replace(tzinfo=datetime.UTC).timestamp(), int(fields[1].split()[0]),
                                float(fields[2].split()[0]), int(fields[3], 16)))
            except (ValueError, IndexError):  # a header, or a line cut off at the end
                continue
    return samples


def summarize(phases, samples):
    """Adds to each phase the clock, power and power-cap share of the samples inside it (those past its first
    0.3 s where it lasts longer than that: the clock follows the load within ~0.15 s)."""
    for phase in phases:
        inside = [s for s in samples if phase["start"] <= s[0] <= phase["end"]]
        inside = [s for s in inside if s[0] >= phase["start"] + 0.3] or inside
        if inside:
            clocks = [s[1] for s in inside]
            phase.update(samples=len(inside), sm_clock_min_mhz=min(clocks),
                         sm_clock_mean_mhz=round(sum(clocks) / len(clocks)), power_max_w=max(s[2] for s in inside),
                         power_capped=round(sum(bool(s[3] & SW_POWER_CAP) for s in inside) / len(inside), 3))
    return phases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smi-csv", default=None, help="keep nvidia-smi's samples here")
    parser.add_argument("--seconds", type=float, default=2.5, help="GPU time of each sustained phase")
    args = parser.parse_args(argv)
    import gated_delta_rule  # (a sibling script: benchmarks/ is on sys.path when this one runs)
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    smi_path = args.smi_csv
    if smi_path is None:
        handle, smi_path = tempfile.mkstemp(suffix=".csv")
        os.close(handle)
    phases = []

    def timed(impl, workload, fn, sync, reps):  # one phase: `reps` back-to-back calls, its wall-clock span kept
        t0 = time.time()
        ms = gated_delta_rule.wall_ms(fn, sync, reps, warmup=0)
        phases.append({"impl": impl, "workload": workload.name, "reps": reps, "ms": ms, "start": t0,
                       "end": time.time()})
        print(phases[-1], flush=True)
        time.sleep(1.5)

    def run(workload):  # burst, burst, sustained, sustained, burst
        inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=0)
        inputs["beta"] = inputs["beta"].astype(jnp.bfloat16).astype(jnp.float32)
        ours = functools.partial(jax.jit(functools.partial(pallas_triton.gated_delta_rule_pallas,
                                                           interpret=False)), **inputs)
        fla = gated_delta_rule.fla_call(inputs, torch, chunk_gated_delta_rule)
        jax_sync, torch_sync = jax.block_until_ready, lambda _: torch.cuda.synchronize()
        for _ in range(3):
            jax_sync(ours())
            torch_sync(fla())
        time.sleep(1.5)
        timed("ours", workload, ours, jax_sync, 50)
        timed("fla", workload, fla, torch_sync, 50)
        per_call = phases[-2]["ms"], phases[-1]["ms"]
        timed("ours", workload, ours, jax_sync, int(args.seconds * 1e3 / per_call[0]))
        timed("fla", workload, fla, torch_sync, int(args.seconds * 1e3 / per_call[1]))
        timed("ours", workload, ours, jax_sync, 50)

    with open(smi_path, "w") as smi_out:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "20"],
                               stdout=smi_out)
        for workload in (workloads.QWEN35_PACKED_8X8K, workloads.QWEN35_PREFILL_16K):
            run(workload)
        smi.terminate()
        smi.wait()
    summarize(phases, read_samples(smi_path))
    doc = run_header("gdn_sustained_clock", torch=torch.__version__, phases=phases)
    write_json(doc, args.out, echo=False)
    for p in phases:
        print(p["impl"], p["workload"], p["reps"], round(p["ms"], 4), p.get("sm_clock_mean_mhz"),
              p.get("power_capped"))


if __name__ == "__main__":
    main()

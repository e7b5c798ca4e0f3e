"""FLA 0.6.0's chunk_gated_delta_rule kernels, timed one by one with the torch profiler (packed 8 x 8192)."""
import collections
import json
import os
import sys

import jax.numpy as jnp
import torch

sys.path.insert(0, "benchmarks")
import gated_delta_rule as bench  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from pallas_kernels.gated_delta_rule import workloads  # noqa: E402

inputs = workloads.make_inputs(workloads.QWEN35_PACKED_8X8K, dtype=jnp.bfloat16, seed=0)
call = bench.fla_call(inputs, torch, chunk_gated_delta_rule)
for _ in range(5):
    call()
torch.cuda.synchronize()
reps = 20
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
per = collections.defaultdict(float)
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        per[e.name] += e.device_time_total / 1e3 / reps  # ms per call
rows = sorted(per.items(), key=lambda kv: -kv[1])
print(json.dumps({"fla_kernels_ms": rows, "total_ms": sum(per.values())}, indent=1))
json.dump({"fla_kernels_ms": rows, "device": torch.cuda.get_device_name()},
          open(os.path.join(os.environ["OUT"], "fla_split.json"), "w"), indent=1)

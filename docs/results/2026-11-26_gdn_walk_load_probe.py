"""Per-step time of the Mosaic walk: packed vs batch rows, half vs full load (one process, wall + kernel split)."""
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import gated_delta_rule as bench

from pallas_kernels.gated_delta_rule import pallas_triton, workloads

W = workloads.Workload
DEFAULT = pallas_triton.BlockSizes.get_default()
cases = [  # name, workload, BlockSizes changes, programs, chunks per program
    ("packed 8x8192 (default, P in walk)", W(name="p", seq=65536, seqlens=(8192,) * 8), {}, 512, 128),
    ("batch 8x8192 (default, P from prepare)", W(name="b8", batch=8, seq=8192), {}, 512, 128),
    ("batch 8x8192, P in walk", W(name="b8p", batch=8, seq=8192), {"p_in_walk": True}, 512, 128),
    ("batch 4x8192, P in walk", W(name="b4p", batch=4, seq=8192), {"p_in_walk": True}, 256, 128),
    ("batch 2x8192, P in walk", W(name="b2p", batch=2, seq=8192), {"p_in_walk": True}, 128, 128),
    ("batch 1x16384, P in walk", W(name="b1p", batch=1, seq=16384), {"p_in_walk": True}, 64, 256),
    ("batch 1x16384 (default)", W(name="b1", batch=1, seq=16384), {}, 64, 256),
]
rows = []
for name, w, changes, programs, chunks in cases:
    inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0)
    bs = dataclasses.replace(DEFAULT, **changes) if changes else None
    fn = jax.jit(functools.partial(pallas_triton.gated_delta_rule_pallas, block_sizes=bs))
    call = functools.partial(fn, **inputs)
    ms = bench.wall_ms(call, bench.jax_sync, reps=30)
    split = bench.kernel_split_ms(call)
    walk = sum(v for k, v in split.items() if "gdn_state" in k)
    waves = -(-programs // 132)
    row = {"case": name, "ms": round(ms, 4), "walk_ms": walk, "kernels_ms": split, "programs": programs,
           "waves": waves, "us_per_step": round(walk * 1e3 / (waves * chunks), 3)}
    print(json.dumps(row), flush=True)
    rows.append(row)
with open(os.path.join(os.environ["OUT"], "load_probe.json"), "w") as f:
    json.dump({"rows": rows, "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)

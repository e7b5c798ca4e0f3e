"""Pinned host -> device copies of experts, the ways the offload scheduler could issue them.

One layer of `--experts` experts of `--expert-bytes` bytes each (1.6 MB ~ one 4-bit Qwen3.6 expert):
  per_expert_buffers   one `jax.device_put` of a list of per-expert pinned buffers (the scheduler before
                       2026-11-22: one transfer per expert, ~21 GB/s on an H100)
  layer_buffer         one `jax.device_put` of the contiguous [experts, nbytes] pinned buffer (the scheduler's
                       whole-layer copy)
  parts_N              the layer as N contiguous pinned buffers in one `jax.device_put`
  rows_M               `HostExperts.to_device` with M of the experts (row copies inside one jitted program,
                       the scheduler's partial-layer copy); checks the bytes arrive intact
Each: median of --repeats copies, synchronised; GB/s = 10^9 bytes/s.

Overlap with compute (`overlap`): a jitted chain of bf16 matmuls (~--compute-ms alone) and the whole-layer copy,
timed alone and together: `after_compute` enqueues the compute then the copy (the scheduler's pattern);
`in_program` returns the copy from inside the compute's jitted program (XLA's host offloader issues it as an
asynchronous copy); `half_slice` copies a static slice (half the layer) of the host buffer inside the program,
`half_buffer` a separate pinned buffer of the same bytes (the scheduler's way: one part per program); `pageable` copies from a numpy array instead of pinned memory. overlap = (alone sum -
together) / min(alone): 1 = the copy hides entirely behind compute, 0 = they run one after the other.
Prints one JSON document.

usage: XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/h2d_copies.py [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from bench_io import run_header, write_json

from hybridlm.offload import HostExperts
from hybridlm.offload.expert_cache import ExpertLayout
from hybridlm.offload.host import device_sharding, pinned_host_sharding


def median_s(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_overlap(host: HostExperts, host_np: np.ndarray, compute_ms: float, repeats: int) -> dict:
    """Whether a whole-layer host -> device copy runs beside compute (see the module docstring)."""
    dev = device_sharding()
    x = jax.device_put(np.ones((4096, 4096), np.float32), dev).astype(jax.numpy.bfloat16)

    def chain(x, n):
        for _ in range(n):
            x = (x @ x) * 1e-3
        return x

    one = median_s(lambda: jax.jit(chain, static_argnums=1)(x, 1), repeats)
    n = max(1, int(compute_ms / 1e3 / one))
    compute = jax.jit(chain, static_argnums=1)
    fused = jax.jit(lambda x, h: (chain(x, n), jax.device_put(h, jax.memory.Space.Device)))
    layer = host.layers[0][0]
    t_compute = median_s(lambda: compute(x, n), repeats)
    t_copy = median_s(lambda: jax.device_put(layer, dev), repeats)
    t_after = median_s(lambda: (compute(x, n), jax.device_put(layer, dev)), repeats)
    t_fused = median_s(lambda: fused(x, layer), repeats)
    half = layer.shape[0] // 2
    copy_half = jax.jit(lambda h: jax.device_put(h[:half], jax.memory.Space.Device))
    fused_half = jax.jit(lambda x, h: (chain(x, n), jax.device_put(h[:half], jax.memory.Space.Device)))
    t_half = median_s(lambda: copy_half(layer), repeats)
    t_fused_half = median_s(lambda: fused_half(x, layer), repeats)
    part = jax.device_put(host_np[:half], pinned_host_sharding())     # a whole buffer of the same bytes
    copy_part = jax.jit(lambda h: jax.device_put(h, jax.memory.Space.Device))
    fused_part = jax.jit(lambda x, h: (chain(x, n), jax.device_put(h, jax.memory.Space.Device)))
    t_part = median_s(lambda: copy_part(part), repeats)
    t_fused_part = median_s(lambda: fused_part(x, part), repeats)
    t_page = median_s(lambda: jax.device_put(host_np, dev), repeats)
    t_page_after = median_s(lambda: (compute(x, n), jax.device_put(host_np, dev)), repeats)

    def ov(a, b, both):
        return round((a + b - both) / min(a, b), 3)

    return {"compute_ms": round(t_compute * 1e3, 3), "copy_ms": round(t_copy * 1e3, 3),
            "after_compute_ms": round(t_after * 1e3, 3), "in_program_ms": round(t_fused * 1e3, 3),
            "pageable_copy_ms": round(t_page * 1e3, 3), "pageable_after_compute_ms": round(t_page_after * 1e3, 3),
            "overlap_after_compute": ov(t_compute, t_copy, t_after),
            "overlap_in_program": ov(t_compute, t_copy, t_fused),
            "overlap_pageable": ov(t_compute, t_page, t_page_after),
            "half_slice_copy_in_own_program_ms": round(t_half * 1e3, 3),
            "half_slice_in_program_ms": round(t_fused_half * 1e3, 3),
            "overlap_half_slice_in_program": ov(t_compute, t_half, t_fused_half),
            "half_buffer_copy_in_own_program_ms": round(t_part * 1e3, 3),
            "half_buffer_in_program_ms": round(t_fused_part * 1e3, 3),
            "overlap_half_buffer_in_program": ov(t_compute, t_part, t_fused_part)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--expert-bytes", type=int, default=1_638_400)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 200])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    E, nb = a.experts, a.expert_bytes
    host_np = np.random.default_rng(0).integers(0, 256, (E, nb), dtype=np.uint8)
    layout = ExpertLayout.of(np.zeros((E, nb), np.uint8), np.zeros((E, 0), np.uint8))
    host = HostExperts(layout, [jax.device_put(host_np, pinned_host_sharding())])
    dev = device_sharding()
    res = run_header("h2d_copies", experts=E, expert_bytes=nb, gbps={})
    per_expert = [jax.device_put(host_np[e], pinned_host_sharding()) for e in range(E)]
    res["gbps"]["per_expert_buffers"] = E * nb / median_s(lambda: jax.device_put(per_expert, dev), a.repeats) / 1e9
    res["gbps"]["layer_buffer"] = E * nb / median_s(lambda: host.to_device(0)[0][0], a.repeats) / 1e9
    for n in (4, 16):
        parts = [jax.device_put(x, pinned_host_sharding()) for x in np.array_split(host_np, n)]
        res["gbps"][f"parts_{n}"] = E * nb / median_s(lambda parts=parts: jax.device_put(parts, dev), a.repeats) / 1e9
    rng = np.random.default_rng(1)
    for m in a.rows:
        ids = [int(e) for e in rng.permutation(E)[:m]]
        got = host.to_device(0, ids)
        intact = all(np.array_equal(np.asarray(buf), host_np[rows]) for buf, rows in got)
        t = median_s(lambda ids=ids: [buf for buf, _ in host.to_device(0, ids)], a.repeats)
        res["gbps"][f"rows_{m}"] = m * nb / t / 1e9
        res[f"rows_{m}_intact"] = intact
    res["gbps"] = {k: float(f"{v:.4g}") for k, v in res["gbps"].items()}   # 4 significant digits (tiny CPU runs too)
    if jax.default_backend() != "cpu":
        res["overlap"] = measure_overlap(host, host_np, a.compute_ms, a.repeats)
    write_json(res, a.out)
    return res


if __name__ == "__main__":
    main()

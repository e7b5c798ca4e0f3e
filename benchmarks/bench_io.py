"""What every benchmark script's JSON document starts with, and how it is written.

    doc = run_header("decode", preset="qwen3.6-35b-a3b", rows=[])
    ...
    write_json(doc, args.out)      # also printed last, as the scripts promise
"""

from __future__ import annotations

import contextlib
import datetime
import json

import jax


def run_header(benchmark: str, **fields) -> dict:
    """{"benchmark", "device" (its kind, e.g. "NVIDIA H100 80GB HBM3"), "jax_version", "date" (UTC, ISO seconds),
    then `fields`}: the figures of docs/benchmarks.md name their device, JAX version and date."""
    return {"benchmark": benchmark, "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **fields}


def write_json(doc: dict, path: str | None, *, echo: bool = True) -> None:
    """Writes `doc` (indented JSON) to `path` if given, and prints it if `echo`."""
    text = json.dumps(doc, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text)
    if echo:
        print(text)


def preset_config(preset: str, num_layers: int | None = None):
    """`hybridlm.get_config(preset)`, its depth overridden by `num_layers` where given (the benchmarks' smoke tests
    run 4-layer models)."""
    import dataclasses

    import hybridlm

    config = hybridlm.get_config(preset)
    return dataclasses.replace(config, num_layers=num_layers) if num_layers else config


@contextlib.contextmanager
def traced_constant(module, name: str, value):
    """`module.name` set to `value` inside the block, for an A/B in one process of a choice made while tracing
    (a module constant read when a program is traced). JAX's caches are cleared where the value changes, on entry
    and again on exit (where the former value comes back)."""
    former = getattr(module, name)
    if value != former:
        setattr(module, name, value)
        jax.clear_caches()
    try:
        yield
    finally:
        if value != former:
            setattr(module, name, former)
            jax.clear_caches()


def gemv_max_rows(value: int):
    """`pallas_gemv.MAX_ROWS` set to `value` inside the block (0: decode's expert products on the tensor-core
    kernel), for an A/B of the matrix-vector kernel in one process (`traced_constant`)."""
    from pallas_kernels.grouped_matmul import pallas_gemv

    return traced_constant(pallas_gemv, "MAX_ROWS", value)

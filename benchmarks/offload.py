"""Offloaded prefill: experts in pinned host memory, paged into a device expert pool (hybridlm.offload).

Builds a full-size preset with random weights WITHOUT ever holding all experts on the device: the trunk
(embeddings, mixers, router, shared expert, head) is drawn on the device, and the experts are drawn, quantized
and packed one layer at a time, then copied to pinned host memory. For every expert format x budget x policy
it runs prefills of each prompt length and reports tokens/s, bytes moved host -> device, and the ratio of the
prefill time to the transfer floor (bytes / pinned host -> device bandwidth measured in the same run) and to
the all-resident prefill (where the experts fit on the device). With --decode-tokens it also times greedy
decode after a short prompt (`hybridlm.generate`) per configuration, with the decode steps' cache statistics.

Run on the GPU machine, e.g.:
    python benchmarks/offload.py --expert-formats int4 int8 --budgets 12GiB 24GiB --policies static slru stream
CPU smoke test:
    JAX_PLATFORMS=cpu python benchmarks/offload.py --preset tiny --budgets 1MiB 3MiB --prompt-tokens 256 512 \
        --chunk-size 128
Prints one JSON object per configuration, then the whole result (device, JAX version, date) on one line, or
with --out writes it there (indented) instead.
Compilation is excluded: before each timed prompt the runner prefills a different warm-up prompt of the same
length (this also warms its cache, as a previous request would); the cache is shared across prompts (reuse
across prompts is part of the design).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import run_header, write_json
from flax import nnx

import hybridlm
from hybridlm.model import EXPERT_PARAMS, HybridLM, _random_param_jax
from hybridlm.offload import (
    HostExperts,
    OffloadConfig,
    OffloadedRunner,
    default_host_parts,
    measure_h2d_gbps,
    parse_bytes,
)
from pallas_kernels.quantized import quantize_int4, quantize_int8


def build_trunk(config, dtype) -> HybridLM:
    """The model with random trunk weights on the device and 1-element placeholders for the experts."""
    abstract = nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(1)
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        name, value = path[-1], var.get_value()
        if name in EXPERT_PARAMS:
            var.set_value(jnp.zeros((1, 1, 1), dtype))
        elif hasattr(value, "shape"):
            var.set_value(_random_param_jax(name, jax.random.fold_in(key, i), tuple(value.shape), value.dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _random_experts(key, num_experts, hidden, ffn, dtype):
    k1, k2 = jax.random.split(key)
    gate_up = jax.random.normal(k1, (num_experts, hidden, 2 * ffn), jnp.float32) / math.sqrt(hidden)
    down = jax.random.normal(k2, (num_experts, ffn, hidden), jnp.float32) / math.sqrt(ffn)
    return gate_up.astype(dtype), down.astype(dtype)


_random_experts = jax.jit(_random_experts, static_argnums=(1, 2, 3, 4))


def build_host_experts(config, expert_format: str, dtype, seed: int = 0, parts: int | None = None) -> HostExperts:
    """Random experts drawn on the device one layer at a time, quantized, packed into pinned host memory as
    `parts` buffers a layer."""
    moe = config.moe
    layout, layers = None, []
    for layer in range(config.num_layers):
        gate_up, down = _random_experts(jax.random.key(1000 * seed + layer), moe.num_experts, config.hidden_dim,
                                        moe.expert_ffn_dim, dtype)
        if expert_format == "int8":
            gate_up, down = quantize_int8(gate_up), quantize_int8(down)
        elif expert_format == "int4":
            gate_up, down = quantize_int4(gate_up), quantize_int4(down)
        layout, buffer = HostExperts.pack_layer(gate_up, down, parts=parts)
        jax.block_until_ready(buffer)
        del gate_up, down
        layers.append(buffer)
    return HostExperts(layout, layers)


def measure_h2d_experts(host: HostExperts, experts=None, repeats: int = 3) -> float:
    """GB/s of experts of layer 0 copied the scheduler's way (`HostExperts.to_device`): experts=None, the whole
    layer in one copy; else those experts as row copies."""
    count = host.num_experts if experts is None else len(experts)
    jax.block_until_ready([buf for buf, _ in host.to_device(0, experts)])    # compiles the row copies
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready([buf for buf, _ in host.to_device(0, experts)])
        times.append(time.perf_counter() - t)
    return count * host.layout.nbytes / statistics.median(times) / 1e9


def run_prompts(runner, prompts: dict[int, np.ndarray], warmup: dict[int, np.ndarray], chunk: int,
                offload: bool, profile: bool = False) -> list:
    out = []
    for tokens, ids in prompts.items():
        # Each prompt length has its own KV-cache capacity (attention shapes), so each is warmed up (compiled)
        # with a different prompt of the same length first; the 2026-11-22 run warmed up the first length only.
        t = time.perf_counter()
        hybridlm.prefill(runner, warmup[tokens], chunk_size=chunk)
        first_s = time.perf_counter() - t
        r = hybridlm.prefill(runner, ids, chunk_size=chunk)
        row = {"prompt_tokens": tokens, "chunk_size": r.chunk_size, "ttft_s": round(r.ttft_s, 4),
               "tokens_per_s": round(tokens / r.ttft_s, 1), "warmup_s": round(first_s, 2)}
        if offload:
            s = runner.stats(per_layer=False)["prefill"]
            row.update({k: s[k] for k in ("lookups", "hits", "misses", "prefetched", "prefetch_used", "evictions",
                                          "bytes_h2d")})
            row.update({"hit_rate": round(s["hit_rate"], 4), "stall_s": round(s["stall_s"], 4),
                        "achieved_gbps": round(s["achieved_gbps"], 2)})
        if profile:   # one more pass, synchronised after every program: where the time goes (no overlap
            # between programs; a copy inside a program still overlaps that program's compute)
            p = hybridlm.prefill(runner, warmup[tokens], chunk_size=chunk, profile=True)
            row["phase_seconds"] = {k: round(v, 4) for k, v in p.phase_seconds.items()}
        out.append(row)
    return out


def decode_row(runner, ids: np.ndarray, new_tokens: int, offload: bool) -> dict:
    """`hybridlm.generate` after a prompt of ids: greedy decode tokens/s (the steps after the first, which
    compiles on a first call, and with device paging fills the expert pool: its seconds are reported beside) and,
    offloaded, the decode steps' cache statistics."""
    hybridlm.generate(runner, ids, max_new_tokens=2, chunk_size=ids.shape[1])    # compiles the step's programs
    g = hybridlm.generate(runner, ids, max_new_tokens=new_tokens, chunk_size=ids.shape[1])
    row = {"decode_prompt_tokens": ids.shape[1], "decode_tokens": new_tokens,
           "decode_tokens_per_s": round(g.decode_tokens_per_s, 2), "decode_s": round(g.decode_s, 3),
           "decode_first_step_s": round(g.first_step_s, 3)}
    if offload:
        s = runner.stats(per_layer=False)["decode"]
        row.update({f"decode_{k}": s[k] for k in ("lookups", "hits", "misses", "prefetched", "prefetch_used",
                                                  "evictions", "bytes_h2d")})
        row.update({"decode_hit_rate": round(s["hit_rate"], 4), "decode_stall_s": round(s["stall_s"], 4)})
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--expert-formats", nargs="+", choices=("bf16", "int8", "int4"), default=["int4", "int8", "bf16"])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--budgets", nargs="+", default=["12GiB", "24GiB"])
    p.add_argument("--policies", nargs="+", default=["static", "slru", "lru", "lfu", "stream"])
    p.add_argument("--host-parts", type=int, nargs="+", default=[default_host_parts()],
                   help="pinned buffers a layer (HostExperts parts), each value a configuration in turn")
    p.add_argument("--prefetch", default="auto", choices=("auto", "router", "layer", "none"))
    p.add_argument("--prefetch-depth", type=int, default=2, help="layers streamed ahead (whole-layer mode)")
    p.add_argument("--no-resident", action="store_true", help="skip the all-resident comparison")
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new configurations after this")
    p.add_argument("--profile", action="store_true", help="add per-phase seconds from one more, synchronised pass")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after each offloaded configuration, one more prefill of each prompt under jax.profiler.trace "
                        "(perfetto trace under DIR/<format>_<budget>_<policy>_<tokens>; summary: "
                        "benchmarks/trace_summary.py)")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="also greedy-decode this many tokens after a --decode-prompt-tokens prompt per configuration "
                        "(tokens/s of the steps after the first and, offloaded, the decode cache statistics)")
    p.add_argument("--decode-prompt-tokens", type=int, default=512)
    p.add_argument("--out", default=None, help="write the final JSON here")
    a = p.parse_args(argv)

    t_start = time.perf_counter()
    config = hybridlm.get_config(a.preset, **({"num_layers": a.num_layers} if a.num_layers else {}))
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    header = run_header("offload", preset=config.name, num_layers=config.num_layers, dtype=jnp.dtype(dtype).name,
                        chunk_size=a.chunk_size, prefetch=a.prefetch, prefetch_depth=a.prefetch_depth)
    header["pinned_h2d_gbps"] = round(measure_h2d_gbps(), 2)
    t = time.perf_counter()
    model = build_trunk(config, dtype)
    jax.block_until_ready(jax.tree_util.tree_leaves(model))
    header["trunk_bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(model))
    header["trunk_init_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(header), flush=True)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, config.vocab_size, (1, n)).astype(np.int32) for n in a.prompt_tokens}
    warmup = {n: rng.integers(0, config.vocab_size, (1, n)).astype(np.int32) for n in a.prompt_tokens}
    decode_ids = rng.integers(0, config.vocab_size, (1, a.decode_prompt_tokens)).astype(np.int32)
    rows = []

    short = ("expert_format", "host_parts", "mode", "budget", "policy", "prompt_tokens", "tokens_per_s", "ttft_s",
             "bytes_h2d", "hit_rate", "stall_s", "ratio_to_floor", "ratio_to_bound", "warmup_s", "phase_seconds", "error",
             "skipped", "decode_tokens_per_s", "decode_hit_rate", "decode_bytes_h2d", "decode_stall_s")

    def emit(row):
        rows.append(row)
        print(json.dumps({k: row[k] for k in short if k in row}), flush=True)

    def out_of_time():
        return time.perf_counter() - t_start > a.max_seconds

    for fmt, parts in [(fmt, parts) for fmt in a.expert_formats for parts in a.host_parts]:
        if out_of_time():
            break
        t = time.perf_counter()
        host = build_host_experts(config, fmt, dtype, parts=parts)
        fmt_info = {"expert_format": fmt, "host_parts": parts, "expert_bytes": host.layout.nbytes,
                    "all_expert_bytes": host.nbytes,
                    "host_init_s": round(time.perf_counter() - t, 1),
                    "experts_h2d_gbps": round(measure_h2d_experts(host), 2),
                    "experts_h2d_gbps_rows_64": round(measure_h2d_experts(host, list(range(0, 256, 4))[:64]), 2)}
        print(json.dumps(fmt_info), flush=True)
        floor_gbps = header["pinned_h2d_gbps"]
        resident = {}
        if not a.no_resident and not out_of_time():
            try:
                for i, layer in enumerate(model.layers):
                    gate_up, down = host.unpack_layer(i)
                    layer.ffn.experts_gate_up.set_value(gate_up)
                    layer.ffn.experts_down.set_value(down)
                for row in run_prompts(hybridlm.LayerwiseRunner(model), prompts, warmup, a.chunk_size, False,
                                       a.profile):
                    resident[row["prompt_tokens"]] = row["ttft_s"]
                    emit({**fmt_info, "mode": "resident", **row})
                if a.decode_tokens:
                    emit({**fmt_info, "mode": "resident", **decode_row(hybridlm.LayerwiseRunner(model), decode_ids,
                                                                      a.decode_tokens, False)})
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: report and go on
                emit({**fmt_info, "mode": "resident", "error": repr(e)[:300]})
            finally:
                for layer in model.layers:
                    layer.ffn.experts_gate_up.set_value(jnp.zeros((1, 1, 1), dtype))
                    layer.ffn.experts_down.set_value(jnp.zeros((1, 1, 1), dtype))
                gc.collect()
        for budget in a.budgets:
            for policy in a.policies:
                if out_of_time():
                    emit({**fmt_info, "mode": "offload", "budget": budget, "policy": policy, "skipped": "time"})
                    continue
                try:
                    offload_config = OffloadConfig(expert_budget=budget, cache_policy=policy, prefetch=a.prefetch,
                                                   prefetch_depth=a.prefetch_depth, chunk_size=a.chunk_size)
                    runner = OffloadedRunner(model, offload_config, host_experts=host)
                    for row in run_prompts(runner, prompts, warmup, a.chunk_size, True, a.profile):
                        floor_s = row["bytes_h2d"] / (floor_gbps * 1e9)
                        bound = max(floor_s, resident.get(row["prompt_tokens"], 0.0))
                        row.update({"floor_s": round(floor_s, 4),
                                    "ratio_to_floor": round(row["ttft_s"] / floor_s, 3) if floor_s else None,
                                    "ratio_to_bound": round(row["ttft_s"] / bound, 3) if bound else None})
                        emit({**fmt_info, "mode": "offload", "budget": budget,
                              "budget_bytes": parse_bytes(budget), "policy": policy,
                              "slots": runner.cache.num_slots, "staging_slots": runner.staging_slots, **row})
                    if a.decode_tokens:
                        emit({**fmt_info, "mode": "offload", "budget": budget, "policy": policy,
                              **decode_row(runner, decode_ids, a.decode_tokens, True)})
                    if a.trace:   # no Python function events: they would slow the host side being measured
                        options = jax.profiler.ProfileOptions()
                        options.python_tracer_level = 0
                        for tokens, ids in prompts.items():
                            with jax.profiler.trace(f"{a.trace}/{fmt}_{budget}_{policy}_{tokens}",
                                                    create_perfetto_trace=True, profiler_options=options):
                                hybridlm.prefill(runner, ids, chunk_size=a.chunk_size)
                    del runner
                except Exception as e:  # noqa: BLE001
                    emit({**fmt_info, "mode": "offload", "budget": budget, "policy": policy, "error": repr(e)[:300]})
                gc.collect()
        del host
        gc.collect()
    result = {**header, "total_s": round(time.perf_counter() - t_start, 1), "results": rows}
    if a.out:
        write_json(result, a.out, echo=False)
    else:
        print(json.dumps(result), flush=True)   # one line, as the rows above
    return result


if __name__ == "__main__":
    main()

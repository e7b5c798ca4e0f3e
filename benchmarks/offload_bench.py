"""Offloaded prefill and decode (experts in pinned host memory, paged into a device expert pool), and the host
-> device copies they rest on.

The preset is built WITHOUT ever holding all experts on the device: the trunk (embeddings, mixers, router,
shared expert, head) is drawn on the device and the experts are drawn, quantized and packed one layer at a
time into pinned host memory. Per expert format x host parts x budget x policy it runs a prefill of each
prompt length after an untimed one of a different prompt of the same length (compilation excluded; the cache
stays warm, as after a previous request), and reports tokens/s, bytes moved, hit rate and the ratios to the
transfer floor (bytes / pinned bandwidth measured in the same run) and to the all-resident prefill.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hybridlm
from benchmarks import common, model_bench
from benchmarks.common import Recorder
from hybridlm.model import EXPERT_PARAMS, HybridLM, random_param_jax
from hybridlm.offload import (
    ExpertLayout,
    HostExperts,
    OffloadConfig,
    OffloadedRunner,
    measure_h2d_gbps,
    parse_bytes,
)
from pallas_kernels.quantized import quantize_int4, quantize_int8

STAT_KEYS = (
    "lookups",
    "hits",
    "misses",
    "prefetched",
    "prefetch_used",
    "evictions",
    "bytes_h2d",
    "hit_rate",
    "stall_s",
    "achieved_gbps",
)


def make_offloaded_runner(
    model: HybridLM,
    host: HostExperts,
    *,
    budget: str | int,
    policy: str,
    prefetch: str,
    prefetch_depth: int,
    whole_layer: bool | None,
    chunk_size: int | None,
) -> OffloadedRunner:
    """The one place the benchmarks and experiments construct an `OffloadedRunner`."""
    config = OffloadConfig(
        expert_budget=budget,
        cache_policy=policy,
        prefetch=prefetch,
        prefetch_depth=prefetch_depth,
        whole_layer=whole_layer,
        chunk_size=chunk_size,
    )
    return OffloadedRunner(model, config, host_experts=host)


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
            var.set_value(random_param_jax(name, jax.random.fold_in(key, i), tuple(value.shape), value.dtype))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_experts(key, num_experts, hidden, ffn, dtype):
    k1, k2 = jax.random.split(key)
    gate_up = jax.random.normal(k1, (num_experts, hidden, 2 * ffn), jnp.float32) / math.sqrt(hidden)
    down = jax.random.normal(k2, (num_experts, ffn, hidden), jnp.float32) / math.sqrt(ffn)
    return gate_up.astype(dtype), down.astype(dtype)


def build_host_experts(
    config, expert_format: str, dtype, parts: int | None = None, seed: int = 0
) -> HostExperts:
    """Random experts drawn on the device a layer at a time, quantized, packed into pinned host memory
    (`parts` buffers a layer; None: the runner's default)."""
    moe = config.moe
    layout, layers = None, []
    for layer in range(config.num_layers):
        gate_up, down = _random_experts(
            jax.random.key(1000 * seed + layer), moe.num_experts, config.hidden_dim, moe.expert_ffn_dim, dtype
        )
        if expert_format in ("int8", "int4"):
            quantize = quantize_int8 if expert_format == "int8" else quantize_int4
            gate_up, down = quantize(gate_up), quantize(down)
        layout, buffer = HostExperts.pack_layer(gate_up, down, parts=parts)
        jax.block_until_ready(buffer)
        del gate_up, down
        layers.append(buffer)
    return HostExperts(layout, layers)


def measure_h2d_experts(host: HostExperts, experts=None, repeats: int = 3) -> float:
    """GB/s of layer 0's experts copied the scheduler's way (`HostExperts.to_device`): experts=None, the whole
    layer; else those experts as row copies."""
    count = host.num_experts if experts is None else len(experts)
    seconds = common.median_seconds(lambda: [buf for buf, _ in host.to_device(0, experts)], repeats)
    return count * host.layout.nbytes / seconds / 1e9


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    model_bench.add_model_arguments(p, ["int4"], llama=False)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--chunk-size", type=int, default=32768, help="prefill chunk size (tokens)")
    p.add_argument("--budget", nargs="+", default=["12GiB"], help="device expert budgets, e.g. 12GiB 24GiB")
    p.add_argument("--policy", nargs="+", default=["static"], choices=hybridlm.offload.POLICIES)
    p.add_argument(
        "--host-parts",
        type=int,
        nargs="+",
        default=[None],
        help="pinned buffers a layer, each value a configuration in turn (default: the runner's)",
    )
    p.add_argument("--prefetch", default="auto", choices=("auto", "router", "layer", "none"))
    p.add_argument("--prefetch-depth", type=int, default=2, help="layers streamed ahead (whole-layer mode)")
    p.add_argument(
        "--whole-layer",
        choices=("auto", "on", "off"),
        default="auto",
        help="force whole-layer streaming on or off (auto: the chunk size decides)",
    )
    p.add_argument("--no-resident", action="store_true", help="skip the all-resident comparison")
    p.add_argument("--profile", action="store_true", help="also seconds per phase from one synchronised pass")
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        help="also greedy-decode this many tokens after a --decode-prompt-tokens prompt",
    )
    p.add_argument("--decode-prompt-tokens", type=int, default=512)
    p.add_argument("--max-seconds", type=float, default=None, help="start no new configuration after this")


def run_offload(args: argparse.Namespace, rec: Recorder) -> None:
    """Resident and offloaded prefill (and decode) per expert format x host parts x budget x policy."""
    start = time.perf_counter()
    config = model_bench.model_config(args)
    dtype = model_bench.model_dtype(args)
    floor_gbps = measure_h2d_gbps()
    model = build_trunk(config, dtype)
    prompts = {n: common.random_ids(config.vocab_size, (1, n), seed=0) for n in args.prompt_tokens}
    warmups = {n: common.random_ids(config.vocab_size, (1, n), seed=1) for n in args.prompt_tokens}
    decode_ids = common.random_ids(config.vocab_size, (1, args.decode_prompt_tokens), seed=2)
    whole_layer = {"auto": None, "on": True, "off": False}[args.whole_layer]

    def out_of_time() -> bool:
        return args.max_seconds is not None and time.perf_counter() - start > args.max_seconds

    for fmt in args.expert_format:
        for parts in args.host_parts:
            host = build_host_experts(config, fmt, dtype, parts)
            base = {
                "preset": config.name,
                "num_layers": config.num_layers,
                "expert_format": fmt,
                "host_parts": parts,
                "chunk_size": args.chunk_size,
                "expert_bytes": host.layout.nbytes,
                "all_expert_bytes": host.nbytes,
            }
            rec.emit(
                f"{config.name}_experts_{fmt}",
                "h2d",
                {
                    "pinned_h2d_gbps": floor_gbps,
                    "experts_h2d_gbps": measure_h2d_experts(host),
                    "experts_h2d_gbps_rows": measure_h2d_experts(
                        host, list(range(0, host.num_experts, 4))[:64]
                    ),
                },
                params=base,
            )
            resident = (
                {}
                if args.no_resident or out_of_time()
                else _resident(rec, args, model, host, prompts, warmups, decode_ids, base)
            )
            for budget in args.budget:
                for policy in args.policy:
                    params = {
                        **base,
                        "budget": budget,
                        "budget_bytes": parse_bytes(budget),
                        "policy": policy,
                        "prefetch": args.prefetch,
                        "whole_layer": args.whole_layer,
                    }
                    if out_of_time():
                        rec.skip(f"{config.name}_offload", "hybridlm.offload", "past --max-seconds")
                        continue
                    runner = make_offloaded_runner(
                        model,
                        host,
                        budget=budget,
                        policy=policy,
                        prefetch=args.prefetch,
                        prefetch_depth=args.prefetch_depth,
                        whole_layer=whole_layer,
                        chunk_size=args.chunk_size,
                    )
                    _offloaded(rec, args, runner, prompts, warmups, decode_ids, params, resident, floor_gbps)
                    del runner
                    gc.collect()
            del host
            gc.collect()


def _resident(rec, args, model, host, prompts, warmups, decode_ids, base) -> dict[int, float]:
    """The all-resident prefill (and decode) with the experts unpacked onto the device; TTFT per prompt
    length."""
    ttft = {}
    try:
        for i, layer in enumerate(model.layers):
            gate_up, down = host.unpack_layer(i)
            layer.ffn.experts_gate_up.set_value(gate_up)
            layer.ffn.experts_down.set_value(down)
        runner = hybridlm.LayerwiseRunner(model)
        for tokens, ids in prompts.items():
            figures = prefill_figures(runner, ids, warmups[tokens], args.chunk_size, args.profile)
            ttft[tokens] = figures["ttft_s"]
            rec.emit(
                f"{base['preset']}_prefill_{tokens}",
                "hybridlm.resident",
                figures,
                params={**base, "prompt_tokens": tokens},
            )
        if args.decode_tokens:
            rec.emit(
                f"{base['preset']}_decode_{args.decode_prompt_tokens}+{args.decode_tokens}",
                "hybridlm.resident",
                decode_figures(runner, decode_ids, args.decode_tokens, offloaded=False),
                params=base,
            )
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: report and go on
        rec.skip(f"{base['preset']}_prefill", "hybridlm.resident", f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        for layer in model.layers:
            layer.ffn.experts_gate_up.set_value(jnp.zeros((1, 1, 1), model.dtype))
            layer.ffn.experts_down.set_value(jnp.zeros((1, 1, 1), model.dtype))
        gc.collect()
    return ttft


def _offloaded(rec, args, runner, prompts, warmups, decode_ids, params, resident, floor_gbps) -> None:
    pool = runner.stats(per_layer=False)["pool"]
    params = {**params, "slots": pool["slots"], "staging_slots": pool["staging_slots"]}
    preset = params["preset"]
    try:
        for tokens, ids in prompts.items():
            figures = prefill_figures(runner, ids, warmups[tokens], args.chunk_size, args.profile)
            stats = runner.stats(per_layer=False)["prefill"]
            figures |= {k: stats[k] for k in STAT_KEYS}
            floor_s = stats["bytes_h2d"] / (floor_gbps * 1e9)
            bound = max(floor_s, resident.get(tokens, 0.0))
            figures |= {
                "floor_s": floor_s,
                "ratio_to_floor": figures["ttft_s"] / floor_s if floor_s else None,
                "ratio_to_bound": figures["ttft_s"] / bound if bound else None,
            }
            extra = {}
            if args.trace:
                directory = (
                    f"{args.trace}/{params['expert_format']}_{params['budget']}_{params['policy']}_{tokens}"
                )
                extra["trace_summary"] = model_bench.traced_summary(
                    directory,
                    lambda ids=ids: hybridlm.prefill(runner, ids, chunk_size=args.chunk_size).logits,
                )
            rec.emit(
                f"{preset}_prefill_{tokens}",
                "hybridlm.offload",
                figures,
                params={**params, "prompt_tokens": tokens},
                **extra,
            )
        if args.decode_tokens:
            rec.emit(
                f"{preset}_decode_{args.decode_prompt_tokens}+{args.decode_tokens}",
                "hybridlm.offload",
                decode_figures(runner, decode_ids, args.decode_tokens, offloaded=True),
                params=params,
            )
    except Exception as e:  # noqa: BLE001 - e.g. a budget too small: report, go on with the next
        rec.skip(f"{preset}_prefill", "hybridlm.offload", f"{type(e).__name__}: {str(e)[:300]}")


def prefill_figures(runner, ids: np.ndarray, warmup: np.ndarray, chunk: int, profile: bool) -> dict:
    """TTFT of `ids` after an untimed prefill of `warmup` (same length: the same programs, another prompt)."""
    start = time.perf_counter()
    hybridlm.prefill(runner, warmup, chunk_size=chunk)
    warmup_s = time.perf_counter() - start
    r = hybridlm.prefill(runner, ids, chunk_size=chunk)
    figures = {"ttft_s": r.ttft_s, "tokens_per_s": ids.shape[1] / r.ttft_s, "warmup_s": warmup_s}
    if profile:  # synchronised after every program: where the time goes (no overlap between programs)
        phases = hybridlm.prefill(runner, warmup, chunk_size=chunk, profile=True).phase_seconds
        figures |= {f"phase_s:{k}": v for k, v in phases.items()}
    return figures


def decode_figures(runner, ids: np.ndarray, new_tokens: int, offloaded: bool) -> dict:
    """`hybridlm.generate` after the prompt `ids`: decode tokens/s of the steps after the first (which
    compiles, and with device paging fills the pool) and, offloaded, the decode steps' cache statistics."""
    hybridlm.generate(runner, ids, max_new_tokens=2, chunk_size=ids.shape[1])  # compiles the step
    g = hybridlm.generate(runner, ids, max_new_tokens=new_tokens, chunk_size=ids.shape[1])
    figures = {"tokens_per_s": g.decode_tokens_per_s, "decode_s": g.decode_s, "first_step_s": g.first_step_s}
    if offloaded:
        stats = runner.stats(per_layer=False)["decode"]
        figures |= {k: stats[k] for k in STAT_KEYS if k != "achieved_gbps"}
    return figures


def add_h2d_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=256)
    p.add_argument(
        "--expert-bytes", type=int, default=1_638_400, help="bytes an expert (one 4-bit Qwen3.6 expert)"
    )
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 200], help="experts copied as row copies")
    p.add_argument("--repeats", type=int, default=5)


def run_h2d(args: argparse.Namespace, rec: Recorder) -> None:
    """Pinned host -> device copies of one layer of experts: one buffer per expert, the whole layer as one
    buffer, as N buffers, and M experts as row copies (`HostExperts.to_device`, checked to arrive intact)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    num, nbytes = args.experts, args.expert_bytes
    layer = np.random.default_rng(0).integers(0, 256, (num, nbytes), dtype=np.uint8)
    layout = ExpertLayout.of(np.zeros((num, nbytes), np.uint8), np.zeros((num, 0), np.uint8))
    host = HostExperts(layout, [jax.device_put(layer, pinned)])
    workload = f"layer_{num}x{nbytes}"
    params = {"experts": num, "expert_bytes": nbytes, "repeats": args.repeats}

    def emit(label: str, copied_bytes: int, seconds: float, **figures) -> None:
        rec.emit(
            workload,
            label,
            {"gbps": copied_bytes / seconds / 1e9, "ms": seconds * 1e3, **figures},
            params=params,
        )

    per_expert = [jax.device_put(layer[e], pinned) for e in range(num)]
    emit(
        "per_expert_buffers",
        num * nbytes,
        common.median_seconds(lambda: jax.device_put(per_expert, device), args.repeats),
    )
    emit("layer_buffer", num * nbytes, common.median_seconds(lambda: host.to_device(0)[0][0], args.repeats))
    for n in (4, 16):
        parts = [jax.device_put(x, pinned) for x in np.array_split(layer, n)]
        emit(
            f"parts_{n}",
            num * nbytes,
            common.median_seconds(lambda parts=parts: jax.device_put(parts, device), args.repeats),
        )
    rng = np.random.default_rng(1)
    for m in args.rows:
        ids = [int(e) for e in rng.permutation(num)[:m]]
        intact = all(np.array_equal(np.asarray(buf), layer[rows]) for buf, rows in host.to_device(0, ids))
        seconds = common.median_seconds(lambda ids=ids: [b for b, _ in host.to_device(0, ids)], args.repeats)
        emit(f"rows_{m}", m * nbytes, seconds, intact=int(intact))

"""Command line: `hybridlm prefill` (the main job: time to first token) and `hybridlm generate`.

With no arguments both use the `tiny` preset with random weights and the public-domain prompt shipped with the
package, tokenized with the real Qwen3.5/3.6 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridlm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("prefill", "ingest a prompt; report TTFT and tokens/s (per phase with --profile)"),
        ("generate", "prefill, then decode new tokens"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--model", metavar="PATH", help="HF checkpoint directory or .gguf file")
        s.add_argument(
            "--preset", default=None, help="named architecture (with --random-weights); default tiny"
        )
        s.add_argument("--random-weights", action="store_true", help="random weights for --preset")
        s.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")
        s.add_argument(
            "--expert-format",
            choices=("int8", "int4"),
            default=None,
            help="store routed experts quantized (int8 / 4-bit): random weights, or an HF checkpoint "
            "directory's experts as they load",
        )
        s.add_argument(
            "--dtype",
            choices=("float32", "bfloat16"),
            default=None,
            help="parameter dtype (default: float32 on CPU, bfloat16 on GPU)",
        )
        s.add_argument("--prompt-file", metavar="PATH", help="text file to use as the prompt")
        s.add_argument("--prompt", help="prompt text (instead of --prompt-file)")
        s.add_argument(
            "--chunk-size",
            default="auto",
            help="prefill chunk size in tokens, or auto (default): the chunk of least predicted TTFT that "
            "fits the memory left (with --expert-budget, fewer chunks re-stream fewer experts)",
        )
        s.add_argument("--max-new-tokens", type=int, default=16 if name == "generate" else 0)
        s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--top-p", type=float, default=1.0)
        if name == "prefill":
            s.add_argument(
                "--warmup",
                action="store_true",
                help="one untimed prefill first, so that the timed one excludes compilation",
            )
            s.add_argument(
                "--profile",
                action="store_true",
                help="also one pass synchronised after every phase: seconds per phase",
            )
        s.add_argument(
            "--expert-budget",
            metavar="BYTES",
            default=None,
            help="offload routed experts to pinned host memory with this device budget, e.g. 12GiB "
            "(a --model loads its experts straight there; GGUF 4- and 8-bit ones kept quantized)",
        )
        s.add_argument(
            "--mixed-formats",
            choices=("widen", "smallest", "refuse"),
            default="widen",
            help="with --expert-budget, for a model whose layers store experts in different formats "
            "(a Q4_K_M GGUF's Q6_K downs): widen into one format that holds each exactly (more "
            "bytes), requantize into the smallest (not exact), or refuse",
        )
        s.add_argument(
            "--cache-policy",
            choices=("lru", "slru", "lfu", "static", "stream"),
            default="slru",
            help="expert cache eviction policy (with --expert-budget)",
        )
        s.add_argument(
            "--prefetch",
            choices=("auto", "router", "layer", "none"),
            default="auto",
            help="expert prefetch (with --expert-budget)",
        )
        s.add_argument(
            "--host-parts",
            type=int,
            default=None,
            metavar="N",
            help="pinned host buffers a layer (with --expert-budget): several spread a layer's copy "
            "over the prefill's programs, 1 lets decode copy experts with no control flow (faster "
            "decode, slower prefill). Default: 1 for generate with --max-new-tokens >= "
            "OffloadConfig.one_host_part_from_tokens, else the runner's",
        )
        s.add_argument(
            "--dry-run",
            action="store_true",
            help="print the memory estimate and the chunk size, then exit without loading any weights",
        )
        s.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def host_parts_for(command: str, max_new_tokens: int, host_parts: int | None) -> int | None:
    """The host parts a layer the CLI asks `OffloadedRunner` for: `host_parts` where given, else 1 for a
    `generate` of at least `OffloadConfig.one_host_part_from_tokens` new tokens (one part speeds decode up and
    slows prefill down), else None (the runner's default)."""
    if host_parts is not None:
        return host_parts
    from hybridlm.offload.config import tuned_default

    return (
        1 if command == "generate" and max_new_tokens >= tuned_default("one_host_part_from_tokens") else None
    )


def _fail(msg: str) -> int:
    print(f"hybridlm: error: {msg}", file=sys.stderr)
    return 2


class UsageError(Exception):
    """A problem with the command line or its inputs, printed as one line with exit status 2."""


def check_arguments(args: argparse.Namespace) -> None:
    """Cheap checks before JAX is imported.

    Raises:
      UsageError: options that cannot go together, or paths and values that cannot work.
    """
    from hybridlm.config import PRESETS

    if args.model and (args.preset or args.random_weights):
        raise UsageError("--model cannot be combined with --preset/--random-weights")
    if args.model and not os.path.exists(args.model):
        raise UsageError(f"model path not found: {args.model}")
    if args.model and args.expert_format and not os.path.isdir(args.model):
        raise UsageError(
            "--expert-format applies to HF checkpoint directories; a GGUF file keeps its own quantization"
        )
    if args.preset and args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        raise UsageError(f"prompt file not found: {args.prompt_file}")
    if args.chunk_size != "auto":
        text = str(args.chunk_size).strip()
        args.chunk_size = int(text) if text.isdigit() else 0
        if args.chunk_size <= 0:
            raise UsageError(f"--chunk-size must be positive or auto, got {text}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_arguments(args)  # before importing JAX
        report = _run(args)
    except UsageError as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0


def _run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    import hybridlm
    from hybridlm.engine.sampling import check_sampling

    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise UsageError(f"--{str(e).replace('_', '-', 1)}") from None
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, None: None}[args.dtype]
    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    host_parts = host_parts_for(args.command, args.max_new_tokens, args.host_parts)
    plan = _plan(args, dtype)  # before any weights: refuses a run that cannot fit, resolves --chunk-size auto
    if args.dry_run:
        return plan
    try:
        model, host_experts, source = _load_model(args, dtype, host_parts)
        tokenizer, ids = _prompt(args, model.config.vocab_size)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    if args.expert_budget is not None:
        from hybridlm.offload import OffloadConfig, OffloadedRunner

        try:
            config = OffloadConfig(
                expert_budget=args.expert_budget,
                cache_policy=args.cache_policy,
                prefetch=args.prefetch,
                chunk_size=min(args.chunk_size, len(ids)),
                host_parts=None if host_experts else host_parts,
                mixed_formats=args.mixed_formats,
            )
            runner = OffloadedRunner(model, config, host_experts=host_experts)
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        runner = hybridlm.LayerwiseRunner(model)
    report = {
        "command": args.command,
        "model": source,
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "dtype": jnp.dtype(model.dtype).name,
        "chunk_reason": plan["chunk_reason"],
        "memory_estimate": plan["memory"],
    }
    report.update(
        _prefill_report(args, runner, ids, tokenizer)
        if args.command == "prefill"
        else _generate_report(args, runner, ids, tokenizer)
    )
    return report


def _plan(args: argparse.Namespace, dtype) -> dict:
    """The memory estimate and chunk size before any weight is allocated (`hybridlm.planning.plan_run`); sets
    args.chunk_size to the chosen int.

    Raises:
      UsageError: a run that cannot fit (with --dry-run it is reported instead), an unreadable model header
        or config.json, an unparsable --expert-budget.
    """
    from hybridlm import planning

    try:
        plan = planning.plan_run(
            model=args.model,
            preset=args.preset or "tiny",
            dtype=dtype,
            prompt_tokens=lambda config: len(_prompt(args, config.vocab_size)[1]),
            chunk_size=args.chunk_size,
            max_new_tokens=args.max_new_tokens,
            expert_format=args.expert_format,
            expert_budget=args.expert_budget,
            cache_policy=args.cache_policy,
            prefetch=args.prefetch,
            mixed_formats=args.mixed_formats,
            check=not args.dry_run,
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    args.chunk_size = plan["chunk_size"]
    return {"command": args.command, "dry_run": args.dry_run, **plan}


def _load_model(args: argparse.Namespace, dtype, host_parts: int | None):
    """(model, host experts or None, a description of where the weights come from)."""
    import hybridlm

    if args.model and args.expert_budget is not None:
        # experts straight into pinned host memory (GGUF: 4-, 8-bit kept): the device never holds them all
        from hybridlm.offload import load_offloaded

        model, host_experts = load_offloaded(
            args.model,
            dtype=None if args.dtype is None else dtype,
            expert_format=args.expert_format,
            mixed_formats=args.mixed_formats,
            parts=host_parts,
        )
        return model, host_experts, args.model
    if args.model:  # a GGUF file's quantized experts stay quantized (exact, a quarter to half the bytes)
        model = hybridlm.load(
            args.model,
            dtype=None if args.dtype is None else dtype,
            expert_format=args.expert_format,
            keep_quantized=None if os.path.isdir(args.model) else "experts",
        )
        return model, None, args.model
    config = hybridlm.get_config(args.preset or "tiny")
    model = hybridlm.init_random(config, args.seed, dtype=dtype, expert_format=args.expert_format)
    return model, None, f"{config.name} (random weights, seed {args.seed})"


def _prompt(args: argparse.Namespace, vocab_size: int):
    """(tokenizer, prompt token ids): the GGUF file's own vocabulary where it has one, else Qwen's.

    Raises:
      UsageError: an empty prompt, or token ids the model's vocabulary does not have.
    """
    from hybridlm.tokenizer import Tokenizer, default_prompt

    tokenizer = None
    if args.model and args.model.endswith(".gguf"):
        from hybridlm.checkpoints.gguf import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(args.model)
    tokenizer = tokenizer or Tokenizer()
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = default_prompt()
    ids = tokenizer.encode(text)
    if not ids:
        raise UsageError("the prompt is empty")
    if max(ids) >= vocab_size:
        raise UsageError(
            f"the prompt has token ids up to {max(ids)} but the model's vocabulary has {vocab_size} "
            "entries (a different tokenizer?)"
        )
    return tokenizer, ids


def _prefill_report(args: argparse.Namespace, runner, ids: list[int], tokenizer) -> dict:
    """One timed prefill; --warmup runs an untimed one first (compilation), --profile a phase pass after."""
    import jax.numpy as jnp

    import hybridlm

    if args.warmup:
        hybridlm.prefill(runner, ids, chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens)
    result = hybridlm.prefill(runner, ids, chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens)
    report = {**result.summary(), "compile_excluded": args.warmup, "profiled": args.profile}
    if args.expert_budget is not None:  # the timed pass's statistics, before the profiled pass
        report["offload"] = runner.stats()
    if args.profile:
        profiled = hybridlm.prefill(
            runner, ids, chunk_size=args.chunk_size, profile=True, max_new_tokens=args.max_new_tokens
        )
        report["phase_seconds"] = profiled.summary()["phase_seconds"]
    top = int(jnp.argmax(result.logits[0]))
    report["next_token"] = {"id": top, "text": tokenizer.decode([top])}
    return report


def _generate_report(args: argparse.Namespace, runner, ids: list[int], tokenizer) -> dict:
    import hybridlm

    gen = hybridlm.generate(
        runner,
        ids,
        max_new_tokens=max(args.max_new_tokens, 1),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chunk_size=args.chunk_size,
    )
    report = {
        **gen.prefill.summary(),
        "compile_excluded": False,
        "new_tokens": gen.tokens[0].tolist(),
        "text": tokenizer.decode(gen.tokens[0]),
        "decode_tokens_per_s": gen.decode_tokens_per_s,
    }
    if args.expert_budget is not None:
        report["offload"] = runner.stats()
    return report


def _print_report(r: dict) -> None:
    if r.get("dry_run"):
        print(r["memory_text"])
        print(f"chunk size     {r['chunk_reason']}")
        print("fits" if r["fits"] else f"does not fit: {r['refusal']}")
        return
    print(f"model          {r['model']}  [{r['dtype']}, {r['device']}, JAX {r['jax_version']}]")
    print(f"prompt tokens  {r['prompt_tokens']}  in {r['chunks']} chunk(s) of {r['chunk_size']}")
    if "chunk_reason" in r:
        print(f"chunk size     {r['chunk_reason']}")
    note = "after warm-up" if r["compile_excluded"] else "includes compilation"
    print(f"TTFT           {r['ttft_s']:.3f} s ({note})")
    print(f"prefill        {r['prefill_tokens_per_s']:.1f} tokens/s")
    if "phase_seconds" in r:
        total = sum(r["phase_seconds"].values()) or 1.0
        print("per phase (profiled pass, synchronised after each phase):")
        for phase, sec in r["phase_seconds"].items():
            print(f"  {phase:10s} {sec * 1e3:9.2f} ms  {100 * sec / total:5.1f}%")
    if "offload" in r:
        _print_offload(r["offload"])
    if "next_token" in r:
        print(f"next token     {r['next_token']['id']} {r['next_token']['text']!r}")
    if "text" in r:
        print(f"generated      {r['text']!r}")
        print(f"decode         {r['decode_tokens_per_s']:.1f} tokens/s")


def _print_offload(o: dict) -> None:
    pool = o["pool"]
    from hybridlm.offload.expert_cache import format_bytes

    print(
        f"expert offload budget {format_bytes(pool['budget_bytes'])}, {pool['slots']} slots of "
        f"{pool['expert_bytes']} B (+{pool['staging_slots']} staging), policy {pool['policy']}, "
        f"prefetch {pool['prefetch']}, {pool['host_parts']} host buffer(s) a layer; experts stored as "
        f"{pool['expert_format']}"
    )
    for kind in ("prefill", "decode"):
        s = o[kind]
        if not s["chunks"]:
            continue
        # device-paged decode steps are never waited for, so they have no wall time of their own
        rate = f"{s['achieved_gbps']:.2f} GB/s" if s["wall_s"] > 0 else "GB/s untimed"
        print(
            f"  {kind:8s} lookups {s['lookups']}  hits {s['hits']}  misses {s['misses']}  hit rate "
            f"{100 * s['hit_rate']:.1f}%  H2D {s['bytes_h2d'] / 1e9:.3f} GB  {rate}  "
            f"stall {s['stall_s'] * 1e3:.1f} ms  evictions {s['evictions']}  prefetched {s['prefetched']} "
            f"(used {s['prefetch_used']})"
        )
    layers = o["prefill"].get("per_layer", [])
    if layers:
        print("  per layer (prefill): hit rate % / H2D MB / stall ms")
        print(
            "   "
            + "  ".join(
                f"{i}:{100 * s['hit_rate']:.0f}/{s['bytes_h2d'] / 1e6:.1f}/{s['stall_s'] * 1e3:.1f}"
                for i, s in enumerate(layers)
            )
        )


if __name__ == "__main__":
    sys.exit(main())

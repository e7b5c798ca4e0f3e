"""Command line: `hybridlm prefill` (the main job: time to first token) and `hybridlm generate`.

With no arguments both use the `tiny` preset with random weights and the public-domain prompt shipped with the
package, tokenized with the real Qwen3.5/3.6 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from hybridlm.cli_report import print_report

_T_IMPORT = time.time()  # the fallback start of the command where /proc is not there

EXAMPLES = """\
examples:
  # the main job on the built-in default: tiny preset, random weights, the prompt shipped with the package
  hybridlm prefill
  # a GGUF file (its own tokenizer; its 4- and 8-bit experts stay quantized) on a prompt of yours
  hybridlm prefill --model Qwen3.6-35B-A3B-Q4_K_M.gguf --prompt-file notes.txt
  # routed experts in pinned host memory, at most 12 GiB of them on the GPU at a time
  hybridlm prefill --model Qwen3.6-35B-A3B-Q4_K_M.gguf --expert-budget 12GiB
  # a full-size architecture with random weights (it needs the real model's memory); one JSON object out
  hybridlm prefill --preset qwen3.6-35b-a3b --random-weights --json
  # an answer: stops at the end-of-turn token (--ignore-eos: goes on), or after 64 tokens
  hybridlm generate --model Qwen3.6-35B-A3B-Q4_K_M.gguf --prompt "Why is the sky blue?" --max-new-tokens 64

Weights come from --model (an HF checkpoint directory or a .gguf file) or are random (--random-weights, of
the --preset architecture, default tiny); --preset without --random-weights is an error. Errors are one line
on stderr with exit status 2; Ctrl-C exits with status 130.
"""


class UsageError(Exception):
    """A problem with the command line or its inputs, printed as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """argparse's own errors as one line (no usage block), like every other error of the CLI."""
        raise UsageError(f"{message} (see {self.prog} --help)")


def version() -> str:
    """hybridlm's installed version (package metadata), else the package's `__version__`."""
    from importlib import metadata

    try:
        return metadata.version("hybridlm")
    except metadata.PackageNotFoundError:
        import hybridlm

        return getattr(hybridlm, "__version__", "unknown")


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="hybridlm", description=__doc__.splitlines()[0], epilog=EXAMPLES, formatter_class=formatter
    )
    p.add_argument("--version", action="version", version=f"hybridlm {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("prefill", "ingest a prompt; report TTFT and tokens/s (per phase with --profile)"),
        ("generate", "prefill, then decode new tokens"),
    ):
        s = sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES, formatter_class=formatter)
        add_model_arguments(s)
        s.add_argument("--prompt-file", metavar="PATH", help="text file to use as the prompt")
        s.add_argument("--prompt", help="prompt text (instead of --prompt-file)")
        s.add_argument(
            "--chunk-size",
            default="auto",
            help="prefill chunk size in tokens, or auto (default): the chunk of least predicted TTFT that "
            "fits the memory left (with --expert-budget, fewer chunks re-stream fewer experts)",
        )
        s.add_argument(
            "--max-new-tokens",
            type=int,
            default=16 if name == "generate" else 0,
            help="tokens to generate (>= 1; default 16)"
            if name == "generate"
            else "KV-cache room to reserve after the prompt (default 0)",
        )
        s.add_argument(
            "--max-context",
            type=int,
            default=None,
            metavar="N",
            help="tokens the run may use, prompt and new tokens together (default: the model's "
            "max_position_embeddings, which it cannot exceed)",
        )
        s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--top-p", type=float, default=1.0)
        if name == "generate":
            s.add_argument(
                "--speculative",
                choices=["mtp", "dflash", "ddtree"],
                default=None,
                help="mtp: the checkpoint's multi-token-prediction module drafts tokens that the model "
                "verifies in one forward; dflash: a DFlash draft model (--draft-model) drafts a block in "
                "one forward, verified as a chain; ddtree: the block's distributions make a token tree "
                "verified in one forward (greedy output as plain decoding's in each)",
            )
            s.add_argument(
                "--draft-model",
                default=None,
                metavar="PATH",
                help="the DFlash draft (HF directory or .gguf) for --speculative dflash / ddtree; with "
                "--random-weights and no path, a random draft",
            )
            s.add_argument(
                "--tree-budget",
                type=int,
                default=None,
                metavar="N",
                help="tree nodes besides the root for --speculative ddtree (default 32)",
            )
            s.add_argument(
                "--draft-tokens",
                default="3",
                metavar="K",
                help="drafts per speculative step, 1-8 (default 3), or auto: 1-4 from the acceptance so far "
                "(each length compiles once)",
            )
            s.add_argument(
                "--ignore-eos",
                action="store_true",
                help="go on to --max-new-tokens past the tokenizer's end-of-text / end-of-turn tokens",
            )
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
        add_offload_arguments(s)
        s.add_argument(
            "--dry-run",
            action="store_true",
            help="print the memory estimate and the chunk size, then exit without loading any weights",
        )
        s.add_argument("--json", action="store_true", help="print one JSON object")
    from hybridlm.cli_chat import add_chat_commands

    add_chat_commands(sub)
    return p


def add_model_arguments(s: argparse.ArgumentParser) -> None:
    """Where the weights come from and how they are stored: options of every command that loads a model."""
    s.add_argument("--model", metavar="PATH", help="HF checkpoint directory or .gguf file")
    s.add_argument(
        "--preset",
        default=None,
        help="named architecture for --random-weights (default tiny); without --random-weights an error",
    )
    s.add_argument("--random-weights", action="store_true", help="random weights of --preset (default tiny)")
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
    s.add_argument(
        "--keep-quantized",
        choices=("experts", "experts+head", "all"),
        default="experts",
        help="a GGUF file's tensors kept in its quantized blocks, exactly: the routed experts (default), "
        "also the lm head, or every projection matrix (fewer bytes a decode step reads)",
    )


def add_offload_arguments(s: argparse.ArgumentParser) -> None:
    """The expert-placement options of both commands: several devices, or offload to host memory."""
    s.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="split the routed experts over the first N devices of this host (expert parallel, the rest "
        "replicated; hybridlm.sharding); not with --expert-budget",
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
        default="static",
        help="expert cache policy (with --expert-budget; default static, OffloadConfig's: a prefill's layer "
        "cycle makes lru/slru/lfu evict each expert just before its next use; slru where the budget holds "
        "every expert)",
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


def host_parts_for(command: str, max_new_tokens: int, host_parts: int | None) -> int | None:
    """The host parts a layer the CLI asks `OffloadedRunner` for: `host_parts` where given, else 1 where
    `hybridlm.offload.config.host_parts_for` says so (a `generate` of enough new tokens: one part speeds
    decode up and slows prefill down), else None (the runner's default)."""
    if host_parts is not None:
        return host_parts
    from hybridlm.offload.config import host_parts_for as offload_rule

    decode_tokens = max_new_tokens if command == "generate" else 0
    return 1 if offload_rule(decode_tokens) == 1 else None  # the offload rule; None: the runner's default


def _fail(msg: str) -> int:
    print(f"hybridlm: error: {msg}", file=sys.stderr)
    return 2


def check_arguments(args: argparse.Namespace) -> None:
    """Cheap checks before JAX is imported; reads --prompt-file into `args.prompt`.

    Raises:
      UsageError: options that cannot go together, or paths and values that cannot work.
    """
    from hybridlm.config import PRESETS

    if args.model and (args.preset or args.random_weights):
        raise UsageError("--model cannot be combined with --preset/--random-weights")
    if args.preset and args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    if args.preset and not args.random_weights:
        raise UsageError(
            f"--preset {args.preset} names an architecture, not weights: add --random-weights, or load "
            "weights with --model PATH"
        )
    if args.model and not os.path.exists(args.model):
        raise UsageError(f"model path not found: {args.model}")
    if args.model and args.expert_format and not os.path.isdir(args.model):
        raise UsageError(
            "--expert-format applies to HF checkpoint directories; a GGUF file keeps its own quantization"
        )
    if args.prompt is not None and args.prompt_file:
        raise UsageError("--prompt and --prompt-file cannot be combined")
    if getattr(args, "speculative", None) in ("dflash", "ddtree"):
        if args.draft_model is None and args.model:
            raise UsageError(f"--speculative {args.speculative} needs --draft-model PATH (a DFlash draft)")
        if args.draft_model is not None and not os.path.exists(args.draft_model):
            raise UsageError(f"draft model path not found: {args.draft_model}")
        if args.tree_budget is not None and args.tree_budget < 1:
            raise UsageError(f"--tree-budget must be >= 1, got {args.tree_budget}")
    elif getattr(args, "draft_model", None) or getattr(args, "tree_budget", None) is not None:
        raise UsageError("--draft-model and --tree-budget go with --speculative dflash or ddtree")
    if getattr(args, "speculative", None):
        text = str(args.draft_tokens).strip()
        args.draft_tokens = "auto" if text == "auto" else int(text) if text.isdigit() else 0
        if args.draft_tokens != "auto" and not 1 <= args.draft_tokens <= 8:
            raise UsageError(f"--draft-tokens must be 1-8 or auto, got {text}")
    if args.chunk_size != "auto":
        text = str(args.chunk_size).strip()
        args.chunk_size = int(text) if text.isdigit() else 0
        if args.chunk_size <= 0:
            raise UsageError(f"--chunk-size must be positive or auto, got {text}")
    if args.max_new_tokens < (1 if args.command == "generate" else 0):
        need = ">= 1 for generate" if args.command == "generate" else ">= 0"
        raise UsageError(f"--max-new-tokens must be {need}, got {args.max_new_tokens}")
    if args.max_context is not None and args.max_context < 1:
        raise UsageError(f"--max-context must be positive, got {args.max_context}")
    if args.prompt_file:
        args.prompt = read_prompt_file(args.prompt_file)


def read_prompt_file(path: str) -> str:
    """The UTF-8 text of a prompt file (a leading byte-order mark dropped).

    Raises:
      UsageError: the path is missing or a directory, cannot be read, or is not UTF-8 text.
    """
    if os.path.isdir(path):
        raise UsageError(f"prompt file {path} is a directory")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UsageError(f"prompt file not found: {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"prompt file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None
    if "\0" in text:  # valid UTF-8, but no text has NUL bytes: a binary file
        raise UsageError(f"prompt file {path} is not text (byte 0x00 at offset {data.index(0)})")
    return text.removeprefix("\ufeff")


def check_context(config, prompt_tokens: int, args: argparse.Namespace) -> int:
    """The run's context limit: `--max-context`, else the model's `max_position_embeddings`.

    Raises:
      UsageError: --max-context above max_position_embeddings, or the prompt (with --max-new-tokens) past the
        limit.
    """
    model_max = config.max_position_embeddings
    if args.max_context is not None and args.max_context > model_max:
        raise UsageError(
            f"--max-context {args.max_context} is above the model's max_position_embeddings ({model_max})"
        )
    limit = args.max_context or model_max
    source = "--max-context" if args.max_context else "the model's max_position_embeddings; see --max-context"
    if prompt_tokens > limit:
        raise UsageError(
            f"the prompt has {prompt_tokens} tokens, more than the context of {limit} ({source})"
        )
    if prompt_tokens + args.max_new_tokens > limit:
        raise UsageError(
            f"the prompt's {prompt_tokens} tokens + --max-new-tokens {args.max_new_tokens} exceed the "
            f"context of {limit} ({source})"
        )
    return limit


def main(argv: list[str] | None = None) -> int:
    """Runs the command line `argv` (default sys.argv[1:]); returns the exit status: 0, 2 for a usage or
    input error (one line on stderr), 130 when interrupted (Ctrl-C)."""
    try:
        args = _parser().parse_args(argv)
        check_arguments(args)  # before importing JAX
        if args.command in ("serve", "chat"):
            from hybridlm.cli_chat import run_chat_command

            return run_chat_command(args)
        report = _run(args)
        if args.json:
            print(json.dumps(report))
        else:
            print_report(report)
    except UsageError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("hybridlm: interrupted", file=sys.stderr)
        return 130
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
    dtype = resolve_dtype(args)
    host_parts = host_parts_for(args.command, args.max_new_tokens, args.host_parts)
    try:  # the model's shapes and the prompt first: a bad one is refused before minutes of loading
        model_cfg, header = model_config(args)
        tokenizer, ids = _prompt(args, model_cfg.vocab_size, header)
    except (ValueError, KeyError, OSError) as e:
        raise UsageError(reason(e)) from None
    check_context(model_cfg, len(ids), args)
    if getattr(args, "speculative", None) == "mtp" and header is not None and model_cfg.mtp_layers == 0:
        raise UsageError(
            f"--speculative mtp: {args.model} has no MTP block (nextn_predict_layers is absent or 0)"
        )
    plan = _plan(args, dtype, len(ids))  # before any weights: refuses what cannot fit, resolves auto
    if args.dry_run:
        return plan
    counters = hybridlm.compile_cache.counters()
    t_load = time.perf_counter()
    runner, source = load_runner(args, dtype, host_parts, min(args.chunk_size, len(ids)))
    model = runner.model
    load_s = time.perf_counter() - t_load  # to prefill-ready: weights placed, offload pool built
    before = counters.snapshot()
    report = {
        "command": args.command,
        "model": source,
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "dtype": jnp.dtype(model.dtype).name,
        "load_s": load_s,
        "chunk_reason": plan["chunk_reason"],
        "memory_estimate": plan["memory"],
    }
    report.update(
        _prefill_report(args, runner, ids, tokenizer)
        if args.command == "prefill"
        else _generate_report(args, runner, ids, tokenizer)
    )
    after = counters.snapshot()
    report["compile"] = {
        "cache_dir": jax.config.jax_compilation_cache_dir or None,
        **{k: after[k] - before[k] for k in after},
    }
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return report


def resolve_dtype(args: argparse.Namespace):
    """--dtype as a JAX dtype; by default float32 on CPU, bfloat16 on GPU (every source, GGUF files and HF
    directories included)."""
    import jax
    import jax.numpy as jnp

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, None: None}[args.dtype]
    return dtype or (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def load_runner(args: argparse.Namespace, dtype, host_parts: int | None, chunk_size: int | None):
    """(runner, a description of where the weights come from): the model of --model or --random-weights, in
    an `OffloadedRunner` with --expert-budget (`chunk_size`: the largest chunk to check its budget for, or
    None), else a `LayerwiseRunner`.

    Raises:
      UsageError: weights that cannot be loaded, or an offload configuration that cannot work.
    """
    import hybridlm

    try:
        model, host_experts, source = _load_model(args, dtype, host_parts)
    except (ValueError, KeyError, OSError) as e:  # GGUFError and CheckpointError are ValueErrors
        raise UsageError(reason(e)) from None
    if args.expert_budget is None:
        return hybridlm.LayerwiseRunner(model), source
    from hybridlm.offload import OffloadConfig, OffloadedRunner

    try:
        config = OffloadConfig(
            expert_budget=args.expert_budget,
            cache_policy=args.cache_policy,
            prefetch=args.prefetch,
            chunk_size=chunk_size,
            host_parts=None if host_experts else host_parts,
            mixed_formats=args.mixed_formats,
        )
        return OffloadedRunner(model, config, host_experts=host_experts), source
    except ValueError as e:
        raise UsageError(str(e)) from None


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), else since the CLI module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _T_IMPORT


def reason(e: BaseException) -> str:
    """One line for an exception: an OSError's reason and path, else its message without KeyError quotes."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).strip("'\"").split())


def model_config(args: argparse.Namespace):
    """(the `ModelConfig` the run will load, the GGUF header or None), read without loading any weights.

    Raises:
      ValueError: a malformed config.json or GGUF header (`GGUFError`), or an unsupported architecture.
      OSError: the checkpoint cannot be read.
    """
    import hybridlm

    if not args.model:
        return hybridlm.get_config(args.preset or "tiny"), None
    if os.path.isdir(args.model):
        return hybridlm.ModelConfig.from_hf(args.model), None
    from hybridlm.checkpoints.gguf import config_from_gguf
    from hybridlm.checkpoints.gguf_header import read_header

    with open(args.model, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{args.model} is neither an HF checkpoint directory nor a GGUF file (magic {magic!r})"
        )
    header = read_header(args.model)
    return config_from_gguf(header), header


def _plan(args: argparse.Namespace, dtype, prompt_tokens: int) -> dict:
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
            prompt_tokens=lambda config: prompt_tokens,
            chunk_size=args.chunk_size,
            max_new_tokens=args.max_new_tokens,
            expert_format=args.expert_format,
            expert_budget=args.expert_budget,
            cache_policy=args.cache_policy,
            prefetch=args.prefetch,
            mixed_formats=args.mixed_formats,
            devices=getattr(args, "devices", None) or 1,
            check=not args.dry_run,
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    args.chunk_size = plan["chunk_size"]
    return {"command": args.command, "dry_run": args.dry_run, **plan}


def _load_model(args: argparse.Namespace, dtype, host_parts: int | None):
    """(model, host experts or None, a description of where the weights come from)."""
    import hybridlm

    devices = getattr(args, "devices", None)
    if devices is not None and args.expert_budget is not None:
        raise ValueError(
            "--devices splits the experts over devices and --expert-budget offloads them: pick one"
        )
    if args.model and args.expert_budget is not None:
        # experts straight into pinned host memory (GGUF: 4-, 8-bit kept): the device never holds them all
        from hybridlm.offload import load_offloaded

        model, host_experts = load_offloaded(
            args.model,
            dtype=dtype,
            expert_format=args.expert_format,
            mixed_formats=args.mixed_formats,
            parts=host_parts,
            keep_quantized=args.keep_quantized,
        )
        return model, host_experts, args.model
    if args.model:  # a GGUF file's quantized experts stay quantized (exact, a quarter to half the bytes)
        model = hybridlm.load(
            args.model,
            dtype=dtype,
            expert_format=args.expert_format,
            keep_quantized=None if os.path.isdir(args.model) else args.keep_quantized,
            devices=devices,
        )
        return model, None, args.model
    config = hybridlm.get_config(args.preset or "tiny")
    model = hybridlm.init_random(config, args.seed, dtype=dtype, expert_format=args.expert_format)
    if devices is not None:
        from hybridlm import sharding

        model = sharding.shard_model(model, sharding.expert_mesh(devices))
    return model, None, f"{config.name} (random weights, seed {args.seed})"


def _prompt(args: argparse.Namespace, vocab_size: int, header=None):
    """(tokenizer, prompt token ids): the GGUF file's own vocabulary where it has one (`header`), else Qwen's.

    Raises:
      UsageError: an empty prompt, or token ids the model's vocabulary does not have.
      GGUFError: malformed tokenizer metadata.
    """
    from hybridlm.tokenizer import default_prompt

    tokenizer = tokenizer_for(args, header)
    text = args.prompt if args.prompt is not None else default_prompt()  # check_arguments read --prompt-file
    ids = tokenizer.encode(text)
    if not ids:
        raise UsageError("the prompt is empty")
    if max(ids) >= vocab_size:
        raise UsageError(
            f"the prompt has token ids up to {max(ids)} but the model's vocabulary has {vocab_size} "
            "entries (a different tokenizer?)"
        )
    return tokenizer, ids


def tokenizer_for(args: argparse.Namespace, header=None):
    """The tokenizer of the run: the GGUF file's own vocabulary where it has one (`header`), else Qwen's.

    Raises:
      GGUFError: malformed tokenizer metadata.
    """
    from hybridlm.tokenizer import Tokenizer

    if header is not None:
        from hybridlm.checkpoints.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(args.model, header)
        if tokenizer is not None:
            return tokenizer
    return Tokenizer()


def _prefill_report(args: argparse.Namespace, runner, ids: list[int], tokenizer) -> dict:
    """One timed prefill; --warmup runs an untimed one first (compilation), --profile a phase pass after."""
    import jax.numpy as jnp

    import hybridlm

    first_token_s = None
    if args.warmup:
        hybridlm.prefill(runner, ids, chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens)
        first_token_s = process_age_s()
    result = hybridlm.prefill(runner, ids, chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens)
    first_token_s = first_token_s or process_age_s()
    report = {
        **result.summary(),
        "compile_excluded": args.warmup,
        "profiled": args.profile,
        "command_to_first_token_s": first_token_s,
    }
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

    start = process_age_s()
    gen = hybridlm.generate(
        runner,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=None if args.ignore_eos else tokenizer.stop_token_ids,
        chunk_size=args.chunk_size,
        **_speculative_options(args, runner),
    )
    report = {
        **gen.prefill.summary(),
        "compile_excluded": False,
        "new_tokens": gen.tokens[0].tolist(),
        "text": tokenizer.decode(gen.tokens[0]),
        "stop_reason": gen.stop_reason,
        "decode_tokens_per_s": gen.decode_tokens_per_s,
        "command_to_first_token_s": start + gen.prefill.ttft_s,
    }
    if args.expert_budget is not None:
        report["offload"] = runner.stats()
    if gen.speculative is not None:
        report["speculative"] = gen.speculative
    return report


def _speculative_options(args: argparse.Namespace, runner) -> dict:
    """generate's speculative arguments: the MTP module of --model (or random, with --random-weights).

    Raises:
      UsageError: the checkpoint has no MTP module.
    """
    if not args.speculative:
        return {}
    if args.speculative in ("dflash", "ddtree"):
        return _dflash_options(args, runner)
    import dataclasses

    from hybridlm.loading import load_mtp
    from hybridlm.mtp import init_random_mtp

    if args.model:
        try:
            mtp = load_mtp(
                args.model,
                dtype=runner.model.dtype,
                keep_quantized=None if os.path.isdir(args.model) else args.keep_quantized,
            )
        except ValueError as e:
            raise UsageError(f"--speculative mtp: {reason(e)}") from None
    else:
        config = dataclasses.replace(runner.config, mtp_layers=max(runner.config.mtp_layers, 1))
        mtp = init_random_mtp(config, args.seed + 1, dtype=runner.model.dtype)
    return {"speculative": args.speculative, "mtp": mtp, "draft_tokens": args.draft_tokens}


def _dflash_options(args: argparse.Namespace, runner) -> dict:
    """generate's arguments for --speculative dflash / ddtree: the draft of --draft-model (or a random one of
    the target's published draft shape, with --random-weights and no path).

    Raises:
      UsageError: a draft that does not load or does not belong to the model.
    """
    from hybridlm.dflash import DFlashConfig, init_random_dflash
    from hybridlm.loading import load_dflash

    try:
        if args.draft_model:
            draft = load_dflash(args.draft_model, runner.config, dtype=runner.model.dtype)
        else:
            config = DFlashConfig.for_target(runner.config)
            draft = init_random_dflash(config, args.seed + 1, dtype=runner.model.dtype)
    except ValueError as e:
        raise UsageError(f"--speculative {args.speculative}: {reason(e)}") from None
    return {"speculative": args.speculative, "draft": draft, "tree_budget": args.tree_budget}


if __name__ == "__main__":
    sys.exit(main())

"""The user's path on a GGUF file through `hybridlm` commands in fresh processes, beside llama.cpp.

    python -m benchmarks.user_path --gguf F.gguf --out results.jsonl [--llama-bench PATH] [--budget 12GiB]

Measures (one JSON line each): load to prefill-ready, peak host RSS and pinned expert bytes, command to first
token with a cold and then a warm compilation cache, resident and offloaded; the offloaded TTFT of the
default (`--chunk-size auto`) beside a sweep of chunk sizes; llama-bench's wall time to load the file and run
one token. Prompts are the packaged text repeated to about the requested number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SWEEP = (2048, 4096, 8192, 16384, 32768)


def prompt_file(gguf: str, tokens: int, directory: str) -> str:
    """A text file that the file's tokenizer turns into about `tokens` tokens."""
    from hybridlm.checkpoints.gguf import load_gguf_tokenizer
    from hybridlm.tokenizer import default_prompt

    tok = load_gguf_tokenizer(gguf)
    text = default_prompt()
    ids = tok.encode(text)
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    path = os.path.join(directory, f"prompt_{tokens}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(tok.decode(ids))
    return path


def cli(args: list[str], env: dict) -> dict:
    """One `python -m hybridlm ... --json` process: its report plus the wall time of the whole command."""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "hybridlm", *args, "--json"], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t
    if p.returncode:
        return {"error": p.stderr.strip()[-2000:], "returncode": p.returncode, "args": args, "wall_s": wall}
    report = json.loads(p.stdout.strip().splitlines()[-1])
    return {**report, "args": args, "wall_s": wall}


def sweep(gguf: str, budget: str, prompts: dict[int, str], chunks) -> list[dict]:
    """Offloaded prefill TTFT (compiled, second call) of each prompt at each chunk size, one load."""
    import gc

    import hybridlm
    from hybridlm.checkpoints.gguf import load_gguf_tokenizer
    from hybridlm.offload import OffloadConfig, OffloadedRunner, load_offloaded

    model, host = load_offloaded(gguf, progress=False)
    tok = load_gguf_tokenizer(gguf)
    out = []
    for path in prompts.values():
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read())
        for chunk in chunks:
            if chunk > 2 * len(ids):
                continue
            runner = OffloadedRunner(
                model, OffloadConfig(expert_budget=budget, chunk_size=min(chunk, len(ids))), host_experts=host
            )
            hybridlm.prefill(runner, ids, chunk_size=chunk)
            r = hybridlm.prefill(runner, ids, chunk_size=chunk)
            out.append(
                {
                    "prompt_tokens": len(ids),
                    "chunk_size": chunk,
                    "ttft_s": r.ttft_s,
                    "bytes_h2d": runner.stats(per_layer=False)["prefill"]["bytes_h2d"],
                }
            )
            print("sweep", out[-1], flush=True)
            del runner, r
            gc.collect()
    return out


def llama_load(llama_bench: str, gguf: str) -> dict:
    """llama-bench's wall time for the file with one prompt token and no generation: its load time."""
    t = time.perf_counter()
    p = subprocess.run(
        [llama_bench, "-m", gguf, "-p", "1", "-n", "0", "-r", "1", "-ngl", "99", "-o", "json"],
        capture_output=True,
        text=True,
    )
    return {"peer": "llama.cpp", "load_and_one_token_wall_s": time.perf_counter() - t, "rc": p.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=[8190, 32760])
    p.add_argument("--sweep", type=int, nargs="*", default=list(SWEEP))
    p.add_argument("--min-chunk", type=int, default=0, help="sweep only chunks of at least this size")
    p.add_argument("--parts", nargs="+", default=["load", "sweep", "peer"])
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="user-path-")
    env = {**os.environ, "HYBRIDLM_COMPILE_CACHE": os.path.join(tmp, "jax-cache")}
    prompts = {n: prompt_file(args.gguf, n, tmp) for n in args.tokens}
    first = prompts[min(prompts)]
    with open(args.out, "a") as out:

        def emit(kind: str, record: dict) -> None:
            out.write(json.dumps({"kind": kind, **record}) + "\n")
            out.flush()
            brief = {k: record.get(k) for k in ("ttft_s", "load_s", "peak_rss_bytes", "wall_s", "error")}
            print(kind, json.dumps(brief), flush=True)

        if "load" in args.parts:
            for placement in ([], ["--expert-budget", args.budget]):
                # compilation cache empty, then filled by the first process
                for run, command in (("cold", "prefill"), ("warm", "prefill"), ("warm", "generate")):
                    extra = ["--max-new-tokens", "8"] if command == "generate" else []
                    rec = cli(
                        [command, "--model", args.gguf, "--prompt-file", first, *placement, *extra], env
                    )
                    emit(f"{command}_{'offloaded' if placement else 'resident'}_{run}", rec)
        if "sweep" in args.parts or "sweep-only" in args.parts:
            for n, path in (
                prompts.items() if "sweep" in args.parts else ()
            ):  # the defaults, as a user runs them
                args_ = [
                    "prefill",
                    "--model",
                    args.gguf,
                    "--prompt-file",
                    path,
                    "--expert-budget",
                    args.budget,
                ]
                emit(f"chunk_auto_{n}", cli([*args_, "--warmup"], env))
            for rec in sweep(args.gguf, args.budget, prompts, [c for c in args.sweep if c >= args.min_chunk]):
                emit("chunk_sweep", rec)
        if "peer" in args.parts and args.llama_bench:
            emit("llama_load", llama_load(args.llama_bench, args.gguf))
    return 0


if __name__ == "__main__":
    sys.exit(main())

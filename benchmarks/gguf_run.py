"""Prefill and decode of a GGUF file through the public API, resident or at an expert budget, in one process.

    python -m benchmarks.gguf_run --gguf F.gguf [--budget 24GiB] [--prompt-tokens 32768] [--chunk-size 32768]
        [--new-tokens 128] [--out results.jsonl]

For the full-size files of `python -m benchmarks make-gguf` (Qwen3-Next-80B-A3B, Qwen3.6-35B-A3B): the load
seconds, a warm prefill of `--prompt-tokens` random tokens (its TTFT and tokens/s; the first call compiles)
and a warm greedy `generate` of `--new-tokens` tokens after a 16-token prompt (decode tokens/s). With
`--budget` the routed experts stay in pinned host memory (one host part a layer, the `static` policy) and that
many bytes of them live on the device. One JSON line per figure.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import hybridlm
from benchmarks.common import emit_line, random_ids


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--budget", default=None, help="expert bytes on the device, e.g. 24GiB (default: all)")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--chunk-size", default="auto", help="tokens per prefill chunk, or auto")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="warm prefills timed (the best is reported)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    chunk = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    t0 = time.perf_counter()
    if args.budget:
        from hybridlm.offload import OffloadConfig, OffloadedRunner, load_offloaded

        model, host = load_offloaded(args.gguf, parts=1, progress=False)
        config = OffloadConfig(expert_budget=args.budget, cache_policy="static")
        runner = OffloadedRunner(model, config, host_experts=host)
    else:
        runner = hybridlm.LayerwiseRunner(hybridlm.load(args.gguf, keep_quantized="experts", progress=False))
    cfg = runner.config
    base = {"gguf": args.gguf, "budget": args.budget, "layers": len(cfg.layer_types)}
    emit_line(args.out, {**base, "what": "load", "seconds": time.perf_counter() - t0})

    ids = random_ids(min(cfg.vocab_size, 150_000), (args.prompt_tokens,))
    ttfts, first = [], None
    for i in range(args.repeats + 1):  # the first compiles
        result = hybridlm.prefill(runner, ids, chunk_size=chunk)
        jax.block_until_ready(result.logits)
        assert np.isfinite(np.asarray(result.logits)).all(), "non-finite prefill logits"
        if i == 0:
            first = result.ttft_s
        else:
            ttfts.append(result.ttft_s)
        del result
    best = min(ttfts)
    emit_line(
        args.out,
        {
            **base,
            "what": "prefill",
            "prompt_tokens": args.prompt_tokens,
            "chunk_size": args.chunk_size,
            "ttft_s": best,
            "tokens_per_s": args.prompt_tokens / best,
            "first_call_s": first,
        },
    )
    prompt = random_ids(min(cfg.vocab_size, 150_000), (16,), seed=1)
    for _ in range(2):  # the second is warm
        g = hybridlm.generate(runner, prompt, max_new_tokens=args.new_tokens)
    emit_line(
        args.out,
        {**base, "what": "decode", "new_tokens": args.new_tokens, "tokens_per_s": g.decode_tokens_per_s},
    )


if __name__ == "__main__":
    main()

"""A conversation's second turn through `Chat` (prefix cache of state snapshots), and alternating generate /
prefill calls on one runner.

    python -m benchmarks.conversation --gguf F.gguf [--history 32768] [--turn 256] [--budget 12GiB]
        [--parts second_turn alternating] [--out results.jsonl]
    python -m benchmarks.conversation --preset tiny --history 200 --turn 20    # random weights, a quick check

Turn 1 sends `--history` prompt tokens and gets a short reply; its history's state is saved (`Chat`).
Turn 2 sends the history, the reply and `--turn` new tokens: its time to first token (TTFT) resumed from the
snapshot, against the same prompt sent to a `Chat` without a prefix cache (cold). Then `generate` (16 new
tokens) and `prefill` alternate on the same runner over a `--turn`-token prompt: each call's prefill seconds
against a lone warm `prefill` of the same prompt. One JSON line per figure.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import hybridlm
from benchmarks.common import add_model_source_args, emit_line, runner_and_tokenizer, traced_run
from hybridlm.chat import Chat


def second_turn(runner, tokenizer, args) -> None:
    """TTFT of a second turn resumed from the history's snapshot, and cold."""
    rng = np.random.default_rng(0)
    vocab = min(runner.config.vocab_size, 150_000)  # plain tokens, no special ones
    history = rng.integers(0, vocab, args.history).astype(np.int32)
    header = rng.integers(0, vocab, 4).astype(np.int32)  # what follows the history in turn 1's prompt
    turn = rng.integers(0, vocab, args.turn).astype(np.int32)
    context = args.history + args.turn + 3 * args.reply + 8
    chat = Chat(runner, tokenizer, max_context=context)
    first = chat.complete_ids(
        np.concatenate([history, header]), max_tokens=args.reply, history_length=history.size
    )
    reply = np.asarray(tokenizer.encode(first.text()), np.int32)[: args.reply]
    prompt = np.concatenate([history, header, reply, turn])
    for _ in range(2):  # the first compiles the resumed prefill's programs; the snapshot stays
        second = chat.complete_ids(prompt, max_tokens=1)
        second.text()
    traced_run(args.trace, args.out, "second_turn", lambda: chat.complete_ids(prompt, max_tokens=1).text())
    cold = Chat(runner, tokenizer, max_context=context, prefix_cache=None)
    for _ in range(2):  # the second is warm
        reply_cold = cold.complete_ids(prompt, max_tokens=1)
        reply_cold.text()
    emit_line(
        args.out,
        {
            "what": "second_turn",
            "budget": args.budget,
            "history_tokens": int(history.size),
            "new_tokens": int(prompt.size - history.size),
            "ttft_resumed_s": second.stats.ttft_s,
            "cached_tokens": second.stats.cached_tokens,
            "ttft_cold_s": reply_cold.stats.ttft_s,
            "first_turn_ttft_s": first.stats.ttft_s,
            "prefix_cache": chat.stats(),
        },
    )


def alternating(runner, args) -> None:
    """Prefill seconds of `prefill` calls alternating with `generate` calls, against a lone warm prefill."""
    prompt = np.random.default_rng(1).integers(0, 150_000, args.turn).astype(np.int32)

    def timed_prefill() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(hybridlm.prefill(runner, prompt, max_new_tokens=16).logits)
        return time.perf_counter() - t0

    for _ in range(2):
        lone = timed_prefill()
    lone = min(lone, timed_prefill())
    calls = []
    for _ in range(3):
        g = hybridlm.generate(runner, prompt, max_new_tokens=16)
        calls.append({"generate_ttft_s": g.prefill.ttft_s, "prefill_s": timed_prefill()})
    worst = max(max(c["prefill_s"], c["generate_ttft_s"]) for c in calls)
    emit_line(
        args.out,
        {
            "what": "alternating",
            "budget": args.budget,
            "lone_prefill_s": lone,
            "calls": calls,
            "worst_over_lone": worst / lone,
        },
    )


PARTS = ("second_turn", "alternating")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source_args(p)
    p.add_argument("--history", type=int, default=32768)
    p.add_argument("--turn", type=int, default=256)
    p.add_argument("--reply", type=int, default=16, help="tokens of the first turn's reply")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="the figures to measure (default: both)",
    )
    p.add_argument("--trace", default=None, metavar="DIR", help="also a profiler trace of a resumed turn")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runner, tokenizer = runner_and_tokenizer(args)
    if "second_turn" in args.parts:
        second_turn(runner, tokenizer, args)
    if "alternating" in args.parts:
        alternating(runner, args)


if __name__ == "__main__":
    main()

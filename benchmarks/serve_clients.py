"""Concurrent streaming clients against `hybridlm serve` (batched decoding) on localhost.

    python -m benchmarks.serve_clients --gguf F.gguf [--clients 1 8] [--seconds 120 [120]]
        [--max-tokens 256] [--budget 12GiB] [--out results.jsonl]
    python -m benchmarks.serve_clients --preset tiny --seconds 5      # random weights, for a quick check

For each client count N, N threads each send streaming chat completions (greedy, distinct prompts) in a
bounded loop for `--seconds` (one value, or one per N; each client sends at least one request), through the
`openai` client. Every response is checked: it ends with a finish reason, its usage counts as many tokens as
arrived, and "length" replies hold max_tokens tokens (no lost, mixed or truncated response). Prints one JSON
line per N: completion tokens/s over all clients, requests, time to first token (median), and the ratio to the
first N's figure.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import openai

from benchmarks.common import add_model_source_args, emit_line, runner_and_tokenizer
from hybridlm.chat import Chat
from hybridlm.serve import make_server

MODEL = "bench"


def _client_loop(url: str, index: int, deadline: float, max_tokens: int, records: list) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    turn = 0
    while turn == 0 or time.monotonic() < deadline:  # at least one request
        prompt = f"Client {index}, request {turn}: write about topic number {index * 1000 + turn}."
        t0 = time.perf_counter()
        ttft, text, usage, finish = None, [], None, None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(choice.delta.content)
                finish = choice.finish_reason or finish
        if finish is None or usage is None:
            raise AssertionError(f"client {index}: a response without finish reason or usage")
        if finish == "length" and usage.completion_tokens != max_tokens:
            got = usage.completion_tokens
            raise AssertionError(f"client {index}: a 'length' reply of {got} tokens, max_tokens {max_tokens}")
        records.append((usage.completion_tokens, ttft or time.perf_counter() - t0, time.perf_counter()))
        turn += 1


def measure(url: str, clients: int, seconds: float, max_tokens: int) -> dict:
    """Runs `clients` client threads for `seconds`; their figures."""
    records: list = []
    errors: list = []
    start = time.monotonic()
    deadline = start + seconds

    def run(i):
        try:
            _client_loop(url, i, deadline, max_tokens, records)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise AssertionError(f"{len(errors)} clients failed: {errors[:3]}")
    tokens = sum(r[0] for r in records)
    return {
        "clients": clients,
        "requests": len(records),
        "completion_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(r[1] for r in records) if records else None,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source_args(p)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--seconds", type=float, nargs="+", default=[120.0], help="per client count (one value: for each)"
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if len(args.seconds) not in (1, len(args.clients)):
        p.error("--seconds takes one value or one per --clients count")
    seconds = args.seconds * len(args.clients) if len(args.seconds) == 1 else args.seconds
    model, tokenizer = runner_and_tokenizer(args)
    chat = Chat(model, tokenizer, max_context=8192, batch_decode=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(chat, MODEL, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = []
    try:
        # One request a client at the measured max_tokens, one client and then the most: the batched decode
        # programs of every row count and KV capacity the timed runs meet compile here, not inside them.
        for n in sorted({1, max(args.clients)}):
            measure(url, n, 0.0, args.max_tokens)
        base = None
        for n, duration in zip(args.clients, seconds, strict=True):
            record = measure(url, n, duration, args.max_tokens)
            base = base or record["tokens_per_s"]
            record.update(
                what="serve_clients",
                ratio_to_first=record["tokens_per_s"] / base,
                peak_rows=chat.batcher.peak_rows,
                budget=args.budget,
            )
            out.append(record)
            emit_line(args.out, record)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
    return out


if __name__ == "__main__":
    main()

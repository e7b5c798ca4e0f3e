"""`hybridlm serve` (an OpenAI-compatible HTTP server, `hybridlm.serve`) and `hybridlm chat` (a conversation
in the terminal): their options, and the `Chat` both build from the model options `hybridlm prefill` takes."""

from __future__ import annotations

import argparse
import os
import sys

from hybridlm import cli
from hybridlm.cli import UsageError

EXAMPLES = """\
examples:
  # an OpenAI-compatible server on http://127.0.0.1:8000/v1 (the model's name: the file's, or --model-name)
  hybridlm serve --model Qwen3.6-35B-A3B-Q4_K_M.gguf --port 8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "Qwen3.6-35B-A3B-Q4_K_M", "messages": [{"role": "user", "content": "Hi"}]}'
  # a chat in the terminal, reasoning first (--thinking); /exit or end of input (Ctrl-D) ends it
  hybridlm chat --model Qwen3.6-35B-A3B-Q4_K_M.gguf --system "Answer briefly." --thinking

Both use the checkpoint's chat template (a GGUF file's tokenizer.chat_template, an HF directory's
chat_template.jinja or tokenizer_config.json), else the built-in Qwen3.5/3.6 one. Requests decode one at a
time, in the order they arrive.
"""

SERVE_HELP = "an OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models"
CHAT_HELP = "a conversation in the terminal, each reply streamed as it is decoded"


def add_chat_commands(sub) -> None:
    """Adds the `serve` and `chat` subcommands to the subparsers `sub` of the hybridlm command line."""
    formatter = argparse.RawDescriptionHelpFormatter
    for name, help_ in (("serve", SERVE_HELP), ("chat", CHAT_HELP)):
        s = sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES, formatter_class=formatter)
        cli.add_model_arguments(s)
        s.add_argument("--chunk-size", default="auto", help="prefill chunk size in tokens, or auto (default)")
        s.add_argument(
            "--max-context",
            type=int,
            default=None,
            metavar="N",
            help="tokens a request may use, prompt and reply together (default: the model's "
            "max_position_embeddings, which it cannot exceed)",
        )
        s.add_argument(
            "--max-tokens",
            dest="max_new_tokens",
            type=int,
            default=1024 if name == "serve" else 512,
            metavar="N",
            help="the longest reply, in tokens (serve: of a request that does not say; default %(default)s)",
        )
        cli.add_offload_arguments(s)
        s.set_defaults(prompt=None, prompt_file=None, dry_run=False, json=False)
        if name == "serve":
            s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
            s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
            s.add_argument(
                "--model-name",
                default=None,
                help="the model's id for clients (default: the name of --model's file or directory, else the "
                "preset's)",
            )
        else:
            s.add_argument("--system", metavar="TEXT", default=None, help="a system message to begin with")
            s.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default 0.7)")
            s.add_argument("--top-p", type=float, default=0.8, help="nucleus sampling (default 0.8)")
            s.add_argument("--top-k", type=int, default=20, help="0: no limit (default 20)")
            s.add_argument(
                "--thinking", action="store_true", help="let the model reason first (a <think> block)"
            )


def run_chat_command(args: argparse.Namespace) -> int:
    """Runs `serve` or `chat` (after `cli.check_arguments`); returns the exit status.

    Raises:
      UsageError: bad options, or a model that cannot be loaded.
    """
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_new_tokens}")
    if args.command == "serve" and not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0-65535, got {args.port}")
    if args.command == "chat":
        from hybridlm.engine.sampling import check_sampling

        try:
            check_sampling(args.temperature, args.top_k, args.top_p)
        except ValueError as e:
            raise UsageError(f"--{str(e).replace('_', '-', 1)}") from None
    chat, source = open_chat(args)
    if args.command == "chat":
        return chat_loop(chat, args, sys.stdin, sys.stdout)
    from hybridlm.serve import run_server

    name = args.model_name or model_name(args)
    print(f"hybridlm: serving {source} as {name!r} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    run_server(chat, name, args.host, args.port, default_max_tokens=args.max_new_tokens)
    return 0


def model_name(args: argparse.Namespace) -> str:
    """The id a server gives its model: the --model file's name without .gguf (or the directory's), else the
    preset's."""
    if args.model:
        return os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")
    return args.preset or "tiny"


def open_chat(args: argparse.Namespace):
    """(a `Chat` of the model options, a description of where its weights come from): the model loaded as
    `hybridlm generate` loads it (the same tokenizer, offload options and runner), its chat template.

    Raises:
      UsageError: an unreadable model, template or tokenizer, or a --max-context the model cannot take.
    """
    from hybridlm.chat import Chat
    from hybridlm.chat_template import ChatTemplate

    dtype = cli.resolve_dtype(args)
    try:
        model_config, header = cli.model_config(args)
        tokenizer = cli.tokenizer_for(args, header)
        template = ChatTemplate.for_model(args.model)
    except (ValueError, KeyError, OSError) as e:
        raise UsageError(cli.reason(e)) from None
    cli.check_context(model_config, 0, args)  # --max-context within the model's, with room for --max-tokens
    host_parts = cli.host_parts_for("generate", args.max_new_tokens, args.host_parts)
    chunk_size = None if args.chunk_size == "auto" else args.chunk_size
    runner, source = cli.load_runner(args, dtype, host_parts, chunk_size)
    chat = Chat(
        runner,
        tokenizer,
        template=template,
        chunk_size=args.chunk_size,
        max_context=args.max_context,
        batch_decode=args.command == "serve",  # concurrent clients decode in one batch
    )
    return chat, source


def chat_loop(chat, args: argparse.Namespace, stdin, stdout) -> int:
    """Reads user turns from `stdin` (a line each) until end of input or /exit, and writes each reply to
    `stdout` as it streams; the conversation's messages accumulate across turns. A line past the context is
    refused (stderr) and the conversation goes on; Ctrl-C during a reply stops that reply."""
    interactive = stdin.isatty()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print("hybridlm chat: /exit or Ctrl-D ends the conversation", file=sys.stderr)
    while True:
        line = _read_line(stdin, interactive)
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = chat.stream(
                messages,
                enable_thinking=args.thinking,
                max_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed + len(messages),
            )
        except ValueError as e:
            messages.pop()
            print(f"hybridlm: {e}", file=sys.stderr)
            continue
        parts = []
        try:
            for delta in reply:
                stdout.write(delta)
                stdout.flush()
                parts.append(delta)
        except KeyboardInterrupt:
            print("\nhybridlm: reply stopped", file=sys.stderr)
        finally:
            reply.close()
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": "".join(parts)})
        _print_stats(reply.stats)


def _read_line(stdin, interactive: bool) -> str | None:
    """The next line without its newline; None at end of input (or Ctrl-C at the prompt)."""
    if interactive:
        try:
            return input("> ")  # input() gives line editing on a terminal
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return None
    line = stdin.readline()
    return line.removesuffix("\n") if line else None


def _print_stats(stats) -> None:
    prompt = f"{stats.prompt_tokens} prompt tokens ({stats.cached_tokens} cached)"
    speed = f"{stats.ttft_s:.2f} s to the first, {stats.decode_tokens_per_s:.1f} tokens/s"
    print(f"[{prompt}, {stats.completion_tokens} reply tokens, {speed}]", file=sys.stderr)

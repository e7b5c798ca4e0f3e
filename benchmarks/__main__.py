"""`python -m benchmarks NAME [args]`: one benchmark of the registry, JSON lines to stdout (and --out)."""

import json
import sys

from benchmarks import make_gguf, registry


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = registry.parser().parse_args(argv)
    if args.benchmark == "list":
        for entry in registry.listing():
            print(json.dumps(entry))
    elif args.benchmark == "trace-summary":
        for summary in registry.trace_summaries(args.dirs, args.gap_ms, args.top):
            print(json.dumps(summary), flush=True)
    elif args.benchmark == "make-gguf":
        print(json.dumps(make_gguf.run(args)), flush=True)
    else:
        registry.run(args.benchmark, argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

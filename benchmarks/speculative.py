"""Decode and MTP speculative decoding on a GGUF file through `hybridlm.generate`, with oracle drafts.

    python -m benchmarks.speculative --gguf F.gguf [--new-tokens 128] [--alphas 0.5 0.75 0.9] [--ks 1 2 3 4]
        [--budget 12GiB [--offloaded-only]]

Random MTP weights accept almost nothing, so the drafts are oracle drafts: "coin", each accepted with
probability alpha (the verify's own tokens emitted); "reference", each the token of an all-rejecting run with
probability alpha. Acceptance is then a controlled input while drafting and verifying cost what they cost.
Prints one JSON line per figure: plain decode tokens/s, speculative tokens/s per (alpha, k) with the
acceptance reached, and the time of one verify of k + 1 tokens against one plain decode step (each program
alone, timed over repeats).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import hybridlm
from benchmarks.common import traced_run
from hybridlm.engine import phases
from hybridlm.engine import speculative as spec
from hybridlm.loading import load_mtp


def _emit(out, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() (waited for) over repeats, after one untimed call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def verify_cost(runner, prompt, ks, repeats: int = 20) -> dict:
    """Seconds of one plain decode step and of one verify of k + 1 tokens (logits included), each alone."""
    pre = hybridlm.prefill(runner, prompt, max_new_tokens=64)
    graph, leaves = spec.flat_layer(runner.whole[0].graphdef, runner.whole[1])
    token = jnp.zeros((1,), jnp.int32)
    position = jnp.int32(pre.prompt_tokens)

    @jax.jit
    def step(leaves, states):
        return phases.model_step(graph.merge(leaves), token, states, position)[0]

    def verify_program(k):
        @jax.jit
        def run(leaves, states):
            model = graph.merge(leaves)
            hidden, _ = spec.verify(model, states, jnp.zeros((1, k + 1), jnp.int32), position)
            return model.logits(hidden)

        return run

    figures = {"decode_step_s": _timed(lambda: step(leaves, pre.states), repeats)}
    for k in ks:
        run = verify_program(k)
        figures[f"verify_{k + 1}_s"] = _timed(lambda run=run: run(leaves, pre.states), repeats)
    return figures


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--verify-ks", type=int, nargs="+", default=[3], help="verifies of k + 1 tokens to time")
    p.add_argument("--reference-ks", type=int, nargs="*", default=[3], help="k of the reference-oracle runs")
    p.add_argument("--budget", default=None, help="also offloaded at this expert budget, e.g. 12GiB")
    p.add_argument("--offloaded-only", action="store_true", help="skip the resident figures (needs --budget)")
    p.add_argument(
        "--methods",
        nargs="*",
        default=["mtp"],
        choices=["mtp", "dflash", "ddtree"],
        help="speculative methods (dflash / ddtree: a random draft of the published 35B-A3B draft shape)",
    )
    p.add_argument("--blocks", type=int, nargs="+", default=[16], help="DFlash block sizes")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64], help="DDTree node budgets")
    p.add_argument(
        "--trace", default=None, metavar="DIR", help="also a profiler trace of each warm run, under DIR"
    )
    p.add_argument(
        "--keep",
        default="experts",
        choices=["experts", "experts+head", "all"],
        help="what the GGUF's quantized blocks are kept for (`load(keep_quantized=...)`)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.offloaded_only and not args.budget:
        p.error("--offloaded-only needs --budget")
    t0 = time.perf_counter()
    mtp = load_mtp(args.gguf, keep_quantized=args.keep) if "mtp" in args.methods else None
    prompt = np.arange(1000, 1000 + args.prompt_tokens, dtype=np.int32)
    if not args.offloaded_only:
        resident(args, mtp, prompt, t0)
    if args.budget:
        offloaded(args, mtp, prompt)


def resident(args, mtp, prompt, t0: float) -> None:
    """Plain and oracle MTP decode with every expert on the device; the verify's cost against a step."""
    model = hybridlm.load(args.gguf, keep_quantized=args.keep, progress=False)
    runner = hybridlm.LayerwiseRunner(model)
    _emit(
        args.out,
        {"what": "load", "seconds": time.perf_counter() - t0, "device": jax.devices()[0].device_kind},
    )
    n = args.new_tokens
    for _ in range(2):  # the second is warm
        plain = hybridlm.generate(runner, prompt, max_new_tokens=n)
    _emit(args.out, {"what": "plain", "tokens_per_s": plain.decode_tokens_per_s, "new_tokens": n})
    traced_run(args.trace, args.out, "plain", lambda: hybridlm.generate(runner, prompt, max_new_tokens=n))
    _emit(args.out, {"what": "verify_cost", **verify_cost(runner, prompt, args.verify_ks)})
    block_methods(args, runner, prompt, plain, "")
    for k in args.ks if "mtp" in args.methods else ():
        for alpha in args.alphas:
            kw = {"speculative": "mtp", "mtp": mtp, "draft_tokens": k, "oracle_draft": (None, alpha)}
            for _ in range(2):  # the second is warm
                g = hybridlm.generate(runner, prompt, max_new_tokens=n, **kw)
            _emit(args.out, _record("mtp_oracle_coin", alpha, k, g, plain))
            if alpha == args.alphas[0] and k == args.ks[-1]:
                traced_run(
                    args.trace,
                    args.out,
                    f"mtp_k{k}",
                    lambda kw=kw: hybridlm.generate(runner, prompt, max_new_tokens=n, **kw),
                )
    for k in args.reference_ks:  # drafts from a reference: an all-rejecting run's own greedy tokens
        kw = {"speculative": "mtp", "mtp": mtp, "draft_tokens": k}
        ref = hybridlm.generate(runner, prompt, max_new_tokens=n, oracle_draft=(None, 0.0), **kw)
        reference = np.concatenate([prompt, ref.tokens[0]])
        for alpha in args.alphas:
            for _ in range(2):
                g = hybridlm.generate(runner, prompt, max_new_tokens=n, oracle_draft=(reference, alpha), **kw)
            record = _record("mtp_oracle_reference", alpha, k, g, plain)
            _emit(args.out, {**record, "same_tokens_as_reference": bool((g.tokens == ref.tokens).all())})


def offloaded(args, mtp, prompt) -> None:
    """Plain and coin-oracle MTP decode with the experts offloaded at `args.budget` (a process's second
    model: load the resident one's runner first or not at all)."""
    from hybridlm.offload import OffloadConfig, OffloadedRunner, load_offloaded

    model, host = load_offloaded(args.gguf, parts=1, progress=False, keep_quantized=args.keep)
    runner = OffloadedRunner(
        model, OffloadConfig(expert_budget=args.budget, cache_policy="static"), host_experts=host
    )
    n = args.new_tokens
    for _ in range(2):
        plain = hybridlm.generate(runner, prompt, max_new_tokens=n)
    _emit(
        args.out,
        {"what": "plain_offloaded", "budget": args.budget, "tokens_per_s": plain.decode_tokens_per_s},
    )
    traced_run(
        args.trace, args.out, "plain_offloaded", lambda: hybridlm.generate(runner, prompt, max_new_tokens=n)
    )
    block_methods(args, runner, prompt, plain, "_offloaded")
    for k in args.ks if "mtp" in args.methods else ():
        for alpha in args.alphas:
            kw = {"speculative": "mtp", "mtp": mtp, "draft_tokens": k, "oracle_draft": (None, alpha)}
            for _ in range(2):
                g = hybridlm.generate(runner, prompt, max_new_tokens=n, **kw)
            _emit(
                args.out, {**_record("mtp_oracle_coin_offloaded", alpha, k, g, plain), "budget": args.budget}
            )


def block_methods(args, runner, prompt, plain, suffix: str) -> None:
    """DFlash chain and DDTree tree decoding with coin-oracle drafts (`generate(oracle_draft=(None, alpha))`)
    for each alpha, block size and (DDTree) node budget: one JSON line each."""
    from hybridlm.dflash import DFlashConfig, init_random_dflash

    methods = [m for m in args.methods if m != "mtp"]
    if not methods:
        return
    base = DFlashConfig.for_target(runner.config)
    for block in args.blocks:
        draft = init_random_dflash(base.replace(block_size=block), seed=1, dtype=runner.model.dtype)
        for method in methods:
            for budget in args.budgets if method == "ddtree" else [None]:
                for alpha in args.alphas:
                    kw = {"speculative": method, "draft": draft, "tree_budget": budget}
                    kw["oracle_draft"] = (None, alpha)
                    for _ in range(2):  # the second is warm
                        g = hybridlm.generate(runner, prompt, max_new_tokens=args.new_tokens, **kw)
                    record = _record(f"{method}_oracle_coin{suffix}", alpha, None, g, plain)
                    _emit(args.out, {**record, "budget": args.budget})  # expert budget; tree_budget: DDTree
        del draft


def _record(what: str, alpha: float, k: int | None, g, plain) -> dict:
    """One speculative run's JSON line; k: MTP's draft length (DFlash records carry block_size and
    tree_budget from `g.speculative` instead)."""
    return {
        "what": what,
        "alpha": alpha,
        **({} if k is None else {"k": k}),
        "tokens_per_s": g.decode_tokens_per_s,
        "speedup": g.decode_tokens_per_s / plain.decode_tokens_per_s,
        "same_tokens_as_plain": bool((g.tokens == plain.tokens).all()),
        **g.speculative,
    }


if __name__ == "__main__":
    main()

"""Times one gated-delta-rule decode step: the pure-JAX step (XLA), the fused Pallas step, and (where installed)
flash-linear-attention's `fused_recurrent_gated_delta_rule` on one token, on the same inputs.

Qwen3.5/3.6 head shape by default (16 q/k heads, 32 v heads, K = V = 128, bf16 q/k/v, f32 state), for each
batch size in --batch. Timing as in `gated_delta_rule.py`: the wall clock over back-to-back calls closed by one
synchronisation. A step reads and writes the state (batch x 32 x 128 x 128 x 4 bytes each way), so the rows
also give that traffic in GB/s against the wall time. Outputs and new states are compared with the reference
step (max |x - ref| / max |ref|). Prints one JSON document.

usage (GPU machine): PYTHONPATH=. python3 benchmarks/gdn_decode_step.py [--batch 1 8 32 128] [--out F]
"""

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the sibling modules: timing helpers, JSON output
from bench_io import run_header, write_json
from gated_delta_rule import jax_sync, rel_err, wall_ms

from pallas_kernels.gated_delta_rule import pallas_step, reference, workloads


def make_token(batch, k_heads, v_heads, dim, seed=0):
    """One token per sequence from `workloads.make_inputs` (the prefill benchmark's distribution), as the
    keyword arguments of a step (state = the random initial state)."""
    workload = workloads.Workload(name="decode", batch=batch, seq=1, k_heads=k_heads, v_heads=v_heads,
                                  key_dim=dim, value_dim=dim)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=seed)
    token = {n: inputs[n][:, 0] for n in ("query", "key", "value", "log_decay", "beta")}
    return {**token, "state": inputs["initial_state"]}


def timed_row(impl, ms, out, new_state, want, state_bytes) -> dict:
    """One row: wall time per step, the state traffic it implies, errors against the reference step."""
    return {"impl": impl, "us": round(ms * 1e3, 2),
            "state_gb_per_s": round(2 * state_bytes / (ms * 1e-3) / 1e9, 1),
            "output_rel_err": rel_err(out, want[0]), "state_rel_err": rel_err(new_state, want[1])}


def time_fla(fla, token, want, reps, state_bytes) -> dict:
    """FLA's fused recurrent kernel on the same token (T = 1), timed like ours."""
    torch, fused = fla

    def to_torch(x, dtype):
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(dtype)

    q, k, v = (to_torch(token[n], torch.bfloat16)[:, None] for n in ("query", "key", "value"))
    g, b = (to_torch(token[n], torch.float32)[:, None] for n in ("log_decay", "beta"))
    s0 = to_torch(token["state"], torch.float32)

    def run():
        return fused(q, k, v, g=g, beta=b, initial_state=s0, output_final_state=True)

    ms = wall_ms(run, lambda _: torch.cuda.synchronize(), reps)
    o, s = run()
    return timed_row("fla.fused_recurrent_gated_delta_rule", ms, o[:, 0].float().cpu().numpy(),
                     s.float().cpu().numpy(), want, state_bytes)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--k-heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128, help="key_dim = value_dim")
    parser.add_argument("--block-v", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    doc = run_header("gdn_decode_step", rows=[])
    fla = None
    if on_gpu and not args.no_fla:
        try:
            import torch
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
            fla = (torch, fused_recurrent_gated_delta_rule)
        except ImportError as e:
            doc["fla"] = f"not installed ({e})"
    for batch in args.batch:
        token = make_token(batch, args.k_heads, args.v_heads, args.dim)
        state_bytes = token["state"].size * 4
        want = reference.gated_delta_rule_step_reference(**token)
        impls = {"reference (XLA)": jax.jit(reference.gated_delta_rule_step_reference)}
        for block_v in args.block_v:
            impls[f"pallas block_v={block_v}"] = functools.partial(
                pallas_step.gated_delta_rule_step_pallas, block_v=block_v, interpret=not on_gpu)
        for name, fn in impls.items():
            call = functools.partial(fn, **token)
            ms = wall_ms(call, jax_sync, args.reps)
            doc["rows"].append({"batch": batch, **timed_row(name, ms, *call(), want, state_bytes)})
            print(doc["rows"][-1], flush=True)
        if fla is not None:
            doc["rows"].append({"batch": batch, **time_fla(fla, token, want, args.reps, state_bytes)})
            print(doc["rows"][-1], flush=True)
    write_json(doc, args.out)
    return doc


if __name__ == "__main__":
    main()

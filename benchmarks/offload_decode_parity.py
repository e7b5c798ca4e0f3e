"""Does an offloaded decode step give the all-resident step's logits? Bit for bit, step by step, on the GPU.

Builds the preset with random weights on the device (all experts resident), its one-program decode
(`LayerwiseRunner.decode_step`) as the reference, and the same experts packed into pinned host memory. After the
same prompt, each `OffloadedRunner` (per policy and `decode_paging` mode) is fed the reference's greedy tokens for
`--steps` steps; per step it reports the largest |logit difference| and whether the argmaxes agree. The device-paged
step (`decode_paging="device"`) runs the experts as the all-resident step does, so its differences should be 0.0; the
layer-by-layer step (`"host"`) runs other programs, whose roundings may differ.

usage (GPU machine): python benchmarks/offload_decode_parity.py [--expert-format int4] [--budget 12GiB]
    [--policies static lru] [--decode-paging device host] [--steps 24] [--out parity.json]
(--preset tiny --num-layers 4 --budget-layers 2 --prompt-tokens 16 --steps 3 runs on the CPU as a smoke test.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import preset_config, run_header, write_json

import hybridlm
from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner, default_host_parts


def decode_logits(runner, pre, tokens: list, position: int) -> list[np.ndarray]:
    """Logits [batch, vocab] of each step of `runner` fed `tokens` after prefill result `pre`."""
    states, out = pre.states, []
    for i, token in enumerate(tokens):
        logits, states = runner.decode_step(token, states, position + i)
        out.append(np.asarray(logits))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--expert-format", choices=("bf16", "int8", "int4"), default="int4")
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--budget-layers", type=int, default=None, help="budget as this many layers of experts instead")
    p.add_argument("--policies", nargs="+", default=["static", "lru"])
    p.add_argument("--decode-paging", nargs="+", choices=("device", "host"), default=["device", "host"])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--host-parts", type=int, default=default_host_parts(),
                   help="pinned buffers a layer (HostExperts parts)")
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    config = preset_config(a.preset, a.num_layers)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    model = hybridlm.init_random(config, seed=0, dtype=dtype, expert_format=None if a.expert_format == "bf16"
                                 else a.expert_format)
    base = hybridlm.LayerwiseRunner(model)
    host = HostExperts.from_model(model, parts=a.host_parts)
    budget = a.budget if a.budget_layers is None else a.budget_layers * host.num_experts * host.layout.nbytes
    doc = run_header("offload_decode_parity", preset=config.name, num_layers=config.num_layers,
                     expert_format=a.expert_format, budget=budget, host_parts=a.host_parts,
                     prompt_tokens=a.prompt_tokens, steps=a.steps, rows=[])
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, a.prompt_tokens)).astype(np.int32)
    pre = hybridlm.prefill(base, ids, chunk_size=a.prompt_tokens, max_new_tokens=a.steps)
    tokens, reference, logits, states = [], [], pre.logits, pre.states
    for i in range(a.steps):                                   # the reference, and the tokens every runner is fed
        tokens.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        logits, states = base.decode_step(tokens[-1], states, a.prompt_tokens + i)
        reference.append(np.asarray(logits))
    for policy, paging in [(policy, paging) for policy in a.policies for paging in a.decode_paging]:
        runner = OffloadedRunner(model, OffloadConfig(expert_budget=budget, cache_policy=policy, decode_paging=paging),
                                 host_experts=host)
        got = decode_logits(runner, hybridlm.prefill(runner, ids, chunk_size=a.prompt_tokens,
                                                     max_new_tokens=a.steps), tokens, a.prompt_tokens)
        diffs = [float(np.abs(g - r).max()) for g, r in zip(got, reference)]
        row = {"policy": policy, "decode_paging": paging, "max_abs_diff_per_step": diffs,
               "identical_steps": sum(d == 0.0 for d in diffs),
               "argmax_agree": sum(bool((g.argmax(-1) == r.argmax(-1)).all()) for g, r in zip(got, reference)),
               "finite": all(bool(np.isfinite(g).all()) for g in got),
               "decode_hit_rate": round(runner.stats(per_layer=False)["decode"]["hit_rate"], 4)}
        doc["rows"].append(row)
        print(f"{policy} {paging}: {row['identical_steps']} of {a.steps} steps bit for bit, argmax agreeing "
              f"{row['argmax_agree']}, max |logit difference| {max(diffs)}", flush=True)
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()

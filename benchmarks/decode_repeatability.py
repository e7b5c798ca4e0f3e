"""Is greedy decode repeatable bit for bit? Two decodes of the same tokens from copies of one prefill state.

After a prefill, a first run decodes `--steps` greedy tokens (`LayerwiseRunner.decode_step`, what
`hybridlm.generate` runs); each later run starts again from a copy of the same state and is fed the first run's
tokens. After every step a checksum of the logits and of every state leaf (the int32 sum of their float32 bits)
is taken on the device, so the first (step, leaf) where two runs differ names the layer whose kernel is not
repeatable. Run once per attention implementation of the decode step (`gated_attention.DECODE_IMPLEMENTATION`).
The prefill is checked too: the prompt twice in chunks of `--prefill-chunk` tokens (by default two chunks, so that
the second attends to the first through the cache's blocks), its logits and states compared the same way.

On an H100 (JAX 0.11.2, 2026-11-27) cuDNN's one-query attention made two runs differ after ~20 steps, first in an
attention layer, and XLA's did not (docs/benchmarks.md, "Decode", item 6).

usage (GPU machine): python benchmarks/decode_repeatability.py [--expert-format int4] [--steps 48]
    [--attention xla cudnn] [--out repeat.json]
(--preset tiny --num-layers 4 --prompt-tokens 16 --steps 4 --attention xla runs on the CPU as a smoke test.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_io import preset_config, run_header, traced_constant, write_json

import hybridlm
from hybridlm.engine import sample
from hybridlm.layers import gated_attention


@jax.jit
def checksums(logits, states) -> jax.Array:
    """[1 + leaves] int32: the wrapped sum of each array's float32 bits (logits first, then the state leaves)."""
    leaves = [logits] + jax.tree_util.tree_leaves(states)
    return jnp.stack([jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).sum() for x in leaves])


def decode_checksums(runner, states, first_token, position: int, steps: int, tokens=None):
    """Greedy decode from a copy of `states` (or fed `tokens`): ([steps, 1 + leaves] checksums, the tokens fed)."""
    states = jax.tree_util.tree_map(jnp.copy, states)
    token, sums, fed = first_token, [], []
    for i in range(steps):
        if tokens is not None:
            token = tokens[i]
        fed.append(token)
        logits, states = runner.decode_step(token, states, position + i)
        sums.append(checksums(logits, states))
        token = sample(logits, None)
    return np.asarray(jnp.stack(sums)), fed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke tests)")
    p.add_argument("--expert-format", choices=("bf16", "int8", "int4"), default="int4")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--runs", type=int, default=3, help="runs in all, the first one included")
    p.add_argument("--attention", nargs="+", choices=("xla", "cudnn"), default=["xla", "cudnn"])
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: half the prompt")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    config = preset_config(a.preset, a.num_layers)
    model = hybridlm.init_random(config, seed=0, dtype=jnp.bfloat16,
                                 expert_format=None if a.expert_format == "bf16" else a.expert_format)
    runner = hybridlm.LayerwiseRunner(model)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, a.prompt_tokens)).astype(np.int32)
    chunk = a.prefill_chunk or max(a.prompt_tokens // 2, 1)
    doc = run_header("decode_repeatability", preset=config.name, num_layers=config.num_layers,
                     expert_format=a.expert_format, prompt_tokens=a.prompt_tokens, prefill_chunk=chunk,
                     steps=a.steps, rows=[])
    pre, pre_again = (hybridlm.prefill(runner, ids, chunk_size=chunk, max_new_tokens=a.steps + 8) for _ in range(2))
    names = ["logits"] + [f"layer {jax.tree_util.keystr(path)}"
                          for path, _ in jax.tree_util.tree_leaves_with_path(pre.states)]
    first_token = sample(pre.logits, None)
    first, again = (np.asarray(checksums(r.logits, r.states)) for r in (pre, pre_again))
    row = {"check": "prefill", "identical": bool((first == again).all()),
           "first_differences": [names[int(i)] for i in np.flatnonzero(first != again)[:8]]}
    doc["rows"].append(row)
    print(row, flush=True)
    for attention in a.attention:
        with traced_constant(gated_attention, "DECODE_IMPLEMENTATION", attention):
            want, tokens = decode_checksums(runner, pre.states, first_token, a.prompt_tokens, a.steps)
            for run in range(1, a.runs):
                got, _ = decode_checksums(runner, pre.states, first_token, a.prompt_tokens, a.steps, tokens)
                where = np.argwhere(got != want)
                row = {"check": "decode", "attention": attention, "run": run, "identical": not len(where),
                       "differing_step_leaf_pairs": len(where),
                       "first_differences": [{"step": int(s), "leaf": names[int(i)]} for s, i in where[:8]]}
                doc["rows"].append(row)
                print(row, flush=True)
    write_json(doc, a.out)
    return doc


if __name__ == "__main__":
    main()

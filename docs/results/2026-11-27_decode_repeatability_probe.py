"""Decode repeatability over many steps: two runs from copies of one prefill state, the same tokens fed; per step,
a checksum of every state leaf and of the logits; the first step and leaf where the runs differ."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import hybridlm
from hybridlm.engine import sample
fmt = sys.argv[1] if len(sys.argv) > 1 else "int4"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 48
config = hybridlm.get_config("qwen3.6-35b-a3b")
if len(sys.argv) > 3:
    config = config.replace(attention_implementation=sys.argv[3])
model = hybridlm.init_random(config, seed=0, dtype=jnp.bfloat16, expert_format=fmt)
runner = hybridlm.LayerwiseRunner(model)
ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 512)).astype(np.int32)

@jax.jit
def checksums(logits, states):
    leaves = [logits] + jax.tree_util.tree_leaves(states)
    return jnp.stack([jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).sum() for x in leaves])

names = ["logits"] + [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
    hybridlm.prefill(runner, ids[:, :16], chunk_size=16, max_new_tokens=4).states)]
pre = hybridlm.prefill(runner, ids, chunk_size=512, max_new_tokens=steps + 8)
copy = lambda s: jax.tree_util.tree_map(jnp.copy, s)
base = copy(pre.states)
tok0 = sample(pre.logits, None)

def run(tokens=None, sync=False):
    states, tok, sums, toks = copy(base), tok0, [], []
    for i in range(steps):
        if tokens is not None:
            tok = tokens[i]
        toks.append(tok)
        logits, states = runner.decode_step(tok, states, 512 + i)
        sums.append(checksums(logits, states))
        if sync:
            jax.block_until_ready(logits)
        tok = sample(logits, None)
    return np.asarray(jnp.stack(sums)), toks

a, toks = run()
res = {"format": fmt, "steps": steps, "attention": config.attention_implementation}
for tag, kw in (("async", {}), ("async_again", {})):
    b, _ = run(toks, **kw)
    d = np.argwhere(a != b)
    res[tag] = {"differing (step, leaf)": len(d), "first": [(int(s), names[int(l)]) for s, l in d[:8]]}
    print(tag, res[tag], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"determinism2_{fmt}.json"), "w"), indent=1)

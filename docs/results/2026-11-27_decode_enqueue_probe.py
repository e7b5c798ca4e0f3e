"""Host enqueue time of LayerwiseRunner.decode_step: fresh token / position arrays each step (as generate does)
against the same arrays every step (stable input addresses for XLA's command buffers)."""
import json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import hybridlm
from hybridlm.engine import sample
from hybridlm.engine.runner import commit
fmt = sys.argv[1] if len(sys.argv) > 1 else "int4"
config = hybridlm.get_config("qwen3.6-35b-a3b")
model = hybridlm.init_random(config, seed=0, dtype=jnp.bfloat16, expert_format=fmt)
runner = hybridlm.LayerwiseRunner(model)
ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 512)).astype(np.int32)
out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "format": fmt, "rows": []}

def run(variant, steps=96):
    pre = hybridlm.prefill(runner, ids, chunk_size=512, max_new_tokens=steps + 8)
    states, logits, pos = pre.states, pre.logits, 512
    tok0 = commit(sample(logits, None))
    pos0 = commit(jnp.int32(pos))
    for i in range(3):   # warm
        logits, states = runner.decode_step(sample(logits, None), states, pos + i)
    jax.block_until_ready(logits)
    enq = []
    t0 = time.perf_counter()
    for i in range(steps):
        t = time.perf_counter()
        if variant == "fresh":
            logits, states = runner.decode_step(sample(logits, None), states, pos + 3 + i)
        elif variant == "same_arrays":
            logits, states = runner.decode_step(tok0, states, pos0)
        elif variant == "fresh_token_same_position":
            logits, states = runner.decode_step(sample(logits, None), states, pos0)
        enq.append(time.perf_counter() - t)
    jax.block_until_ready(logits)
    total = time.perf_counter() - t0
    row = {"variant": variant, "ms_per_step": round(total / steps * 1e3, 3),
           "enqueue_ms_median": round(statistics.median(enq) * 1e3, 3)}
    print(row, flush=True)
    out["rows"].append(row)

for v in ("fresh", "same_arrays", "fresh_token_same_position", "fresh"):
    run(v)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"enqueue_probe_{fmt}.json"), "w"), indent=1)

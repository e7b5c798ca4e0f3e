"""A/B of the one-program decode step: XLA's dot strength reduction on / off, and the GDN decode step."""
import sys, time, json, statistics, dataclasses
import numpy as np, jax, jax.numpy as jnp
import hybridlm
from hybridlm.engine import runner as runner_mod
sys.path.insert(0, "benchmarks")
from decode import decode_loop

fmt = sys.argv[1] if len(sys.argv) > 1 else "int8"
config = hybridlm.get_config("qwen3.6-35b-a3b")
ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 512)).astype(np.int32)
model = hybridlm.init_random(config, seed=0, dtype=jnp.bfloat16, expert_format=fmt)
from hybridlm.layers import linear as linear_mod
variants = [("single_row_padded", 8, None), ("single_row_plain", 1, None), ("padded_gdn_pallas_step", 8, "pallas"),
            ("single_row_padded_again", 8, None)]
toks = {}
for name, pad, gdn in variants:
    linear_mod.SINGLE_ROW_PAD = pad
    jax.clear_caches()
    model.config = dataclasses.replace(config, gdn_implementation=gdn)
    for layer in model.layers:
        layer.mixer.config = model.config
    r = hybridlm.LayerwiseRunner(model)
    t = time.perf_counter(); decode_loop(r, "one_program", ids, 2); first = time.perf_counter() - t
    runs = [decode_loop(r, "one_program", ids, 64) for _ in range(3)]
    sec = statistics.median(x["seconds"] for x in runs)
    toks[name] = runs[0]["tokens"]
    same = int((toks[name] == toks["single_row_padded"]).all(axis=0).cumprod().sum())
    print(json.dumps(dict(format=fmt, variant=name, first_call_s=round(first, 1), ms_per_step=round(sec / 64 * 1e3, 3),
                          tokens_per_s=round(64 / sec, 1), enqueue_ms=round(statistics.median(x["enqueue_seconds"] for x in runs) / 64 * 1e3, 3),
                          same_tokens_as_first=same)), flush=True)

import sys, time, json
sys.path.insert(0, "benchmarks")
import numpy as np, jax, jax.numpy as jnp, hybridlm
from offload import build_trunk, build_host_experts
from hybridlm.offload.scheduler import OffloadedRunner
config = hybridlm.get_config("qwen3.6-35b-a3b")
model = build_trunk(config, jnp.bfloat16)
host = build_host_experts(config, "int4", jnp.bfloat16)
runner = OffloadedRunner(model, expert_budget="12GiB", cache_policy="lru", host_experts=host, chunk_size=512)
ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 512)).astype(np.int32)
for n in (2, 16, 16):
    t = time.perf_counter(); g = hybridlm.generate(runner, ids, max_new_tokens=n, chunk_size=512)
    print(n, "wall", round(time.perf_counter() - t, 2), "first_step", round(g.first_step_s, 3), "decode_s", round(g.decode_s, 3), "tok/s", round(g.decode_tokens_per_s, 2), flush=True)
pre = hybridlm.prefill(runner, ids, chunk_size=512, max_new_tokens=16)
states, logits = pre.states, pre.logits
timer = hybridlm.engine.runner.PhaseTimer(True)
tok = jnp.argmax(logits, -1).astype(jnp.int32)
for i in range(4):
    x, states = runner.forward_chunk(tok[:, None], states, 512 + i, 1, timer)
    logits = runner.head_logits(x[:, 0]); tok = jnp.argmax(logits, -1).astype(jnp.int32)
print("phases over 4 steps (s):", {k: round(v, 4) for k, v in timer.seconds.items()}, flush=True)
options = jax.profiler.ProfileOptions(); options.python_tracer_level = 1
with jax.profiler.trace("/tmp/odt", create_perfetto_trace=True, profiler_options=options):
    for i in range(4):
        x, states = runner.forward_chunk(tok[:, None], states, 520 + i, 1)
        logits = runner.head_logits(x[:, 0]); tok = jnp.argmax(logits, -1).astype(jnp.int32)
    jax.block_until_ready(logits)
print(json.dumps(runner.stats(per_layer=False)["decode"])[:600])

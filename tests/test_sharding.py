"""Expert parallelism over several devices (`hybridlm.sharding`): the logits and greedy tokens of a model
split over 2 devices are those of one device, for both architectures, float, int4, Q8_0 and Q4_K experts,
loaded from a checkpoint or a GGUF file; bad device counts get one clear error."""

import json
import os
import subprocess
import sys
import types

import pytest
from support import FIXTURES, assert_finite

from hybridlm import sharding

# Runs in a child process: the host platform's device count is fixed when JAX starts.
TWO_DEVICES = r"""
import json, sys
import jax, numpy as np
import hybridlm
from hybridlm import sharding

jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 2, jax.devices()
ids = np.random.default_rng(0).integers(0, 200, 37).astype(np.int32)

def run(model):
    runner = hybridlm.LayerwiseRunner(model)
    pre = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=6)
    gen = hybridlm.generate(runner, ids, max_new_tokens=6, chunk_size=16)
    return np.asarray(pre.logits), np.asarray(gen.tokens)[0].tolist(), pre.logits.sharding

out = {}
cases = {
    name: lambda devices, name=name: hybridlm.load(sys.argv[1] + "/hf/" + name, devices=devices)
    for name in ("qwen35moe_text", "qwen3next")
}
cfg = hybridlm.get_config("tiny")
def tiny_int4(devices):
    model = hybridlm.init_random(cfg, seed=1, expert_format="int4")
    return model if devices is None else sharding.shard_model(model, sharding.expert_mesh(devices))
cases["tiny_int4"] = tiny_int4
gguf = sys.argv[2]
hybridlm.save_gguf(hybridlm.init_random(cfg, seed=2), gguf, "q8_0")
cases["gguf_q8_0"] = lambda devices: hybridlm.load(
    gguf, keep_quantized="experts", dtype=jax.numpy.float32, devices=devices
)  # float32: a random bfloat16 model amplifies the sums' rounding order into other tokens
from support import K256

q4k = sys.argv[2] + ".q4_k.gguf"
hybridlm.save_gguf(hybridlm.init_random(K256, seed=3), q4k, "q4_k")
cases["gguf_q4_k"] = lambda devices: hybridlm.load(
    q4k, keep_quantized="experts", dtype=jax.numpy.float32, devices=devices
)
for name, make in cases.items():
    one_logits, one_tokens, _ = run(make(None))
    model = make(2)
    experts = model.layers[0].ffn.experts_gate_up.get_value()
    two_logits, two_tokens, placed = run(model)
    out[name] = {
        "max_abs_diff": float(np.abs(one_logits - two_logits).max()),
        "scale": float(np.abs(one_logits).max()),
        "finite": bool(np.isfinite(two_logits).all()),
        "tokens": [one_tokens, two_tokens],
        "experts_devices": len(jax.tree_util.tree_leaves(experts)[0].sharding.device_set),
        "logits_devices": len(placed.device_set),
    }
print("RESULT " + json.dumps(out))
"""


def test_two_devices_give_the_logits_and_tokens_of_one(tmp_path):
    env = {
        **os.environ,
        # the session's flags (conftest: fast CPU compiles) plus two host devices
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "HYBRIDLM_COMPILE_CACHE": "off",
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", TWO_DEVICES, str(FIXTURES), str(tmp_path / "tiny.gguf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULT "))
    assert set(results) == {"qwen35moe_text", "qwen3next", "tiny_int4", "gguf_q8_0", "gguf_q4_k"}
    for name, r in results.items():
        assert r["finite"], name
        assert r["experts_devices"] == 2 and r["logits_devices"] == 2, (name, r)
        assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["scale"]), (name, r)  # float32: sums in another order
        assert r["tokens"][0] == r["tokens"][1], (name, r)


def test_device_counts_that_cannot_work_are_refused():
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"sees {n} device"):
        sharding.expert_mesh(n + 1)
    with pytest.raises(ValueError, match="sees"):
        sharding.expert_mesh(0)
    three = types.SimpleNamespace(shape={sharding.EXPERT_AXIS: 3})
    config = types.SimpleNamespace(name="tiny", moe=types.SimpleNamespace(num_experts=16))
    with pytest.raises(ValueError, match="16 experts do not split evenly over 3 devices"):
        sharding.check_shardable(config, three)
    dense = types.SimpleNamespace(name="dense", moe=None)
    with pytest.raises(ValueError, match="has none"):
        sharding.check_shardable(dense, three)


def test_offloading_a_split_model_is_refused(tiny_model):
    import hybridlm
    from hybridlm.offload import OffloadConfig, OffloadedRunner

    model = sharding.shard_model(hybridlm.init_random(tiny_model.config, seed=0), sharding.expert_mesh(1))
    assert sharding.model_mesh(model) is not None
    assert_finite(hybridlm.prefill(model, [1, 2, 3]).logits)
    with pytest.raises(ValueError, match="offloading experts to host memory runs on one device"):
        OffloadedRunner(model, OffloadConfig(expert_budget="1GiB"))

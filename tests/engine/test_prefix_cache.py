"""Prefix reuse through decode-state snapshots: a resumed prefill equals a cold one, for both architectures,
resident and offloaded; the cache's tiers and lookups; a conversation's second turn resumes its history."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import hybridlm
from hybridlm.chat import Chat
from hybridlm.engine.prefix_cache import PrefixCache
from hybridlm.state import init_layer_states

TINY = hybridlm.get_config("tiny")
TINY_NEXT = TINY.replace(  # Qwen3-Next's attention: plain RoPE, no M-RoPE sections
    name="tiny-next", vocab_size=4096, attention=dataclasses.replace(TINY.attention, mrope_sections=None)
)
CAPACITY = 64


@pytest.fixture(scope="module")
def models():
    return {
        name: hybridlm.init_random(cfg, seed=3)
        for name, cfg in (("qwen3.5", TINY), ("qwen3-next", TINY_NEXT))
    }


def runner_for(model, offloaded: bool):
    if not offloaded:
        return hybridlm.LayerwiseRunner(model)
    from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner

    return OffloadedRunner(
        model, OffloadConfig(expert_budget="1MiB"), host_experts=HostExperts.from_model(model)
    )


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize("arch", ["qwen3.5", "qwen3-next"])
def test_resumed_prefill_equals_a_cold_one(models, arch, offloaded):
    """Prefill 21 tokens, snapshot, restore into a new cache, prefill the next 19: the logits and the
    greedy continuation equal one prefill of all 40 (a split off chunk boundaries, chunk 16)."""
    model = models[arch]
    runner = runner_for(model, offloaded)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 40).astype(np.int32)
    cold = hybridlm.prefill(runner, ids, chunk_size=16, max_new_tokens=CAPACITY - 40)
    states = init_layer_states(model.config, 1, CAPACITY, model.dtype)
    first = hybridlm.prefill(
        runner, ids[:21], chunk_size=16, max_new_tokens=CAPACITY - 21, resume=(states, 0)
    )
    cache = PrefixCache()
    snap = cache.insert(ids[:21], first.states)
    assert cache.lookup(ids) is snap and cache.lookup(ids[:21]) is None  # one token is always left to prefill
    warm = hybridlm.prefill(
        runner,
        ids[21:],
        chunk_size=16,
        max_new_tokens=CAPACITY - 40,
        resume=(cache.restore(snap, CAPACITY), 21),
    )
    assert warm.prompt_tokens == 40 and warm.cached_tokens == 21
    assert np.isfinite(np.asarray(warm.logits)).all()
    np.testing.assert_allclose(np.asarray(warm.logits), np.asarray(cold.logits), rtol=2e-4, atol=2e-4)
    a = hybridlm.generate_stream(runner, ids, max_new_tokens=6, chunk_size=16)
    b = hybridlm.generate_stream(
        runner, ids[21:], max_new_tokens=6, chunk_size=16, resume=(cache.restore(snap, CAPACITY), 21)
    )
    np.testing.assert_array_equal(np.concatenate(list(a), 1), np.concatenate(list(b), 1))


def test_resume_refuses_states_too_small(models):
    model = models["qwen3.5"]
    states = init_layer_states(model.config, 1, 32, model.dtype)
    with pytest.raises(ValueError, match="KV cache of 32 tokens"):
        hybridlm.prefill(model, np.arange(20), max_new_tokens=8, resume=(states, 10))


def test_cache_moves_snapshots_to_host_then_drops_them(models):
    model = models["qwen3.5"]
    runner = hybridlm.LayerwiseRunner(model)
    ids = np.arange(100, 140, dtype=np.int32)
    pre = hybridlm.prefill(runner, ids[:20], chunk_size=16, max_new_tokens=CAPACITY - 20)
    probe = PrefixCache()
    one = probe.insert(ids[:20], pre.states).nbytes
    cache = PrefixCache(device_bytes=one, host_bytes=one)
    for n in (20, 21, 22):  # the same states stand for three prefixes: only the bookkeeping is tested
        cache.insert(ids[:n], pre.states)
    s = cache.stats()
    assert (s["snapshots"], s["device_bytes"], s["host_bytes"]) == (2, one, one)
    # 20 was moved to the host by 21, then dropped when 22 moved 21 there
    assert cache.lookup(ids[:21]) is None
    assert cache.lookup(ids[:30]).length == 22
    on_host = cache.lookup(ids[:22])
    assert on_host.length == 21 and not on_host.on_device
    restored = cache.restore(on_host, CAPACITY)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree_util.tree_leaves(restored))
    assert cache.stats()["hits"] == 2 and cache.stats()["lookups"] == 3


def test_a_second_turn_resumes_the_history_and_answers_as_a_cold_chat(models):
    model, tok = models["qwen3.5"], hybridlm.Tokenizer()
    chat = Chat(model, tok, chunk_size=16)
    cold = Chat(model, tok, chunk_size=16, prefix_cache=None)
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    first = chat.stream(turn1, max_tokens=8)
    reply = first.text()
    assert first.stats.cached_tokens == 0 and first.stats.completion_tokens >= 1
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = chat.stream(turn2, max_tokens=8)
    text = second.text()
    assert second.stats.cached_tokens > 0 and chat.stats()["hits"] == 1
    assert text == cold.stream(turn2, max_tokens=8).text()

"""MTP speculative decoding (`generate(..., speculative="mtp")`) on tiny float32 models of both architectures:
greedy output equals plain greedy decoding (random and oracle drafts, stop ids), the verify's per-token states
are those of single steps (the rollback), oracle acceptance is the alpha asked for, sampling is seeded and
stays in the filtered support, and bad requests get one clear error.

Compilation is most of the time on the CPU: every generate here uses chunk 16 and a KV cache of 64 positions
(prompts of 9 and 30 tokens, 24 new, any draft length up to 4), so the programs of one architecture and one
draft length are shared by every seed and prompt."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_finite

import hybridlm
from hybridlm.engine.prefill import cache_capacity
from hybridlm.mtp import init_random_mtp
from hybridlm.state import GatedDeltaNetState, KVCache, init_layer_states

CHUNK = 16
NEW = 24
LENGTHS = (9, 30)  # one chunk; two chunks, the second partial
# The oracle reference holds the plain greedy text past NEW, since the last iteration drafts beyond it, and is
# padded to one length: one program for every prompt.
REFERENCE_NEW = NEW + 8
REFERENCE_LENGTH = 64
K = 3

TINY_35 = hybridlm.get_config("tiny").replace(mtp_layers=1)
# Qwen3-Next differs from the 3.5 preset in its attention (plain 1-D RoPE, no M-RoPE sections); a small
# vocabulary keeps the lm head cheap.
TINY_NEXT = TINY_35.replace(
    name="tiny-next",
    vocab_size=4096,
    attention=dataclasses.replace(TINY_35.attention, mrope_sections=None),
)
ARCHS = {"qwen3.5": TINY_35, "qwen3-next": TINY_NEXT}


def test_configs_are_the_architectures_asked_for():
    """The Qwen3-Next stand-in has the full-size Qwen3-Next preset's attention type, the 3.5 one M-RoPE, and
    every spec generate below fits the one KV-cache size the programs are shared at."""
    assert (
        TINY_NEXT.attention.mrope_sections
        is hybridlm.get_config("qwen3-next-80b-a3b").attention.mrope_sections
    )
    assert TINY_35.attention.mrope_sections is not None
    for length in LENGTHS:
        for slots in (2, 4, 5):  # k = 1, 3, "auto" (up to 4)
            assert cache_capacity(length, CHUNK, NEW + 2 * slots) == 64
        assert cache_capacity(length, CHUNK, REFERENCE_NEW) == 64
        assert length + REFERENCE_NEW <= REFERENCE_LENGTH


@pytest.fixture(scope="module")
def cases():
    """(arch, seed, length) -> (runner, mtp, prompt [length] int32, plain greedy tokens [NEW] int32, oracle
    reference [REFERENCE_LENGTH] int32), built once per key."""
    built: dict = {}
    models: dict = {}

    def get(arch: str, seed: int, length: int):
        if (arch, seed) not in models:
            config = ARCHS[arch]
            model = hybridlm.init_random(config, seed=seed)
            models[arch, seed] = (hybridlm.LayerwiseRunner(model), init_random_mtp(config, seed=seed + 100))
        if (arch, seed, length) not in built:
            runner, mtp = models[arch, seed]
            rng = np.random.default_rng(1000 * seed + length)
            prompt = rng.integers(0, ARCHS[arch].vocab_size, length).astype(np.int32)
            plain = hybridlm.generate(runner, prompt, max_new_tokens=REFERENCE_NEW, chunk_size=CHUNK)
            assert plain.tokens.shape == (1, REFERENCE_NEW)
            assert_finite(plain.prefill.logits, "plain prefill logits")
            # the oracle reference: prompt then plain greedy tokens by absolute position, zero past them
            reference = np.zeros(REFERENCE_LENGTH, np.int32)
            reference[: length + REFERENCE_NEW] = np.concatenate([prompt, plain.tokens[0]])
            built[arch, seed, length] = (runner, mtp, prompt, plain.tokens[0, :NEW], reference)
        return built[arch, seed, length]

    return get


def spec(runner, mtp, prompt, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("draft_tokens", K)
    result = hybridlm.generate(runner, prompt, chunk_size=CHUNK, speculative="mtp", mtp=mtp, **kwargs)
    assert_finite(result.prefill.logits, "speculative prefill logits")
    check_stats(result.speculative, kwargs["draft_tokens"])
    return result


def check_stats(stats: dict, draft_tokens) -> None:
    """The statistics' fields are present, finite and consistent with each other."""
    k_max = 4 if draft_tokens == "auto" else draft_tokens
    assert stats["method"] == "mtp"
    assert stats["iterations"] > 0
    assert_finite([stats["mean_accepted"], stats["tokens_per_iteration"], *stats["acceptance_per_position"]])
    assert 1.0 <= stats["tokens_per_iteration"] <= k_max + 1
    assert 0.0 <= stats["mean_accepted"] <= k_max
    # every iteration emits its accepted drafts and one token of the model's own
    assert stats["tokens_per_iteration"] == pytest.approx(stats["mean_accepted"] + 1.0)
    assert 1 <= len(stats["acceptance_per_position"]) <= k_max
    assert all(0.0 <= a <= 1.0 for a in stats["acceptance_per_position"])
    assert np.isfinite(stats["iteration_s"]) and stats["iteration_s"] >= 0
    assert all(1 <= k <= k_max for k in stats["draft_tokens_per_block"])
    if draft_tokens != "auto":
        assert (
            set(stats["draft_tokens_per_block"]) == {draft_tokens} and stats["draft_tokens"] == draft_tokens
        )


# ---------------------------------------------------------------------------------------------------------
# greedy: the speculative tokens are plain greedy decoding's
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_plain_decoding(cases, arch, seed, length):
    runner, mtp, prompt, plain, reference = cases(arch, seed, length)
    random = spec(runner, mtp, prompt)
    np.testing.assert_array_equal(random.tokens[0], plain, err_msg="random MTP drafts")
    assert random.stop_reason == "length"
    # oracle drafts: most drafts are the greedy tokens, so most iterations accept some and reject one
    oracle = spec(runner, mtp, prompt, oracle_draft=(reference, 0.75))
    np.testing.assert_array_equal(oracle.tokens[0], plain, err_msg="oracle drafts")
    assert oracle.speculative["mean_accepted"] > 0
    assert oracle.speculative["iterations"] < random.speculative["iterations"]


def test_greedy_one_draft_and_auto_depth(cases):
    """k = 1, and the adaptive depth with every oracle draft right (the longest depth wins); one architecture
    (the depth logic is the driver's, the same for both)."""
    runner, mtp, prompt, plain, reference = cases("qwen3.5", 0, LENGTHS[1])
    one = spec(runner, mtp, prompt, draft_tokens=1, oracle_draft=(reference, 0.75))
    np.testing.assert_array_equal(one.tokens[0], plain)
    assert one.speculative["mean_accepted"] > 0
    auto = spec(runner, mtp, prompt, draft_tokens="auto", oracle_draft=(reference, 1.0))
    np.testing.assert_array_equal(auto.tokens[0], plain)
    used = auto.speculative["draft_tokens_per_block"]
    assert used[:4] == [4, 3, 2, 1]  # every depth compiles first, one iteration each
    assert used[-1] == 4  # once the acceptance counts hold more than the warm-up, the longest depth wins
    assert auto.speculative["acceptance_per_position"] == [1.0] * 4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_stops_at_eos_as_plain_decoding(cases, arch):
    runner, mtp, prompt, plain, reference = cases(arch, 1, LENGTHS[0])
    firsts = [i for i in range(4, NEW - 4) if plain[i] not in plain[:i]]
    assert firsts, "no token of the plain output appears first mid-way"
    eos = int(plain[firsts[0]])
    cut = hybridlm.generate(runner, prompt, max_new_tokens=NEW, chunk_size=CHUNK, eos_token_id=eos)
    assert cut.stop_reason == "eos"
    np.testing.assert_array_equal(cut.tokens[0], plain[: firsts[0] + 1])
    for oracle in (None, (reference, 1.0)):  # with every draft accepted, eos lands inside an iteration
        got = spec(runner, mtp, prompt, eos_token_id=eos, oracle_draft=oracle)
        assert got.stop_reason == "eos"
        np.testing.assert_array_equal(got.tokens[0], cut.tokens[0], err_msg=f"oracle={oracle is not None}")
    # the prefill's own token is the stop id: nothing is verified
    got = hybridlm.generate(
        runner,
        prompt,
        max_new_tokens=NEW,
        chunk_size=CHUNK,
        speculative="mtp",
        mtp=mtp,
        draft_tokens=K,
        eos_token_id=int(plain[0]),
    )
    assert got.stop_reason == "eos" and got.speculative["iterations"] == 0
    np.testing.assert_array_equal(got.tokens[0], plain[:1])


def test_one_new_token_is_the_prefill_token(cases):
    runner, mtp, prompt, plain, reference = cases("qwen3.5", 0, LENGTHS[0])
    got = hybridlm.generate(
        runner, prompt, max_new_tokens=1, chunk_size=CHUNK, speculative="mtp", mtp=mtp, draft_tokens=K
    )
    np.testing.assert_array_equal(got.tokens[0], plain[:1])
    assert got.stop_reason == "length"


# ---------------------------------------------------------------------------------------------------------
# oracle "coin" mode: acceptance is alpha exactly
# ---------------------------------------------------------------------------------------------------------
def test_coin_oracle_accepts_all_or_nothing(cases):
    runner, mtp, prompt, plain, reference = cases("qwen3.5", 0, LENGTHS[0])
    every = spec(runner, mtp, prompt, oracle_draft=(None, 1.0))
    stats = every.speculative
    assert every.tokens.shape == (1, NEW)
    assert stats["acceptance_per_position"] == [1.0] * K
    assert stats["mean_accepted"] == K and stats["tokens_per_iteration"] == K + 1
    # no iteration is wasted: the NEW - 1 tokens after the prefill's take ceil((NEW - 1) / (K + 1)) of them
    assert stats["iterations"] == -(-(NEW - 1) // (K + 1))
    none = spec(runner, mtp, prompt, oracle_draft=(None, 0.0))
    stats = none.speculative
    assert stats["acceptance_per_position"] == [0.0]
    assert stats["mean_accepted"] == 0 and stats["tokens_per_iteration"] == 1
    assert stats["iterations"] == NEW - 1
    # nothing accepted: each iteration emits the verify's first greedy token, plain decoding's
    np.testing.assert_array_equal(none.tokens[0], plain)
    # a reference oracle at alpha 0 drafts a token other than the greedy one every time
    wrong = spec(runner, mtp, prompt, oracle_draft=(reference, 0.0))
    assert wrong.speculative["acceptance_per_position"] == [0.0]
    assert wrong.speculative["iterations"] == NEW - 1
    np.testing.assert_array_equal(wrong.tokens[0], plain)


# ---------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------
TOP_K = 20


def test_sampling_is_seeded_and_stays_in_the_top_k(cases, forward):
    runner, mtp, prompt, _, _ = cases("qwen3.5", 0, LENGTHS[0])
    settings = dict(temperature=1.0, top_k=TOP_K)
    a = spec(runner, mtp, prompt, seed=5, **settings)
    b = spec(runner, mtp, prompt, seed=5, **settings)
    c = spec(runner, mtp, prompt, seed=6, **settings)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    timing = "iteration_s"  # wall time: the one field two runs need not share
    assert {k: v for k, v in a.speculative.items() if k != timing} == {
        k: v for k, v in b.speculative.items() if k != timing
    }
    assert a.tokens.shape == c.tokens.shape == (1, NEW)
    assert not np.array_equal(a.tokens, c.tokens), "another seed drew the same 24 tokens"
    for got in (a, c):
        tokens = got.tokens[0]
        assert tokens.min() >= 0 and tokens.max() < TINY_35.vocab_size
        # rejection sampling's residual lies inside the target's support: each token is among the top-k of
        # the model's logits at its position (a margin for the full forward's chunked-form rounding)
        logits = np.asarray(forward(runner.model, jnp.asarray(np.concatenate([prompt, tokens])[None])))[0]
        assert_finite(logits, "full forward logits")
        logits = logits[prompt.size - 1 : -1]  # the logits each new token was drawn from
        kth = np.sort(logits, axis=-1)[:, -TOP_K]
        drawn = np.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
        assert (drawn >= kth - 1e-3).all(), np.flatnonzero(drawn < kth - 1e-3)


# ---------------------------------------------------------------------------------------------------------
# rollback: the verify's slot j is the state after j + 1 single steps
# ---------------------------------------------------------------------------------------------------------
VERIFY_TOKENS = 4
ATOL = 2e-5


def _close(got, want, what):
    assert_finite(got, what)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=ATOL, err_msg=what)


@pytest.fixture(scope="module")
def layer_model():
    return hybridlm.init_random(TINY_35, seed=3)


def _random_gdn_state(config, seed):
    rng = np.random.default_rng(seed)
    g = config.gdn
    return GatedDeltaNetState(
        conv=jnp.asarray(rng.normal(size=(1, g.conv_kernel - 1, g.conv_dim)), jnp.float32),
        recurrent=jnp.asarray(0.3 * rng.normal(size=(1, g.num_v_heads, g.key_dim, g.value_dim)), jnp.float32),
    )


def test_gated_deltanet_verify_keeps_every_single_step_state(layer_model):
    config = layer_model.config
    mixer = layer_model.layers[0].mixer
    state = _random_gdn_state(config, 0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, VERIFY_TOKENS, config.hidden_dim)), jnp.float32)
    out, states = mixer.verify(x, state)
    assert out.shape == x.shape
    assert states.conv.shape == (VERIFY_TOKENS, *state.conv.shape)
    assert states.recurrent.shape == (VERIFY_TOKENS, *state.recurrent.shape)
    step = state
    for j in range(VERIFY_TOKENS):
        o, step = mixer(x[:, j : j + 1], step)
        _close(out[:, j], o[:, 0], f"output {j}")
        _close(states.conv[j], step.conv, f"conv state slot {j}")
        _close(states.recurrent[j], step.recurrent, f"recurrent state slot {j}")


def test_decoder_layer_verify_equals_single_steps(layer_model):
    """Both layer types: outputs of one verify equal single steps; a Gated DeltaNet layer's slot j is the
    state after j + 1 steps; an attention layer's cache holds the steps' keys and values."""
    config = layer_model.config
    types = config.layer_types
    rng = np.random.default_rng(2)
    start = 11
    x = jnp.asarray(rng.normal(size=(1, VERIFY_TOKENS, config.hidden_dim)), jnp.float32)
    for index in (types.index("linear_attention"), types.index("full_attention")):
        layer = layer_model.layers[index]
        if types[index] == "linear_attention":
            state = _random_gdn_state(config, index)
        else:  # a cache whose first `start` positions hold a prefix
            cache = init_layer_states(config, 1, 32)[index]
            prefix = jnp.asarray(rng.normal(size=(1, start, config.hidden_dim)), jnp.float32)
            _, state = layer(prefix, cache, 0)
        out, verified = layer.verify(x, state, start)
        step = state
        for j in range(VERIFY_TOKENS):
            o, step = layer(x[:, j : j + 1], step, start + j)
            _close(out[:, j], o[:, 0], f"layer {index} output {j}")
            if isinstance(step, KVCache):
                continue
            _close(verified.conv[j], step.conv, f"layer {index} conv slot {j}")
            _close(verified.recurrent[j], step.recurrent, f"layer {index} recurrent slot {j}")
        if isinstance(step, KVCache):
            _close(verified.key, step.key, f"layer {index} keys")
            _close(verified.value, step.value, f"layer {index} values")


def test_attention_rollback_by_overwrite(layer_model):
    """Accepting n of a verify's tokens leaves its later KV entries in the cache; the next verify, at
    start + n + 1, overwrites them before its causal mask lets a query see them: its outputs equal those
    over a cache that never held the rejected entries."""
    config = layer_model.config
    index = config.layer_types.index("full_attention")
    layer = layer_model.layers[index]
    rng = np.random.default_rng(4)
    start, accepted = 7, 1
    cache = init_layer_states(config, 1, 32)[index]
    _, cache = layer(jnp.asarray(rng.normal(size=(1, start, config.hidden_dim)), jnp.float32), cache, 0)
    first = jnp.asarray(rng.normal(size=(1, VERIFY_TOKENS, config.hidden_dim)), jnp.float32)
    second = jnp.asarray(rng.normal(size=(1, VERIFY_TOKENS, config.hidden_dim)), jnp.float32)
    _, stale = layer.verify(first, cache, start)  # writes start .. start + 3, keeps accepted + 1 of them
    _, clean = layer(first[:, : accepted + 1], cache, start)
    nxt = start + accepted + 1
    got, _ = layer.verify(second, stale, nxt)
    want, _ = layer.verify(second, clean, nxt)
    _close(got, want, "outputs after a rollback")


# ---------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------
def test_refusals(cases):
    runner, mtp, prompt, _, _ = cases("qwen3.5", 0, LENGTHS[0])

    def call(**kwargs):
        args = dict(max_new_tokens=4, chunk_size=CHUNK, speculative="mtp", mtp=mtp) | kwargs
        return hybridlm.generate(runner, args.pop("ids", prompt), **args)

    with pytest.raises(ValueError, match=r"speculative='mtp'.*mtp="):
        call(mtp=None)
    with pytest.raises(ValueError, match=r"speculative='eagle'"):
        call(speculative="eagle")
    for bad in (0, 9, "many", 2.0):
        with pytest.raises(ValueError, match=rf"draft_tokens={bad!r} must be"):
            call(draft_tokens=bad)
    with pytest.raises(ValueError, match="one sequence at a time; got a batch of 2"):
        call(ids=np.stack([prompt, prompt]))
    with pytest.raises(ValueError, match="oracle drafts are for greedy decoding"):
        call(temperature=1.0, oracle_draft=(None, 0.5))


@pytest.mark.parametrize(
    ("budget", "host_parts"), [("1MiB", None), ("3MiB", 1)], ids=["default-host-parts", "one-host-part"]
)
def test_offloaded_experts_verify_as_resident(cases, budget, host_parts):
    """With the experts paged (layers whose experts are in host memory fetch each distinct expert of the
    verify's copies once; pool layers gather), speculative greedy tokens equal plain greedy: with random
    drafts (rejected) through one host part, oracle drafts (some accepted) through the default parts."""
    from hybridlm.offload import HostExperts, OffloadConfig, OffloadedRunner
    from hybridlm.offload.decode import IN_HOST, IN_POOL

    runner, mtp, prompt, plain, reference = cases("qwen3.5", 0, LENGTHS[1])
    model = runner.model
    host = (
        HostExperts.from_model(model)
        if host_parts is None
        else HostExperts.from_model(model, parts=host_parts)
    )
    offloaded = OffloadedRunner(model, OffloadConfig(expert_budget=budget), host_experts=host)
    oracle = None if host_parts == 1 else (reference, 0.75)
    got = spec(offloaded, mtp, prompt, oracle_draft=oracle)
    np.testing.assert_array_equal(got.tokens[0], plain)
    assert oracle is None or got.speculative["mean_accepted"] > 0
    sources = set(offloaded.decoder.view.sources)
    assert {IN_HOST, IN_POOL} <= sources


def test_mtp_of_another_model_is_refused(cases):
    runner, _, prompt, _, _ = cases("qwen3.5", 0, LENGTHS[0])
    attention = dataclasses.replace(TINY_35.attention, num_heads=2, num_kv_heads=1)
    other = init_random_mtp(TINY_35.replace(hidden_dim=32, attention=attention), seed=1)
    with pytest.raises(ValueError, match="mtp"):
        spec(runner, other, prompt)


@pytest.mark.parametrize(
    "oracle", [(None, 1.5), (None, -0.5), (None,)], ids=["alpha-1.5", "alpha--0.5", "short"]
)
def test_bad_oracle_draft_is_refused(cases, oracle):
    runner, mtp, prompt, _, _ = cases("qwen3.5", 0, LENGTHS[0])
    with pytest.raises(ValueError, match="oracle_draft"):
        spec(runner, mtp, prompt, oracle_draft=oracle)


def test_bool_draft_tokens_is_refused(cases):
    runner, mtp, prompt, _, reference = cases("qwen3.5", 0, LENGTHS[1])
    with pytest.raises(ValueError, match="draft_tokens=True"):
        spec(runner, mtp, prompt, draft_tokens=True, oracle_draft=(reference, 0.75))

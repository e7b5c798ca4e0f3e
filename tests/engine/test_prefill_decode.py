"""Chunked prefill, decode and generate on the tiny preset (full 248 320 vocab)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_finite

import hybridlm
from hybridlm.engine.prefill import cache_capacity, effective_chunk_size

SEQ = 70  # not a multiple of any chunk size below
ATOL = 1e-4


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(7).integers(0, 248_320, (2, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def full_logits(tiny_model, prompt, forward):
    logits = np.asarray(forward(tiny_model, jnp.asarray(prompt)))
    assert_finite(logits, "full forward logits")
    return logits


@pytest.fixture(scope="module")
def recurrence_logits(prompt, forward):
    """Full forward of the same weights with the token-by-token delta rule (the oracle) in every GDN layer.

    Decode runs the recurrence; the default full forward on CPU runs the chunked WY form, whose fp32 rounding
    differs: on this random model the two forwards differ by up to 1.3e-4 (|logits| ~ 5) at some positions,
    while decode stays within 3.4e-5 of this one (JAX 0.11.2, CPU)."""
    model = hybridlm.init_random(hybridlm.get_config("tiny").replace(gdn_implementation="reference"), seed=0)
    logits = np.asarray(forward(model, jnp.asarray(prompt)))
    assert_finite(logits, "recurrence forward logits")
    return logits


@pytest.mark.parametrize("chunk_size", [16, 64, 4096])
def test_chunked_prefill_equals_full_forward(tiny_runner, prompt, full_logits, chunk_size):
    result = hybridlm.prefill(tiny_runner, prompt, chunk_size=chunk_size)
    assert_finite(result.logits)
    assert result.logits.shape == (2, 248_320)
    assert result.num_chunks == -(-SEQ // result.chunk_size)
    np.testing.assert_allclose(np.asarray(result.logits), full_logits[:, -1], atol=ATOL, rtol=0)


def test_prefill_then_decode_reproduces_full_forward(tiny_runner, prompt, recurrence_logits):
    result = hybridlm.prefill(tiny_runner, prompt[:, :40], chunk_size=16, max_new_tokens=SEQ - 40)
    states = result.states
    for pos in range(40, SEQ):
        logits, states = hybridlm.decode_step(tiny_runner, jnp.asarray(prompt[:, pos]), states, pos)
        assert_finite(logits)
        np.testing.assert_allclose(
            np.asarray(logits), recurrence_logits[:, pos], atol=ATOL, rtol=0, err_msg=f"position {pos}"
        )


def test_one_program_decode_step_equals_layer_by_layer(tiny_runner, prompt):
    """`LayerwiseRunner.decode_step` (all layers in one program) against `decode_step_layerwise`
    (forward_chunk + head) over 4 steps: the same logits and states (the layers' own code in both; only the
    program boundaries differ)."""
    result = hybridlm.prefill(tiny_runner, prompt[:, :40], chunk_size=16, max_new_tokens=8)

    def copy(states):
        return jax.tree_util.tree_map(jnp.copy, states)

    ref_states, states = copy(result.states), copy(result.states)
    for pos in range(40, 44):
        ref, ref_states = tiny_runner.decode_step_layerwise(prompt[:, pos], ref_states, pos)
        logits, states = tiny_runner.decode_step(prompt[:, pos], states, pos)
        assert_finite(logits)
        np.testing.assert_allclose(
            np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=0, err_msg=f"position {pos}"
        )
    for got, want in zip(
        jax.tree_util.tree_leaves(states), jax.tree_util.tree_leaves(ref_states), strict=False
    ):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("step", ["decode_step", "decode_step_layerwise"])
def test_decode_refuses_positions_outside_the_cache_and_bad_tokens(tiny_runner, prompt, step):
    # Past the capacity a step's KV write would land clamped on the last slot: a silently wrong answer.
    result = hybridlm.prefill(tiny_runner, prompt[:, :16], chunk_size=16, max_new_tokens=0)
    decode = getattr(tiny_runner, step)
    for pos, match in (
        (result.capacity, "past the KV cache's capacity of 16 tokens.*max_new_tokens"),
        (np.int32(result.capacity + 3), "past the KV cache"),
        (-1, "negative"),
    ):
        with pytest.raises(ValueError, match=match):
            decode(prompt[:, 15], jax.tree_util.tree_map(jnp.copy, result.states), pos)
    for tokens in (np.array([1, 2, 3]), np.array([[1], [2]])):  # the prompt's batch is 2
        with pytest.raises(ValueError, match=r"tokens must be \[batch\] = \[2\]"):
            decode(tokens, result.states, result.capacity - 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
        decode(np.array([0, tiny_runner.config.vocab_size]), result.states, result.capacity - 1)
    logits, _ = decode(prompt[:, 15], result.states, result.capacity - 1)  # the last slot is fine
    assert_finite(logits)


def test_full_forward_refuses_bad_ids(tiny_model):
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        tiny_model(np.arange(4))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
        tiny_model(np.array([[0, tiny_model.config.vocab_size]]))


def test_prefill_in_two_calls_equals_one(tiny_runner, prompt):
    """prefill(a + b) == prefill(a) then feeding b token by token (state carried)."""
    whole = hybridlm.prefill(tiny_runner, prompt, chunk_size=32)
    first = hybridlm.prefill(tiny_runner, prompt[:, :64], chunk_size=32, max_new_tokens=SEQ - 64)
    states = first.states
    for pos in range(64, SEQ):
        logits, states = hybridlm.decode_step(tiny_runner, jnp.asarray(prompt[:, pos]), states, pos)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(whole.logits), atol=ATOL, rtol=0)


def test_profile_reports_every_phase(tiny_runner, prompt):
    result = hybridlm.prefill(tiny_runner, prompt, chunk_size=32, profile=True)
    phases = result.summary()["phase_seconds"]
    assert set(phases) == set(hybridlm.engine.PHASES)
    assert all(v > 0 for v in phases.values()), phases
    assert result.tokens_per_s > 0 and result.ttft_s > 0


def test_chunk_and_capacity_rules():
    assert effective_chunk_size(5, 4096) == 16
    assert effective_chunk_size(70, 4096) == 128
    assert effective_chunk_size(10_000, 4096) == 4096
    assert cache_capacity(70, 16, 0) == 16 * 8  # 5 chunks -> rounded up to 8
    assert cache_capacity(70, 128, 100) == 256
    with pytest.raises(ValueError, match="chunk_size"):
        effective_chunk_size(10, 0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((1, 0), np.int32), "seq >= 1"),
        (np.array([[1, 2, 248_320]]), r"\[0, 248320\)"),
        (np.array([[-1, 2]]), r"\[0, 248320\)"),
    ],
)
def test_prefill_rejects_bad_prompts(tiny_runner, bad, match):
    with pytest.raises(ValueError, match=match):
        hybridlm.prefill(tiny_runner, bad)


def test_generate_greedy_matches_argmax_chain(tiny_runner, tiny_model, prompt, forward):
    out = hybridlm.generate(tiny_runner, prompt[0, :20], max_new_tokens=4, chunk_size=16)
    assert out.tokens.shape == (1, 4)
    # 3 decode steps: the rate counts the 2 after the first (timed apart: it compiles on a first call)
    assert 0 < out.first_step_s < out.decode_s
    assert out.decode_tokens_per_s == pytest.approx(2 / (out.decode_s - out.first_step_s))
    # the full forward (causal) over the sequence padded to one length: one compilation for the 4 checks
    seq = list(prompt[0, :20])
    for tok in out.tokens[0]:
        padded = np.zeros((1, 24), np.int32)
        padded[0, : len(seq)] = seq
        logits = np.asarray(forward(tiny_model, jnp.asarray(padded)))[0, len(seq) - 1]
        assert int(tok) == int(logits.argmax())
        seq.append(int(tok))


def test_generate_sampling_is_seeded(tiny_runner, prompt):
    kw = {"max_new_tokens": 5, "temperature": 1.0, "top_k": 50, "top_p": 0.9, "chunk_size": 16}
    a = hybridlm.generate(tiny_runner, prompt[0, :10], seed=3, **kw).tokens
    b = hybridlm.generate(tiny_runner, prompt[0, :10], seed=3, **kw).tokens
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_blocks_give_the_tokens_of_one_step_a_program(tiny_runner, prompt, temperature):
    """Decode blocks of any length feed each token back on the device: the tokens equal those of one step a
    program (block 1), greedy and sampled, and a stop id ends every length at the same token."""
    kw = {"max_new_tokens": 9, "temperature": temperature, "top_k": 20, "seed": 5, "chunk_size": 16}
    one = hybridlm.generate(tiny_runner, prompt[0, :12], decode_block=1, **kw).tokens
    assert one.shape == (1, 9)
    for block in (3, 16):
        got = hybridlm.generate(tiny_runner, prompt[0, :12], decode_block=block, **kw)
        np.testing.assert_array_equal(got.tokens, one)
        assert got.stop_reason == "length"
    stop = int(one[0, 5])
    cut = int(np.flatnonzero(one[0] == stop)[0]) + 1
    for block in (1, 4):
        got = hybridlm.generate(tiny_runner, prompt[0, :12], decode_block=block, eos_token_id=stop, **kw)
        np.testing.assert_array_equal(got.tokens, one[:, :cut])
        assert got.stop_reason == "eos"
    with pytest.raises(ValueError, match="decode_block"):
        hybridlm.generate(tiny_runner, prompt[0, :12], decode_block=0)


def test_generate_stream_yields_the_tokens_of_generate_block_by_block(tiny_runner, prompt):
    kw = {
        "max_new_tokens": 9,
        "temperature": 1.0,
        "top_k": 20,
        "seed": 2,
        "chunk_size": 16,
        "decode_block": 3,
    }
    want = hybridlm.generate(tiny_runner, prompt[0, :12], **kw).tokens
    pieces = list(hybridlm.generate_stream(tiny_runner, prompt[0, :12], **kw))
    assert [p.shape[1] for p in pieces] == [1, 1, 3, 3, 1]  # the prefill's, the first step's, then blocks
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), want)
    stop = int(want[0, 4])
    stream = hybridlm.generate_stream(tiny_runner, prompt[0, :12], eos_token_id=stop, **kw)
    cut = np.concatenate(list(stream), axis=1)
    np.testing.assert_array_equal(cut, want[:, : int(np.flatnonzero(want[0] == stop)[0]) + 1])
    assert stream.stop_reason == "eos"


def test_sample_greedy_needs_no_key_and_sampling_does():
    logits = jnp.log(jnp.array([[0.2, 0.5, 0.3]], jnp.float32))
    assert int(hybridlm.engine.sample(logits, None, temperature=0.0)[0]) == 1
    with pytest.raises(ValueError, match="needs a PRNG key"):
        hybridlm.engine.sample(logits, None, temperature=0.7)


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_p": 0.0}, r"top_p=0.0 must lie in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p=1.5"),
    ],
)
def test_sampling_settings_out_of_range_are_refused(tiny_runner, prompt, setting, match):
    # Each would silently mean something else (greedy, or no nucleus); generate refuses them before
    # prefilling.
    logits = jnp.zeros((1, 4), jnp.float32)
    with pytest.raises(ValueError, match=match):
        hybridlm.engine.sample(logits, jax.random.key(0), **{"temperature": 1.0, **setting})
    with pytest.raises(ValueError, match=match):
        hybridlm.generate(tiny_runner, prompt[:, :4], max_new_tokens=2, **{"temperature": 1.0, **setting})


def test_sample_top_k_and_top_p_restrict_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    keys = jax.random.split(jax.random.key(0), 400)

    def draw(**kw):
        return {int(hybridlm.engine.sample(logits, k, temperature=1.0, **kw)[0]) for k in keys}

    assert draw(top_k=2) == {0, 1}
    assert draw(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert draw(top_p=0.5) == {0}
    assert draw() == {0, 1, 2, 3}
    greedy = hybridlm.engine.sample(logits, keys[0], temperature=0.0)
    assert int(greedy[0]) == 0


def test_each_program_compiles_once_with_committed_and_uncommitted_weights():
    """Experts placed by jax.device_put (committed), the rest not, as the offload benchmark builds its model:
    the runner commits its weights and the states, so a second prefill chunk and the decode steps after the
    first compile nothing (they compiled again inside the decode loop before, ~10 s at full size)."""
    from hybridlm.engine import phases

    model = hybridlm.init_random(hybridlm.get_config("tiny"), seed=1)
    for layer in model.layers:
        for var in (layer.ffn.experts_gate_up, layer.ffn.experts_down):
            var.set_value(jax.device_put(var.get_value(), jax.devices()[0]))
    runner = hybridlm.LayerwiseRunner(model)
    ids = np.random.default_rng(3).integers(0, 248_320, (1, 48)).astype(np.int32)
    groups_before = phases.layer_group._cache_size()
    result = hybridlm.prefill(runner, ids, chunk_size=24, max_new_tokens=4)  # two chunks of an unused size
    assert phases.layer_group._cache_size() - groups_before == 1  # every group of 4 layers: one program
    states, logits = result.states, result.logits
    for pos in range(48, 51):
        logits, states = runner.decode_step(jnp.argmax(logits, -1).astype(jnp.int32), states, pos)
        if pos == 48:
            decode_programs = phases.decode._cache_size()
    assert_finite(logits)
    assert phases.decode._cache_size() == decode_programs


def test_runners_share_layer_graphs_and_pass_flat_weights(tiny_model, tiny_runner):
    """Every runner's layers of one type pass the same StaticGraph object (jit's cache lookup stops at
    identity, no GraphDef comparison) and their weights as a flat tuple of arrays (flattened by jit in
    C++)."""
    from hybridlm.engine.runner import LayerwiseRunner

    other = LayerwiseRunner(tiny_model)
    assert all(g is h for (g, _), (h, _) in zip(tiny_runner.layers, other.layers, strict=False))
    assert len({id(g) for g, _ in other.layers}) == len(set(tiny_model.config.layer_types))
    for graph, leaves in other.layers:
        assert isinstance(leaves, tuple) and all(isinstance(x, jax.Array) for x in leaves)
        assert graph.merge(leaves).ffn.router.get_value().shape == (
            tiny_model.config.hidden_dim,
            tiny_model.config.moe.num_experts,
        )

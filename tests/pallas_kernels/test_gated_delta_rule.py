"""Every gated-delta-rule implementation against the token-by-token f32 reference (Pallas interpreted)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels.gated_delta_rule import (
    api,
    chunk,
    config,
    decode_step,
    gates,
    prepare,
    reference,
    workloads,
)

# Max |got - want| / max |want| against the f32 reference, by input dtype. The bf16 bound covers bf16 tiles
# (W, U, V', chunk states) feeding the matrix products; the f32 bound is f32 rounding over ~100 tokens.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
IMPLEMENTATIONS = ["chunked", "triton"]
CHUNK = 16  # small chunks keep interpret mode quick; the model uses 64 (covered by test_chunk_size_64)
SMALL = dataclasses.replace(workloads.TINY, name="small", k_heads=2, v_heads=4, key_dim=16, value_dim=16)


def assert_close(name, got, want, dtype):
    """Relative max error against the output scale; NaN/Inf anywhere fails."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{name} has NaN/Inf"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.3g} > {TOLERANCE[dtype]}"


def expected(inputs):
    """The oracle on the same (already rounded) inputs, in f32."""
    as_f32 = {
        n: (x if x is None or n == "cu_seqlens" else jnp.asarray(x, jnp.float32)) for n, x in inputs.items()
    }
    return reference.gated_delta_rule_reference(**as_f32)


def check(inputs, implementation, dtype, chunk_size=CHUNK):
    want = expected(inputs)
    got = api.gated_delta_rule(**inputs, chunk_size=chunk_size, implementation=implementation)
    assert got[0].dtype == inputs["value"].dtype and got[1].dtype == jnp.float32
    for name, g, w in zip(("output", "final_state"), got, want, strict=True):
        assert_close(name, g, w, dtype)


# One token, chunk - 1 (all tail), exactly one chunk, several chunks + tail; bf16 on the last two only.
CASES = [
    (jnp.float32, 1),
    (jnp.float32, CHUNK - 1),
    (jnp.float32, CHUNK),
    (jnp.float32, 2 * CHUNK + 5),
    (jnp.bfloat16, CHUNK),
    (jnp.bfloat16, 2 * CHUNK + 5),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype,seq", CASES, ids=[f"{d.__name__}-seq{s}" for d, s in CASES])
def test_matches_reference(implementation, dtype, seq):
    check(workloads.make_inputs(SMALL, seq=seq, dtype=dtype, seed=seq), implementation, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "k_heads,v_heads,initial_state", [(3, 3, True), (2, 6, False)], ids=["ratio1", "ratio3-no-initial-state"]
)
def test_grouped_heads(implementation, k_heads, v_heads, initial_state):
    shapes = dataclasses.replace(SMALL, k_heads=k_heads, v_heads=v_heads)
    inputs = workloads.make_inputs(
        shapes, seq=37, dtype=jnp.float32, seed=v_heads, initial_state=initial_state
    )
    check(inputs, implementation, jnp.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_extreme_gates(implementation):
    """g = -20 (state wiped), g = 0, beta exactly 0 and 1, mixed along the sequence."""
    inputs = workloads.make_inputs(SMALL, seq=40, dtype=jnp.float32, seed=3)
    rng = np.random.default_rng(0)
    pick = rng.integers(0, 3, inputs["log_decay"].shape)
    inputs["log_decay"] = jnp.asarray(np.choose(pick, [-20.0, 0.0, -0.5]), jnp.float32)
    inputs["beta"] = jnp.asarray(np.choose(rng.integers(0, 3, pick.shape), [0.0, 1.0, 0.5]), jnp.float32)
    check(inputs, implementation, jnp.float32)


def test_chunk_size_64():
    """The model's chunk size, several chunks and a tail, for both chunked implementations at once."""
    inputs = workloads.make_inputs(SMALL, seq=150, dtype=jnp.bfloat16, seed=7)
    for implementation in IMPLEMENTATIONS:
        check(inputs, implementation, jnp.bfloat16, chunk_size=64)


@pytest.mark.parametrize("implementation", ["reference"] + IMPLEMENTATIONS)
def test_packed_sequences_match_separate_runs(implementation):
    """cu_seqlens (boundaries off the chunk grid, one empty sequence) == each sequence run on its own."""
    seqlens = (5, 2 * CHUNK + 3, 0, CHUNK, 1)
    inputs = workloads.make_inputs(SMALL, dtype=jnp.float32, seed=11, seqlens=seqlens)
    out, final = api.gated_delta_rule(**inputs, chunk_size=CHUNK, implementation=implementation)
    cu = np.asarray(inputs["cu_seqlens"])
    for i, (start, stop) in enumerate(itertools.pairwise(cu)):
        piece = {n: inputs[n][:, start:stop] for n in ("query", "key", "value", "log_decay", "beta")}
        init = inputs["initial_state"][i : i + 1]
        if stop == start:
            assert_close(f"final_state[{i}]", final[i : i + 1], init, jnp.float32)
            continue
        want_out, want_final = reference.gated_delta_rule_reference(**piece, initial_state=init)
        assert_close(f"output[{i}]", out[:, start:stop], want_out, jnp.float32)
        assert_close(f"final_state[{i}]", final[i : i + 1], want_final, jnp.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_padding_preserves_outputs_and_state(implementation):
    """Trailing tokens with k = v = 0, g = 0, beta = 0 change neither the outputs nor the final state."""
    inputs = workloads.make_inputs(SMALL, seq=21, dtype=jnp.float32, seed=5)
    out, final = api.gated_delta_rule(**inputs, chunk_size=CHUNK, implementation=implementation)
    padded = {
        n: (jnp.pad(x, [(0, 0), (0, 9)] + [(0, 0)] * (x.ndim - 2)) if n != "initial_state" else x)
        for n, x in inputs.items()
    }
    out_p, final_p = api.gated_delta_rule(**padded, chunk_size=CHUNK, implementation=implementation)
    assert_close("output", out_p[:, :21], out, jnp.float32)
    assert_close("final_state", final_p, final, jnp.float32)


def test_prefill_in_two_parts_and_chunk_size_independence():
    inputs = workloads.make_inputs(SMALL, seq=50, dtype=jnp.float32, seed=9)
    whole_out, whole_final = api.gated_delta_rule(**inputs, implementation="chunked", chunk_size=CHUNK)
    first = {n: (x[:, :23] if n != "initial_state" else x) for n, x in inputs.items()}
    second = {n: x[:, 23:] for n, x in inputs.items() if n != "initial_state"}
    out_a, state_a = api.gated_delta_rule(**first, implementation="chunked", chunk_size=CHUNK)
    out_b, state_b = api.gated_delta_rule(
        **second, initial_state=state_a, implementation="chunked", chunk_size=7
    )
    assert_close("output", jnp.concatenate([out_a, out_b], axis=1), whole_out, jnp.float32)
    assert_close("final_state", state_b, whole_final, jnp.float32)


def test_decode_step_matches_prefill():
    inputs = workloads.make_inputs(SMALL, seq=6, dtype=jnp.float32, seed=2)
    want_out, want_final = reference.gated_delta_rule_reference(**inputs)
    state = inputs["initial_state"]
    for t in range(6):
        token = {n: inputs[n][:, t] for n in ("query", "key", "value", "log_decay", "beta")}
        out, state = api.gated_delta_rule_step(**token, state=state)
        assert out.shape == want_out[:, t].shape and state.dtype == jnp.float32
        assert_close(f"output[{t}]", out, want_out[:, t], jnp.float32)
    assert_close("state", state, want_final, jnp.float32)


@pytest.mark.parametrize(
    "dtype,group,block_v", [(jnp.float32, 1, 32), (jnp.float32, 2, 16), (jnp.bfloat16, 3, 32)]
)
def test_pallas_decode_step_matches_the_recurrence(dtype, group, block_v):
    """The fused Pallas step (interpreter), token by token from an initial state, against the f32 recurrence
    over the same tokens: grouped heads 1, 2, 3, several value blocks, strongly negative g and beta 0 / 1."""
    workload = dataclasses.replace(
        workloads.TINY, seq=5, batch=2, k_heads=2, v_heads=2 * group, key_dim=32, value_dim=64
    )
    inputs = workloads.make_inputs(workload, dtype=dtype, seed=11)
    inputs["log_decay"] = inputs["log_decay"].at[:, 1].set(-30.0)  # the state all but erased at token 1
    inputs["beta"] = inputs["beta"].at[:, 2].set(0.0).at[:, 3].set(1.0)
    as_f32 = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    want_out, want_final = reference.gated_delta_rule_reference(**as_f32)
    state = inputs["initial_state"]
    step = functools.partial(decode_step.gated_delta_rule_step_triton, block_v=block_v, interpret=True)
    for t in range(workload.seq):
        token = {n: inputs[n][:, t] for n in ("query", "key", "value", "log_decay", "beta")}
        out, state = step(**token, state=state)
        assert out.dtype == dtype and state.dtype == jnp.float32
        assert_close(f"output[{t}]", out, want_out[:, t], dtype)
    assert_close("state", state, want_final, dtype)


def test_pallas_decode_step_through_the_api_and_its_errors():
    inputs = workloads.make_inputs(SMALL, seq=1, dtype=jnp.float32, seed=3)
    token = {n: inputs[n][:, 0] for n in ("query", "key", "value", "log_decay", "beta")}
    want = api.gated_delta_rule_step(**token, state=inputs["initial_state"], implementation="reference")
    got = api.gated_delta_rule_step(**token, state=inputs["initial_state"], implementation="triton")
    for name, g, w in zip(("output", "state"), got, want, strict=True):
        assert_close(name, g, w, jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        decode_step.gated_delta_rule_step_triton(**token, state=inputs["initial_state"], block_v=12)
    with pytest.raises(ValueError, match="state.shape"):
        decode_step.gated_delta_rule_step_triton(**token, state=inputs["initial_state"][:, :1])


def _decode_layer_inputs(batch, k_heads, v_heads, dim, dtype, seed, kernel=4):
    """Random raw projections of one decode token of a Gated DeltaNet layer (`gated_delta_rule_decode`)."""
    rng = np.random.default_rng(seed)
    conv_dim = 2 * k_heads * dim + v_heads * dim

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    return {
        "mixed": normal(batch, conv_dim).astype(dtype),
        "conv_state": normal(batch, kernel - 1, conv_dim).astype(dtype),
        "conv_weight": normal(kernel, conv_dim, scale=0.5).astype(dtype),
        "decay_input": normal(batch, v_heads),
        "beta_input": normal(batch, v_heads),
        "log_decay_rate": jnp.log(jnp.asarray(rng.uniform(1, 16, v_heads), jnp.float32)),
        "dt_bias": jnp.asarray(rng.uniform(-2, 1, v_heads), jnp.float32),
        "state": normal(batch, v_heads, dim, dim, scale=0.3),
    }


@pytest.mark.parametrize("dtype,group,block_v", [(jnp.float32, 1, 16), (jnp.bfloat16, 2, 32)])
def test_fused_decode_matches_the_layer_inputs_and_step(dtype, group, block_v):
    """The one-kernel decode (interpreter) from raw projections equals the layer's conv, norms and gates
    followed by the step reference, over three tokens (each token's conv window shifted in)."""
    k_heads, dim = 2, 32
    inputs = _decode_layer_inputs(2, k_heads, k_heads * group, dim, dtype, seed=group)
    kernel = functools.partial(
        decode_step.gated_delta_rule_decode_triton,
        k_heads=k_heads,
        key_dim=dim,
        block_v=block_v,
        interpret=True,
    )
    ref = functools.partial(reference.gated_delta_rule_decode_reference, k_heads=k_heads, key_dim=dim)
    got_state = want_state = inputs.pop("state")
    rng = np.random.default_rng(5)
    for t in range(3):
        out, got_state = kernel(**inputs, state=got_state)
        want, want_state = ref(**inputs, state=want_state)
        assert out.dtype == dtype and got_state.dtype == jnp.float32
        assert_close(f"output[{t}]", out, want, dtype)
        assert_close(f"state[{t}]", got_state, want_state, dtype)
        conv = inputs["conv_state"]
        inputs["conv_state"] = jnp.concatenate([conv[:, 1:], inputs["mixed"][:, None]], axis=1)
        inputs["mixed"] = jnp.asarray(rng.standard_normal(inputs["mixed"].shape), dtype)


@pytest.mark.parametrize("dtype,tokens", [(jnp.float32, 5), (jnp.bfloat16, 2)])
def test_fused_decode_of_several_tokens_keeps_each_state(dtype, tokens):
    """The several-token kernel (interpreter: a verify's tokens in one call, the state in registers between
    them) equals its reference and the one-token kernel called token after token, state after each token
    included; tokens past the conv kernel read earlier tokens of the call, not the history."""
    k_heads, dim = 2, 16
    one = _decode_layer_inputs(2, k_heads, 4, dim, dtype, seed=9)
    rng = np.random.default_rng(3)
    inputs = {
        **one,
        "mixed": jnp.asarray(rng.standard_normal((2, tokens, one["mixed"].shape[1])), dtype),
        "decay_input": jnp.asarray(rng.standard_normal((2, tokens, 4)), jnp.float32),
        "beta_input": jnp.asarray(rng.standard_normal((2, tokens, 4)), jnp.float32),
    }
    kw = {"k_heads": k_heads, "key_dim": dim}
    out, states = decode_step.gated_delta_rule_decode_tokens_triton(**inputs, **kw, interpret=True)
    want_out, want_states = reference.gated_delta_rule_decode_tokens_reference(**inputs, **kw)
    assert out.shape == want_out.shape and states.shape == (tokens, *one["state"].shape)
    assert_close("output", out, want_out, dtype)
    assert_close("states", states, want_states, dtype)
    conv, state = inputs["conv_state"], inputs["state"]
    for t in range(tokens):  # the one-token kernel, token after token
        o, state = decode_step.gated_delta_rule_decode_triton(
            inputs["mixed"][:, t],
            conv,
            inputs["conv_weight"],
            inputs["decay_input"][:, t],
            inputs["beta_input"][:, t],
            inputs["log_decay_rate"],
            inputs["dt_bias"],
            state,
            **kw,
            interpret=True,
        )
        conv = jnp.concatenate([conv[:, 1:], inputs["mixed"][:, t : t + 1]], axis=1)
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(out[:, t], np.float32))
        np.testing.assert_array_equal(np.asarray(state), np.asarray(states[t]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_of_a_tree_starts_each_node_from_its_parent(dtype):
    """The tree kernel (interpreter) equals its reference, and each node's state and output equal the
    several-token kernel run over that node's root path (a chain) with the same windows."""
    k_heads, dim, nodes = 2, 16, 6
    parents = jnp.asarray([-1, 0, 0, 1, 3, 2], jnp.int32)  # two branches at the root, a chain of three
    one = _decode_layer_inputs(1, k_heads, 4, dim, dtype, seed=13)
    rng = np.random.default_rng(8)
    conv_dim = one["mixed"].shape[1]
    mixed = jnp.asarray(rng.standard_normal((1, nodes, conv_dim)), dtype)
    decay = jnp.asarray(rng.standard_normal((1, nodes, 4)), jnp.float32)
    beta = jnp.asarray(rng.standard_normal((1, nodes, 4)), jnp.float32)
    paths = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [0, 2, 5]}
    history = one["conv_state"]
    windows = []
    for i in range(nodes):  # the conv window before node i: its ancestors' inputs after the history
        rows = jnp.concatenate([history, mixed[:, paths[i][:-1]]], axis=1)
        windows.append(rows[:, -3:])
    windows = jnp.stack(windows, axis=1)  # [1, nodes, 3, conv_dim]
    args = (
        mixed,
        windows,
        one["conv_weight"],
        decay,
        beta,
        one["log_decay_rate"],
        one["dt_bias"],
        one["state"],
    )
    kw = {"k_heads": k_heads, "key_dim": dim}
    out, states = decode_step.gated_delta_rule_decode_tree_triton(*args, parents, **kw, interpret=True)
    want_out, want_states = reference.gated_delta_rule_decode_tree_reference(*args, parents, **kw)
    assert_close("output", out, want_out, dtype)
    assert_close("states", states, want_states, dtype)
    for i, path in paths.items():
        chain_out, chain_states = decode_step.gated_delta_rule_decode_tokens_triton(
            mixed[:, path],
            history,
            one["conv_weight"],
            decay[:, path],
            beta[:, path],
            one["log_decay_rate"],
            one["dt_bias"],
            one["state"],
            **kw,
            interpret=True,
        )
        np.testing.assert_array_equal(
            np.asarray(out[:, i], np.float32), np.asarray(chain_out[:, -1], np.float32)
        )
        np.testing.assert_array_equal(np.asarray(states[i]), np.asarray(chain_states[-1]))


def test_fused_decode_api_and_errors():
    inputs = _decode_layer_inputs(1, 2, 4, 16, jnp.float32, seed=7)
    want = api.gated_delta_rule_decode(**inputs, k_heads=2, key_dim=16, implementation="reference")
    got = api.gated_delta_rule_decode(**inputs, k_heads=2, key_dim=16, implementation="triton")
    for name, g, w in zip(("output", "state"), got, want, strict=True):
        assert_close(name, g, w, jnp.float32)
    with pytest.raises(ValueError, match="conv_weight.shape"):
        api.gated_delta_rule_decode(
            **{**inputs, "conv_weight": inputs["conv_weight"][:, 1:]},
            k_heads=2,
            key_dim=16,
            implementation="triton",
        )
    with pytest.raises(ValueError, match="unknown implementation"):
        api.gated_delta_rule_decode(**inputs, k_heads=2, key_dim=16, implementation="mosaic")


def test_fused_decode_lowers_for_cuda():
    """The one-kernel decode through Pallas' Triton lowering for an H100 (an abstract device): Qwen3.5's
    shapes."""
    b, kh, vh, d = 1, 16, 32, 128
    bf16, f32 = jnp.bfloat16, jnp.float32
    conv_dim = 2 * kh * d + vh * d
    args = (
        jax.ShapeDtypeStruct((b, conv_dim), bf16),
        jax.ShapeDtypeStruct((b, 3, conv_dim), bf16),
        jax.ShapeDtypeStruct((4, conv_dim), bf16),
        jax.ShapeDtypeStruct((b, vh), bf16),
        jax.ShapeDtypeStruct((b, vh), bf16),
        jax.ShapeDtypeStruct((vh,), f32),
        jax.ShapeDtypeStruct((vh,), f32),
        jax.ShapeDtypeStruct((b, vh, d, d), f32),
    )
    assert "gdn_decode" in support.lowered_for_h100(
        decode_step.gated_delta_rule_decode_triton, *args, k_heads=kh, key_dim=d, interpret=False
    )
    tokens = 4  # an MTP verify of 3 drafts
    several = (
        jax.ShapeDtypeStruct((b, tokens, conv_dim), bf16),
        *args[1:3],
        jax.ShapeDtypeStruct((b, tokens, vh), bf16),
        jax.ShapeDtypeStruct((b, tokens, vh), bf16),
        *args[5:],
    )
    assert "gdn_decode_tokens" in support.lowered_for_h100(
        decode_step.gated_delta_rule_decode_tokens_triton, *several, k_heads=kh, key_dim=d, interpret=False
    )
    windows = jax.ShapeDtypeStruct((b, tokens, 3, conv_dim), bf16)
    parents = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    tree = (several[0], windows, *several[2:], parents)
    assert "gdn_decode_tree" in support.lowered_for_h100(
        decode_step.gated_delta_rule_decode_tree_triton, *tree, k_heads=kh, key_dim=d, interpret=False
    )


def test_pallas_decode_step_lowers_for_cuda():
    """The step through Pallas' Triton lowering for an H100 (an abstract device: no GPU here; compiling the
    Triton IR needs one): Qwen3.5's head shape, batch 4."""
    b, kh, vh, d = 4, 16, 32, 128
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = (
        jax.ShapeDtypeStruct((b, kh, d), bf16),
        jax.ShapeDtypeStruct((b, kh, d), bf16),
        jax.ShapeDtypeStruct((b, vh, d), bf16),
        jax.ShapeDtypeStruct((b, vh), f32),
        jax.ShapeDtypeStruct((b, vh), f32),
        jax.ShapeDtypeStruct((b, vh, d, d), f32),
    )
    assert "gdn_step" in support.lowered_for_h100(
        decode_step.gated_delta_rule_step_triton, *args, interpret=False
    )


@pytest.mark.parametrize(
    "seq,heads,cu_seqlens",
    [
        (
            300,
            5,
            (0, 70, 75, 200, 300),
        ),  # two starts in one chunk, a last partial chunk, heads not a power of 2
        (128, 3, (0, 0, 5, 128)),  # an empty sequence, a start at a chunk's first row
        (1000, 4, None),  # batch rows: padding only
        (520, 96, None),  # more than 32 heads: 64-token tiles
    ],
)
def test_heads_major_gates_match_xla(seq, heads, cu_seqlens):
    """`gates.heads_major_gates` (interpreter) writes what XLA's pad, sequence breaks and transposes
    (`gates.own_grid_gates`, then [batch, v_heads, t]) give, bit for bit; bad lengths raise."""
    rng = np.random.default_rng(seq)
    batch = 2 if cu_seqlens is None else 1
    g = jnp.asarray(-np.abs(rng.standard_normal((batch, seq, heads))), jnp.float32)
    beta = jnp.asarray(rng.random((batch, seq, heads)), jnp.bfloat16)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    padded = -(-seq // 64) * 64
    got = gates.heads_major_gates(g, beta, cu, padded=padded, interpret=True)
    want = (jnp.swapaxes(x, 1, 2) for x in gates.own_grid_gates(g, beta, cu))
    for name, a, e in zip(("log decay", "beta"), got, want, strict=True):
        support.assert_finite(np.asarray(a), name)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
    with pytest.raises(ValueError, match="multiple of 16"):
        gates.heads_major_gates(g, beta, cu, padded=padded + 8, interpret=True)
    with pytest.raises(ValueError, match=">= seq"):
        gates.heads_major_gates(g, beta, cu, padded=16 * (seq // 16 - 1), interpret=True)


@pytest.mark.parametrize("cu_seqlens", [None, (0, 100, 256)])
def test_prepare_fast_exp_lowers_for_cuda(cu_seqlens):
    """The compiled bf16 prepare takes its decays by `ex2.approx` (inline PTX, which the interpreter cannot
    run), batch rows (P formed there too) and packed sequences (T alone); f32 inputs do not."""
    t, kh, vh, d = 256, 2, 4, 64
    f32 = jnp.float32

    def lowered(dtype):
        args = (
            jax.ShapeDtypeStruct((1, t, kh, d), dtype),
            jax.ShapeDtypeStruct((1, t, kh, d), dtype),
            jax.ShapeDtypeStruct((1, t, vh, d), dtype),
            jax.ShapeDtypeStruct((1, t, vh), f32),
            jax.ShapeDtypeStruct((1, t, vh), f32),
        )
        cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
        return support.lowered_for_h100(
            lambda *a: chunk.gated_delta_rule_pallas(*a, backend="triton", cu_seqlens=cu, interpret=False),
            *args,
        )

    assert "ex2.approx" in lowered(jnp.bfloat16)
    assert "ex2.approx" not in lowered(f32)


def test_nan_output_fails_the_check():
    with pytest.raises(AssertionError, match="NaN/Inf"):
        assert_close("output", jnp.array([1.0, jnp.nan]), jnp.array([1.0, 1.0]), jnp.float32)


def test_default_implementation_and_errors():
    inputs = workloads.make_inputs(SMALL, seq=3, dtype=jnp.float32)
    if jax.default_backend() != "gpu":
        default = api.gated_delta_rule(**inputs)
        chunked = api.gated_delta_rule(**inputs, implementation="chunked")
        np.testing.assert_array_equal(default[0], chunked[0])
    with pytest.raises(ValueError, match="choose from"):
        api.gated_delta_rule(**inputs, implementation="pallas")
    with pytest.raises(ValueError, match="choose from"):
        api.gated_delta_rule(**inputs, implementation=("triton", "cuda"))
    with pytest.raises(ValueError, match="v_heads"):
        api.gated_delta_rule(**{**inputs, "value": inputs["value"][:, :, :3]})
    with pytest.raises(ValueError, match="log_decay.shape"):
        api.gated_delta_rule(**{**inputs, "log_decay": inputs["log_decay"][:, :2]})
    with pytest.raises(ValueError, match="initial_state.shape"):
        api.gated_delta_rule(**{**inputs, "initial_state": inputs["initial_state"][..., :8]})
    with pytest.raises(ValueError, match="state.shape"):
        token = {n: inputs[n][:, 0] for n in ("query", "key", "value", "log_decay", "beta")}
        api.gated_delta_rule_step(**token, state=inputs["initial_state"][:, :2])


def triton(inputs, **kwargs):
    """`chunk.gated_delta_rule_pallas` with the Triton state pass (interpreter off GPU)."""
    return chunk.gated_delta_rule_pallas(**inputs, backend="triton", **kwargs)


def test_pallas_packed_bf16_narrow_value_blocks():
    """The state pass writing the output of packed bf16 sequences, 16 value columns per program."""
    seqlens = (CHUNK + 3, 0, 2 * CHUNK)
    inputs = workloads.make_inputs(SMALL, dtype=jnp.bfloat16, seed=4, seqlens=seqlens)
    got = triton(inputs, chunk_size=CHUNK, config=config.Config(state_block_v=16))
    for name, g, w in zip(("output", "final_state"), got, expected(inputs), strict=True):
        assert_close(name, g, w, jnp.bfloat16)


# Pallas options besides the defaults: (case id, Config overrides, dtype, chunk_size, seq, seqlens, batch).
VARIANTS = [
    ("dense-prepare-c64-f32", {}, jnp.float32, 64, 150, None, 1),
    ("inverse-slabs-c32-w-u-bf16", {"wy_in_state": False}, jnp.bfloat16, 32, 150, None, 1),
    # one state-pass stage: an explicit config is not fitted, and 3 stages of f32 128-token tiles exceed the
    # shared memory of any GPU (this case then also compiles on one)
    ("inverse-slabs-c128-f32", {"state_stages": 1}, jnp.float32, 128, 300, None, 1),
    ("inverse-slabs-packed-in-place", {}, jnp.bfloat16, 64, None, (67, 0, 130), 1),
    ("dense-fused-packed", {"state_block_v": 16}, jnp.bfloat16, CHUNK, None, (CHUNK + 3, 0, 2 * CHUNK), 1),
    # W and U written by the prepare (the walk forms them from T by default on chunk-aligned inputs)
    ("w-u-from-prepare-f32", {"wy_in_state": False}, jnp.float32, 64, 150, None, 2),
    ("w-u-from-prepare-bf16-grouped", {"wy_in_state": False}, jnp.bfloat16, CHUNK, 2 * CHUNK + 5, None, 1),
    (
        "wy-in-state-bf16-grouped",
        {"wy_in_state": True, "state_block_v": 8},
        jnp.bfloat16,
        CHUNK,
        2 * CHUNK + 5,
        None,
        1,
    ),
    # packed: q, k and v copied chunk-aligned by the prepare (in place), the output written in place
    ("wy-in-state-packed", {"wy_in_state": True}, jnp.float32, CHUNK, None, (CHUNK + 3, 0, 2 * CHUNK, 7), 1),
    # chunks per prepare program (capped at num_chunks // 16): 50 chunks -> 3 per program, 17 programs, the
    # last clamped to the last chunk; packed, 37 chunks -> 2 per program
    ("prepare-chunks-3", {"prepare_chunks": 8}, jnp.float32, CHUNK, 50 * CHUNK - 3, None, 1),
    (
        "prepare-chunks-3-w-u-bf16",
        {"prepare_chunks": 3, "wy_in_state": False},
        jnp.bfloat16,
        CHUNK,
        50 * CHUNK - 3,
        None,
        1,
    ),
    (
        "prepare-chunks-2-packed",
        {"prepare_chunks": 8},
        jnp.float32,
        CHUNK,
        None,
        (20 * CHUNK + 3, 0, 15 * CHUNK, 7),
        1,
    ),
    # packed, 50 chunks -> 3 per program: offsets and lengths read once per program (a span of 4)
    (
        "prepare-prefetch-rows-packed",
        {"prepare_chunks": 8},
        jnp.float32,
        CHUNK,
        None,
        (30 * CHUNK + 3, 0, 18 * CHUNK, 7),
        1,
    ),
    ("prepare-one-chunk-per-program", {"prepare_chunks": 1}, jnp.float32, CHUNK, 50 * CHUNK - 3, None, 1),
]


@pytest.mark.parametrize(
    "overrides,dtype,chunk_size,seq,seqlens,batch", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS]
)
def test_pallas_config_variants(overrides, dtype, chunk_size, seq, seqlens, batch):
    """The kernel options besides the defaults (W and U from the prepare, chunks per program, block
    widths)."""
    shapes = dataclasses.replace(SMALL, batch=batch)
    inputs = workloads.make_inputs(shapes, seq=seq, dtype=dtype, seed=8, seqlens=seqlens)
    got = triton(inputs, chunk_size=chunk_size, config=config.Config(**overrides))
    for name, g, w in zip(("output", "final_state"), got, expected(inputs), strict=True):
        assert_close(name, g, w, dtype)


def test_pallas_dense_prepare_extreme_gates():
    """g = -20 / 0, beta 0 / 1 with 64-token chunks."""
    inputs = workloads.make_inputs(SMALL, seq=140, dtype=jnp.float32, seed=3)
    rng = np.random.default_rng(1)
    pick = rng.integers(0, 3, inputs["log_decay"].shape)
    inputs["log_decay"] = jnp.asarray(np.choose(pick, [-20.0, 0.0, -0.5]), jnp.float32)
    inputs["beta"] = jnp.asarray(np.choose(rng.integers(0, 3, pick.shape), [0.0, 1.0, 0.5]), jnp.float32)
    got = triton(inputs, chunk_size=64)
    for name, g, w in zip(("output", "final_state"), got, expected(inputs), strict=True):
        assert_close(name, g, w, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_as_padded_batch(dtype):
    """max_seqlen: packed sequences run as a padded batch (one walk each) == the reference, per sequence."""
    seqlens = (5, 2 * CHUNK + 3, 0, CHUNK, 1)
    inputs = workloads.make_inputs(SMALL, dtype=dtype, seed=11, seqlens=seqlens)
    got = api.gated_delta_rule(**inputs, chunk_size=CHUNK, max_seqlen=max(seqlens), implementation="triton")
    for name, g, w in zip(("output", "final_state"), got, expected(inputs), strict=True):
        assert_close(name, g, w, dtype)
    # The bound is static and may exceed the longest sequence.
    loose = api.gated_delta_rule(
        **inputs, chunk_size=CHUNK, max_seqlen=3 * CHUNK + 1, implementation="triton"
    )
    for name, g, w in zip(("output", "final_state"), loose, got, strict=True):
        assert_close(name, g, w, dtype)


def test_packed_max_seqlen_too_small():
    """A sequence longer than max_seqlen: ValueError for concrete cu_seqlens, NaN (never a silent answer)
    inside jit, where the lengths are not known at trace time."""
    inputs = workloads.make_inputs(SMALL, dtype=jnp.float32, seed=11, seqlens=(5, 2 * CHUNK + 3))
    with pytest.raises(ValueError, match="max_seqlen=16 but cu_seqlens has a sequence of 35 tokens"):
        api.gated_delta_rule(**inputs, chunk_size=CHUNK, max_seqlen=CHUNK, implementation="triton")
    run = jax.jit(
        lambda x: api.gated_delta_rule(**x, chunk_size=CHUNK, max_seqlen=CHUNK, implementation="triton")
    )
    out, final = run(inputs)
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(final)).all()


def correlated_inputs(dtype, key_cosine, seq=150):
    """Keys at about `key_cosine` to each other, beta 1, almost no decay: (I + A) far from I in every
    chunk."""
    shapes = dataclasses.replace(SMALL, key_dim=64, value_dim=16)
    return workloads.hard_gates(
        workloads.make_inputs(shapes, seq=seq, dtype=dtype, seed=4, key_cosine=key_cosine)
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("key_cosine", [0.9, 0.99])
def test_pallas_correlated_keys(implementation, key_cosine):
    """Repeated-squaring inverses of 16-row blocks cancel powers of ~6 000 here (relative error 0.76 at cosine
    0.9 even in f32); the 4-row blocks inside 16-row slabs stay exact. "chunked": the pure-JAX implementation
    (a triangular solve) on the same inputs."""
    inputs = correlated_inputs(jnp.float32, key_cosine)
    if implementation == "chunked":
        check(inputs, "chunked", jnp.float32, chunk_size=64)
        return
    got = triton(inputs, chunk_size=64)
    for name, g, w in zip(("output", "final_state"), got, expected(inputs), strict=True):
        assert_close(name, g, w, jnp.float32)


def test_slab_inverse():
    """bf16 inputs, keys at cosine 0.9 (the hard case, where bf16 factors exceed the usual bound): the inverse
    by 16-row slabs with bf16 operands stays finite and within twice the bf16 tolerance of the f32 reference;
    and it is the inverse (T (I + A) = I) of a random strictly lower A in f32."""
    inputs = correlated_inputs(jnp.bfloat16, 0.9)
    for name, g, w in zip(
        ("output", "final_state"), triton(inputs, chunk_size=64), expected(inputs), strict=True
    ):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        assert np.abs(g - w).max() / np.abs(w).max() <= 2 * TOLERANCE[jnp.bfloat16], name
    a = np.tril(np.random.default_rng(0).normal(size=(64, 64)), -1).astype(np.float32) * 0.3
    t = np.concatenate(prepare.slab_inverse(jnp.asarray(a), exact=True), axis=0)
    np.testing.assert_allclose(t @ (np.eye(64) + a), np.eye(64), atol=1e-4)


def test_state_stages_fit_the_device_shared_memory():
    # The default 3 pipeline stages of bf16 tiles (W, K, Q [64, 128] and P [64, 64] per stage: 168 KiB) fit an
    # H100 (227 KiB); an A100 (163 KiB) gets 2 stages, a 99 KiB Ada card 1, f32 tiles on an H100 2. No limit
    # (the interpreter) and explicit configs are left as they are.
    default = config.Config()
    sizes = {"chunk_size": 64, "key_dim": 128, "itemsize": 2}
    assert config.state_pass_shared_memory(default, **sizes) == 3 * 56 * 1024
    stages = {
        limit: config.fit_shared_memory(default, limit, **sizes).state_stages
        for limit in (232448, 166912, 101376, None)
    }
    assert stages == {232448: default.state_stages, 166912: 2, 101376: 1, None: default.state_stages}
    f32 = config.fit_shared_memory(default, 232448, chunk_size=64, key_dim=128, itemsize=4)
    assert f32.state_stages == 2
    # T in place of W, K counted twice (64 KiB a stage): 3 stages on an H100, 2 on an A100, 1 on Ada
    wy = dataclasses.replace(default, wy_in_state=True)
    assert config.state_pass_shared_memory(wy, **sizes) == 3 * 64 * 1024
    wy_stages = {
        limit: config.fit_shared_memory(wy, limit, **sizes).state_stages for limit in (232448, 166912, 101376)
    }
    assert wy_stages == {232448: 3, 166912: 2, 101376: 1}


def test_prepare_chunks_per_program_fill_the_last_wave():
    """Auto (None): 8..24 chunks per dense prepare program, fitted so that the programs run in whole waves
    (132 SMs x 6 programs = 792 at once); capped at num_chunks // 16; 8 for pipelined pieces; explicit values
    kept (capped)."""
    per_program = prepare.prepare_chunks_per_program
    assert per_program(None, 1024, 32, sm_count=132) == 14  # packed 8 x 8192: 2 368 programs, 2.99 waves
    assert per_program(None, 256, 32, sm_count=132) == 11  # 768 programs: one wave
    assert per_program(None, 64, 32, sm_count=132) == 4  # num_chunks // 16
    assert per_program(None, 1024, 32, fit=False) == 8
    assert per_program(3, 1024, 32) == 3 and per_program(64, 100, 32) == 6
    for num_chunks in (128, 300, 1024, 5000):
        for rows in (1, 8, 32, 64):
            cap = min(24, num_chunks // 16)
            steps = {
                c: -(-rows * -(-num_chunks // c) // 792) * c for c in range(8, cap + 1)
            }  # waves x chunks
            chosen = per_program(None, num_chunks, rows, sm_count=132)
            assert chosen == min(steps, key=lambda c: (steps[c], c))
    with pytest.raises(ValueError, match="prepare_chunks=0 must be >= 1"):
        per_program(0, 1024, 32)


def test_wy_in_state_auto_default():
    """The default (wy_in_state=None) forms W h and U in the state pass from T on chunk-aligned inputs, and
    takes W and U from the prepare for packed sequences read in place (bit for bit the explicit choices)."""
    default = config.Config()
    assert default.wy_in_state is None
    for seqlens, auto_is in ((None, True), ((CHUNK + 3, 0, 2 * CHUNK), False)):
        inputs = workloads.make_inputs(SMALL, seq=2 * CHUNK + 5, dtype=jnp.bfloat16, seed=3, seqlens=seqlens)
        run = functools.partial(triton, inputs, chunk_size=CHUNK)
        auto, explicit = run(), run(config=dataclasses.replace(default, wy_in_state=auto_is))
        other = run(config=dataclasses.replace(default, wy_in_state=not auto_is))
        for a, e, o in zip(auto, explicit, other, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))
            assert np.isfinite(np.asarray(o, np.float32)).all()
        assert not np.array_equal(np.asarray(auto[0], np.float32), np.asarray(other[0], np.float32))

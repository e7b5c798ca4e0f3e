"""The Hopper state pass (`state_pass_mosaic`, implementation "mosaic"): where it is chosen, what it refuses,
and that it lowers; its outputs against the f32 reference where an sm_90 GPU is present.

Pallas' GPU interpreter cannot run it (its wgmma takes no register operands), so on the CPU machine the
kernel is lowered for CUDA (Mosaic GPU's layout inference and shape checks run) but not executed; the
numerical checks run on an sm_90 GPU:
  JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/pallas_kernels/test_gated_delta_rule_mosaic.py
(tests/conftest.py otherwise pins JAX to the CPU)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import (
    api,
    chunk,
    gates,
    prepare,
    reference,
    state_pass_mosaic,
    walk_pipeline,
    workloads,
)
from pallas_kernels.gated_delta_rule import config as gdn_config

DIM128 = dataclasses.replace(workloads.TINY, name="dim128", seq=200, batch=2, key_dim=128, value_dim=128)
DEFAULT = gdn_config.Config()
REFUSAL_ARGS = {
    "interpret": False,
    "chunk_size": 64,
    "key_dim": 128,
    "value_dim": 128,
    "compute_dtype": jnp.bfloat16,
}


def mosaic(inputs, **kwargs):
    """`chunk.gated_delta_rule_pallas` with the Mosaic GPU state pass."""
    return chunk.gated_delta_rule_pallas(**inputs, backend="mosaic", **kwargs)


def test_supported_shapes():
    assert (
        state_pass_mosaic.supported(chunk_size=64, key_dim=128, value_dim=128, compute_dtype=jnp.bfloat16)
        is None
    )
    assert "chunk_size=32" in state_pass_mosaic.supported(
        chunk_size=32, key_dim=128, value_dim=128, compute_dtype=jnp.bfloat16
    )
    assert "value_dim=96" in state_pass_mosaic.supported(
        chunk_size=64, key_dim=128, value_dim=96, compute_dtype=jnp.bfloat16
    )
    assert "float32" in state_pass_mosaic.supported(
        chunk_size=64, key_dim=128, value_dim=128, compute_dtype=jnp.float32
    )
    assert state_pass_mosaic.shared_memory_bytes(128, 2) == 215_552


@pytest.mark.parametrize("key_dim,stages", [(128, 2), (128, 3), (192, 1), (192, 2), (256, 1)])
def test_supported_exactly_where_the_walk_fits_shared_memory(key_dim, stages, monkeypatch):
    """`supported` refuses the shapes whose buffers exceed an sm_90 block's shared memory (so that the GPU
    default takes the Triton walk rather than failing to compile), and only those: its verdict is Mosaic GPU's
    own, from lowering the kernel for CUDA with the check lifted."""
    verdict = state_pass_mosaic.supported(
        chunk_size=64, key_dim=key_dim, value_dim=128, compute_dtype=jnp.bfloat16, stages=stages
    )
    assert verdict is None or "shared memory" in verdict
    t, bf16, f32 = 128, jnp.bfloat16, jnp.float32
    s = jax.ShapeDtypeStruct
    args = (
        s((1, t, 1, key_dim), bf16),
        s((1, t, 1, key_dim), bf16),
        s((1, t, 2, 128), bf16),
        s((1, t, 2, 64), bf16),
        None,
        s((1, 2, t), f32),
        s((1, 2, key_dim, 128), f32),
        s((2,), jnp.int32),
    )
    monkeypatch.setattr(state_pass_mosaic, "SHARED_MEMORY_LIMIT", 10**7)
    try:
        state_pass_mosaic.state_pass.trace(*args, scale=0.1, max_concurrent_steps=stages).lower(
            lowering_platforms=("cuda",)
        )
        fits = True
    except ValueError as error:
        assert "exceeds available shared memory" in str(error)
        fits = False
    assert fits == (verdict is None)


def test_refusals_name_the_reason(monkeypatch):
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: True)
    wy = gdn_config.Config(wy_in_state=True)
    assert state_pass_mosaic.refusal(wy, **REFUSAL_ARGS) is None
    cases = {
        "interpreter": {"interpret": True},
        "float32": {"compute_dtype": jnp.float32},
        "shared memory": {"key_dim": 256},  # the GPU default then takes the Triton walk
    }
    for words, change in cases.items():
        assert words in state_pass_mosaic.refusal(wy, **{**REFUSAL_ARGS, **change})
    no_wy = gdn_config.Config(wy_in_state=False)
    assert "Config.wy_in_state=False" in state_pass_mosaic.refusal(no_wy, **REFUSAL_ARGS)
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: False)
    assert "sm_90" in state_pass_mosaic.refusal(wy, **REFUSAL_ARGS)


def test_explicit_mosaic_refused_in_the_interpreter_and_the_gpu_default_falls_back():
    inputs = workloads.make_inputs(DIM128, dtype=jnp.bfloat16, seed=2)
    with pytest.raises(NotImplementedError, match="does not take the Pallas interpreter"):
        api.gated_delta_rule(**inputs, implementation="mosaic", interpret=True)
    with pytest.raises(NotImplementedError, match="mosaic: .*interpreter.*; mosaic: .*interpreter"):
        api.gated_delta_rule(**inputs, implementation=("mosaic", "mosaic"), interpret=True)
    with pytest.raises(ValueError, match="choose from"):
        chunk.gated_delta_rule_pallas(**inputs, backend="cuda", interpret=True)
    # the GPU default ("mosaic", "triton") in the interpreter is the Triton state pass, bit for bit
    small = workloads.make_inputs(
        dataclasses.replace(DIM128, seq=70, batch=1, v_heads=2, k_heads=1), dtype=jnp.bfloat16, seed=3
    )
    auto = api.gated_delta_rule(**small, implementation=api.GPU_DEFAULT, interpret=True)
    explicit = api.gated_delta_rule(**small, implementation="triton", interpret=True)
    for a, e in zip(auto, explicit, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


def test_kernel_lowers_for_cuda():
    """The walk kernel through Mosaic GPU's lowering (layout inference, wgmma shapes, shared memory within
    227 KiB) for an sm_90 target: two batch rows, and three packed sequences writing their output in place."""
    t, kh, vh, k, v = 256, 2, 4, 128, 128
    bf16, f32 = jnp.bfloat16, jnp.float32

    def args(b, rows, seq=t):  # q, k, v, T diag(beta), P, gamma, initial state
        return (
            jax.ShapeDtypeStruct((b, seq, kh, k), bf16),
            jax.ShapeDtypeStruct((b, seq, kh, k), bf16),
            jax.ShapeDtypeStruct((b, seq, vh, v), bf16),
            jax.ShapeDtypeStruct((b, seq, vh, 64), bf16),
            jax.ShapeDtypeStruct((b, seq, vh, 64), bf16),
            jax.ShapeDtypeStruct((b, vh, seq), f32),
            jax.ShapeDtypeStruct((rows, vh, k, v), f32),
        )

    def lowered(*a, scale=k**-0.5, **kw):
        return (
            state_pass_mosaic.state_pass.trace(*a, scale=scale, **kw)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )

    assert "mosaic_gpu" in lowered(*args(2, 2))
    a = args(
        2, 2
    )  # the decay factors formed by the prepare, the state read and written in place: no XLA exp,
    # no transpose
    text = lowered(*a[:5], None, a[6], decays=(a[5], a[5]))
    assert "mosaic_gpu" in text and "stablehlo.exponential" not in text and "stablehlo.transpose" not in text
    with pytest.raises(ValueError, match="gamma or .batch rows, own grid. decays, one of the two"):
        lowered(*a[:5], None, a[6])
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    qkv, chunked, state = args(1, 3)[:3], args(1, 3)[3:6], args(1, 3)[6]
    packed = (jax.ShapeDtypeStruct((1, 250) + x.shape[2:], bf16) for x in qkv)  # 250 tokens, 4 chunks
    assert "mosaic_gpu" in lowered(*packed, *chunked, state, cu)  # own grid (250 % 8: q, k, v copied)
    assert "mosaic_gpu" in lowered(*args(1, 3), cu, cu, out_seq=250)  # regathered chunk-aligned
    with pytest.raises(ValueError, match="seq=200 not a multiple of 64"):
        lowered(*args(2, 2, seq=200))
    with pytest.raises(ValueError, match="one entry per initial state"):
        lowered(*args(1, 2), cu)
    with pytest.raises(ValueError, match="out_seq"):
        lowered(*args(1, 3), cu, cu)
    with pytest.raises(ValueError, match="need 192 tokens"):
        lowered(*args(1, 3, seq=192)[:3], *chunked, state, cu)
    # P formed by a fourth warpgroup of the kernel (p=None) from Q, K and gamma: batch rows with and without
    # the prepare's decay factors, and packed on the own grid; it needs gamma
    assert "mosaic_gpu" in lowered(*a[:4], None, a[5], a[6])
    assert "mosaic_gpu" in lowered(*a[:4], None, a[5], a[6], decays=(a[5], a[5]))
    own_grid = (*(jax.ShapeDtypeStruct((1, 256) + x.shape[2:], bf16) for x in qkv), chunked[0])
    assert "mosaic_gpu" in lowered(*own_grid, None, chunked[2], state, cu)
    # the own grid with the chunk grid's decay factors: each walk restarts them in its first and last chunk
    # from gamma, so no XLA scatter or exp; that needs P formed in the walk
    text = lowered(*own_grid, None, chunked[2], state, cu, decays=(chunked[2],) * 2)
    assert "mosaic_gpu" in text and "stablehlo.scatter" not in text and "stablehlo.exponential" not in text
    with pytest.raises(ValueError, match="decays on the own grid need p=None"):
        lowered(*own_grid, chunked[1], None, state, cu, decays=(chunked[2],) * 2)
    with pytest.raises(ValueError, match="p=None .* needs gamma"):
        lowered(*a[:4], None, None, a[6], decays=(a[5], a[5]))
    # P's decay as one exp2 takes log2(scale): a scale <= 0 multiplies after the exp instead
    for scale in (-0.5, 0.0):
        assert "mosaic_gpu" in lowered(*a[:4], None, a[5], a[6], scale=scale)


def _walk_on_own_grid(q, k, v, t_beta, p, gamma, initial_state, cu_seqlens, scale):
    """What `state_pass_mosaic.state_pass` computes for packed sequences on their own chunk grid, in f32 jnp:
    one walk per sequence over the chunks holding its tokens, other sequences' tokens masked off."""
    seq, k_heads = q.shape[1], q.shape[2]
    v_heads, c = v.shape[2], state_pass_mosaic.CHUNK
    t = gamma.shape[2]

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    def pad(x):  # [t, heads, dim]
        return jnp.pad(f32(x[0]), [(0, t - seq)] + [(0, 0)] * (x.ndim - 2))

    heads = jnp.arange(v_heads) // (v_heads // k_heads)
    q, k, v = pad(q)[:, heads], pad(k)[:, heads], pad(v)  # [t, v_heads, dim]
    tb, pp = f32(t_beta[0]), f32(p[0])
    exp_gamma, exp_to_last = (f32(x[0]).T for x in gates.decay_factors(gamma, cu_seqlens, seq))
    out, finals = jnp.zeros((seq, v_heads, v.shape[2]), jnp.float32), []
    for i in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        h = f32(initial_state[i])  # [v_heads, key_dim, value_dim]
        for n in range(start // c, -(-end // c) if end > start else start // c):
            rows = slice(n * c, n * c + c)
            first, last = max(start - n * c, 0), min(end - n * c, c)
            own = (jnp.arange(c) >= first) & (jnp.arange(c) < last)
            eg, ed = exp_gamma[rows], exp_to_last[rows]  # [c, v_heads]
            kh = jnp.einsum("thk,hkv->thv", k[rows], h) * eg[..., None]
            v_new = jnp.einsum("ths,shv->thv", tb[rows], v[rows] - kh)  # T diag(beta) (V - diag(e^g) K h)
            o = jnp.einsum("thk,hkv->thv", q[rows], h) * eg[..., None] * scale + jnp.einsum(
                "ths,shv->thv", pp[rows], v_new
            )
            out = out.at[n * c + first : n * c + last].set(o[first:last])
            weights = jnp.where(own[:, None], ed, 0.0)
            h = h * exp_gamma[n * c + last - 1][:, None, None] + jnp.einsum(
                "thk,thv->hkv", k[rows] * weights[..., None], v_new
            )
        finals.append(h)
    return out[None], jnp.stack(finals)


def test_break_sequences_in_xla_and_in_the_gates_kernel_alike():
    """The sequence breaks as XLA's scatter (`break_sequences`, beyond `gates.MAX_SEQS` sequences) and as the
    gates kernel's compares (interpreter) are the same: the penalty at each start inside a chunk only (not at
    a chunk's first row, an empty sequence's start once, none at the packed length)."""
    cu = jnp.asarray([0, 70, 70, 75, 78, 128, 192, 330], jnp.int32)
    g = -jnp.abs(jax.random.normal(jax.random.key(0), (1, 384, 3), jnp.float32))
    scattered = gates.break_sequences(g, cu, 330)
    compared, _ = gates.heads_major_gates(
        g[:, :330], jnp.ones_like(g[:, :330]), cu, padded=384, interpret=True
    )
    np.testing.assert_array_equal(
        np.asarray(compared)[..., :330], np.swapaxes(np.asarray(scattered), 1, 2)[..., :330]
    )
    broken = np.flatnonzero(np.asarray(scattered - g)[0, :, 0])
    np.testing.assert_array_equal(broken, [70, 75, 78])


@pytest.mark.parametrize("seqlens", [(70, 0, 5, 3, 64, 188), (64, 128), (1, 129)])
def test_own_grid_prepare_and_walk_math(seqlens):
    """The packed path of the Mosaic walk, its math on the CPU: the prepare on the packed array's own chunk
    grid (T, P block-diagonal over each chunk's sequences by `break_sequences`; interpreter) and the decay
    factors, walked as the kernel walks them (`_walk_on_own_grid`), against the f32 recurrence. Sequences that
    share chunks, one inside a chunk, an empty one, a sequence ending exactly at a chunk's end, a last partial
    chunk."""
    workload = dataclasses.replace(DIM128, seq=sum(seqlens), batch=1, key_dim=64, value_dim=64)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=7, seqlens=seqlens)
    cu = np.asarray(inputs["cu_seqlens"])
    as_f32 = {
        n: (x if x is None or n == "cu_seqlens" else jnp.asarray(x, jnp.float32)) for n, x in inputs.items()
    }
    want = reference.gated_delta_rule_reference(**as_f32)
    seq, c = workload.seq, state_pass_mosaic.CHUNK
    t = -(-seq // c) * c
    g, bt = (jnp.swapaxes(x, 1, 2) for x in gates.own_grid_gates(inputs["log_decay"], inputs["beta"], cu))
    scale = workload.key_dim**-0.5
    t_beta, _, gamma, p, _, _ = prepare.prepare(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        g,
        bt,
        scale=scale,
        chunk_size=c,
        group=workload.v_heads // workload.k_heads,
        compute_dtype=jnp.bfloat16,
        config=gdn_config.Config(wy_in_state=True),
        interpret=True,
        valid_rows=seq if seq < t else None,
    )
    got = _walk_on_own_grid(
        inputs["query"], inputs["key"], inputs["value"], t_beta, p, gamma, inputs["initial_state"], cu, scale
    )
    for name, g, w in zip(("output", "final_state"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        assert np.abs(g - w).max() / np.abs(w).max() <= 2e-2, name


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("p_in_walk", [None, False, True])
@pytest.mark.parametrize(
    "seq,batch,seqlens",
    [
        (200, 2, None),
        (64, 1, None),
        (1000, 1, None),
        (330, 1, (70, 0, 64, 196)),
        (336, 1, (70, 0, 5, 3, 64, 194)),
        (192, 1, (64, 128)),
    ],
)
def test_matches_reference_on_hopper(seq, batch, seqlens, p_in_walk):
    workload = dataclasses.replace(DIM128, seq=seq, batch=batch)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=5, seqlens=seqlens)
    assert_matches_reference(inputs, config=gdn_config.Config(p_in_walk=p_in_walk))


def assert_matches_reference(inputs, scale=None, **kwargs):
    """The Pallas call (kwargs: its options) against the f32 recurrence on the same bf16 inputs: finite, and
    within 2e-2 of the largest reference value (output and final state)."""
    as_f32 = {
        n: (x if x is None or n == "cu_seqlens" else jnp.asarray(x, jnp.float32)) for n, x in inputs.items()
    }
    want = reference.gated_delta_rule_reference(**as_f32, scale=scale)
    got = mosaic(inputs, scale=scale, **kwargs)
    for name, g, w in zip(("output", "final_state"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        assert np.abs(g - w).max() / np.abs(w).max() <= 2e-2, name


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("scale", [-0.3, 0.25])
def test_query_scale_on_hopper(scale):
    """P formed in the walk takes the scale as log2(scale) in its exp2 (scale > 0) or multiplies it after the
    exp (scale <= 0): both against the reference, packed sequences on the own grid."""
    workload = dataclasses.replace(DIM128, seq=336, batch=1)  # a multiple of 8: the own grid, P in the walk
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=6, seqlens=(70, 0, 5, 3, 64, 194))
    assert_matches_reference(inputs, scale)


def prepare_inputs(chunks, seed):
    """(q, k, v), g and beta [b, v_heads, t] f32, and the other `prepare.prepare` arguments (interpreter, T
    diag(beta)) for two rows of `chunks` 64-token chunks."""
    workload = dataclasses.replace(DIM128, seq=chunks * 64, batch=2, key_dim=64, value_dim=64)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=seed)
    g, bt = (jnp.swapaxes(jnp.asarray(inputs[n], jnp.float32), 1, 2) for n in ("log_decay", "beta"))
    common = {
        "scale": 0.125,
        "chunk_size": 64,
        "group": 2,
        "compute_dtype": jnp.bfloat16,
        "interpret": True,
        "config": gdn_config.Config(wy_in_state=True),
    }
    return (inputs["query"], inputs["key"], inputs["value"]), g, bt, common


def test_prepare_of_a_piece_is_that_piece_of_the_whole_prepare():
    """The pipelined walk's prepare of one piece (chunk_offset, num_chunks; interpreter) writes what the
    prepare of the whole sequence writes for those chunks, reading q, k, v, g, beta in place."""
    qkv, g, bt, common = prepare_inputs(chunks=5, seed=8)
    whole = prepare.prepare(*qkv, g, bt, **common)
    piece = prepare.prepare(*qkv, g, bt, chunk_offset=2, num_chunks=2, **common)
    rows = slice(2 * 64, 4 * 64)
    for name, got, want in (
        ("T diag(beta)", piece[0], whole[0][:, rows]),
        ("gamma", piece[2], whole[2][..., rows]),
        ("P", piece[3], whole[3][:, rows]),
    ):
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
    with pytest.raises(ValueError, match="chunk_offset=4, num_chunks=2"):
        prepare.prepare(*qkv, g, bt, chunk_offset=4, num_chunks=2, **common)


def test_prepare_warps_by_what_it_writes(monkeypatch):
    """`Config.prepare_warps` None: the prepare of T diag(beta) alone (packed sequences on their own grid,
    the Mosaic GPU walk forming P) runs 1 warp per program, the prepare that forms P (batch rows) 2; an
    explicit value holds for both. Lowered for an H100 (abstract device)."""
    monkeypatch.setattr(gpu_limits, "is_hopper", lambda device=None: True)
    t, bf16, f32 = 1024, jnp.bfloat16, jnp.float32
    args = (jax.ShapeDtypeStruct((1, t, 2, 128), bf16),) * 2 + (
        jax.ShapeDtypeStruct((1, t, 4, 128), bf16),
        jax.ShapeDtypeStruct((1, t, 4), f32),
        jax.ShapeDtypeStruct((1, t, 4), f32),
    )

    def prepare_warps(cu, config=None):
        text = support.lowered_for_h100(
            lambda *a: mosaic(
                dict(zip(("query", "key", "value", "log_decay", "beta"), a, strict=True)),
                cu_seqlens=cu,
                interpret=False,
                config=config,
            ),
            *args,
        )
        return {int(w) for w in re.findall(r'name = "gdn_prepare[^"]*"[^}]*?num_warps = (\d+)', text)}

    packed = jnp.asarray([0, 300, t], jnp.int32)
    assert prepare_warps(packed) == {1}
    assert prepare_warps(None) == {2}
    assert prepare_warps(packed, gdn_config.Config(prepare_warps=2)) == {2}


def test_pipelined_walk_lowers_for_cuda():
    """The pipelined walk (`Config.walk_pipeline`) lowers for an H100: one prepare and one walk launch per
    piece, the walks writing one output buffer in place (aliased, no copies), each prepare after the last."""
    t, kh, vh, k, v = 640, 2, 4, 128, 128
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = (
        jax.ShapeDtypeStruct((1, t, kh, k), bf16),
        jax.ShapeDtypeStruct((1, t, kh, k), bf16),
        jax.ShapeDtypeStruct((1, t, vh, v), bf16),
        jax.ShapeDtypeStruct((1, vh, t), f32),
        jax.ShapeDtypeStruct((1, vh, t), f32),
        jax.ShapeDtypeStruct((1, vh, k, v), f32),
    )
    for p_in_walk in (False, True):  # True: the walks form P, the prepares write gamma in its place
        text = support.lowered_for_h100(
            walk_pipeline.pipelined_walk,
            *args,
            pieces=4,
            scale=k**-0.5,
            chunk_size=64,
            config=gdn_config.Config(wy_in_state=True, walk_pipeline=4, p_in_walk=p_in_walk),
            group=2,
            compute_dtype=bf16,
            interpret=False,
        )
        assert text.count("custom_call @mosaic_gpu") == 4 and text.count("xla.gpu.triton") == 4
        assert text.count("output_operand_aliases") == 4 and text.count("optimization_barrier") == 3
        # the prepares write the walks' decay factors; the walks read and write the state as it is (no
        # transpose)
        assert "stablehlo.exponential" not in text and "stablehlo.transpose" not in text


def test_prepare_writes_the_walks_decay_factors():
    """With decay_factors the prepare (interpreter) writes e^gamma and e^(gamma_last - gamma), what
    `gates.decay_factors` forms from the gamma it otherwise writes, and the same T diag(beta) and P."""
    qkv, g, bt, common = prepare_inputs(chunks=3, seed=9)
    plain = prepare.prepare(*qkv, g, bt, **common)
    factors = prepare.prepare(*qkv, g, bt, decay_factors=True, **common)
    want = gates.decay_factors(plain[2])
    for name, got, w in (("e^gamma", factors[2], want[0]), ("e^(gamma_last - gamma)", factors[1], want[1])):
        assert got.shape == w.shape and np.isfinite(np.asarray(got)).all(), name
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=0, err_msg=name)
    for name, i in (("T diag(beta)", 0), ("P", 3)):
        np.testing.assert_array_equal(
            np.asarray(factors[i], np.float32), np.asarray(plain[i], np.float32), name
        )
    with pytest.raises(ValueError, match="decay_factors needs"):
        prepare.prepare(*qkv, g, bt, decay_factors=True, **{**common, "config": DEFAULT})


def test_prepare_for_a_walk_that_forms_p():
    """With `p_in_walk` (Mosaic walk) the prepare (interpreter) writes no P: with decay_factors gamma itself
    in its place (the walk's P mask), without them nothing; T diag(beta) and the decays are unchanged."""
    qkv, g, bt, common = prepare_inputs(chunks=3, seed=10)
    plain = prepare.prepare(*qkv, g, bt, **common)
    factors = prepare.prepare(*qkv, g, bt, decay_factors=True, p_in_walk=True, **common)
    np.testing.assert_array_equal(np.asarray(factors[3]), np.asarray(plain[2]), "gamma in place of P")
    np.testing.assert_array_equal(np.asarray(factors[0], np.float32), np.asarray(plain[0], np.float32))
    no_factors = prepare.prepare(*qkv, g, bt, p_in_walk=True, **common)
    assert no_factors[3].shape == (1,)  # no P
    np.testing.assert_array_equal(np.asarray(no_factors[2]), np.asarray(plain[2]), "gamma")


@pytest.mark.skipif(not gpu_limits.is_hopper(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("pieces,p_in_walk", [(2, False), (3, False), (16, False), (3, True)])
def test_pipelined_walk_matches_one_walk_on_hopper(pieces, p_in_walk):
    """The chunks cut into pieces (uneven: 16 chunks in 3), each prepared and walked by its own launches: the
    same as one walk over all chunks, and near the f32 reference."""
    workload = dataclasses.replace(DIM128, seq=1000, batch=2)
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=6)
    as_f32 = {n: (x if x is None else jnp.asarray(x, jnp.float32)) for n, x in inputs.items()}
    want = reference.gated_delta_rule_reference(**as_f32)
    one = mosaic(inputs, config=gdn_config.Config(walk_pipeline=1))
    got = mosaic(inputs, config=gdn_config.Config(walk_pipeline=pieces, p_in_walk=p_in_walk))
    for name, g, o, w in zip(("output", "final_state"), got, one, want, strict=True):
        g, o, w = (np.asarray(x, np.float32) for x in (g, o, w))
        assert np.isfinite(g).all(), name
        assert np.abs(g - o).max() / np.abs(o).max() <= 1e-3, name
        assert np.abs(g - w).max() / np.abs(w).max() <= 2e-2, name


def test_walk_pipeline_pieces_follow_the_concurrent_regions_flag(monkeypatch):
    """Auto: 4 pieces only where XLA may run the pieces' launches concurrently and each piece gets >= 64
    chunks; an explicit count is kept (at most one piece per chunk); enabling the flag after the backend has
    started is refused with a message naming it."""
    auto = gdn_config.Config(walk_pipeline=None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert not gpu_limits.concurrent_regions_enabled()
    assert walk_pipeline.num_pieces(auto, 256) == 1
    jax.devices()  # the backend has started
    with pytest.raises(RuntimeError, match="xla_gpu_graph_enable_concurrent_region"):
        gpu_limits.enable_concurrent_regions()
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {gpu_limits.CONCURRENT_REGIONS_FLAG}")
    gpu_limits.enable_concurrent_regions()  # already set: nothing to do
    for flags, on in (
        ("--xla_gpu_graph_enable_concurrent_region", True),
        ("--xla_gpu_graph_enable_concurrent_region=1", True),
        (
            "--xla_gpu_graph_enable_concurrent_region=true --xla_gpu_graph_enable_concurrent_region=false",
            False,
        ),
        ("--xla_gpu_graph_enable_concurrent_region_x=true", False),
    ):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert gpu_limits.concurrent_regions_enabled() is on, flags
    monkeypatch.setenv("XLA_FLAGS", gpu_limits.CONCURRENT_REGIONS_FLAG)
    assert [walk_pipeline.num_pieces(auto, n) for n in (255, 256, 4096)] == [1, 4, 4]
    explicit = gdn_config.Config(walk_pipeline=8)
    assert [walk_pipeline.num_pieces(explicit, n) for n in (3, 64)] == [3, 8]
    with pytest.raises(ValueError, match="walk_pipeline=0"):
        walk_pipeline.num_pieces(gdn_config.Config(walk_pipeline=0), 64)

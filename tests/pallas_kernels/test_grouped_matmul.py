"""gmm / gmm_swiglu: every implementation against a per-group numpy loop (float64).

The Pallas kernel runs in the Pallas interpreter on CPU (interpret=None picks it when no GPU is present).
"""

import dataclasses
import itertools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support

from pallas_kernels import tuning
from pallas_kernels.grouped_matmul import (
    api,
    gmm,
    gmm_swiglu,
    pallas_gemv,
    pallas_triton,
    reference,
    workloads,
)
from pallas_kernels.quantized import QuantizedWeights, quantize_int8

# (atol, rtol) against the float64 oracle, by lhs dtype. bf16: inputs are rounded to bf16 before the
# oracle runs, so only the bf16 output rounding (2**-8 relative) and f32 accumulation remain.
TOLERANCE = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 1e-2)}
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
CI = [name for name, w in workloads.WORKLOADS.items() if "ci_tests" in w.tags]
IMPLEMENTATIONS = ["reference", "triton"]


def numpy_gmm(lhs, rhs, group_sizes, swiglu=False):
    """The plainest statement of the contract: a loop over groups, float64, zero rows past the last group."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    n = rhs.shape[2] // 2 if swiglu else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + int(size))
        h = lhs[rows] @ rhs[g]
        if swiglu:
            gate, up = h[:, :n], h[:, n:]
            h = gate / (1.0 + np.exp(-gate)) * up
        out[rows] = h
        start += int(size)
    return out


def assert_close(actual, expected, dtype, name=""):
    """Finite everywhere, then allclose with the dtype's tolerance (comparison in float64)."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    assert np.isfinite(actual).all(), f"{name}: output has NaN/Inf"
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol, err_msg=name)


def as_float(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _cases(names_f32, names_bf16):
    return [pytest.param(n, jnp.float32, id=f"{n}-f32") for n in names_f32] + [
        pytest.param(n, jnp.bfloat16, id=f"{n}-bf16") for n in names_bf16
    ]


# Every layout once per implementation; the other dtype on the skewed router layout. (Each case compiles a
# kernel, and the CPU CI has 2 cores: keep the matrix small.)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,dtype", _cases(CI, ["tiny_router", "tiny_partial"]))
def test_gmm_matches_numpy(name, dtype, implementation):
    w = workloads.WORKLOADS[name]
    lhs, rhs, gs = workloads.make_inputs(w, dtype=dtype, seed=3)
    out = gmm(lhs, rhs, gs, implementation=implementation)
    assert out.shape == (w.m, w.n) and out.dtype == dtype
    assert_close(out, numpy_gmm(as_float(lhs), as_float(rhs), gs), dtype, name)
    routed = int(np.asarray(gs).sum())
    assert not np.asarray(out[routed:], np.float32).any(), "rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,dtype", _cases(["tiny_partial"], ["tiny_router", "tiny_empty"]))
def test_gmm_swiglu_matches_numpy(name, dtype, implementation):
    w = workloads.WORKLOADS[name]
    lhs, w_gate_up, gs = workloads.make_inputs(w, dtype=dtype, swiglu=True, seed=5)
    out = gmm_swiglu(lhs, w_gate_up, gs, implementation=implementation)
    assert out.shape == (w.m, w.n) and out.dtype == dtype
    assert_close(out, numpy_gmm(as_float(lhs), as_float(w_gate_up), gs, swiglu=True), dtype, name)


@pytest.mark.parametrize("block_m", [16])
def test_pallas_block_shapes_and_out_dtype(block_m):
    # A tile that straddles many groups, m not a multiple of block_m, k not a multiple of block_k, f32 out.
    w = workloads.Workload(name="odd", m=45, k=48, n=40, groups=6)
    lhs, rhs, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=7)
    bs = pallas_triton.Config(block_m=block_m, block_n=16, block_k=32, num_warps=4, num_stages=2)
    out = pallas_triton.gmm_triton(lhs, rhs, gs, preferred_element_type=jnp.float32, config=bs)
    assert out.dtype == jnp.float32
    assert_close(out, numpy_gmm(as_float(lhs), as_float(rhs), gs), jnp.float32, "f32 out of bf16 in")


def test_schedule_covers_every_row_once():
    block_m = 8
    for sizes in ([0, 5, 0, 17, 3, 0], [30, 0, 0, 0, 0, 0], [0] * 6, [1] * 6, [9, 8, 7, 9, 0, 0]):
        m = 33
        group, lo, hi = map(
            np.asarray, pallas_triton.make_schedule(jnp.asarray(sizes, jnp.int32), m, block_m)
        )
        owner = np.full(m, -1)
        for g, a, b in zip(group, lo, hi, strict=True):
            if g > len(sizes):
                continue
            assert 0 <= a < b <= min(a + block_m, m)
            assert (owner[a:b] == -1).all(), "a row owned twice"
            owner[a:b] = g
        expected = np.repeat(np.arange(len(sizes) + 1), list(sizes) + [m - sum(sizes)])
        np.testing.assert_array_equal(owner, expected)


def test_jit_with_traced_group_sizes_and_no_host_sync():
    w = workloads.WORKLOADS["tiny_router"]
    lhs, rhs, gs = workloads.make_inputs(w, dtype=jnp.float32)
    f = jax.jit(lambda a, b, g: gmm(a, b, g, implementation="triton"))
    with jax.transfer_guard("disallow"):
        out = f(lhs, rhs, gs)
    assert_close(out, numpy_gmm(as_float(lhs), as_float(rhs), gs), jnp.float32)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU default")
def test_default_implementation_off_gpu_is_reference():
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"], dtype=jnp.float32)
    assert api.default_implementation(lhs, rhs) == "reference"
    assert api.default_implementation(lhs, quantize_int8(rhs), row_groups=gs) == "reference"
    want = np.asarray(reference.gmm_reference(lhs, rhs, gs))
    np.testing.assert_array_equal(np.asarray(gmm(lhs, rhs, gs)), want)
    np.testing.assert_array_equal(np.asarray(gmm(lhs, rhs, gs, implementation=None)), want)


def test_default_implementation_on_gpu(monkeypatch):
    # On a GPU: the matrix-vector kernel for a decode step's rows of quantized k-major experts, else the
    # tensor-core kernel (shapes only: the choice is made at trace time).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    lhs, rhs = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16)
    q = quantize_int8(jnp.zeros((4, 64, 32)))
    rows = jnp.zeros((8,), jnp.int32)
    assert api.default_implementation(lhs, q, row_groups=rows) == "gemv"
    assert (
        api.default_implementation(lhs, q, row_groups=rows, lhs_index=jnp.zeros((9,), jnp.int32)) == "triton"
    )
    assert api.default_implementation(lhs, rhs, row_groups=rows) == "triton"
    assert api.default_implementation(lhs, q) == "triton"


def test_sequence_of_implementations_falls_back_on_refusal():
    # "gemv" takes rows with their groups named only: with group_sizes it refuses, and a sequence moves on.
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"], dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="row_groups"):
        gmm(lhs, rhs, gs, implementation="gemv")
    with pytest.raises(NotImplementedError, match="every implementation refused"):
        gmm(lhs, rhs, gs, implementation=("gemv",) * 2)
    got = gmm(lhs, rhs, gs, implementation=("gemv", "reference"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.gmm_reference(lhs, rhs, gs)))


def test_unknown_implementation_lists_choices():
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"], dtype=jnp.float32)
    with pytest.raises(ValueError, match="'gemv'.*'reference'.*'triton'"):
        gmm(lhs, rhs, gs, implementation="cutlass")
    with pytest.raises(ValueError, match="choose from"):
        gmm_swiglu(lhs, rhs, gs, implementation="xla")


def test_shape_errors():
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"], dtype=jnp.float32)
    with pytest.raises(ValueError, match="disagree on k"):
        gmm(lhs[:, :32], rhs, gs)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, gs[:3])
    with pytest.raises(ValueError, match="2 \\* ffn"):
        gmm_swiglu(lhs, rhs[:, :, :63], gs)


def test_operand_past_int32_offsets_is_an_error():
    """An rhs of 2**31 elements or more would be read at wrapped int32 offsets: a clear error at trace time
    (shapes only, nothing allocated)."""
    lhs = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((1025, 2048, 1024), jnp.bfloat16)  # 2.15e9 elements
    gs = jax.ShapeDtypeStruct((1025,), jnp.int32)
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.eval_shape(lambda a, b, c: gmm(a, b, c, implementation="triton"), lhs, rhs, gs)
    ok = jax.ShapeDtypeStruct((1023, 2048, 1024), jnp.bfloat16)  # below the limit
    out = jax.eval_shape(lambda a, b, c: gmm(a, b, c[:1023], implementation="triton"), lhs, ok, gs)
    assert out.shape == (64, 1024)


def test_assert_close_rejects_nan():
    expected = np.zeros((2, 2))
    with pytest.raises(AssertionError, match="NaN/Inf"):
        assert_close(jnp.array([[0.0, jnp.nan], [0.0, 0.0]]), expected, jnp.float32)
    with pytest.raises(AssertionError, match="NaN/Inf"):
        assert_close(jnp.array([[0.0, jnp.inf], [0.0, 0.0]]), expected, jnp.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_quantized_matches_dequantize_then_matmul(bits, implementation):
    w = workloads.WORKLOADS["tiny_partial"]
    for swiglu in (False, True):
        lhs, q, gs = workloads.make_inputs(
            w, dtype=jnp.bfloat16, weights=f"int{bits}", swiglu=swiglu, seed=11
        )
        assert isinstance(q, QuantizedWeights) and q.bits == bits
        out = (gmm_swiglu if swiglu else gmm)(lhs, q, gs, implementation=implementation)
        expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs, swiglu=swiglu)
        assert_close(out, expected, jnp.bfloat16, f"bits={bits} swiglu={swiglu}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "block_size,scale_dtype", [(32, jnp.float16), (16, jnp.float32)], ids=["f16_32", "f32_16"]
)
def test_int8_with_offsets(block_size, scale_dtype, implementation):
    """GGUF Q5_1 / Q5_K experts kept quantized: int8 codes with a scale and an offset per block (and the exact
    superset of 4-bit and 8-bit layers, `reencode`)."""
    w = workloads.WORKLOADS["tiny_partial"]
    for swiglu in (False, True):
        lhs, dense, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, swiglu=swiglu, seed=13)
        q = quantize_int8(
            dense.astype(jnp.float32), block_size=block_size, scale_dtype=scale_dtype, offsets=True
        )
        assert q.offsets is not None and float(jnp.abs(q.offsets).max()) > 0
        out = (gmm_swiglu if swiglu else gmm)(lhs, q, gs, implementation=implementation)
        expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs, swiglu=swiglu)
        assert_close(out, expected, jnp.bfloat16, f"swiglu={swiglu}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_int8_with_16_element_blocks_and_float32_scales(implementation):
    """GGUF Q6_K experts kept quantized (`gguf_quants.to_quantized_weights`): int8 codes in [-32, 31], one
    float32 scale per 16 elements along k."""
    w = workloads.WORKLOADS["tiny_partial"]
    for swiglu in (False, True):
        lhs, dense, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, swiglu=swiglu, seed=12)
        q = quantize_int8(dense.astype(jnp.float32), block_size=16, scale_dtype=jnp.float32)
        q = dataclasses.replace(q, values=jnp.clip(q.values, -32, 31))  # Q6_K's code range
        assert q.block_size == 16 and q.scales.dtype == jnp.float32
        out = (gmm_swiglu if swiglu else gmm)(lhs, q, gs, implementation=implementation)
        expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs, swiglu=swiglu)
        assert_close(out, expected, jnp.bfloat16, f"swiglu={swiglu}")


# The MoE dispatch's gather fused into the kernel: row i of the product reads lhs[lhs_index[i]] (lhs has other
# rows than the product: tokens vs tokens x top_k); out-of-range indices are clamped like jnp's gather.
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
def test_lhs_index_gathers_rows(weights, implementation):
    w = workloads.WORKLOADS["tiny_partial"]
    _, rhs, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=weights, swiglu=True, seed=3)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.standard_normal((w.m // 3 + 1, w.k), np.float32), jnp.bfloat16)
    index = rng.integers(0, tokens.shape[0], w.m).astype(np.int32)
    index[-1] = tokens.shape[0] + 5  # past the end: clamped
    dense = as_float(rhs) if weights == "float" else np.asarray(rhs.dequantize(jnp.float32))
    gathered = as_float(tokens)[np.minimum(index, tokens.shape[0] - 1)]
    out = gmm_swiglu(tokens, rhs, gs, lhs_index=jnp.asarray(index), implementation=implementation)
    assert out.shape == (w.m, w.n)
    assert_close(out, numpy_gmm(gathered, dense, gs, swiglu=True), jnp.bfloat16, "gmm_swiglu")
    out = gmm(tokens, rhs, gs, lhs_index=jnp.asarray(index), implementation=implementation)
    assert_close(out, numpy_gmm(gathered, dense, gs), jnp.bfloat16, "gmm")


def numpy_row_groups(lhs, rhs, row_groups, swiglu=False):
    """Each row times its own group's matrix (float64), rows in any order; a group outside the range:
    zeros."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    n = rhs.shape[2] // 2 if swiglu else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    for i, g in enumerate(np.asarray(row_groups)):
        if 0 <= g < rhs.shape[0]:
            h = lhs[i] @ rhs[g]
            out[i] = h[:n] / (1.0 + np.exp(-h[:n])) * h[n:] if swiglu else h
    return out


# Decode: a step's (token, expert) pairs come unsorted; `row_groups` names each row's group instead of sorted
# group sizes (repeated groups, groups out of range -> zero rows, the token gather fused).
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "weights,dtype",
    [("float", jnp.float32), ("float", jnp.bfloat16), ("int8", jnp.bfloat16), ("int4", jnp.bfloat16)],
    ids=["f32", "bf16", "int8", "int4"],
)
def test_row_groups_any_order(weights, dtype, implementation):
    w = workloads.WORKLOADS["tiny_partial"]
    _, rhs, _ = workloads.make_inputs(w, dtype=dtype, weights=weights, swiglu=True, seed=8)
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.standard_normal((3, w.k), np.float32), dtype)
    groups = rng.integers(0, w.groups, 24).astype(np.int32)  # 3 tokens x top-8, unsorted
    groups[[2, 5]] = groups[0]  # one group twice more
    groups[7], groups[11] = -1, w.groups  # no group: zero rows
    index = np.repeat(np.arange(3, dtype=np.int32), 8)
    dense = as_float(rhs) if weights == "float" else np.asarray(rhs.dequantize(jnp.float32))
    x = as_float(tokens)[index]
    h = gmm_swiglu(
        tokens,
        rhs,
        row_groups=jnp.asarray(groups),
        lhs_index=jnp.asarray(index),
        implementation=implementation,
    )
    assert h.shape == (24, w.n) and h.dtype == dtype
    assert_close(h, numpy_row_groups(x, dense, groups, swiglu=True), dtype, "gmm_swiglu")
    assert not np.asarray(h[7:8], np.float32).any() and not np.asarray(h[11:12], np.float32).any()
    y = gmm(
        tokens,
        rhs,
        row_groups=jnp.asarray(groups),
        lhs_index=jnp.asarray(index),
        implementation=implementation,
    )
    assert y.shape == (24, 2 * w.n)
    assert_close(y, numpy_row_groups(x, dense, groups), dtype, "gmm")
    y = gmm(jnp.asarray(x, dtype), rhs, row_groups=jnp.asarray(groups), implementation=implementation)
    assert_close(y, numpy_row_groups(x, dense, groups), dtype, "gmm, rows given")


def test_row_groups_errors():
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"], dtype=jnp.float32)
    with pytest.raises(ValueError, match="exactly one"):
        gmm(lhs, rhs)
    with pytest.raises(ValueError, match="exactly one"):
        gmm(lhs, rhs, gs, row_groups=jnp.zeros((lhs.shape[0],), jnp.int32))
    with pytest.raises(ValueError, match="row_groups"):
        gmm(lhs, rhs, row_groups=jnp.zeros((lhs.shape[0] + 1,), jnp.int32))
    with pytest.raises(ValueError, match="row_groups"):
        gmm(lhs, rhs, row_groups=jnp.zeros((lhs.shape[0],), jnp.float32))


def test_lhs_index_with_swapped_operands():
    # The 4-bit prefill default multiplies out^T = W^T x^T (`swap_operands`); gathered rows go through it too.
    w = workloads.WORKLOADS["tiny_partial"]
    _, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights="int4", seed=6)
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.standard_normal((20, w.k), np.float32), jnp.bfloat16)
    index = jnp.asarray(rng.integers(0, 20, w.m), jnp.int32)
    bs = pallas_triton.Config(block_m=16, block_n=32, block_k=64, swap_operands=True)
    out = pallas_triton.gmm_triton(tokens, q, gs, lhs_index=index, config=bs)
    expected = numpy_gmm(as_float(tokens)[np.asarray(index)], np.asarray(q.dequantize(jnp.float32)), gs)
    assert_close(out, expected, jnp.bfloat16, "tile_swapped + lhs_index")


def test_lhs_index_must_be_integer_vector():
    lhs, rhs, gs = workloads.make_inputs(workloads.WORKLOADS["tiny_router"])
    with pytest.raises(ValueError, match="lhs_index"):
        gmm(lhs, rhs, gs, lhs_index=jnp.zeros((lhs.shape[0],), jnp.float32))
    with pytest.raises(ValueError, match="lhs_index"):
        gmm(lhs, rhs, gs, lhs_index=jnp.zeros((lhs.shape[0], 1), jnp.int32))


# Long groups (prefill chunks of 32k tokens: ~1 000 rows per expert) get 256-row chunks by default for the
# int8 down product and the 4-bit gate_up in the [groups, k, n] layout, 128 (int8 down) and 64-row chunks
# k-major; m not a multiple of any, one group ends mid-chunk.
@pytest.mark.parametrize("k_major", [False, True], ids=["kn", "k_major"])
@pytest.mark.parametrize("bits,swiglu", [(8, False), (4, True)], ids=["int8-gmm", "int4-swiglu"])
def test_quantized_default_tiles_for_long_groups(bits, swiglu, k_major):
    w = workloads.Workload(name="long_groups", m=600, k=64, n=64, groups=1)
    lhs, q, _ = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=f"int{bits}", swiglu=swiglu, seed=5)
    q = q.with_k_major(k_major)
    gs = jnp.asarray([600], jnp.int32)
    bs = pallas_triton.default_config(600, 1, bits=bits, swiglu=swiglu, k_major=k_major)
    assert (
        bs.block_m == ((128 if bits == 8 else 64) if k_major else 256)
        and (bs.int_to_float == "asm") == k_major
    )
    out = (gmm_swiglu if swiglu else gmm)(lhs, q, gs, implementation="triton")
    expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs, swiglu=swiglu)
    assert_close(out, expected, jnp.bfloat16, f"bits={bits} swiglu={swiglu}")


def test_default_tiles_fit_shared_memory():
    # Triton refused bf16 gmm_swiglu 64x128x128 with 3 stages on a 227 KiB device ("requested 245760,
    # available: 232448"): the estimate reproduces that figure, every default fits 227 KiB unchanged, and on a
    # 99 KiB device the guard shrinks stages, then block_k, until the estimate fits.
    bad = pallas_triton.Config(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    assert pallas_triton.shared_memory_bytes(bad, swiglu=True, lhs_bytes=2, bits=None) == 245760
    hopper, ada = 232448, 101376
    for bits, k_major in itertools.product((None, 8, 4), (False, True)):
        for swiglu in (False, True):
            for m in (8, 512, 4096, 65536, 262144):
                k, n = (2048, 512) if swiglu else (512, 2048)
                bs = pallas_triton.default_config(m, 256, bits=bits, swiglu=swiglu, k_major=k_major)
                sizes = {"swiglu": swiglu, "bits": bits, "lhs_bytes": 2}
                assert pallas_triton.within_shared_memory(bs, hopper, **sizes) == bs, (bits, swiglu, m, bs)
                small = pallas_triton.within_shared_memory(bs, ada, **sizes)
                assert pallas_triton.shared_memory_bytes(small, **sizes) <= ada or small.block_k == 32
    assert pallas_triton.within_shared_memory(bad, None, swiglu=True, bits=None, lhs_bytes=2) == bad


# The 2**23 int-to-float conversions (in jnp, and in inline PTX on the GPU) give the same weights as the
# conversion instruction, bit for bit, over every code (int8 from -128, which GGUF Q8_0 can hold though our
# quantizer never writes it, to 127). Off the GPU "asm" runs the jnp arithmetic; its PTX is checked by
# lowering. int8 with float16 scales takes the one-fma PTX (2**15 + 128 + code); with float32 scales the
# two-step one.
@pytest.mark.parametrize(
    "bits,scale_dtype,offsets",
    [(8, jnp.float16, False), (8, jnp.float32, False), (8, jnp.float16, True), (4, jnp.float16, True)],
    ids=["int8", "int8_f32_scales", "int8_offsets", "int4"],
)
@pytest.mark.parametrize("swap_operands", [False, True], ids=["tile", "swapped"])
def test_magic_int_to_float_is_exact(bits, scale_dtype, offsets, swap_operands):
    w = workloads.WORKLOADS["tiny_partial"]
    lhs, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=f"int{bits}", seed=5)
    q = dataclasses.replace(q, scales=q.scales.astype(scale_dtype))
    if bits == 8 and offsets:
        q = dataclasses.replace(q, offsets=(q.scales.astype(jnp.float32) * -3.5).astype(scale_dtype))
    rng = np.random.default_rng(5)
    if bits == 8:
        codes = rng.integers(-128, 128, q.values.shape).astype(np.int8)
        codes.reshape(-1)[:256] = np.arange(-128, 128)
    else:
        codes = rng.integers(0, 256, q.values.shape).astype(np.uint8)
        codes.reshape(-1)[:256] = np.arange(256)
    q = dataclasses.replace(q, values=jnp.asarray(codes))
    outs = []
    for int_to_float in ("convert", "magic", "asm"):
        bs = pallas_triton.Config(
            block_m=16, block_n=32, block_k=64, swap_operands=swap_operands, int_to_float=int_to_float
        )
        outs.append(
            np.asarray(pallas_triton.gmm_triton(lhs, q, gs, config=bs, preferred_element_type=jnp.float32))
        )
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    assert np.isfinite(outs[1]).all()
    expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs)
    assert_close(outs[1], expected, jnp.bfloat16, "magic")


def test_asm_dequantization_of_int8_with_offsets_lowers_to_ptx():
    # int8 with offsets (Q5_1 / Q5_K kept): the one-fma form (float16 scales), then the offset's add per code
    w = workloads.WORKLOADS["tiny_partial"]
    lhs, dense, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=5)
    q = quantize_int8(dense.astype(jnp.float32), offsets=True)
    text = support.lowered_for_h100(
        pallas_triton.gmm_triton,
        lhs,
        q,
        gs,
        interpret=False,
        config=pallas_triton.Config(block_m=16, block_n=32, block_k=64, int_to_float="asm"),
    )
    assert "0x47000000" in text and "fma.rn.f32" in text and "add.rn.f32 f3, f3, $10;" in text


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_asm_dequantization_lowers_to_ptx(bits):
    # Lowered for an H100 (not compiled here): the kernel carries the PTX block, once per weight tile (int8)
    # or per nibble half (4 bits), and the interpreter-only fallback is not taken.
    w = workloads.WORKLOADS["tiny_partial"]
    lhs, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=f"int{bits}", seed=5)

    def lowered(q, int_to_float="asm"):
        return support.lowered_for_h100(
            pallas_triton.gmm_triton,
            lhs,
            q,
            gs,
            interpret=False,
            config=pallas_triton.Config(block_m=16, block_n=32, block_k=64, int_to_float=int_to_float),
        )

    text = lowered(q)
    assert text.count("cvt.rn.bf16x2.f32 $0, f1, f0") == (1 if bits == 8 else 2)
    # one fma per code: 4 bits (2**23 + code) and int8 with float16 scales (2**15 + 128 + code); float32
    # scales keep int8's subtraction and multiply
    assert "fma.rn.f32" in text
    assert ("0x47000000" in text) == (bits == 8) and ("0x4B000000" in text) == (bits == 4)
    if bits == 8:
        text = lowered(dataclasses.replace(q, scales=q.scales.astype(jnp.float32)))
        assert "fma.rn.f32" not in text and "0x4B000000" in text and "sub.rn.f32" in text


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_swiglu_fast_silu_lowers_to_ptx(weights):
    # Lowered for sm_90: the compiled bf16 gmm_swiglu's epilogue takes silu from ex2.approx and rcp.approx,
    # with no libdevice expf left; with f32 operands the exact sigmoid stays.
    w = workloads.WORKLOADS["tiny_partial"]

    def lowered(dtype):
        lhs, rhs, gs = workloads.make_inputs(w, dtype=dtype, weights=weights, swiglu=True, seed=5)
        bs = pallas_triton.Config(block_m=16, block_n=32, block_k=64)
        return support.lowered_for_h100(
            pallas_triton.gmm_swiglu_triton, lhs, rhs, gs, interpret=False, config=bs
        )

    fast = lowered(jnp.bfloat16)
    assert "rcp.approx.ftz.f32" in fast and "__nv_expf" not in fast
    assert "rcp.approx" not in lowered(jnp.float32)


# Both storage orders of the codes ([groups, n, k] k-major, the default, and [groups, k, n]) give the same
# product in every dequantization order: the same bf16 weights, so equal up to the f32 summation order (the
# interpreter's CPU dot sums a transposed operand in another order).
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
@pytest.mark.parametrize("swap_operands", [False, True], ids=["tile", "swapped"])
def test_k_major_and_kn_layouts_agree(bits, swap_operands):
    w = workloads.WORKLOADS["tiny_partial"]
    lhs, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights=f"int{bits}", swiglu=True, seed=7)
    assert q.k_major
    bs = pallas_triton.Config(block_m=16, block_n=32, block_k=64, swap_operands=swap_operands)
    outs = [
        np.asarray(pallas_triton.gmm_swiglu_triton(lhs, r, gs, config=bs, preferred_element_type=jnp.float32))
        for r in (q, q.with_k_major(False))
    ]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs, swiglu=True)
    assert_close(outs[0], expected, jnp.bfloat16, f"swap_operands={swap_operands}")


# The swapped operands on the 4-bit layout (its branches contain the 8-bit ones' steps).
def test_swapped_operands():
    w = workloads.WORKLOADS["tiny_partial"]
    lhs, q, gs = workloads.make_inputs(w, dtype=jnp.bfloat16, weights="int4", seed=13)
    bs = pallas_triton.Config(block_m=16, block_n=32, block_k=64, swap_operands=True)
    out = pallas_triton.gmm_triton(lhs, q, gs, config=bs)
    expected = numpy_gmm(as_float(lhs), np.asarray(q.dequantize(jnp.float32)), gs)
    assert_close(out, expected, jnp.bfloat16, "swap_operands")


def test_measured_tiles_are_config_fields():
    # Every stored table's grouped-matmul entries name knobs of the kernels' configs, and a device with no
    # table (the CPU) gets the heuristic's tiles.
    for path in sorted(tuning.TABLES.glob("*.json")):
        table = tuning.table(path.stem)
        for shape_class, knobs in table.get(pallas_triton.TUNING_OP, {}).items():
            dataclasses.replace(pallas_triton.Config(), **knobs)
            assert shape_class.split(".")[0] in ("float", "int8", "int4", "int8_kn", "int4_kn"), shape_class
        gemv = dict(table.get(pallas_gemv.TUNING_OP, {}).get("default", {}))
        gemv.pop("max_rows", None)
        pallas_gemv.Config(**gemv)
    kw = {"bits": 8, "swiglu": True, "k_major": True}
    assert pallas_triton.default_config(4096, 256, **kw) == pallas_triton.heuristic_config(16.0, **kw)
    assert pallas_triton.shape_class(16.0, **kw) == "int8.swiglu.le32"
    assert (
        pallas_triton.shape_class(1.0, bits=None, swiglu=False, k_major=False, rows=True) == "float.gmm.rows"
    )


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(sizes=st.lists(st.integers(0, 12), min_size=6, max_size=6), data=st.data())
def test_any_group_sizes_property(sizes, data):
    # Fixed shapes (one compilation), random group sizes with sum <= m: both implementations match the loop.
    m = 48
    sizes = np.asarray(sizes, np.int32)
    sizes[-1] = max(0, min(sizes[-1], m - sizes[:-1].sum()))
    hypothesis.assume(sizes.sum() <= m)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    lhs = jnp.asarray(rng.standard_normal((m, 32), np.float32))
    rhs = jnp.asarray(rng.standard_normal((6, 32, 16), np.float32))
    gs = jnp.asarray(sizes)
    expected = numpy_gmm(np.asarray(lhs), np.asarray(rhs), sizes)
    for implementation in IMPLEMENTATIONS:
        assert_close(gmm(lhs, rhs, gs, implementation=implementation), expected, jnp.float32, implementation)

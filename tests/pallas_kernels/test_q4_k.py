"""GGUF Q4_K weights read in place (`Q4KExperts`) by the matrix-vector kernel, against gguf's own dequantizer.

The kernel runs in the Pallas interpreter on CPU and is lowered for an abstract H100 (on a GPU,
`python -m pytest tests/pallas_kernels` runs it compiled).
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support
from gguf.constants import GGMLQuantizationType as T
from test_grouped_matmul import assert_close, numpy_row_groups
from test_grouped_matmul_gemv import kernel_names

from hybridlm.checkpoints.gguf_quants import quantize_q4_k
from pallas_kernels.grouped_matmul import gmm, gmm_swiglu, pallas_gemv, pallas_triton
from pallas_kernels.q4_k import Q4KExperts, q4_k_to_quantized

GROUPS, HIDDEN, FFN = 5, 512, 40  # FFN = 40: the last 8- and 16-column tiles are partly masked


def packed_experts(seed: int = 0):
    """Rows of packed experts as the offload pool holds them, each a gate_up (GGUF [2 FFN, HIDDEN]) then a
    down of k = 256 (GGUF [HIDDEN, 256]) in Q4_K blocks: (data uint8 [GROUPS, bytes], gate_up and down as
    `Q4KExperts`, their float64 values [GROUPS, k, n] by gguf's dequantizer)."""
    rng = np.random.default_rng(seed)
    gate_up = rng.standard_normal((GROUPS, 2 * FFN, HIDDEN), np.float32) / np.sqrt(HIDDEN)  # GGUF [out, in]
    down = rng.standard_normal((GROUPS, HIDDEN, 256), np.float32) / 16.0  # k = 256: one super-block a row
    blocks = [quantize_q4_k(w.reshape(-1, w.shape[-1])).reshape(GROUPS, -1) for w in (gate_up, down)]
    data = jnp.asarray(np.concatenate(blocks, axis=1))
    q_gate_up = Q4KExperts(data, offset=0, k=HIDDEN, n=2 * FFN)
    q_down = Q4KExperts(data, offset=blocks[0].shape[1], k=256, n=HIDDEN)

    def dense(b, out, k):  # gguf's dequantizer: the float values, transposed to [groups, k, n]
        w = gguf.quants.dequantize(b.reshape(GROUPS * out, k // 256 * 144), T.Q4_K)
        return np.swapaxes(w.reshape(GROUPS, out, k).astype(np.float64), 1, 2)

    return data, q_gate_up, q_down, dense(blocks[0], 2 * FFN, HIDDEN), dense(blocks[1], HIDDEN, 256)


def test_q4_k_experts_dequantize_as_gguf():
    _, gate_up, down, dense_gate_up, dense_down = packed_experts()
    np.testing.assert_array_equal(np.asarray(gate_up.dequantize(), np.float64), dense_gate_up)
    np.testing.assert_array_equal(np.asarray(down.dequantize(), np.float64), dense_down)
    assert gate_up.shape == (GROUPS, HIDDEN, 2 * FFN) and down.shape == (GROUPS, 256, HIDDEN)
    sub = gate_up.take(jnp.asarray([3, 1]))
    np.testing.assert_array_equal(np.asarray(sub.dequantize(), np.float64), dense_gate_up[[3, 1]])
    assert sub.to_quantized().shape == (2, HIDDEN, 2 * FFN)


@pytest.mark.parametrize("implementation", ["gemv", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_rows_read_q4_k_in_place(implementation, dtype):
    _, gate_up, down, dense_gate_up, dense_down = packed_experts(seed=1)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.standard_normal((2, HIDDEN), np.float32), dtype)
    groups = np.array([3, 0, 4, 3, -1, 2, GROUPS, 1], np.int32)  # a repeat, and two rows of no group
    index = np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int32)
    kw = {
        "row_groups": jnp.asarray(groups),
        "lhs_index": jnp.asarray(index),
        "implementation": implementation,
    }
    x = np.asarray(jnp.asarray(tokens, jnp.float32), np.float64)[index]
    h = gmm_swiglu(tokens, gate_up, **kw)
    assert h.shape == (8, FFN) and h.dtype == dtype
    assert_close(h, numpy_row_groups(x, dense_gate_up, groups, swiglu=True), dtype, "swiglu")
    rows = jnp.asarray(rng.standard_normal((8, 256)), dtype)
    y = gmm(rows, down, row_groups=jnp.asarray(groups), implementation=implementation)
    assert y.shape == (8, HIDDEN)
    want = numpy_row_groups(np.asarray(jnp.asarray(rows, jnp.float32), np.float64), dense_down, groups)
    assert_close(y, want, dtype, "down")
    for out in (h, y):  # rows of no group are zeros
        assert not np.asarray(out[4:5], np.float32).any() and not np.asarray(out[6:7], np.float32).any()
    z = gmm(tokens, gate_up, **kw)
    assert_close(z, numpy_row_groups(x, dense_gate_up, groups), dtype, "gmm")
    if implementation == "gemv":
        assert "gemv_q4_k_swiglu" in kernel_names(gmm_swiglu, tokens, gate_up, **kw)


def test_q4_k_tile_widths_agree():
    _, gate_up, _, dense, _ = packed_experts(seed=3)
    tokens = jnp.asarray(np.random.default_rng(4).standard_normal((3, HIDDEN)), jnp.float32)
    groups = jnp.asarray([4, 2, 0], jnp.int32)
    want = numpy_row_groups(np.asarray(tokens, np.float64), dense, np.asarray(groups), swiglu=True)
    for block_n in (8, 16, 64):
        config = pallas_gemv.Config(block_n=block_n)
        got = pallas_gemv.gemv_swiglu(tokens, gate_up, row_groups=groups, config=config)
        assert_close(got, want, jnp.float32, f"block_n={block_n}")


def test_q4_k_experts_need_row_groups():
    _, gate_up, _, _, _ = packed_experts()
    tokens = jnp.zeros((4, HIDDEN), jnp.bfloat16)
    sizes = jnp.asarray([4, 0, 0, 0, 0], jnp.int32)
    assert pallas_gemv.takes(64, gate_up, jnp.zeros((64,), jnp.int32))  # no row limit: nothing else reads it
    with pytest.raises(NotImplementedError, match="Q4_K rows in place"):
        pallas_triton.gmm_swiglu_triton(tokens, gate_up, sizes)
    with pytest.raises(NotImplementedError):
        gmm_swiglu(tokens, gate_up, sizes, implementation="gemv")
    got = gmm_swiglu(tokens, gate_up, sizes, implementation="reference")  # the oracle takes both
    assert got.shape == (4, FFN)


def test_q4_k_experts_check():
    data = jnp.zeros((2, 144 * 8), jnp.uint8)
    Q4KExperts(data, offset=144 * 4, k=256, n=4).check()
    for bad, match in [
        (Q4KExperts(data, offset=0, k=128, n=4), "multiple of 256"),
        (Q4KExperts(data, offset=100, k=256, n=4), "super-blocks"),
        (Q4KExperts(data, offset=144 * 5, k=256, n=4), "pass the end"),
        (Q4KExperts(data.astype(jnp.int8), offset=0, k=256, n=4), "uint8"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad.check()


def test_q4_k_to_quantized_matches_gguf():
    rows = quantize_q4_k(np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32))
    q = q4_k_to_quantized(jnp.asarray(rows)[None], 512)
    np.testing.assert_array_equal(np.asarray(q.dequantize()[0]).T, gguf.quants.dequantize(rows, T.Q4_K))


def test_offsets_past_int32():
    # Pallas Triton addresses an operand of 2**31 to 2**32 bytes with wrapped int32 offsets: refused there.
    assert pallas_gemv.addressable(jax.ShapeDtypeStruct((12, 2**30), jnp.uint8))  # 12 GiB: int64 offsets
    assert not pallas_gemv.addressable(jax.ShapeDtypeStruct((3, 2**30), jnp.uint8))
    assert pallas_gemv.addressable(jax.ShapeDtypeStruct((1, 2**30), jnp.uint8))


def test_q4_k_kernel_lowers_for_h100():
    _, gate_up, _, _, _ = packed_experts()
    tokens = jnp.zeros((1, HIDDEN), jnp.bfloat16)
    text = support.lowered_for_h100(
        pallas_gemv.gemv_swiglu,
        tokens,
        gate_up,
        row_groups=jnp.zeros((8,), jnp.int32),
        lhs_index=jnp.zeros((8,), jnp.int32),
        interpret=False,
    )
    assert "gemv_q4_k_swiglu" in text

"""Named gated-delta-rule shapes shared by tests and benchmarks, and `make_inputs` to build them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One prefill shape of the gated delta rule (spec §4.5; Qwen3.5/3.6-35B-A3B: 16 k-heads, 32 v-heads)."""

    name: str
    batch: int = 1
    seq: int  # tokens per batch row (all packed sequences together when seqlens is set)
    k_heads: int = 16
    v_heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    seqlens: tuple[int, ...] | None = None  # packed variable-length sequences (batch must be 1)

    def __post_init__(self):
        if self.v_heads % self.k_heads:
            raise ValueError(f"v_heads={self.v_heads} is not a multiple of k_heads={self.k_heads}")
        if self.seqlens is not None and (self.batch != 1 or sum(self.seqlens) != self.seq):
            raise ValueError(f"seqlens={self.seqlens} needs batch == 1 and sum == seq={self.seq}")


TINY = Workload(name="tiny", seq=130, k_heads=2, v_heads=4, key_dim=32, value_dim=16)
QWEN35_PREFILL_512 = Workload(name="qwen35_prefill_512", seq=512)
QWEN35_PREFILL_4K = Workload(name="qwen35_prefill_4k", seq=4096)
QWEN35_PREFILL_16K = Workload(name="qwen35_prefill_16k", seq=16384)
QWEN35_PREFILL_64K = Workload(name="qwen35_prefill_64k", seq=65536)
QWEN35_PACKED_8X8K = Workload(name="qwen35_packed_8x8k", seq=8 * 8192, seqlens=(8192,) * 8)
# 8 prompts of uneven lengths: sequences start anywhere in a chunk, 65 533 tokens (not a multiple of 8)
RAGGED = (8191, 8193, 6000, 10385, 8100, 8284, 8000, 8380)
QWEN35_PACKED_RAGGED = Workload(name="qwen35_packed_ragged", seq=sum(RAGGED), seqlens=RAGGED)

WORKLOADS = {
    w.name: w
    for w in (
        TINY,
        QWEN35_PREFILL_512,
        QWEN35_PREFILL_4K,
        QWEN35_PREFILL_16K,
        QWEN35_PREFILL_64K,
        QWEN35_PACKED_8X8K,
        QWEN35_PACKED_RAGGED,
    )
}


def make_inputs(
    workload: Workload,
    *,
    seq: int | None = None,
    dtype=jnp.bfloat16,
    seed: int = 0,
    initial_state: bool = True,
    seqlens: tuple[int, ...] | None = None,
    key_cosine: float = 0.0,
) -> dict[str, jax.Array]:
    """Random inputs for `gated_delta_rule` in the caller's distribution.

    q, k: L2-normalised Gaussian vectors; v Gaussian; log_decay = log_sigmoid(N(0,1))
    (<= 0); beta = sigmoid(N(0,1)); initial_state N(0, 0.1^2) f32.

    Args:
      workload: shapes.
      seq: overrides workload.seq (ignored when seqlens is given).
      dtype: dtype of query, key, value (log_decay and beta are f32).
      seed: numpy seed.
      initial_state: include a random initial state (else None).
      seqlens: packed sequence lengths (overrides workload.seqlens); adds cu_seqlens.
      key_cosine: in [0, 1): q and k lean towards one direction per head, so that two keys have about this
        cosine (0: independent). Trained models' keys correlate (repeated tokens: cosine 1); with beta
        near 1 and little decay this is the hard case for the chunk's triangular inverse.

    Returns:
      dict of keyword arguments: query, key, value, log_decay, beta, initial_state[, cu_seqlens].
    """
    seqlens = workload.seqlens if seqlens is None else seqlens
    seq = sum(seqlens) if seqlens is not None else (workload.seq if seq is None else seq)
    rng = np.random.default_rng(seed)
    b, hk, hv, dk, dv = (
        workload.batch,
        workload.k_heads,
        workload.v_heads,
        workload.key_dim,
        workload.value_dim,
    )
    if seqlens is not None:
        b = 1

    if not 0.0 <= key_cosine < 1.0:
        raise ValueError(f"key_cosine={key_cosine} must be in [0, 1)")
    shared = np.random.default_rng([seed, 1]).standard_normal((1, 1, hk, dk), dtype=np.float32)
    shared /= np.sqrt((shared * shared).sum(-1, keepdims=True))

    def unit(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        x = x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
        if key_cosine:
            x = np.sqrt(1.0 - key_cosine) * x + np.sqrt(key_cosine) * shared
            x = x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
        return x

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    inputs = {
        "query": jnp.asarray(unit((b, seq, hk, dk)), dtype),
        "key": jnp.asarray(unit((b, seq, hk, dk)), dtype),
        "value": jnp.asarray(rng.standard_normal((b, seq, hv, dv), dtype=np.float32), dtype),
        "log_decay": jnp.asarray(np.log(sigmoid(rng.standard_normal((b, seq, hv), dtype=np.float32)))),
        "beta": jnp.asarray(sigmoid(rng.standard_normal((b, seq, hv), dtype=np.float32))),
        "initial_state": None,
    }
    num_states = b if seqlens is None else len(seqlens)
    if initial_state:
        inputs["initial_state"] = jnp.asarray(
            0.1 * rng.standard_normal((num_states, hv, dk, dv), dtype=np.float32)
        )
    if seqlens is not None:
        inputs["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(seqlens)]), jnp.int32)
    return inputs


def hard_gates(inputs: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`inputs` with beta 1 and log-decay -1e-3 everywhere: with correlated keys (`make_inputs(key_cosine=)`)
    (I + A) is far from I in every chunk, the hard case for the chunk's triangular inverse."""
    hard = {"beta": jnp.ones_like(inputs["beta"]), "log_decay": jnp.full_like(inputs["log_decay"], -1e-3)}
    return {**inputs, **hard}

"""Public gated-delta-rule entry points: `gated_delta_rule` (prefill), `gated_delta_rule_step` (decode)."""

from collections.abc import Callable
from typing import Literal

import jax
import numpy as np

from pallas_kernels.gated_delta_rule import chunked, pallas_step, pallas_triton, reference

Implementation = Literal["reference", "chunked", "pallas"]
StepImplementation = Literal["reference", "pallas"]

_IMPLEMENTATIONS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "reference": reference.gated_delta_rule_reference,
    "chunked": chunked.gated_delta_rule_chunked,
    "pallas": pallas_triton.gated_delta_rule_pallas,
}
# Largest batch for which `gated_delta_rule_step(implementation=None)` takes the fused Pallas step on a GPU: on an
# H100 it beats XLA's step at 1 and 8 sequences (54 against 67.5 us, 61 against 75) but not at 32-128
# (docs/benchmarks.md, "Decode step"); in the whole-model decode step at batch 1, 4.19 against 4.27-4.31 ms
# (2026-11-26, "Decode, whole model").
PALLAS_STEP_MAX_BATCH = 8

_STEP_IMPLEMENTATIONS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "reference": reference.gated_delta_rule_step_reference,
    "pallas": pallas_step.gated_delta_rule_step_pallas,
}


def gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    log_decay: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    cu_seqlens: jax.Array | None = None,
    max_seqlen: int | None = None,
    implementation: Implementation | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gated delta rule over a whole prompt (prefill).

    Per value head, state S [key_dim, value_dim] in float32, for each token t:
        S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = scale S^T q_t
    Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464; spec §4.5, §9.

    Args:
      query, key: [batch, seq, k_heads, key_dim], already L2-normalised along key_dim; bf16 or f32.
      value: [batch, seq, v_heads, value_dim], v_heads a multiple of k_heads; value head h reads q/k head
        h // (v_heads // k_heads) (never materialised as a repeat).
      log_decay: [batch, seq, v_heads], natural-log decay g <= 0; any float dtype (computed in f32).
      beta: [batch, seq, v_heads], write strength in [0, 1]; any float dtype (computed in f32).
      initial_state: [batch, v_heads, key_dim, value_dim] f32 ([num_seqs, ...] with cu_seqlens), or None
        for zeros.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      chunk_size: tokens per chunk for the chunked implementations (64; a power of two >= 16 for "pallas").
        Any seq is accepted: the last partial chunk is padded internally without changing the results.
      cu_seqlens: optional int32 [num_seqs + 1] offsets of packed variable-length sequences, batch == 1,
        cu_seqlens[0] == 0 and cu_seqlens[-1] == seq; the state restarts at every boundary. With "pallas" on
        an sm_90 GPU a packed seq that is a multiple of 8 runs fastest (the sequences stay on the packed
        array's own chunks; otherwise they are regathered chunk-aligned: H100, ~65 K tokens, 1.52 against
        2.04 ms, docs/benchmarks.md).
      max_seqlen: optional static bound (tokens) on the packed sequences' lengths. For "pallas" the
        sequences then run as a padded batch, one sequential walk per sequence in parallel (worth it when
        lengths are similar); the other implementations ignore it. Checked against concrete cu_seqlens.
      implementation: "reference" (token-by-token lax.scan in f32: the oracle), "chunked" (pure JAX, WY
        form, spec §9) or "pallas" (Pallas kernels with the Triton lowering). None picks "pallas" on GPU and
        "chunked" elsewhere.
      interpret: for "pallas": run the kernels in the Pallas interpreter; None = only when no GPU is present.

    Returns:
      output: [batch, seq, v_heads, value_dim] in value.dtype.
      final_state: [batch or num_seqs, v_heads, key_dim, value_dim] float32.

    Raises:
      ValueError: unknown `implementation`, shapes that disagree, or (concrete cu_seqlens) a sequence longer
        than `max_seqlen`.
    """
    if implementation is None:
        implementation = "pallas" if jax.default_backend() == "gpu" else "chunked"
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {sorted(_IMPLEMENTATIONS)}")
    extra = {}
    if max_seqlen is not None and cu_seqlens is not None:
        if not isinstance(cu_seqlens, jax.core.Tracer):
            cu = np.asarray(cu_seqlens)
            longest = int(np.max(cu[1:] - cu[:-1], initial=0))
            if longest > max_seqlen:
                raise ValueError(f"max_seqlen={max_seqlen} but cu_seqlens has a sequence of {longest} tokens")
        if implementation == "pallas":
            extra["max_seqlen"] = int(max_seqlen)
    return _IMPLEMENTATIONS[implementation](
        query,
        key,
        value,
        log_decay,
        beta,
        initial_state=initial_state,
        scale=scale,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        interpret=interpret,
        **extra,
    )


def gated_delta_rule_step(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    log_decay: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    implementation: StepImplementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step (a single token per sequence) of the gated delta rule.

    Same recurrence as `gated_delta_rule` with seq = 1. Source: arXiv:2412.06464; spec §4.5, §8.

    Args:
      query, key: [batch, k_heads, key_dim], already L2-normalised; bf16 or f32.
      value: [batch, v_heads, value_dim], v_heads a multiple of k_heads.
      log_decay, beta: [batch, v_heads]; any float dtype (computed in f32).
      state: [batch, v_heads, key_dim, value_dim] float32.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      implementation: "reference" (pure JAX, XLA's fusions) or "pallas" (`pallas_step`: one fused kernel,
        the state read and written once; in the Pallas interpreter where no GPU is present). None picks
        "pallas" on a GPU up to `PALLAS_STEP_MAX_BATCH` sequences and "reference" otherwise: on an H100
        (2026-11-25, docs/benchmarks.md) the Pallas step took 54 / 61 / 99 / 393 us at batch 1 / 8 / 32 / 128
        against the JAX step's 68 / 75 / 84 / 284.

    Returns:
      output: [batch, v_heads, value_dim] in value.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: unknown `implementation`, or shapes that disagree.
    """
    if implementation is None:
        small = query.shape[0] <= PALLAS_STEP_MAX_BATCH
        implementation = "pallas" if small and jax.default_backend() == "gpu" else "reference"
    if implementation not in _STEP_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown implementation {implementation!r}; choose from {sorted(_STEP_IMPLEMENTATIONS)}"
        )
    return _STEP_IMPLEMENTATIONS[implementation](query, key, value, log_decay, beta, state, scale=scale)

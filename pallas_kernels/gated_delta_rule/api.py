"""Public gated-delta-rule entry points: `gated_delta_rule` (prefill), `gated_delta_rule_step` (decode)."""

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np

from pallas_kernels import dispatch, tuning
from pallas_kernels.gated_delta_rule import chunk, chunked, decode_step, reference

Implementation = Literal["reference", "chunked", "triton", "mosaic"]
StepImplementation = Literal["reference", "triton"]

_IMPLEMENTATIONS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "reference": reference.gated_delta_rule_reference,
    "chunked": chunked.gated_delta_rule_chunked,
    "triton": functools.partial(chunk.gated_delta_rule_pallas, backend="triton"),
    "mosaic": functools.partial(chunk.gated_delta_rule_pallas, backend="mosaic"),
}
_PALLAS = ("triton", "mosaic")  # the implementations that take max_seqlen
# What `implementation=None` tries on a GPU, in order: the Mosaic GPU walk where it runs, else the Triton one.
GPU_DEFAULT = ("mosaic", "triton")

# Decode step on devices without a tuning table: the fused Triton step up to this many sequences (beyond, the
# state reads dominate and XLA's step is as fast), 32 value columns per program.
STEP_DEFAULTS = {"max_batch": 8, "block_v": 32}


def step_config() -> dict[str, int]:
    """`STEP_DEFAULTS` updated by the running device's tuning table ("gated_delta_rule.step")."""
    return {**STEP_DEFAULTS, **tuning.lookup("gated_delta_rule.step")}


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
    implementation: Implementation | Sequence[Implementation] | None = None,
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
      chunk_size: tokens per chunk for the chunked implementations (64; a power of two >= 16 for "triton",
        64 for "mosaic").
        Any seq is accepted: the last partial chunk is padded internally without changing the results.
      cu_seqlens: optional int32 [num_seqs + 1] offsets of packed variable-length sequences, batch == 1,
        cu_seqlens[0] == 0 and cu_seqlens[-1] == seq; the state restarts at every boundary. With "mosaic" a
        packed seq that is a multiple of 8 runs fastest (the sequences stay on the packed array's own chunks;
        otherwise they are regathered chunk-aligned).
      max_seqlen: optional static bound (tokens) on the packed sequences' lengths. For "triton" and
        "mosaic" the sequences then run as a padded batch, one sequential walk per sequence in parallel
        (worth it when lengths are similar); the other implementations ignore it. Checked against concrete
        cu_seqlens.
      implementation: "reference" (token-by-token lax.scan in f32: the oracle), "chunked" (pure JAX, WY
        form, spec §9), "triton" (Pallas kernels, Triton lowering; the interpreter off GPU) or "mosaic"
        (the Triton prepare and a Mosaic GPU state pass: Hopper, bf16, chunk_size 64), or a sequence of them
        tried in order while each raises NotImplementedError. None: ("mosaic", "triton") on a GPU, "chunked"
        elsewhere.
      interpret: for "triton" and "mosaic": the Pallas interpreter; None = only when no GPU is present.

    Returns:
      output: [batch, seq, v_heads, value_dim] in value.dtype.
      final_state: [batch or num_seqs, v_heads, key_dim, value_dim] float32.

    Raises:
      ValueError: unknown `implementation`, shapes that disagree, or (concrete cu_seqlens) a sequence longer
        than `max_seqlen`.
      NotImplementedError: a single implementation refusing the call, or every one of a sequence (naming
        each refusal).
    """
    if implementation is None:
        implementation = GPU_DEFAULT if jax.default_backend() == "gpu" else "chunked"
    names = dispatch.implementation_names(implementation, _IMPLEMENTATIONS)
    if max_seqlen is not None and cu_seqlens is not None and not isinstance(cu_seqlens, jax.core.Tracer):
        cu = np.asarray(cu_seqlens)
        longest = int(np.max(cu[1:] - cu[:-1], initial=0))
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} but cu_seqlens has a sequence of {longest} tokens")
    padded = max_seqlen is not None and cu_seqlens is not None

    def call(name):
        extra = {"max_seqlen": int(max_seqlen)} if name in _PALLAS and padded else {}
        return _IMPLEMENTATIONS[name](
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

    return dispatch.first_accepted(names, call)


def _step_default(batch: int, config: dict) -> str:
    """The decode step's implementation for `batch` sequences when none is named: the fused Triton kernel on a
    GPU up to config["max_batch"] sequences (beyond, the state reads dominate and XLA is as fast)."""
    return "triton" if batch <= config["max_batch"] and jax.default_backend() == "gpu" else "reference"


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
      implementation: "reference" (pure JAX, XLA's fusions) or "triton" (`decode_step`: one fused Pallas
        kernel, the state read and written once; in the Pallas interpreter where no GPU is present). None
        picks "triton" on a GPU up to `step_config()["max_batch"]` sequences and "reference" otherwise.

    Returns:
      output: [batch, v_heads, value_dim] in value.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: unknown `implementation`, or shapes that disagree.
    """
    config = step_config()
    implementation = implementation or _step_default(query.shape[0], config)
    if implementation == "reference":
        return reference.gated_delta_rule_step_reference(
            query, key, value, log_decay, beta, state, scale=scale
        )
    if implementation != "triton":
        raise ValueError(f"unknown implementation {implementation!r}; choose from ['reference', 'triton']")
    return decode_step.gated_delta_rule_step_triton(
        query, key, value, log_decay, beta, state, scale=scale, block_v=config["block_v"]
    )


def gated_delta_rule_decode(
    mixed: jax.Array,
    conv_state: jax.Array,
    conv_weight: jax.Array,
    decay_input: jax.Array,
    beta_input: jax.Array,
    log_decay_rate: jax.Array,
    dt_bias: jax.Array,
    state: jax.Array,
    *,
    k_heads: int,
    key_dim: int,
    scale: float | None = None,
    implementation: StepImplementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step of a Gated DeltaNet layer from its raw projections: the causal conv with SiLU, the L2
    norm of q and k, the gates and the delta-rule update (`gated_delta_rule_step`).

    Source: arXiv:2412.06464; HF `Qwen3_5MoeGatedDeltaNet`; spec §4.

    Args:
      mixed: [batch, conv_dim] the pre-conv [q | k | v] projections of the token (activation dtype).
      conv_state: [batch, conv_kernel - 1, conv_dim] the previous tokens' pre-conv inputs.
      conv_weight: [conv_kernel, conv_dim].
      decay_input, beta_input: [batch, v_heads] the `a` and `b` projections.
      log_decay_rate, dt_bias: [v_heads] A_log and dt_bias.
      state: [batch, v_heads, key_dim, value_dim] float32.
      k_heads, key_dim: the q/k heads and their size.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      implementation: "reference" (`reference.gated_delta_rule_decode_reference`: XLA's fusions) or "triton"
        (`decode_step.gated_delta_rule_decode_triton`: one Pallas kernel; the interpreter where no GPU is
        present). None: "triton" on a GPU up to `step_config()["max_batch"]` sequences, else "reference".

    Returns:
      output: [batch, v_heads, value_dim] in mixed.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: unknown `implementation`, or shapes that disagree.
    """
    args = (mixed, conv_state, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state)
    implementations = (
        reference.gated_delta_rule_decode_reference,
        decode_step.gated_delta_rule_decode_triton,
    )
    return _decode(implementations, args, k_heads, key_dim, scale, implementation)


def gated_delta_rule_decode_tokens(
    mixed: jax.Array,
    conv_state: jax.Array,
    conv_weight: jax.Array,
    decay_input: jax.Array,
    beta_input: jax.Array,
    log_decay_rate: jax.Array,
    dt_bias: jax.Array,
    state: jax.Array,
    *,
    k_heads: int,
    key_dim: int,
    scale: float | None = None,
    implementation: StepImplementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A few tokens of each sequence through a Gated DeltaNet layer, keeping the state after each (a
    speculative verify): `gated_delta_rule_decode` token after token, in one kernel on a GPU.

    Args:
      mixed: [batch, tokens, conv_dim]; decay_input, beta_input: [batch, tokens, v_heads]; the rest as
        `gated_delta_rule_decode` (conv_state and state: before the first token).
      implementation: "reference" (`reference.gated_delta_rule_decode_tokens_reference`) or "triton"
        (`decode_step.gated_delta_rule_decode_tokens_triton`); None as `gated_delta_rule_decode`.

    Returns:
      output: [batch, tokens, v_heads, value_dim] in mixed.dtype; states: [tokens, batch, v_heads, key_dim,
      value_dim] float32, entry t after token t.

    Raises:
      ValueError: unknown `implementation`, or shapes that disagree.
    """
    args = (mixed, conv_state, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state)
    implementations = (
        reference.gated_delta_rule_decode_tokens_reference,
        decode_step.gated_delta_rule_decode_tokens_triton,
    )
    return _decode(implementations, args, k_heads, key_dim, scale, implementation)


def gated_delta_rule_decode_tree(
    mixed: jax.Array,
    windows: jax.Array,
    conv_weight: jax.Array,
    decay_input: jax.Array,
    beta_input: jax.Array,
    log_decay_rate: jax.Array,
    dt_bias: jax.Array,
    state: jax.Array,
    parents: jax.Array,
    *,
    k_heads: int,
    key_dim: int,
    scale: float | None = None,
    implementation: StepImplementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The nodes of a token tree through a Gated DeltaNet layer (a tree verify): `gated_delta_rule_decode`
    node after node, each from its parent's state, in one kernel on a GPU.

    Args:
      mixed: [batch, nodes, conv_dim]; windows: [batch, nodes, conv_kernel - 1, conv_dim] each node's conv
        window (its ancestors' inputs, then the history; oldest first); decay_input, beta_input: [batch,
        nodes, v_heads]; parents: [nodes] int32, -1 at the root, parents[i] < i; the rest as
        `gated_delta_rule_decode` (state: before the root).
      implementation: "reference" (`reference.gated_delta_rule_decode_tree_reference`) or "triton"
        (`decode_step.gated_delta_rule_decode_tree_triton`); None as `gated_delta_rule_decode`.

    Returns:
      output: [batch, nodes, v_heads, value_dim] in mixed.dtype; states: [nodes, batch, v_heads, key_dim,
      value_dim] float32, entry i after node i's root path.

    Raises:
      ValueError: unknown `implementation`, or shapes that disagree.
    """
    args = (mixed, windows, conv_weight, decay_input, beta_input, log_decay_rate, dt_bias, state, parents)
    implementations = (
        reference.gated_delta_rule_decode_tree_reference,
        decode_step.gated_delta_rule_decode_tree_triton,
    )
    return _decode(implementations, args, k_heads, key_dim, scale, implementation)


def _decode(implementations, args, k_heads, key_dim, scale, implementation):
    """Runs a decode entry point's (reference, triton) pair on args (mixed first) as `implementation` names
    it, None as `_step_default` picks.

    Raises:
      ValueError: unknown `implementation`.
    """
    config = step_config()
    implementation = implementation or _step_default(args[0].shape[0], config)
    if implementation not in ("reference", "triton"):
        raise ValueError(f"unknown implementation {implementation!r}; choose from ['reference', 'triton']")
    kw = {"k_heads": k_heads, "key_dim": key_dim, "scale": scale}
    if implementation == "triton":
        kw["block_v"] = config["block_v"]
    return implementations[implementation == "triton"](*args, **kw)

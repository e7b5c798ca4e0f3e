"""Gated DeltaNet (linear-attention) layer of Qwen3.5 / Qwen3-Next (spec §4).

Per token t and value head h (q/k from k-head h // (v_heads // k_heads)):
    [q | k | v] = silu(causal_depthwise_conv([q | k | v] projection))
    q, k        = l2norm(q), l2norm(k);  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    S_t         = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = S_t^T q_t / sqrt(key_dim)
    out         = out_proj(gated_rms_norm(o, z))
Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (arXiv:2412.06464); HF
`Qwen3_5MoeGatedDeltaNet.forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybridlm.config import ModelConfig
from hybridlm.layers.linear import linear
from hybridlm.layers.norms import gated_rms_norm
from hybridlm.state import GatedDeltaNetState
from pallas_kernels.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_rule_decode,
    gated_delta_rule_decode_tokens,
    gated_delta_rule_decode_tree,
)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (HF `l2norm`; eps inside the root)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_depthwise_conv(mixed: jax.Array, weight: jax.Array, history: jax.Array) -> jax.Array:
    """Causal depthwise convolution with SiLU; tap conv_kernel-1 multiplies the current token.

    out[t] = silu(sum_j weight[j] * window[t + j]) with window = concat(history, mixed), each tap computed as
    a shifted copy of `mixed` plus the history's rows (pads and slices that XLA fuses into one pass): the
    [batch, kernel - 1 + seq, channels] window itself is never built (XLA would write it out, as it would an
    f32 copy if the history rows were added by dynamic_update_slice).

    Args:
      mixed: [batch, seq, channels] pre-conv inputs.
      weight: [conv_kernel, channels].
      history: [batch, conv_kernel - 1, channels] inputs before the first token (zeros at sequence start).

    Returns:
      [batch, seq, channels] in mixed.dtype.
    """
    kernel = weight.shape[0]
    seq = mixed.shape[1]
    w = weight.astype(jnp.float32)
    x, h = mixed.astype(jnp.float32), history.astype(jnp.float32)
    out = 0.0
    for j in range(kernel):  # window[t + j]: history[t + j] for t + j < kernel - 1, else x[t - shift]
        shift = kernel - 1 - j
        from_history = min(shift, seq)
        tap = 0.0
        if from_history:  # the first rows, zero below (exact: one of the two terms is 0 at every row)
            tap = jnp.pad(h[:, j : j + from_history], ((0, 0), (0, seq - from_history), (0, 0)))
        if seq > shift:
            tap = tap + jnp.pad(x[:, : seq - shift], ((0, 0), (shift, 0), (0, 0)))
        out = out + tap * w[j]  # the taps summed in the order of the window formula (same rounding)
    return jax.nn.silu(out).astype(mixed.dtype)


def conv_history_after(history: jax.Array, mixed: jax.Array, num_valid: jax.Array | int) -> jax.Array:
    """The conv state after `num_valid` tokens: rows [num_valid, num_valid + kernel - 1) of
    concat(history, mixed), without materialising that concatenation (a [batch, seq, channels] copy per layer
    and chunk).

    Args:
      history: [batch, conv_kernel - 1, channels] inputs before the chunk.
      mixed: [batch, seq, channels] the chunk's pre-conv inputs.
      num_valid: valid tokens of the chunk, 0 <= num_valid <= seq (int or traced int32).

    Returns:
      [batch, conv_kernel - 1, channels] in mixed.dtype.
    """
    width = history.shape[1]
    head = jnp.concatenate([history, mixed[:, :width]], axis=1)  # covers num_valid < width
    from_head = jax.lax.dynamic_slice_in_dim(
        head, jnp.minimum(num_valid, head.shape[1] - width), width, axis=1
    )
    if mixed.shape[1] < width:
        return from_head
    from_mixed = jax.lax.dynamic_slice_in_dim(mixed, jnp.maximum(num_valid - width, 0), width, axis=1)
    return jnp.where(num_valid >= width, from_mixed, from_head)


def tree_conv_windows(mixed: jax.Array, history: jax.Array, parents: jax.Array) -> list[jax.Array]:
    """The causal conv window of every node of a token tree: the pre-conv inputs along the node's root path.

    Row m of node i is the input m steps up its path (m = 0: node i itself, m = 1: its parent, ...); once the
    path has passed the root, the rows continue into the incoming conv history, newest first, so a path of
    d + 1 nodes reads the same window as a chain of those tokens after `history`.

    Args:
      mixed: [batch, nodes, channels] pre-conv inputs of the nodes.
      history: [batch, conv_kernel - 1, channels] inputs before the root, oldest first.
      parents: [nodes] int32, each node's parent, -1 at the root; parents[i] < i.

    Returns:
      conv_kernel arrays [batch, nodes, channels] in mixed.dtype, for m = 0 .. conv_kernel - 1.
    """
    width = history.shape[1]
    node = jnp.arange(parents.shape[0], dtype=jnp.int32)
    past = jnp.zeros_like(node)  # steps taken past the root
    rows = [mixed]
    for _ in range(width):
        node = jnp.where(node >= 0, parents[jnp.maximum(node, 0)], -1)
        past = past + (node < 0)
        from_history = jnp.take(history, jnp.clip(width - past, 0, width - 1), axis=1)  # [b, nodes, c]
        from_nodes = jnp.take(mixed, jnp.maximum(node, 0), axis=1)
        rows.append(jnp.where((node >= 0)[None, :, None], from_nodes, from_history))
    return rows


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet mixer: projections, causal conv, gates, gated delta rule, gated norm, output
    projection."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        g = config.gdn
        h = config.hidden_dim
        self.config = config
        normal = nnx.initializers.normal(stddev=0.02)

        def p(shape):
            return nnx.Param(normal(rngs.params(), shape, dtype))

        self.qkv_proj = p((h, g.conv_dim))  # [hidden, 2*k_heads*key_dim + v_heads*value_dim]
        self.output_gate_proj = p((h, g.num_v_heads * g.value_dim))  # z: [hidden, v_heads*value_dim]
        self.beta_proj = p((h, g.num_v_heads))  # b: [hidden, v_heads]
        self.decay_proj = p((h, g.num_v_heads))  # a: [hidden, v_heads]
        self.conv_weight = nnx.Param(
            normal(rngs.params(), (g.conv_kernel, g.conv_dim), dtype)
        )  # [kernel, channels]
        self.log_decay_rate = nnx.Param(jnp.zeros((g.num_v_heads,), jnp.float32))  # A_log: [v_heads]
        self.delta_time_bias = nnx.Param(jnp.ones((g.num_v_heads,), jnp.float32))  # dt_bias: [v_heads]
        self.output_norm = nnx.Param(jnp.ones((g.value_dim,), dtype))  # gated norm weight (plain w)
        self.out_proj = p((g.num_v_heads * g.value_dim, h))  # [v_heads*value_dim, hidden]

    def __call__(
        self, x: jax.Array, state: GatedDeltaNetState | None = None, num_valid: jax.Array | int | None = None
    ) -> tuple[jax.Array, GatedDeltaNetState]:
        """Runs the layer over a chunk of tokens.

        Args:
          x: [batch, seq, hidden] normalised input (activation dtype).
          state: state entering the chunk, or None for a fresh sequence.
          num_valid: tokens of the chunk that are real (int or int32 scalar, traced is fine); positions at or
            past it are padding: they neither change the state nor matter for the output. None: all.

        Returns:
          out [batch, seq, hidden] in x.dtype, and the state after the last valid token.
        """
        batch, seq, _ = x.shape
        state = self.zero_state(batch, x.dtype) if state is None else state
        num_valid = seq if num_valid is None else num_valid
        if seq == 1:
            return self._decode(x, state, num_valid)
        q, k, v, log_decay, beta, z, mixed = self._inputs(x, state, num_valid)
        new_conv = conv_history_after(state.conv.astype(mixed.dtype), mixed, num_valid)
        o, recurrent = gated_delta_rule(
            q,
            k,
            v,
            log_decay,
            beta,
            initial_state=state.recurrent,
            implementation=self.config.gdn_implementation,
        )
        return self._output(o, z), GatedDeltaNetState(
            conv=new_conv.astype(state.conv.dtype), recurrent=recurrent
        )

    def _decode(self, x, state: GatedDeltaNetState, num_valid) -> tuple[jax.Array, GatedDeltaNetState]:
        """`__call__` for one token a sequence: the conv, norms, gates and the recurrent update in one kernel
        on a GPU (`gated_delta_rule_decode`), where the chunk path runs several small fusions."""
        cfg = self.config.gdn
        batch = x.shape[0]
        mixed, z, a, b = self._projections(x)
        if not (isinstance(num_valid, int) and num_valid >= 1):
            # a padded token leaves the state as it is: beta = 0 and g = 0 (softplus(-1e30) = 0)
            a = jnp.where(num_valid >= 1, a, -1e30)
            b = jnp.where(num_valid >= 1, b, -1e30)
        o, recurrent = gated_delta_rule_decode(
            mixed[:, 0],
            state.conv,
            self.conv_weight[...],
            a[:, 0],
            b[:, 0],
            self.log_decay_rate[...],
            self.delta_time_bias[...],
            state.recurrent,
            k_heads=cfg.num_k_heads,
            key_dim=cfg.key_dim,
            implementation=self._step,
        )
        new_conv = conv_history_after(state.conv.astype(mixed.dtype), mixed, num_valid)
        z = z.reshape(batch, 1, cfg.num_v_heads, cfg.value_dim)
        return self._output(o[:, None], z), GatedDeltaNetState(
            conv=new_conv.astype(state.conv.dtype), recurrent=recurrent
        )

    def verify(self, x: jax.Array, state: GatedDeltaNetState) -> tuple[jax.Array, GatedDeltaNetState]:
        """Runs the layer over a few tokens (a speculative verify) one recurrence step after another, keeping
        the state after every token, so that accepting j of them is choosing slot j - 1 (no recompute); the
        decode kernel's numbers, all tokens in one call (`gated_delta_rule_decode_tokens`).

        Args:
          x: [batch, seq, hidden] normalised input, seq small (the draft tokens + 1).
          state: the state before x[:, 0].

        Returns:
          out [batch, seq, hidden] in x.dtype, and a `GatedDeltaNetState` whose arrays have a leading [seq]
          axis: entry t is the state after token t.
        """
        cfg = self.config.gdn
        batch, seq, _ = x.shape
        mixed, z, a, b = self._projections(x)
        history = state.conv.astype(mixed.dtype)
        convs = [conv_history_after(history, mixed, t + 1).astype(state.conv.dtype) for t in range(seq)]
        # the decode kernel's numbers token after token, in one call (one kernel on a GPU)
        o, states = gated_delta_rule_decode_tokens(
            mixed,
            state.conv,
            self.conv_weight[...],
            a,
            b,
            self.log_decay_rate[...],
            self.delta_time_bias[...],
            state.recurrent,
            k_heads=cfg.num_k_heads,
            key_dim=cfg.key_dim,
            implementation=self._step,
        )
        z = z.reshape(batch, seq, cfg.num_v_heads, cfg.value_dim)
        return self._output(o, z), GatedDeltaNetState(conv=jnp.stack(convs), recurrent=states)

    def verify_tree(
        self, x: jax.Array, state: GatedDeltaNetState, parents: jax.Array
    ) -> tuple[jax.Array, GatedDeltaNetState]:
        """Runs the layer over a token tree's nodes in one pass (a tree verify), keeping every node's state.

        Node i's recurrent state is its parent's advanced by node i's token (the root's: `state`'s advanced
        by the root token), its conv window the pre-conv inputs of its nearest ancestors, then the incoming
        conv history (`tree_conv_windows`). The nodes go through the decode kernel in one call
        (`gated_delta_rule_decode_tree`), as `verify`'s tokens do, so a root-to-node path gives a chain
        verify's numbers for that path.
        Source: the token-tree verification of SpecInfer (Miao et al., arXiv:2305.09781) and DDTree (Ringel,
        Romano, arXiv:2604.12989), for a recurrent layer: the state branches where the tree does.

        Args:
          x: [batch, nodes, hidden] normalised input of the nodes, in topological order (one tree shared by
            the batch rows).
          state: the state before the root (node 0).
          parents: [nodes] int32, each node's parent, -1 at the root; parents[i] < i.

        Returns:
          out [batch, nodes, hidden] in x.dtype, and a `GatedDeltaNetState` whose arrays have a leading
          [nodes] axis: entry i is the state after the root path of node i (conv: its last conv_kernel - 1
          inputs, oldest first).

        Raises:
          ValueError: parents not [nodes].
        """
        cfg = self.config.gdn
        batch, nodes, _ = x.shape
        if parents.shape != (nodes,):
            raise ValueError(f"parents must be [nodes] = [{nodes}], got shape {parents.shape}")
        mixed, z, a, b = self._projections(x)
        rows = tree_conv_windows(mixed, state.conv.astype(mixed.dtype), parents)
        before = jnp.stack(rows[:0:-1], axis=2).astype(state.conv.dtype)  # [b, nodes, kernel - 1, c]
        after = jnp.stack(rows[-2::-1], axis=2)  # the window less its oldest row: the node's conv state
        o, slots = gated_delta_rule_decode_tree(
            mixed,
            before,
            self.conv_weight[...],
            a,
            b,
            self.log_decay_rate[...],
            self.delta_time_bias[...],
            state.recurrent,
            parents,
            k_heads=cfg.num_k_heads,
            key_dim=cfg.key_dim,
            implementation=self._step,
        )
        z = z.reshape(batch, nodes, cfg.num_v_heads, cfg.value_dim)
        return self._output(o, z), GatedDeltaNetState(
            conv=jnp.moveaxis(after, 1, 0).astype(state.conv.dtype), recurrent=slots
        )

    @property
    def _step(self) -> str | None:
        # "triton", "mosaic" (no step of its own) and None go to the fused Triton step (None: on a GPU for few
        # sequences); "reference" and "chunked" take the pure-JAX step (the chunked form has no step)
        impl = self.config.gdn_implementation
        return None if impl is None else "triton" if impl in ("triton", "mosaic") else "reference"

    def zero_state(self, batch: int, dtype) -> GatedDeltaNetState:
        """The state of a fresh sequence: zero conv history [batch, kernel - 1, conv_dim] in `dtype`, zero
        recurrent state [batch, v_heads, key_dim, value_dim] float32."""
        cfg = self.config.gdn
        return GatedDeltaNetState(
            conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
            recurrent=jnp.zeros((batch, cfg.num_v_heads, cfg.key_dim, cfg.value_dim), jnp.float32),
        )

    def _inputs(self, x, state: GatedDeltaNetState, num_valid):
        """(q, k [b, t, k_heads, key_dim] l2-normalised, v [b, t, v_heads, value_dim], log_decay, beta [b, t,
        v_heads] float32 (zero past num_valid, as k), z [b, t, v_heads, value_dim], mixed [b, t, conv_dim]
        the pre-conv inputs)."""
        cfg = self.config.gdn
        batch, seq, _ = x.shape
        kq = cfg.num_k_heads * cfg.key_dim
        mixed, z, a, b = self._projections(x)
        z = z.reshape(batch, seq, cfg.num_v_heads, cfg.value_dim)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [b, t, v_heads]
        a = a.astype(jnp.float32)
        log_decay = -jnp.exp(self.log_decay_rate[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.delta_time_bias[...].astype(jnp.float32)
        )  # g <= 0, [b, t, v_heads]
        conv_out = causal_depthwise_conv(mixed, self.conv_weight[...], state.conv)
        q = conv_out[..., :kq].reshape(batch, seq, cfg.num_k_heads, cfg.key_dim)
        k = conv_out[..., kq : 2 * kq].reshape(batch, seq, cfg.num_k_heads, cfg.key_dim)
        v = conv_out[..., 2 * kq :].reshape(batch, seq, cfg.num_v_heads, cfg.value_dim)
        q, k = l2_normalize(q), l2_normalize(k)
        valid = (jnp.arange(seq) < num_valid)[None, :]  # [1, t]
        beta = jnp.where(valid[..., None], beta, 0.0)
        log_decay = jnp.where(valid[..., None], log_decay, 0.0)
        k = jnp.where(valid[..., None, None], k, 0.0)
        return q, k, v, log_decay, beta, z, mixed

    def _projections(self, x):
        """The input projections of x [b, t, hidden]: (mixed [b, t, conv_dim] pre-conv [q | k | v], z [b, t,
        v_heads * value_dim], a [b, t, v_heads], b [b, t, v_heads]), in x.dtype."""
        return (
            linear(x, self.qkv_proj.get_value()),
            linear(x, self.output_gate_proj.get_value()),
            linear(x, self.decay_proj.get_value()),
            linear(x, self.beta_proj.get_value()),
        )

    def _output(self, o, z):
        """out_proj(gated_rms_norm(o, z)): o [b, t, v_heads, value_dim] -> [b, t, hidden] in z.dtype."""
        batch, seq = o.shape[:2]
        o = gated_rms_norm(o.astype(z.dtype), z, self.output_norm[...], self.config.rms_norm_eps)
        return linear(o.reshape(batch, seq, -1), self.out_proj.get_value())

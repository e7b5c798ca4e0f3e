"""Layer-by-layer jitted execution of the model over one chunk of tokens.

Each phase of a layer (mixer, router, experts) is one jitted function of (layer graph, layer weights,
activations, state). All Gated DeltaNet layers share one graph, so each phase compiles once per layer type and
chunk shape however deep the model is; the Python loop over layers only enqueues work (no host sync) unless
per-phase timing is asked for. The same seams let the offload scheduler page expert weights between layers.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
from flax import nnx

from hybridlm.model import HybridLM
from hybridlm.state import LayerState

PHASES = ("embed", "gdn", "attention", "router", "experts", "head")


@functools.partial(jax.jit, static_argnums=0)
def _mix(graphdef, params, x, state, start, num_valid):
    layer = nnx.merge(graphdef, params)
    return layer.mix(x, state, start, num_valid)


@functools.partial(jax.jit, static_argnums=0)
def _route(graphdef, params, h):
    layer = nnx.merge(graphdef, params)
    batch, seq, hidden = h.shape
    u = layer.post_norm(h).reshape(batch * seq, hidden)
    weights, ids = layer.ffn.route(u)
    return u, weights, ids


@functools.partial(jax.jit, static_argnums=0)
def _experts(graphdef, params, h, u, weights, ids, num_valid, experts=None):
    """The layer's routed experts on h (post-attention residual); `experts` = (gate_up, down) replaces the
    layer's own expert weights (the offload runner passes weights held outside the layer)."""
    layer = nnx.merge(graphdef, params)
    if experts is not None:
        layer.ffn.experts_gate_up.set_value(experts[0])
        layer.ffn.experts_down.set_value(experts[1])
    batch, seq, hidden = h.shape
    valid = jnp.broadcast_to(jnp.arange(seq) < num_valid, (batch, seq)).reshape(-1)
    return h + layer.ffn.experts(u, weights, ids, valid).reshape(batch, seq, hidden)


@functools.partial(jax.jit, static_argnums=0)
def _dense_ffn(graphdef, params, h):
    layer = nnx.merge(graphdef, params)
    return h + layer.ffn(layer.post_norm(h))


@jax.jit
def _embed(table, ids):
    return table[ids]


@functools.partial(jax.jit, static_argnums=0)
def _head(graphdef, params, x_last):
    return nnx.merge(graphdef, params).logits(x_last)


class PhaseTimer:
    """Wall-clock seconds per phase; when enabled it waits for each phase's result (host sync)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)

    def __call__(self, phase: str, fn, *args):
        if not self.enabled:
            return fn(*args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.seconds[phase] += time.perf_counter() - t0
        return out


class LayerwiseRunner:
    """Runs `HybridLM` one chunk at a time through per-layer jitted phases.

    Args:
      model: the model; its weights are split once into per-layer pytrees (no copy).
    """

    def __init__(self, model: HybridLM):
        self.model = model
        self.config = model.config
        self.layers = [nnx.split(layer) for layer in model.layers]          # [(graphdef, params)]
        self.embed_table = model.embed[...]
        self.whole = nnx.split(model)

    def on_prefill_start(self, num_chunks: int = 1) -> None:
        """Hook called by `prefill` before the first of its `num_chunks` chunks (no-op; the offload runner resets
        its statistics and prefetches across chunk boundaries when more chunks follow)."""

    def head_logits(self, x_last: jax.Array) -> jax.Array:
        """Final norm + lm head: [batch, hidden] -> [batch, vocab] float32."""
        return _head(*self.whole, x_last)

    def forward_chunk(self, ids: jax.Array, states: list[LayerState], start, num_valid: int,
                      timer: PhaseTimer | None = None) -> tuple[jax.Array, list[LayerState]]:
        """Runs all layers over one chunk.

        Args:
          ids: [batch, chunk] int32 token ids (padding after num_valid).
          states: per-layer states before the chunk (donated: do not reuse them).
          start: absolute position of ids[:, 0].
          num_valid: real tokens in the chunk.
          timer: per-phase timing, or None.

        Returns:
          hidden [batch, chunk, hidden] after the last layer (before the final norm), and the new states.
        """
        timer = timer or PhaseTimer(False)
        start = jnp.asarray(start, jnp.int32)
        num_valid = jnp.asarray(num_valid, jnp.int32)
        x = timer("embed", _embed, self.embed_table, ids)
        new_states = []
        for (graphdef, params), state, layer_type in zip(self.layers, states, self.config.layer_types):
            phase = "gdn" if layer_type == "linear_attention" else "attention"
            x, state = timer(phase, _mix, graphdef, params, x, state, start, num_valid)
            new_states.append(state)
            if self.config.moe is None:
                x = timer("experts", _dense_ffn, graphdef, params, x)
                continue
            u, weights, expert_ids = timer("router", _route, graphdef, params, x)
            x = timer("experts", _experts, graphdef, params, x, u, weights, expert_ids, num_valid)
        return x, new_states


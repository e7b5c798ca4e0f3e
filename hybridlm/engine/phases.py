"""The jitted per-layer phases of a chunk (embed, mixer, router, experts, head) and the one-program decode
step.

Each phase is one jitted function of (layer graph, layer weights, activations, state). All Gated DeltaNet
layers share one graph, so each phase compiles once per layer type and chunk shape however deep the model is.
`LayerwiseRunner` calls them in a loop over layers; the offload runner calls the same functions and pages
expert weights between them.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

# Compiler options of the programs that loop over decode steps on the device (`decode_block`, the speculative
# and paged blocks). A decode step is ~1 200 small kernels (30 a layer), each launched from the host by XLA's
# while-loop thunk; captured as one CUDA graph, with the loop as a conditional node, their launch cost goes.
# The list is XLA's default command-buffer types plus WHILE and CONDITIONAL (the option takes no "+X" form).
# An `--xla_gpu_enable_command_buffer` in XLA_FLAGS wins (e.g. empty, for a profiler trace, which cannot see
# the kernels inside a CUDA graph).
DEVICE_LOOP_OPTIONS = (
    {}
    if "xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", "")
    else {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
        "xla_gpu_graph_min_graph_size": 1,
    }
)


class StaticGraph:
    """An nnx `GraphDef` (and the treedef of its weights) as a static jit argument whose hash is computed
    once.

    jit hashes its static arguments on every call, and a GraphDef hashes its whole node list each time, which
    adds host time to every layer-phase call. One `StaticGraph` per distinct graph lets layers of one type
    pass the same object, so that jit's key comparison stops at identity. With `treedef` (the layer runner's
    form, `flat_layer`) the weights travel as a flat tuple of arrays, which jit flattens in C++, rather than
    as an nnx `State`, whose Variables flatten through Python.
    """

    __slots__ = ("_hash", "graphdef", "treedef")

    def __init__(self, graphdef, treedef=None):
        self.graphdef = graphdef
        self.treedef = treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, StaticGraph)
            and self._hash == other._hash
            and self.graphdef == other.graphdef
            and self.treedef == other.treedef
        )

    def merge(self, params):
        """The module: `nnx.merge(graphdef, params)`; `params` is an nnx State, or the flat tuple of its
        leaves when the graph has a treedef."""
        if self.treedef is not None and isinstance(params, (list, tuple)):
            params = self.params(params)
        return nnx.merge(self.graphdef, params)

    def params(self, leaves):
        """The nnx State of a flat tuple of leaves (graphs with a treedef)."""
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


# Every runner's StaticGraphs, one per (graph, weight structure): layers of one type, in this runner or in any
# later one, pass the same object, so that jit's cache lookup stops at identity instead of comparing
# GraphDefs.
_GRAPHS: dict = {}


def flat_layer(graphdef, params) -> tuple[StaticGraph, tuple]:
    """(graph, weights as a flat tuple of leaves) of one layer, the graph shared by every layer of the same
    graph and weight structure."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    key = (graphdef, treedef)
    if key not in _GRAPHS:
        _GRAPHS[key] = StaticGraph(graphdef, treedef)
    return _GRAPHS[key], tuple(leaves)


@functools.partial(jax.jit, static_argnums=0)
def mix(graph: StaticGraph, params, x, state, start, num_valid):
    """The layer's token mixer (Gated DeltaNet or attention) and residual: x [batch, seq, hidden] -> (x,
    state)."""
    layer = graph.merge(params)
    return layer.mix(x, state, start, num_valid)


@functools.partial(jax.jit, static_argnums=0)
def route(graph: StaticGraph, params, h):
    """Post-norm and router: h [batch, seq, hidden] -> (u [tokens, hidden], weights, ids [tokens, top_k])."""
    layer = graph.merge(params)
    batch, seq, hidden = h.shape
    u = layer.post_norm(h).reshape(batch * seq, hidden)
    weights, ids = layer.ffn.route(u)
    return u, weights, ids


@functools.partial(jax.jit, static_argnums=0)
def experts(graph: StaticGraph, params, h, u, weights, ids, num_valid, expert_weights=None):
    """The layer's routed experts on h (post-mixer residual) [batch, seq, hidden].

    `expert_weights` = (gate_up, down) replaces the layer's own expert weights (the offload runner passes
    weights held outside the layer).
    """
    layer = graph.merge(params)
    if expert_weights is not None:
        layer.ffn.experts_gate_up.set_value(expert_weights[0])
        layer.ffn.experts_down.set_value(expert_weights[1])
    batch, seq, hidden = h.shape
    valid = jnp.broadcast_to(jnp.arange(seq) < num_valid, (batch, seq)).reshape(-1)
    return h + layer.ffn.experts(u, weights, ids, valid).reshape(batch, seq, hidden)


@functools.partial(jax.jit, static_argnums=0)
def dense_ffn(graph: StaticGraph, params, h):
    """A dense model's feed-forward block and residual on h [batch, seq, hidden]."""
    layer = graph.merge(params)
    return h + layer.ffn(layer.post_norm(h))


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("taps",))
def layer_group(graphs: tuple, dense: bool, params: tuple, x, states: tuple, start, num_valid, taps=()):
    """Consecutive whole layers (mixer, then router and experts, or the dense feed-forward block of a model
    without MoE) in one program: graphs, params and states one per layer -> (x, new states, the outputs of
    the group's layers numbered in `taps` (static, indices within the group), in that order).

    A short chunk's three dispatches a layer cost more host time than the device spends on them; one program
    per group of layers removes most of that, and groups of the same layer pattern share one compilation.
    The phases are the same jitted functions, inlined.
    """
    new_states, tapped = [], {}
    for i, (graph, leaves, state) in enumerate(zip(graphs, params, states, strict=True)):
        x, state = mix(graph, leaves, x, state, start, num_valid)
        new_states.append(state)
        if dense:
            x = dense_ffn(graph, leaves, x)
        else:
            u, weights, ids = route(graph, leaves, x)
            x = experts(graph, leaves, x, u, weights, ids, num_valid)
        tapped[i] = x
    return x, tuple(new_states), tuple(tapped[i] for i in taps)


@jax.jit
def embed(table, ids):
    """Token embeddings: table [vocab, hidden], ids [batch, seq] -> [batch, seq, hidden]."""
    return table[ids]


@functools.partial(jax.jit, static_argnums=0)
def head(graph: StaticGraph, params, x_last):
    """Final norm + lm head of the whole model: [batch, hidden] -> [batch, vocab] float32."""
    return graph.merge(params).logits(x_last)


def model_step(model, tokens, states, position):
    """Every layer and the head of `model` (a `HybridLM`) for tokens [batch] at `position`: (logits [batch,
    vocab] float32, new states)."""
    x = model.embed[...][tokens[:, None]]
    new_states = []
    for layer, state in zip(model.layers, states, strict=True):
        x, state = layer(x, state, position, 1)
        new_states.append(state)
    return model.logits(x[:, 0]), new_states


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=4)
def decode(graph: StaticGraph, treedef, leaves, tokens, states, position):
    """Every layer and the head for one token per sequence, in one program (`LayerwiseRunner.decode_step`)."""
    return model_step(graph.merge(jax.tree_util.tree_unflatten(treedef, leaves)), tokens, states, position)


@functools.partial(
    jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5, 7), compiler_options=DEVICE_LOOP_OPTIONS
)
def decode_block(graph: StaticGraph, treedef, sampler, leaves, token, states, position, carry, steps):
    """Up to `sampler.block` decode steps in one program: the device feeds each sampled token back itself, so
    the host enqueues one program per block instead of one per token (`LayerwiseRunner.decode_block`).

    Args:
      sampler: a `BlockSampler` (static): block length, sampling settings and stop ids.
      token: [batch] int32, the last sampled token (not yet fed).
      states: per-layer states holding positions [0, position) (donated).
      position: int32 scalar, the position of `token`.
      carry: (key, finished [batch] bool), donated: the PRNG key and which rows have produced a stop id.
      steps: int32 scalar <= sampler.block, the steps to run; the loop also ends once every row is finished.

    Returns:
      (tokens [batch, block] int32, the sampled tokens, valid up to `count`; count int32; the last token, the
      states, the position after the block, the new carry).
    """
    model = graph.merge(jax.tree_util.tree_unflatten(treedef, leaves))
    return sampler.loop(functools.partial(model_step, model), token, states, position, carry, steps)

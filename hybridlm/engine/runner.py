"""Layer-by-layer jitted execution of the model over one chunk of tokens, and the one-program decode step.

The phases of a layer (mixer, router, experts) are the jitted functions of `hybridlm.engine.phases`; a chunk
runs them four whole layers a program (`phases.layer_group`), or, for per-phase timing, one phase a program.
The Python loop over groups only enqueues work (no host sync) unless timing is asked for. The same phase seams
let the offload runner page expert weights between layers.
A decode step (one token per sequence) is short enough on the device that ~120 such calls would bound it on
the host, so `LayerwiseRunner.decode_step` runs every layer and the head in one program instead.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridlm.engine import phases
from hybridlm.engine.phases import StaticGraph, flat_layer
from hybridlm.model import HybridLM, check_taps, check_token_ids, concat_taps
from hybridlm.sharding import model_mesh, replicated
from hybridlm.state import KVCache, LayerState

PHASES = ("embed", "gdn", "attention", "router", "experts", "head")

# Whole layers a prefill program runs (`LayerwiseRunner.forward_chunk` without per-phase timing): the
# models' pattern of three Gated DeltaNet layers and one attention layer, so that every group of a model is
# one compiled program.
LAYER_GROUP = 4


def check_decode_inputs(vocab_size: int, tokens, states: list[LayerState], position) -> None:
    """Refuses a decode step whose tokens are not one per sequence of the states, whose position falls outside
    the KV cache (below 0, or at or past its capacity: a write there would be clamped onto the last slot, a
    silently wrong answer), or whose token ids fall outside [0, vocab_size) (the embedding gather would clamp
    them too). Shapes are always checked; values only where given on the host (Python / numpy): values held on
    the device are not read back (that would make the host wait for them).

    Raises:
      ValueError: naming the tokens' shape and the states' batch, the position and the capacity and how to
        reserve room (prefill's max_new_tokens), or the token ids' range.
    """
    if states:
        first = states[0]
        batch = (first.key if isinstance(first, KVCache) else first.conv).shape[0]
        if np.shape(tokens) != (batch,):
            raise ValueError(
                f"tokens must be [batch] = [{batch}] (one per sequence of the states), got shape "
                f"{np.shape(tokens)}"
            )
    if not isinstance(tokens, jax.Array):
        check_token_ids(tokens, vocab_size)
    if isinstance(position, jax.Array):
        return
    positions = np.asarray(position)
    if positions.ndim and positions.shape != np.shape(tokens):
        raise ValueError(
            f"positions must be a scalar or one per sequence, shape {np.shape(tokens)}, got {positions.shape}"
        )
    capacity = min((s.capacity for s in states if isinstance(s, KVCache)), default=None)
    if positions.size and int(positions.min()) < 0:
        raise ValueError(f"decode position {int(positions.min())} is negative")
    if capacity is not None and positions.size and int(positions.max()) >= capacity:
        raise ValueError(
            f"decode position {int(positions.max())} is past the KV cache's capacity of {capacity} tokens; "
            f"reserve room for the tokens to decode when prefilling (hybridlm.prefill(..., max_new_tokens=N))"
        )


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


def commit(tree, sharding=None):
    """`tree` with its uncommitted device arrays committed where they lie (an alias: no copy, same buffers).

    jit compiles a program once per kind of input, and an uncommitted array (made without a placement, e.g. by
    jnp.zeros) is another kind than a committed one (placed by `jax.device_put`, or computed from one). A
    model with both (experts placed by a benchmark, the rest not) would give decode states of both kinds and
    compile the one-program step twice, the second time inside the decode loop. Committing the weights makes
    every program output committed. Arrays in host memory are left as they are. `sharding`: where to commit
    them instead (a model on several devices: replicated over its mesh, `hybridlm.sharding`)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.committed and x.sharding.memory_kind in (None, "device"):
            return jax.device_put(x, sharding or x.sharding)
        return x

    return jax.tree_util.tree_map(one, tree)


class LayerwiseRunner:
    """Runs `HybridLM` one chunk at a time through per-layer jitted phases.

    Args:
      model: the model; its weights are split once into per-layer pytrees and committed where they lie (no
        copy, see `commit`).
    """

    def __init__(self, model: HybridLM):
        self.model = model
        self.config = model.config
        graphdef, params = nnx.split(model)
        params = commit(params)  # once: the per-layer views below hold these same arrays
        committed = nnx.merge(graphdef, params)
        self.layers = [
            flat_layer(g, p)  # [(graph, flat weights)]; all GDN layers share one graph
            for g, p in (nnx.split(layer) for layer in committed.layers)
        ]
        self.embed_table = committed.embed[...]
        # the head's pieces for programs that run it without the whole model (the offload runner's decode
        # step): (graph, flat weights) of the final norm, and lm_head (None when tied to the embedding)
        self.final_norm = flat_layer(*nnx.split(committed.final_norm))
        self.lm_head = None if self.config.tie_word_embeddings else committed.lm_head.get_value()
        self.whole = (StaticGraph(graphdef), params)
        # where states and other uncommitted inputs go: None (where they lie), or replicated over the mesh of
        # a model on several devices
        mesh = model_mesh(model)
        self.placement = None if mesh is None else replicated(mesh)

    @functools.cached_property
    def _flat_weights(self) -> tuple:
        """(treedef, leaves) of the whole model's weights: a flat list is quicker to pass to jit per step."""
        leaves, treedef = jax.tree_util.tree_flatten(self.whole[1])
        return treedef, leaves

    def on_prefill_start(self, num_chunks: int = 1) -> None:
        """Hook called by `prefill` before the first of its `num_chunks` chunks (no-op; the offload runner
        resets its statistics and prefetches across chunk boundaries when more chunks follow)."""

    def head_logits(self, x_last: jax.Array) -> jax.Array:
        """Final norm + lm head: [batch, hidden] -> [batch, vocab] float32."""
        return phases.head(*self.whole, x_last)

    def decode_step(
        self, tokens: jax.Array, states: list[LayerState], position
    ) -> tuple[jax.Array, list[LayerState]]:
        """One decode step: every layer and the head in one jitted program (one dispatch per token).

        Args:
          tokens: [batch] int32, one token per sequence.
          states: per-layer states holding positions [0, position) (donated: do not reuse them). Uncommitted
            tokens or states are committed first (`commit`), so that every step runs one compiled program.
          position: absolute position of `tokens` (a Python int or int32 scalar; not static, so one
            compilation serves every step), or [batch] int32, one a sequence (sequences at different
            positions decoded together).

        Returns:
          logits [batch, vocab] float32 for the next position, and the new states.

        Raises:
          ValueError: tokens not one per sequence, a position outside the KV cache, or token ids outside the
            vocabulary (`check_decode_inputs`).
        """
        check_decode_inputs(self.config.vocab_size, tokens, states, position)
        treedef, leaves = self._flat_weights
        return phases.decode(self.whole[0], treedef, leaves, *self.step_inputs(tokens, states, position))

    def decode_block(self, sampler, token, states, position, carry, steps: int) -> tuple:
        """Up to `sampler.block` decode steps in one program, each sampled token fed back on the device
        (`phases.decode_block`; its Args and Returns). `token`, `states` and `carry` are donated.

        Raises:
          ValueError: as `decode_step`, for the block's last position.
        """
        check_decode_inputs(self.config.vocab_size, token, states, position + max(steps, 1) - 1)
        treedef, leaves = self._flat_weights
        token, states, position = self.step_inputs(token, states, position)
        if not all(a.committed for a in carry):
            carry = commit(carry, self.placement)  # one compilation per sampler
        return phases.decode_block(
            self.whole[0], treedef, sampler, leaves, token, states, position, carry, np.int32(steps)
        )

    @property
    def all_experts_fit(self) -> bool:
        """Whether every routed expert is on the device (an offloaded runner's budget may leave some out)."""
        return True

    def speculative_target(self) -> tuple:
        """(target, its traced arguments) that `engine.speculative` verifies drafts with: the whole model."""
        from hybridlm.engine.speculative import ResidentTarget

        graph, leaves = flat_layer(self.whole[0].graphdef, self.whole[1])
        return ResidentTarget(graph), tuple(leaves)

    def step_inputs(self, tokens, states, position) -> tuple:
        """(tokens int32, states, position) as a one-program decode step takes them: tokens and states
        committed (one kind of input every step: one compilation) and a Python position as an int32 scalar
        (not static)."""
        if not (isinstance(tokens, jax.Array) and tokens.dtype == jnp.int32):
            tokens = jnp.asarray(tokens, jnp.int32)  # (a no-op asarray still costs a dispatch)
        if not (tokens.committed and all(a.committed for a in jax.tree_util.tree_leaves(states))):
            tokens, states = commit((tokens, states), self.placement)
        return tokens, states, position if isinstance(position, jax.Array) else np.asarray(position, np.int32)

    def decode_step_layerwise(
        self, tokens: jax.Array, states: list[LayerState], position
    ) -> tuple[jax.Array, list[LayerState]]:
        """`decode_step` through `forward_chunk` (the prefill programs, whose seams the offload runner pages
        experts at) and the head: the same results, with several dispatches a step instead of one.

        Raises:
          ValueError: tokens not one per sequence, a position outside the KV cache, or token ids outside the
            vocabulary (`check_decode_inputs`)."""
        check_decode_inputs(self.config.vocab_size, tokens, states, position)
        x, states = self.forward_chunk(jnp.asarray(tokens, jnp.int32)[:, None], states, position, 1)
        return self.head_logits(x[:, 0]), states

    def forward_chunk(
        self,
        ids: jax.Array,
        states: list[LayerState],
        start,
        num_valid: int,
        timer: PhaseTimer | None = None,
        taps: tuple[int, ...] = (),
    ):
        """Runs all layers over one chunk: `LAYER_GROUP` whole layers a program, or, with an enabled timer,
        each phase of each layer as its own program, timed.

        Args:
          ids: [batch, chunk] int32 token ids (padding after num_valid).
          states: per-layer states before the chunk (donated: do not reuse them).
          start: absolute position of ids[:, 0].
          num_valid: real tokens in the chunk.
          timer: per-phase timing, or None.
          taps: layer indices whose outputs are returned too (a DFlash draft's features); () for none.

        Returns:
          hidden [batch, chunk, hidden] after the last layer (before the final norm), and the new states;
          with taps, also the features [batch, chunk, len(taps) * hidden]: the tapped layers' outputs
          concatenated in `taps` order (`model.concat_taps`).

        Raises:
          ValueError: a tap outside the model's layers.
        """
        taps = check_taps(taps, self.config.num_layers)
        timer = timer or PhaseTimer(False)
        if not all(a.committed for a in jax.tree_util.tree_leaves(states)):
            # as the programs' outputs are: the next chunk's programs compile nothing
            states = commit(states, self.placement)
        start = jnp.asarray(start, jnp.int32)
        num_valid = jnp.asarray(num_valid, jnp.int32)
        x = timer("embed", phases.embed, self.embed_table, ids)
        if not timer.enabled:
            x, new_states, tapped = self._forward_groups(x, states, start, num_valid, taps)
        else:
            new_states, tapped = [], {}
            for i, ((graph, params), state, layer_type) in enumerate(
                zip(self.layers, states, self.config.layer_types, strict=False)
            ):
                phase = "gdn" if layer_type == "linear_attention" else "attention"
                x, state = timer(phase, phases.mix, graph, params, x, state, start, num_valid)
                new_states.append(state)
                if self.config.moe is None:
                    x = timer("experts", phases.dense_ffn, graph, params, x)
                else:
                    u, weights, expert_ids = timer("router", phases.route, graph, params, x)
                    x = timer("experts", phases.experts, graph, params, x, u, weights, expert_ids, num_valid)
                if i in taps:
                    tapped[i] = x
        return (x, new_states, concat_taps(tapped, taps)) if taps else (x, new_states)

    def _forward_groups(
        self, x, states, start, num_valid, taps=()
    ) -> tuple[jax.Array, list[LayerState], dict]:
        """All layers over one chunk, `LAYER_GROUP` whole layers a program (`phases.layer_group`): (x, new
        states, {tapped layer: its output})."""
        dense = self.config.moe is None
        new_states: list[LayerState] = []
        tapped = {}
        for g in range(0, len(self.layers), LAYER_GROUP):
            graphs, params = zip(*self.layers[g : g + LAYER_GROUP], strict=True)
            group = tuple(states[g : g + LAYER_GROUP])
            here = tuple(sorted({i - g for i in taps if g <= i < g + LAYER_GROUP}))
            x, out, outputs = phases.layer_group(graphs, dense, params, x, group, start, num_valid, taps=here)
            new_states.extend(out)
            tapped.update({g + i: y for i, y in zip(here, outputs, strict=True)})
        return x, new_states, tapped

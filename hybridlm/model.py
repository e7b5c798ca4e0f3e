"""The hybrid model: embedding -> layers (Gated DeltaNet or gated attention, each + MoE) -> norm -> lm head.

    x = E[ids];  for each layer: h = x + Mixer(RMSNorm(x));  x = h + FFN(RMSNorm(h));
    logits = RMSNorm(x) W_lm
Source: HF `Qwen3_5MoeTextModel.forward`, `Qwen3_5MoeDecoderLayer.forward`; spec §2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridlm.config import ModelConfig
from hybridlm.layers.gated_attention import GatedAttention
from hybridlm.layers.gated_deltanet import GatedDeltaNet
from hybridlm.layers.linear import head_matmul
from hybridlm.layers.moe import DenseMLP, SparseMoE
from hybridlm.layers.norms import RMSNorm
from hybridlm.state import GatedDeltaNetState, LayerState, TreeKV


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: mixer (Gated DeltaNet or gated attention) then sparse MoE (or dense MLP)."""

    def __init__(self, config: ModelConfig, layer_type: str, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.layer_type = layer_type
        self.input_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, dtype=dtype)
        mixer_cls = GatedDeltaNet if layer_type == "linear_attention" else GatedAttention
        self.mixer = mixer_cls(config, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, dtype=dtype)
        ffn_cls = SparseMoE if config.moe is not None else DenseMLP
        self.ffn = ffn_cls(config, dtype=dtype, rngs=rngs)

    def mix(
        self, x: jax.Array, state: LayerState | None, start, num_valid
    ) -> tuple[jax.Array, LayerState | None]:
        """x + mixer(input_norm(x)); [batch, seq, hidden] -> same, and the layer's new state."""
        u = self.input_norm(x)
        if self.layer_type == "linear_attention":
            out, state = self.mixer(u, state, num_valid)
        else:
            out, state = self.mixer(u, state, start)
        return x + out, state

    def __call__(
        self, x: jax.Array, state: LayerState | None = None, start=0, num_valid=None
    ) -> tuple[jax.Array, LayerState | None]:
        h, state = self.mix(x, state, start, num_valid)
        valid = (
            None if num_valid is None else jnp.broadcast_to(jnp.arange(x.shape[1]) < num_valid, x.shape[:2])
        )
        return h + self.ffn(self.post_norm(h), valid), state

    def verify(self, x: jax.Array, state: LayerState, start) -> tuple[jax.Array, LayerState]:
        """The layer over a few tokens [batch, seq, hidden] at absolute position `start` (a speculative
        verify): a Gated DeltaNet layer returns its state after every token (`GatedDeltaNet.verify`, a leading
        [seq] axis), an attention layer its KV cache with all of them written."""
        h, state = self.verify_mix(x, state, start)
        return h + self.ffn(self.post_norm(h)), state

    def verify_mix(self, x: jax.Array, state: LayerState, start) -> tuple[jax.Array, LayerState]:
        """`verify`'s mixer and residual alone (the offload runner pages the experts after it)."""
        u = self.input_norm(x)
        if self.layer_type == "linear_attention":
            out, state = self.mixer.verify(u, state)
        else:
            out, state = self.mixer(u, state, start)
        return x + out, state

    def verify_tree(
        self,
        x: jax.Array,
        state: LayerState,
        start,
        parents: jax.Array,
        depth: jax.Array,
        ancestors: jax.Array,
        valid: jax.Array | None = None,
    ) -> tuple[jax.Array, GatedDeltaNetState | TreeKV]:
        """The layer over the nodes of a token tree [batch, nodes, hidden] whose root is at absolute position
        `start` (a tree verify): a Gated DeltaNet layer returns every node's state
        (`GatedDeltaNet.verify_tree`, a leading [nodes] axis), an attention layer the cache unchanged and the
        nodes' keys and values (`TreeKV`). The MoE runs over all nodes at once, `valid` ([batch, nodes] bool
        or None) marking the padding nodes, which get no routed experts."""
        h, state = self.verify_tree_mix(x, state, start, parents, depth, ancestors)
        return h + self.ffn(self.post_norm(h), valid), state

    def verify_tree_mix(
        self,
        x: jax.Array,
        state: LayerState,
        start,
        parents: jax.Array,
        depth: jax.Array,
        ancestors: jax.Array,
    ) -> tuple[jax.Array, GatedDeltaNetState | TreeKV]:
        """`verify_tree`'s mixer and residual alone (the offload runner pages the experts after it)."""
        u = self.input_norm(x)
        if self.layer_type == "linear_attention":
            out, state = self.mixer.verify_tree(u, state, parents)
        else:
            out, (key, value) = self.mixer.verify_tree(u, state, start, depth, ancestors)
            state = TreeKV(cache=state, key=key, value=value)
        return x + out, state


def check_token_ids(ids, vocab_size: int) -> None:
    """Raises ValueError where host-side token ids (numpy, lists) fall outside [0, vocab_size): the embedding
    gather would clamp them, a silently wrong answer."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{ids.min()}, {ids.max()}]")


def check_taps(taps, num_layers: int) -> tuple[int, ...]:
    """`taps` (layer indices whose outputs a forward also returns) as a tuple of ints.

    Raises:
      ValueError: an index outside [0, num_layers)."""
    taps = tuple(int(i) for i in taps)
    outside = [i for i in taps if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"tap layers {outside} are not layers of the {num_layers}-layer model")
    return taps


def concat_taps(outputs: dict, taps: tuple[int, ...]) -> jax.Array:
    """The tapped layers' outputs [batch, seq, hidden] (`outputs`: layer index -> output) concatenated in
    `taps` order: [batch, seq, len(taps) * hidden], the feature rows of a DFlash or EAGLE-3 draft."""
    return jnp.concatenate([outputs[i] for i in taps], axis=-1)


def head_logits(final_norm, head_weight: jax.Array, hidden: jax.Array) -> jax.Array:
    """final_norm(hidden) @ head_weight: [..., hidden] -> [..., vocab] float32 (`HybridLM.logits`, and
    programs that hold the head's pieces without the model, e.g. the offload runner's decode step)."""
    return head_matmul(final_norm(hidden), head_weight)


class HybridLM(nnx.Module):
    """Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid language model (text only).

    Calling the model on input_ids [batch, seq] (int32) returns logits [batch, seq, vocab] (float32) of one
    full causal forward. Chunked prefill with a cache and decode live in `hybridlm.engine`.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(), (config.vocab_size, config.hidden_dim), dtype)
        )  # [vocab, hidden]
        self.layers = nnx.List([DecoderLayer(config, t, dtype=dtype, rngs=rngs) for t in config.layer_types])
        self.final_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, dtype=dtype)
        if not config.tie_word_embeddings:
            init = nnx.initializers.normal(config.hidden_dim**-0.5)
            self.lm_head = nnx.Param(init(rngs.params(), (config.hidden_dim, config.vocab_size), dtype))

    def head_weight(self):
        """[hidden, vocab]: lm_head (a float array, or `QuantizedWeights` [1, hidden, vocab] when loaded with
        keep_quantized="experts+head"), or the transposed embedding when tied."""
        return self.embed[...].T if self.config.tie_word_embeddings else self.lm_head.get_value()

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + lm head: [..., hidden] -> [..., vocab] float32."""
        return head_logits(self.final_norm, self.head_weight(), hidden)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """input_ids [batch, seq] int -> logits [batch, seq, vocab] float32 (no cache).

        Raises:
          ValueError: input_ids not [batch, seq], or (given on the host: numpy or lists) ids outside
            [0, vocab_size), which the embedding gather would clamp. Ids held on the device are not read back.
        """
        if np.ndim(input_ids) != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {np.shape(input_ids)}")
        if not isinstance(input_ids, jax.Array):
            check_token_ids(input_ids, self.config.vocab_size)
        x = self.embed[...][input_ids]
        for layer in self.layers:
            x, _ = layer(x)
        return self.logits(x)


EXPERT_FORMATS = ("int8", "int4")
EXPERT_PARAMS = ("experts_gate_up", "experts_down")  # the routed experts' parameters in each layer's ffn


def loaded_value(path: tuple, value, dtype, expert_sink=None):
    """What a checkpoint loader sets parameter `path` (e.g. ("layers", i, "ffn", name)) to: `value`, or, for a
    routed-expert parameter (EXPERT_PARAMS) when an `expert_sink` is given, a 1-element `dtype` placeholder
    after handing `value` to expert_sink(layer, name, value) (`hybridlm.offload.load_offloaded`)."""
    if expert_sink is None or path[-1] not in EXPERT_PARAMS:
        return value
    expert_sink(path[1], path[-1], value)
    return jnp.zeros((1, 1, 1), dtype)


def init_random(
    config: ModelConfig, seed: int = 0, *, dtype=jnp.float32, expert_format: str | None = None
) -> HybridLM:
    """A model with random weights drawn so that activations and logits stay O(1).

    Projections ~ N(0, 1/fan_in), norms near their identity, A_log and dt_bias spread like trained models, so
    random-weight runs exercise realistic routing and decay. Used for tests, demos and benchmarks.

    Args:
      config: the architecture.
      seed: PRNG seed (same seed, same weights).
      dtype: parameter and activation dtype (jnp.float32 or jnp.bfloat16).
      expert_format: None keeps routed-expert weights in `dtype`; "int8" or "int4" stores them as
        `QuantizedWeights` (per-32 blocks along the input dim), quantized tensor by tensor so the
        full-precision experts never exist all at once (a 35B model with int8 experts fits an 80 GB GPU).

    Raises:
      ValueError: unknown expert_format.
    """
    if expert_format not in (None, *EXPERT_FORMATS):
        raise ValueError(f"unknown expert_format {expert_format!r}; choose from {EXPERT_FORMATS} or None")
    abstract = nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(seed)))  # no memory yet
    graphdef, state = nnx.split(abstract)
    on_cpu = (
        jax.default_backend() == "cpu"
    )  # numpy draws fast on CPU; jitted draws per tensor on accelerators
    key, rng = jax.random.key(seed + 1), np.random.default_rng(seed + 1)
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        name, value = path[-1], var.get_value()
        if hasattr(value, "shape"):
            shape, vdtype = tuple(value.shape), value.dtype
            if on_cpu:
                var.set_value(jnp.asarray(_random_param(name, rng, shape, np).astype(vdtype)))
            else:
                var.set_value(random_param_jax(name, jax.random.fold_in(key, i), shape, vdtype))
            if expert_format and name in EXPERT_PARAMS:
                var.set_value(quantize_experts(var.get_value(), expert_format))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _random_param(name: str, rng, shape: tuple[int, ...], xp):
    """One random parameter by its role (see `init_random`); rng/xp: a numpy Generator and numpy, or a
    function of (kind, shape) and jax.numpy."""
    normal = (
        (lambda: rng.standard_normal(shape, dtype=np.float32)) if xp is np else (lambda: rng("normal", shape))
    )
    uniform = (
        (lambda lo, hi: rng.uniform(lo, hi, shape).astype(np.float32))
        if xp is np
        else (lambda lo, hi: lo + (hi - lo) * rng("uniform", shape))
    )
    if name in ("scale", "q_norm", "k_norm"):
        return 0.1 * normal()
    if name == "output_norm":
        return 1.0 + 0.1 * normal()
    if name == "log_decay_rate":
        return xp.log(uniform(1.0, 16.0))
    if name == "delta_time_bias":
        return uniform(-2.0, 1.0)
    if name == "conv_weight":
        return normal() / np.sqrt(shape[0])
    if name == "embed":
        return normal()
    if name == "router":
        return normal() * (2.0 / np.sqrt(shape[0]))
    if name == "shared_token_gate":
        return normal() / np.sqrt(shape[0])
    return normal() / np.sqrt(shape[-2])  # projections: [..., fan_in, fan_out]


@functools.partial(jax.jit, static_argnums=1)
def quantize_experts(w: jax.Array, expert_format: str):
    """Routed-expert weights [experts, k, n] as `QuantizedWeights`: "int8" (`quantize_int8`, symmetric,
    Q8_0-like) or "int4" (`quantize_int4`, scale and offset, Q4_1-like), blocks of 32 along k."""
    from pallas_kernels.quantized import quantize_int4, quantize_int8

    return (quantize_int8 if expert_format == "int8" else quantize_int4)(w)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def random_param_jax(name: str, key: jax.Array, shape: tuple[int, ...], vdtype) -> jax.Array:
    """One random parameter `name` of `shape` drawn on the device from `key`, as `init_random` draws it."""

    def draw(kind, shape):
        return jax.random.normal(key, shape) if kind == "normal" else jax.random.uniform(key, shape)

    return _random_param(name, draw, shape, jnp).astype(vdtype)

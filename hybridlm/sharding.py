"""Several devices of one host through `jax.sharding`: the routed experts partitioned over a mesh axis (expert
parallelism), everything else replicated.

A sparse MoE layer's routed experts are ~97% of the weights of these models (Qwen3-Next-80B-A3B: ~77 B of its
~80 B parameters), so they are what outgrows one device. `shard_model` places every layer's experts
[experts, ...] split along their first axis over the mesh's "expert" axis (`NamedSharding(mesh,
P("expert"))`, device d holding experts [d * E / n, (d + 1) * E / n)) and every other weight, the decode state
and the activations replicated. In a layer, `expert_parallel` runs the routed experts under `shard_map`: each
device takes the token copies routed to its own experts (the others go to the grouped matmul's dropped
group, so no device computes another's rows), runs the same sort-by-expert grouped matmul on them, and one
`psum` over the axis adds the devices' partial sums: per layer and chunk, an all-reduce of the [tokens,
hidden] output (XLA's collectives, NCCL on GPU). Attention, the Gated DeltaNet layers, the router and the
shared expert run replicated: each device computes them for every token (they are a small part of a chunk's
time and need no communication).

Source: expert parallelism as GShard (Lepikhin et al. 2020, §2.2) places experts, here with replicated
tokens and a sum instead of an all-to-all, which reads each expert's weights on one device only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The mesh axis the routed experts are split over.
EXPERT_AXIS = "expert"


def expert_mesh(devices: int | Sequence | None = None) -> Mesh:
    """A one-axis mesh ("expert") over `devices`: a count (the first that many of `jax.devices()`), a
    sequence of devices, or None (all of them).

    Raises:
      ValueError: a count below 1 or above the devices present (naming both), or an empty sequence.
    """
    available = jax.devices()
    if devices is None:
        chosen = available
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices}: this process sees {len(available)} device(s) "
                f"({available[0].platform}); ask for 1 to {len(available)}"
            )
        chosen = available[:devices]
    else:
        chosen = list(devices)
        if not chosen:
            raise ValueError("devices is an empty sequence")
    return Mesh(np.array(chosen), (EXPERT_AXIS,))


def expert_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays with a leading expert axis, split over the mesh's expert axis."""
    return NamedSharding(mesh, P(EXPERT_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Arrays held whole on every device of the mesh."""
    return NamedSharding(mesh, P())


def check_shardable(config, mesh: Mesh) -> None:
    """Raises ValueError unless `config`'s routed experts split evenly over the mesh's devices."""
    n = mesh.shape[EXPERT_AXIS]
    if n == 1:
        return
    if config.moe is None:
        raise ValueError(f"{n} devices split the routed experts, and {config.name} has none (a dense model)")
    if config.moe.num_experts % n:
        raise ValueError(
            f"{config.moe.num_experts} experts do not split evenly over {n} devices; use a device count that "
            f"divides {config.moe.num_experts}"
        )


def shard_model(model, mesh: Mesh):
    """Places `model` (a `HybridLM`) on `mesh`: routed experts split over the expert axis, the rest
    replicated, and each MoE layer set to run its experts through `expert_parallel`. In place; returns the
    model. Arrays already placed so are not copied.

    Raises:
      ValueError: experts that do not split evenly over the devices (`check_shardable`).
    """
    from flax import nnx

    from hybridlm.model import EXPERT_PARAMS

    check_shardable(model.config, mesh)
    by_expert, whole = expert_sharding(mesh), replicated(mesh)
    for layer in model.layers:
        ffn = layer.ffn
        if hasattr(ffn, "expert_mesh"):
            for name in EXPERT_PARAMS:
                var = getattr(ffn, name)
                var.set_value(jax.device_put(var.get_value(), by_expert))
            ffn.expert_mesh = mesh
    experts = {
        id(getattr(layer.ffn, n)) for layer in model.layers for n in EXPERT_PARAMS if hasattr(layer.ffn, n)
    }
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and id(var) not in experts:
            var.set_value(jax.tree_util.tree_map(lambda a: jax.device_put(a, whole), var.get_value()))
    return model


def model_mesh(model) -> Mesh | None:
    """The mesh `shard_model` placed `model` on, or None for a model on one device."""
    for layer in model.layers:
        mesh = getattr(layer.ffn, "expert_mesh", None)
        if mesh is not None:
            return mesh
    return None


def expert_parallel(
    mesh: Mesh, routed_experts, x, weights, expert_ids, gate_up, down, *, valid=None, implementation=None
) -> jax.Array:
    """`routed_experts(x, weights, expert_ids, gate_up, down, ...)` with gate_up / down split over the mesh's
    expert axis: each device runs its own experts' copies, one psum adds the partial outputs.

    Args:
      mesh: the expert mesh; routed_experts: `hybridlm.layers.moe.routed_experts`.
      x: [tokens, hidden]; weights, expert_ids: [tokens, top_k] (global expert ids), replicated.
      gate_up, down: [experts, ...] arrays or `QuantizedWeights`, split over the expert axis.
      valid: [tokens] bool or None; implementation: the grouped-matmul implementation.

    Returns:
      [tokens, hidden] in x.dtype, replicated.
    """
    n = mesh.shape[EXPERT_AXIS]
    local = jax.tree_util.tree_leaves(gate_up)[0].shape[0] // n
    valid_in = jnp.ones(x.shape[:1], bool) if valid is None else valid

    def on_device(x, weights, ids, gate_up, down, valid):
        first = jax.lax.axis_index(EXPERT_AXIS) * local
        mine = (ids >= first) & (ids < first + local)
        # another device's copies go to the dropped group past the local experts
        ids = jnp.where(mine, ids - first, local)
        weights = jnp.where(mine, weights, jnp.zeros_like(weights))
        part = routed_experts(x, weights, ids, gate_up, down, valid=valid, implementation=implementation)
        return jax.lax.psum(part.astype(jnp.float32), EXPERT_AXIS).astype(x.dtype)

    spec = P(EXPERT_AXIS)
    experts_spec = (
        jax.tree_util.tree_map(lambda _: spec, gate_up),
        jax.tree_util.tree_map(lambda _: spec, down),
    )
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(P(), P(), P(), *experts_spec, P()),
        out_specs=P(),
        check_vma=False,
    )(x, weights, expert_ids, gate_up, down, valid_in)

"""The Mosaic GPU walk on batch rows as a pipeline: the chunks cut into pieces, each prepared and walked by
its own launches, so that a CUDA graph with concurrent regions (`gpu_limits.enable_concurrent_regions`) runs
piece i + 1's prepare beside piece i's walk, which leaves SMs idle; without them the launches run one after
another (same result)."""

import itertools

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_limits, tuning
from pallas_kernels.gated_delta_rule import prepare, state_pass_mosaic

# Without a tuning table ("gated_delta_rule.walk_pipeline"): the pieces of the pipeline
# (`Config.walk_pipeline` None) and the fewest chunks a piece must have (below, the launches cost more than
# the overlap gains).
DEFAULTS = {"pieces": 4, "min_chunks": 64}


def num_pieces(config, num_chunks: int) -> int:
    """How many pieces `pipelined_walk` cuts `num_chunks` chunks into (1: no pipeline):
    `config.walk_pipeline`, at most one per chunk; None: the tuned pieces (`DEFAULTS`) where XLA_FLAGS enable
    CUDA-graph concurrent regions (`gpu_limits.concurrent_regions_enabled`) and each piece gets enough chunks,
    else 1.

    Raises:
      ValueError: walk_pipeline < 1.
    """
    count = config.walk_pipeline
    if count is None:
        tuned = {**DEFAULTS, **tuning.lookup("gated_delta_rule.walk_pipeline")}
        enough = num_chunks >= tuned["pieces"] * tuned["min_chunks"]
        count = tuned["pieces"] if enough and gpu_limits.concurrent_regions_enabled() else 1
    if count < 1:
        raise ValueError(f"Config.walk_pipeline={count} must be >= 1")
    return max(1, min(count, num_chunks))


def pipelined_walk(q, k, v, g, bt, initial_state, *, pieces, scale, chunk_size, config, **common_args):
    """Prepare and Mosaic GPU walk on batch rows, the chunks cut into `pieces` (1 <= pieces <= chunks).

    Prepare i reads q, k, g, beta from its first chunk on and waits for prepare i - 1 (an optimization barrier
    on g: else a concurrent graph would start every prepare at once); walk i takes walk i - 1's final state
    and writes its rows of one output buffer (a `jax.Ref`). Arguments as `chunk.run_stages` takes them.

    Returns:
      (output [b, t, v_heads, value_dim] bf16, final state [b, v_heads, key_dim, value_dim] f32).
    """
    edges = [g.shape[2] // chunk_size * i // pieces for i in range(pieces + 1)]
    prepared, before = [], None
    options = dict(scale=scale, chunk_size=chunk_size, config=config, p_in_walk=bool(config.p_in_walk))
    for first, end in itertools.pairwise(edges):
        g_in = g if before is None else jax.lax.optimization_barrier((g, before))[0]
        piece = dict(chunk_offset=first, num_chunks=end - first, decay_factors=True)
        t_beta, exp_to_last, exp_gamma, p, _, _ = prepare.prepare(
            q, k, v, g_in, bt, **piece, **options, **common_args
        )
        gamma, p = (p, None) if config.p_in_walk else (None, p)  # with P in the walk, p is gamma (its P mask)
        prepared.append((first, t_beta, p, gamma, (exp_gamma, exp_to_last)))
        before = exp_gamma
    out = jax.empty_ref(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16))
    state = initial_state
    for first, t_beta, p, gamma, decays in prepared:
        walk = dict(scale=scale, chunk_offset=first, out=out, max_concurrent_steps=config.mosaic_stages)
        _, state = state_pass_mosaic.state_pass(q, k, v, t_beta, p, gamma, state, decays=decays, **walk)
    return jax.freeze(out), state

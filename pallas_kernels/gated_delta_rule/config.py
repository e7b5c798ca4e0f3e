"""Launch configuration of the Pallas gated delta rule: `Config`, its heuristic and the per-device tuning
table.

`resolve` takes the heuristic (`Config()`, what unknown devices run) updated by the device's tuning table
(`tuning.lookup("gated_delta_rule.<backend>", shape_class)`), then fitted to the device's shared memory;
fields left None are decided per call by the rules beside them.
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import gpu_limits, tuning

SHAPE_CLASSES = ("batch_rows", "packed", "packed_own_grid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiles and launch parameters of the prepare and the state pass."""

    state_block_v: int = 32  # Triton state pass: value columns per program
    state_warps: int = 4  # Triton state pass: warps per program
    state_stages: int = 3  # Triton state pass: software-pipelining depth (fitted to shared memory)
    prepare_warps: int | None = None  # None: 1 where the prepare writes T diag(beta) alone, else 2
    prepare_pipeline_stages: int | None = None  # None: 2 where the prepare forms P, else Pallas' default
    prepare_chunks: int | None = (
        None  # chunks per prepare program; None: `prepare.prepare_chunks_per_program`
    )
    # The prepare writes T diag(beta) and the state pass forms U - W h from it (fewer bytes than W and U);
    # None: on, except for packed sequences read in place by the Triton walk (V would need a chunk-aligned
    # copy).
    wy_in_state: bool | None = None
    mosaic_stages: int = 2  # Mosaic GPU walk: TMA pipeline depth (3 do not fit in shared memory)
    # Mosaic GPU walk on batch rows: the chunks cut into this many pieces, each prepared and walked by its own
    # launches, so that a CUDA graph with concurrent regions overlaps piece i + 1's prepare with piece i's
    # walk. None: `walk_pipeline.num_pieces`.
    walk_pipeline: int | None = None
    # Mosaic GPU walk: a fourth warpgroup forms P from the Q and K tiles it streams (the prepare neither reads
    # Q nor writes P). None: on for packed sequences on their own chunk grid, where the walk is not the
    # bottleneck.
    p_in_walk: bool | None = None


def shape_class(packed: bool, own_grid: bool) -> str:
    """The tuning table's shape class of a call: batch rows, packed sequences regathered, or on their own
    grid."""
    return "packed_own_grid" if own_grid else "packed" if packed else "batch_rows"


def resolve(
    config: Config | None,
    backend: str,
    *,
    packed: bool,
    own_grid: bool,
    interpret: bool,
    chunk_size: int,
    key_dim: int,
    compute_dtype,
    **_,
) -> Config:
    """The call's configuration: None = the heuristic (`Config()`) updated by the running device's tuning
    table (`tuning.lookup("gated_delta_rule.<backend>", shape_class)`) and fitted to the device's shared
    memory (none in the interpreter); an explicit config is the caller's choice. Then `wy_in_state` and
    `p_in_walk` left None are decided by their rules."""
    fitted = config is None
    if fitted:
        tuned = tuning.lookup(f"gated_delta_rule.{backend}", shape_class(packed, own_grid))
        config = dataclasses.replace(Config(), **tuned)
    if config.wy_in_state is None:  # the Mosaic GPU walk always takes T diag(beta)
        config = dataclasses.replace(config, wy_in_state=backend == "mosaic" or not packed)
    if config.p_in_walk is None:
        config = dataclasses.replace(config, p_in_walk=own_grid)
    if fitted:
        limit = None if interpret else gpu_limits.shared_memory_limit()
        itemsize = jnp.dtype(compute_dtype).itemsize
        config = fit_shared_memory(config, limit, chunk_size=chunk_size, key_dim=key_dim, itemsize=itemsize)
    return config


def state_pass_shared_memory(config: Config, *, chunk_size: int, key_dim: int, itemsize: int) -> int:
    """Estimated shared memory (bytes) of one Triton state-pass program: `state_stages` copies of the tiles
    each chunk step feeds to the tensor cores (W, K and Q [chunk, key_dim], P [chunk, chunk]), as Triton's
    software pipeline buffers them. With `wy_in_state` (None counts as off): T [chunk, chunk] in place of W,
    and one more K tile, as profiled."""
    per_stage = chunk_size * key_dim * itemsize * 3 + chunk_size**2 * itemsize
    if config.wy_in_state:  # T [chunk, chunk] in place of W, and K [chunk, key_dim] in a second layout
        per_stage += chunk_size * (chunk_size - key_dim) * itemsize + chunk_size * key_dim * itemsize
    return config.state_stages * per_stage


def fit_shared_memory(config: Config, limit: int | None, **sizes) -> Config:
    """`config` with fewer state-pass stages (down to 1) while `state_pass_shared_memory` exceeds `limit`
    (None: no limit): 3 stages of bf16 tiles fit a 227 KiB block but not 163 KiB or 99 KiB, where Triton would
    refuse to compile the kernel."""
    while limit is not None and config.state_stages > 1 and state_pass_shared_memory(config, **sizes) > limit:
        config = dataclasses.replace(config, state_stages=config.state_stages - 1)
    return config

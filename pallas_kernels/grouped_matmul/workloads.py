"""Named grouped-matmul workloads and their inputs, shared by the tests and `python -m benchmarks gmm`.

Group sizes are drawn like a real top-k router: expert probabilities from a Dirichlet(2.0) over the groups,
then a multinomial of the routed rows (the same recipe as the peer timings in shared/peers/tokamax_gmm.py).
Adversarial layouts (empty groups, every row in one group, rows past the last group) exercise the
schedule's corner cases.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import QuantizedWeights, quantize_int4, quantize_int8

Layout = Literal["router", "uniform", "one_group", "empty_groups", "first_last", "partial", "all_padding"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One grouped matmul: lhs [m, k] x rhs [groups, k, n] with group sizes drawn by `layout`.

    `routed_rows` (<= m) is sum(group_sizes); the rows after it belong to no group.
    """

    name: str
    m: int
    k: int
    n: int
    groups: int
    layout: Layout = "router"
    routed_rows: int | None = None
    tags: tuple[str, ...] = ()

    @property
    def flops(self) -> int:
        """Useful multiply-add FLOPs, 2 * routed_rows * k * n."""
        return 2 * (self.m if self.routed_rows is None else self.routed_rows) * self.k * self.n


# Qwen3.5/3.6-35B-A3B experts: hidden 2048, expert ffn 512 (gate+up = 1024 columns), 256 experts, top-8.
WORKLOADS = {
    w.name: w
    for w in [
        Workload(name="tiny_router", m=64, k=64, n=64, groups=8, tags=("ci_tests",)),
        Workload(
            name="tiny_partial",
            m=70,
            k=64,
            n=48,
            groups=8,
            layout="partial",
            routed_rows=53,
            tags=("ci_tests",),
        ),
        Workload(name="tiny_one_group", m=40, k=32, n=32, groups=4, layout="one_group", tags=("ci_tests",)),
        Workload(name="tiny_empty", m=48, k=64, n=32, groups=16, layout="empty_groups", tags=("ci_tests",)),
        Workload(name="tiny_first_last", m=33, k=64, n=32, groups=4, layout="first_last", tags=("ci_tests",)),
        Workload(
            name="tiny_all_padding",
            m=24,
            k=32,
            n=32,
            groups=4,
            layout="all_padding",
            routed_rows=0,
            tags=("ci_tests",),
        ),
        Workload(name="tiny_512_groups", m=96, k=32, n=32, groups=512, tags=("ci_tests",)),
        # Prefill: 8192 tokens x top-8 = 65536 routed rows; gate_up (n = 2 * 512) and down (k = 512).
        Workload(name="prefill_gate_up", m=65536, k=2048, n=1024, groups=256, tags=("primary",)),
        Workload(name="prefill_down", m=65536, k=512, n=2048, groups=256, tags=("primary",)),
        # 512 tokens x top-8: every expert's weights are read for ~16 rows each: weight-read bound.
        Workload(name="small_gate_up", m=4096, k=2048, n=1024, groups=256, tags=("primary", "weight_bound")),
    ]
}


def group_sizes_for(w: Workload, seed: int = 1) -> np.ndarray:
    """`[groups]` int32 group sizes for `w` (host numpy; move to device with jnp.asarray)."""
    routed = w.m if w.routed_rows is None else w.routed_rows
    g = w.groups
    if w.layout in ("router", "partial"):
        p = np.random.default_rng(0).dirichlet(np.ones(g) * 2.0)
        sizes = np.random.default_rng(seed).multinomial(routed, p)
    elif w.layout == "uniform":
        sizes = np.full(g, routed // g)
        sizes[: routed % g] += 1
    elif w.layout == "one_group":
        sizes = np.zeros(g, np.int64)
        sizes[g // 2] = routed
    elif w.layout == "empty_groups":  # every other group empty, the rest skewed
        live = np.arange(0, g, 2)
        p = np.random.default_rng(0).dirichlet(np.ones(live.size) * 0.5)
        sizes = np.zeros(g, np.int64)
        sizes[live] = np.random.default_rng(seed).multinomial(routed, p)
    elif w.layout == "first_last":  # only the first and the last group
        sizes = np.zeros(g, np.int64)
        sizes[0], sizes[-1] = routed // 3, routed - routed // 3
    elif w.layout == "all_padding":
        sizes = np.zeros(g, np.int64)
    else:
        raise ValueError(f"unknown layout {w.layout!r}")
    assert sizes.sum() == routed
    return sizes.astype(np.int32)


def make_inputs(
    w: Workload,
    *,
    dtype=jnp.bfloat16,
    weights: Literal["float", "int8", "int4"] = "float",
    swiglu: bool = False,
    seed: int = 0,
    on_device_rng: bool = False,
):
    """Random (lhs, rhs, group_sizes) for `w`.

    Args:
      w: the workload.
      dtype: lhs dtype, and rhs dtype for float weights.
      weights: "float", or quantized "int8" / "int4" (`QuantizedWeights` from random float weights).
      swiglu: if True rhs has 2 * n columns (w_gate_up) so the result has n columns.
      seed: PRNG seed for the values (group sizes use `group_sizes_for`).
      on_device_rng: draw values with jax.random on the default device (benchmark sizes) instead of numpy
        (tiny test sizes, where jax.random would compile once per shape).

    Returns:
      lhs `[m, k]` in dtype (standard normal), rhs `[groups, k, n or 2n]` (normal * k**-0.5, so outputs are
      O(1)) or QuantizedWeights, group_sizes `[groups]` int32 on device.
    """
    n = 2 * w.n if swiglu else w.n
    if on_device_rng:
        k_lhs, k_rhs = jax.random.split(jax.random.PRNGKey(seed))
        lhs = jax.random.normal(k_lhs, (w.m, w.k), dtype)
        rhs = jax.random.normal(k_rhs, (w.groups, w.k, n), dtype) * jnp.asarray(w.k**-0.5, dtype)
    else:
        rng = np.random.default_rng(seed)
        lhs = jnp.asarray(rng.standard_normal((w.m, w.k), np.float32), dtype)
        rhs = jnp.asarray(rng.standard_normal((w.groups, w.k, n), np.float32) * w.k**-0.5)
    if weights == "int8":
        rhs: jax.Array | QuantizedWeights = quantize_int8(rhs)
    elif weights == "int4":
        rhs = quantize_int4(rhs)
    else:
        rhs = rhs.astype(dtype)
    return lhs, rhs, jnp.asarray(group_sizes_for(w, seed=seed + 1))

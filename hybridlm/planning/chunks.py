"""The prefill chunk size of least predicted TTFT: a cost model of compute and, with offloaded experts, of
the bytes each chunk re-streams over PCIe (`choose_chunk_size`; docs/offload.md, "Choosing defaults")."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from hybridlm.config import ModelConfig
from hybridlm.engine.prefill import cache_capacity, effective_chunk_size
from hybridlm.planning.memory import (
    DEVICE_OVERHEAD_BYTES,
    activation_bytes,
    device_free_bytes,
    expert_weights,
    gib,
    host_available_bytes,
    state_bytes,
)

# Device-independent constants of the cost model; `pallas_kernels.tuning.lookup("planning")` overrides them
# with the values measured on the running device (docs/offload.md, "Choosing defaults").
HEURISTIC = {
    # pinned host -> device copy rate, 10^9 bytes/s: PCIe 4.0 x16 in practice, the cards this project targets
    "h2d_gbps": 25.0,
    # effective rate of a chunked prefill's matmuls and attention, 10^12 FLOP/s (a quarter of a recent card's
    # dense bf16 peak)
    "prefill_tflops": 100.0,
    # the same on the CPU backend (float32, a few cores)
    "prefill_tflops_cpu": 0.5,
    # a chunk costs as much as this many more tokens (weights read once a chunk, launches, grouped matmuls
    # with few rows an expert): resident prefill tokens/s grows as chunk / (chunk + this)
    "chunk_overhead_tokens": 1500,
    # the largest chunk chosen: beyond it attention's quadratic share grows, and activations outgrow
    # small cards
    "max_chunk_size": 32768,
    # the CPU runs attention through XLA, which writes [heads, chunk, chunk] scores: larger chunks gain
    # nothing there
    "max_chunk_size_cpu": 2048,
}


def tuned(name: str) -> float:
    """Constant `name` of the cost model: the running device's measured value, else `HEURISTIC[name]`."""
    from pallas_kernels import tuning

    return {**HEURISTIC, **tuning.lookup("planning")}[name]


# ----------------------------------------------------------------------------------------------------------
# The cost model: bytes each chunk re-streams, compute time, TTFT
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """What the cost model needs of an offloaded run (`OffloadConfig`'s fields that size the pool).

    Attributes:
      expert_bytes: one expert in a pool slot (its host bytes, `offload.expert_cache.PackedExperts`).
      budget: device bytes of the pool and its staging.
      copy_bytes: one expert as the host stores it, what a copy moves (a GGUF file's Q4_K blocks take fewer
        bytes than the slot); None: expert_bytes.
      cache_policy, prefetch, prefetch_depth, whole_layer, whole_layer_factor: as in `OffloadConfig`.
    """

    expert_bytes: int
    budget: int
    copy_bytes: int | None = None
    cache_policy: str = "static"
    prefetch: str = "auto"
    prefetch_depth: int = 2
    whole_layer: bool | None = None
    whole_layer_factor: int = 4

    @classmethod
    def of_runner(cls, runner) -> OffloadPlan:
        """The plan of an `OffloadedRunner` (its expert bytes, budget and options)."""
        c = runner.offload_config
        return cls(
            expert_bytes=runner.expert_bytes,
            budget=runner.budget,
            copy_bytes=runner.host.layout.nbytes,
            cache_policy=c.cache_policy,
            prefetch=c.prefetch,
            prefetch_depth=c.prefetch_depth,
            whole_layer=c.whole_layer,
            whole_layer_factor=c.whole_layer_factor,
        )


class PoolShape(NamedTuple):
    """How an offloaded run splits its budget for chunks of some size (`Residency._split_budget`)."""

    whole_layer: bool  # whole-layer mode (else exact mode)
    need: int  # experts one layer needs in the pool
    slots: int  # experts the budget holds
    held_layers: int  # layers kept on the device between chunks
    pinned: int  # experts the static policy keeps in exact mode


def pool_shape(config: ModelConfig, plan: OffloadPlan, tokens: int) -> PoolShape:
    """The pool of `plan` for chunks of `tokens` (batch x chunk) tokens, as `hybridlm.offload.residency`
    sizes it: staging for `prefetch_depth + 1` layers in whole-layer mode, and with `static` (or every expert
    fitting) the rest of the budget above one layer's working area held as whole layers."""
    E, L, k = config.moe.num_experts, config.num_layers, config.moe.top_k
    total = plan.budget // plan.expert_bytes
    whole = plan.whole_layer if plan.whole_layer is not None else k * tokens >= plan.whole_layer_factor * E
    need = E if whole else min(k * tokens, E)
    want = 0 if plan.prefetch == "none" else E * (plan.prefetch_depth + 1 if whole else 1)
    if total >= L * E:
        slots, staging = L * E, min(want, total - L * E)
    else:
        staging = max(0, min(want, (total - need) // 2))
        slots = total - staging
    working = need + (staging if plan.prefetch != "none" else 0)
    spare = max(0, slots - working)
    holds = whole and plan.cache_policy != "stream" and (plan.cache_policy == "static" or total >= L * E)
    held = min(L, spare // E) if holds else 0
    pinned = spare if plan.cache_policy == "static" and not holds else 0
    return PoolShape(whole, need, total, held, pinned)


def streamed_bytes(config: ModelConfig, plan: OffloadPlan, tokens: int) -> int:
    """Bytes one chunk of `tokens` (batch x chunk) tokens copies host to device once the pool is warm:
    none where lru, slru or lfu hold every expert; else every expert of the layers not held (whole-layer
    mode), or the experts the chunk touches in the layers the static policy does not pin (exact mode; routing
    taken as uniform: E (1 - (1 - top_k/E)^tokens) a layer)."""
    E, L, k = config.moe.num_experts, config.num_layers, config.moe.top_k
    pool = pool_shape(config, plan, tokens)
    if pool.slots >= L * E and plan.cache_policy in ("lru", "slru", "lfu"):
        return 0
    copy = plan.copy_bytes or plan.expert_bytes
    if pool.whole_layer:
        return (L - pool.held_layers) * E * copy
    touched = E * (1 - (1 - k / E) ** tokens)
    return int((L - pool.pinned // E) * touched * copy)


def active_params(config: ModelConfig) -> int:
    """Weights one prompt token multiplies: the trunk without the embedding (a gather) and the lm head (last
    token only), plus top_k routed experts a layer."""
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_dim
    trunk = config.num_params() - config.num_params(experts_only=True) - config.vocab_size * config.hidden_dim
    experts = config.num_layers * config.moe.top_k * expert_weights(config) if config.moe else 0
    return trunk - head + experts


class ChunkCost(NamedTuple):
    chunk_size: int
    chunks: int
    ttft_s: float  # predicted time to first token, seconds
    streamed: int  # bytes copied host to device (offloaded), 0 resident


def predict_ttft(
    config: ModelConfig,
    prompt_tokens: int,
    chunk_size: int,
    *,
    batch: int = 1,
    offload: OffloadPlan | None = None,
    cpu: bool = False,
) -> ChunkCost:
    """Predicted TTFT of a prefill in chunks of `chunk_size`: per chunk, its compute ((tokens +
    chunk_overhead_tokens) x 2 x active params, plus attention, at prefill_tflops (_cpu with `cpu`, whose
    XLA attention also computes the masked half of each block)) and, offloaded, its copies
    (`streamed_bytes` at h2d_gbps): overlapped in whole-layer mode (the max), one after the other in exact
    mode (the sum)."""
    c = effective_chunk_size(prompt_tokens, chunk_size)
    n = -(-prompt_tokens // c)
    rate = tuned("prefill_tflops_cpu" if cpu else "prefill_tflops") * 1e12
    a = config.attention
    attn_flops = 4 * a.num_heads * a.head_dim * config.layer_types.count("full_attention")
    per_chunk = (batch * c + tuned("chunk_overhead_tokens")) * 2 * active_params(config) / rate
    copy_s, streamed = 0.0, 0
    if offload is not None:
        streamed = streamed_bytes(config, offload, batch * c)
        copy_s = streamed / (tuned("h2d_gbps") * 1e9)
    whole = offload is not None and pool_shape(config, offload, batch * c).whole_layer
    total = 0.0
    for i in range(n):
        context = (i + 1) * c if cpu else i * c + c / 2  # XLA (the CPU) computes the masked half too
        compute = per_chunk + batch * c * context * attn_flops / rate
        total += max(compute, copy_s) if whole else compute + copy_s
    return ChunkCost(c, n, total, n * streamed)


class ChunkChoice(NamedTuple):
    """A prefill chunk size and why it was chosen."""

    chunk_size: int
    reason: str


def choose_chunk_size(
    config: ModelConfig,
    prompt_tokens: int,
    *,
    batch: int = 1,
    max_new_tokens: int = 0,
    dtype="bfloat16",
    memory_left: int | None = None,
    offload: OffloadPlan | None = None,
    backend: str = "gpu",
    max_chunk_size: int | None = None,
) -> ChunkChoice:
    """The prefill chunk size of least predicted TTFT (`predict_ttft`) among the powers of two up to the
    prompt's, whose KV cache, recurrent states and activations fit in `memory_left` and, offloaded, whose
    chunk's experts fit in the budget.

    Args:
      config: the model.
      prompt_tokens: tokens per sequence.
      batch: sequences prefilled together.
      max_new_tokens: tokens decoded afterwards (the KV cache grows with them).
      dtype: activation dtype.
      memory_left: device bytes free for the KV cache, states and activations (after weights and the expert
        pool); None: not bounded.
      offload: the pool of an offloaded run; None: experts resident.
      backend: "gpu" or "cpu" (XLA attention; chunks up to max_chunk_size_cpu).
      max_chunk_size: the largest chunk considered; None: the tuned max_chunk_size (or _cpu).

    Returns:
      `ChunkChoice(chunk_size, reason)`; where no chunk fits, the smallest with the reason saying so (the
      memory check then refuses the run).
    """
    cpu = backend == "cpu"
    cap = max_chunk_size or int(tuned("max_chunk_size_cpu" if cpu else "max_chunk_size"))
    top = max(16, min(cap, effective_chunk_size(prompt_tokens, 1 << 62)))
    candidates = [1 << i for i in range(top.bit_length()) if 1 << i <= top]  # below 16: for tiny budgets
    costs, refused = [], {}
    for c in reversed(candidates):
        tokens = batch * c
        kv, rec = state_bytes(config, batch, cache_capacity(prompt_tokens, c, max_new_tokens), dtype)
        need = kv + rec + activation_bytes(config, tokens, dtype, cpu=cpu)
        if memory_left is not None and need > memory_left:
            refused[c] = f"{c} needs {gib(need)} of the {gib(memory_left)} left"
            continue
        if offload is not None:
            pool = pool_shape(config, offload, tokens)
            if pool.slots < pool.need:
                refused[c] = f"{c} needs {pool.need} experts in the pool, which holds {pool.slots}"
                continue
        costs.append(predict_ttft(config, prompt_tokens, c, batch=batch, offload=offload, cpu=cpu))
    if not costs:
        why = (
            refused[candidates[0]]
            if memory_left is None or memory_left > 0
            else "the weights leave no memory"
        )
        return ChunkChoice(candidates[0], f"{candidates[0]} tokens: no chunk fits ({why})")
    fastest = min(x.ttft_s for x in costs)
    # the largest within 2% of the fastest: fewer chunks also mean fewer dispatches, left out of the model
    best = next(x for x in costs if x.ttft_s <= 1.02 * fastest)
    return ChunkChoice(best.chunk_size, _reason(best, costs, refused, top, offload is not None))


def _reason(best: ChunkCost, costs: list[ChunkCost], refused: dict, top: int, offloaded: bool) -> str:
    """One line: the choice and its predicted TTFT, what stopped a larger chunk, the runner-up's TTFT."""

    def said(x: ChunkCost) -> str:
        moved = f", {x.streamed / 1e9:.1f} GB over PCIe" if offloaded else ""
        return (f"{x.ttft_s:.2f} s" if x.ttft_s >= 0.1 else f"{x.ttft_s * 1e3:.1f} ms") + moved

    chunks = f"{best.chunks} chunks" if best.chunks > 1 else "the whole prompt in one chunk"
    parts = [f"{best.chunk_size} tokens ({chunks}): predicted TTFT {said(best)}"]
    larger = [c for c in refused if c > best.chunk_size]
    if larger:
        parts.append(refused[min(larger)])
    elif best.chunk_size == top and best.chunks > 1:
        parts.append(f"the largest chunk considered ({top})")
    others = sorted((x for x in costs if x is not best), key=lambda x: x.ttft_s)
    if others:
        parts.append(f"{others[0].chunk_size} would take {said(others[0])}")
    return "; ".join(parts)


def choose_chunk_size_for(
    runner, prompt_tokens: int, *, batch: int = 1, max_new_tokens: int = 0
) -> ChunkChoice:
    """`choose_chunk_size` for a built `LayerwiseRunner` or `OffloadedRunner` (what `hybridlm.prefill` and
    `hybridlm.generate` do with chunk_size="auto"): the memory left is the device's free memory now (the
    host's on the CPU), less the expert pool where the first chunk has yet to allocate it."""
    import jax

    offload = OffloadPlan.of_runner(runner) if hasattr(runner, "offload_config") else None
    cpu = jax.default_backend() == "cpu"
    free = device_free_bytes()
    if free is None:
        free = host_available_bytes()
    elif not cpu:
        free -= DEVICE_OVERHEAD_BYTES
    if free is not None and offload is not None and getattr(runner, "cache", None) is None:
        free -= offload.budget
    return choose_chunk_size(
        runner.config,
        prompt_tokens,
        batch=batch,
        max_new_tokens=max_new_tokens,
        dtype=runner.model.dtype,
        memory_left=free,
        offload=offload,
        backend="cpu" if cpu else "gpu",
    )

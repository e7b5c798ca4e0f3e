"""`OffloadedRunner`: a `LayerwiseRunner` whose routed experts live in pinned host memory and are paged into a
device pool; a facade over the host buffers (`host`), the pool and its budget (`residency`), the prefill
schedule (`schedule`: `prefill`, `exact`) and device-paged decode (`decoder`: `decode`). docs/offload.md
describes the schedule.

Device memory: pool slots + staging buffers <= expert_budget. The trunk (embeddings, mixers, routers, shared
experts, head) stays on the device.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine import phases
from hybridlm.engine.phases import StaticGraph, flat_layer
from hybridlm.engine.runner import LayerwiseRunner, PhaseTimer, check_decode_inputs, commit
from hybridlm.engine.sampling import host_block
from hybridlm.model import EXPERT_PARAMS, HybridLM, check_taps, concat_taps
from hybridlm.offload.config import OffloadConfig, default_host_parts
from hybridlm.offload.decode import OffloadTarget, PagedDecoder, PagedView
from hybridlm.offload.expert_cache import ExpertCache, ExpertLayout, format_bytes, parse_bytes
from hybridlm.offload.host import HostExperts, describe_layout, device_sharding, one_layout
from hybridlm.offload.part_queue import PartQueue
from hybridlm.offload.prefill import Chunk, PrefillSchedule, chunk_inputs
from hybridlm.offload.residency import Residency, check_budget
from hybridlm.offload.stats import CacheStats, LayerStats
from hybridlm.sharding import model_mesh
from hybridlm.state import LayerState


def placeholder_experts(graph: StaticGraph, leaves: tuple) -> tuple[StaticGraph, tuple]:
    """A layer's (graph, flat weights) with its expert weights replaced by 1-element placeholders (no device
    memory)."""
    params = jax.tree_util.tree_map(lambda x: x, graph.params(leaves))
    for name in EXPERT_PARAMS:
        params["ffn"][name].set_value(jnp.zeros((1, 1, 1), jnp.float32))
    return flat_layer(graph.graphdef, params)


class OffloadedRunner(LayerwiseRunner):
    """A `LayerwiseRunner` whose routed experts live in pinned host memory and are paged into a device pool.

    Use it wherever a `LayerwiseRunner` is accepted (`hybridlm.prefill`, `hybridlm.generate`, `decode_step`);
    `stats()` returns the statistics of the last prefill and of the decode steps after it.

        runner = OffloadedRunner(model, OffloadConfig(expert_budget="12GiB", cache_policy="slru"))

    Args:
      model: the model. Its trunk is used in place; its experts are copied to pinned host memory unless
        `host_experts` is given (then the model's expert values are ignored and may be placeholders).
      config: the options (`OffloadConfig`: budget, policy, prefetch, host parts, decode paging, ...).
      host_experts: experts already in pinned host memory (e.g. from `load_offloaded`, for a model too large
        to initialise on the device).

    Raises:
      ValueError: budget above the device memory; budget below the experts one layer needs for one token (or
        for `config.chunk_size`); a model without MoE; host_parts given with `host_experts` of another part
        count; layers in different formats with mixed_formats="refuse"; host_experts of another model shape.
    """

    def __init__(self, model: HybridLM, config: OffloadConfig, *, host_experts: HostExperts | None = None):
        if model.config.moe is None:
            raise ValueError("OffloadedRunner needs a sparse-MoE model (config.moe is None)")
        if model_mesh(model) is not None:
            raise ValueError(
                "the model is split over several devices (hybridlm.sharding); offloading experts to host "
                "memory runs on one device: load it without devices= or without an expert budget"
            )
        host_parts = config.host_parts
        if host_parts is not None and host_experts is not None and len(host_experts.part_rows) != host_parts:
            raise ValueError(
                f"host_parts={host_parts}, but host_experts hold {len(host_experts.part_rows)} "
                "buffers a layer (HostExperts.from_model(..., parts=) sets them)"
            )
        super().__init__(model)
        self.offload_config = config
        self.budget = parse_bytes(config.expert_budget)
        self.device = jax.devices()[0]
        self.dev_sharding = device_sharding(self.device)
        moe = self.config.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.num_layers = self.config.num_layers
        self._check_device_memory(config.device_memory_bytes)
        layout = self._layout(model, host_experts)
        self.expert_bytes = layout.nbytes  # a pool slot holds what a copy moves (`PackedExperts`)
        self.total_slots = self.budget // self.expert_bytes
        # before copying anything to the host
        check_budget(
            self.budget,
            self.expert_bytes,
            self.top_k,
            self.num_experts,
            config.batch * (config.chunk_size or 1),
        )
        self.host = (
            host_experts
            if host_experts is not None
            else HostExperts.from_model(
                model,
                parts=default_host_parts() if host_parts is None else host_parts,
                mixed=config.mixed_formats,
            )
        )
        # Per-layer trunk params without expert weights: the runner holds no device copy of any expert.
        self.layers = [placeholder_experts(g, p) for g, p in self.layers]
        self.residency = Residency(
            self.host,
            config,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            budget=self.budget,
            sharding=self.dev_sharding,
        )
        self.schedule = PrefillSchedule(self.residency)
        self.decoder = PagedDecoder(self.residency, config.cache_policy)
        self._kind = "prefill"
        self._num_chunks = 1  # of the prefill running: see on_prefill_start
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self._t_start: float | None = None

    def _check_device_memory(self, free: int | None) -> None:
        if free is None:
            stats = self.device.memory_stats()
            if stats and "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if free is not None and self.budget > free:
            raise ValueError(
                f"expert_budget={self.budget} bytes ({format_bytes(self.budget)}) exceeds the free "
                f"device memory {free} bytes ({format_bytes(free)}) on {self.device}"
            )

    def _layout(self, model: HybridLM, host_experts: HostExperts | None) -> ExpertLayout:
        """The byte layout of one expert on the host, before anything is copied."""
        if host_experts is not None:
            if host_experts.num_layers != self.num_layers or host_experts.num_experts != self.num_experts:
                raise ValueError(
                    f"host_experts hold {host_experts.num_layers} layers x {host_experts.num_experts} "
                    f"experts; the model has {self.num_layers} x {self.num_experts}"
                )
            return host_experts.layout
        layouts = [
            ExpertLayout.of(layer.ffn.experts_gate_up.get_value(), layer.ffn.experts_down.get_value())
            for layer in model.layers
        ]
        return one_layout(layouts, self.offload_config.mixed_formats)

    # ----- the pool, as tests and callers see it -----
    @property
    def cache(self) -> ExpertCache | None:
        """The device pool of expert slots (None before the first chunk)."""
        return self.residency.cache

    @property
    def held_layers(self) -> frozenset[int]:
        """Layers held on the device outside the pool (whole-layer mode, static or everything fitting)."""
        return self.residency.held_layers

    @property
    def all_experts_fit(self) -> bool:
        """Whether the budget holds every routed expert on the device (no decode step reads host memory)."""
        res = self.residency
        return res.total_slots >= res.num_layers * res.num_experts

    @property
    def staging_slots(self) -> int | None:
        """Experts of the budget kept for prefetch staging (None before the first chunk)."""
        return self.residency.staging_slots

    @property
    def queue(self) -> PartQueue:
        """Host parts allocated in the pool, to be copied inside the coming programs."""
        return self.residency.queue

    @property
    def paged_view(self) -> PagedView | None:
        """The pool as the device-paged decode step reads it (None until a step after the pool last
        changed)."""
        return self.decoder.view

    def min_experts(self, tokens: int) -> int:
        """Experts one layer may need for a chunk of `tokens` tokens: top_k * tokens, capped at experts."""
        return self.residency.min_experts(tokens)

    def check_chunk(self, tokens: int) -> None:
        """Raises ValueError if the budget cannot hold one layer's active experts for `tokens` tokens."""
        self.residency.check_chunk(tokens)

    def uses_whole_layer(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` tokens (batch x seq) runs in whole-layer mode."""
        return self.residency.uses_whole_layer(tokens)

    def _ensure_pool(self, tokens: int) -> None:
        if self.residency.ensure(tokens):
            self.decoder.view = None
            self.schedule.exact.prepare()

    # ----- statistics -----
    def _new_stats(self, kind: str) -> CacheStats:
        return CacheStats(
            kind=kind, expert_bytes=self.expert_bytes, layers=[LayerStats() for _ in range(self.num_layers)]
        )

    def on_prefill_start(self, num_chunks: int = 1) -> None:
        """Called by `prefill` before its first chunk: starts new prefill statistics; `num_chunks` tells
        whole- layer streaming whether to prefetch the next chunk's first layers during this chunk's last
        ones."""
        self._kind = "prefill"
        self._num_chunks = num_chunks
        self._prefill_stats = self._new_stats("prefill")
        self._decode_stats = self._new_stats("decode")
        self.decoder.reset_counters()
        self._t_start = None

    def stats(self, per_layer: bool = True) -> dict:
        """{'prefill': last prefill's statistics, 'decode': decode steps since, 'pool': pool
        configuration}."""
        config, cache = self.offload_config, self.cache
        pool = {
            "budget_bytes": self.budget,
            "expert_bytes": self.expert_bytes,
            "host_expert_bytes": self.host.layout.nbytes,
            "pinned_host_bytes": self.host.nbytes,
            "policy": config.cache_policy,
            "prefetch": config.prefetch,
            "prefetch_depth": config.prefetch_depth,
            "host_parts": len(self.host.part_rows),
            "expert_format": describe_layout(self.host.layout),
            "slots": cache.num_slots if cache else None,
            "staging_slots": self.residency.staging_slots,
            "pinned": (len(cache.pinned) + len(self.held_layers) * self.num_experts) if cache else 0,
        }
        decode = self.decoder.stats_with_paged(self._decode_stats)
        return {
            "prefill": self._prefill_stats.to_dict(per_layer),
            "decode": decode.to_dict(per_layer),
            "pool": pool,
        }

    def head_logits(self, x_last: jax.Array) -> jax.Array:
        logits = super().head_logits(x_last)
        if self._t_start is not None:
            jax.block_until_ready(logits)
            stats = self._prefill_stats if self._kind == "prefill" else self._decode_stats
            stats.wall_s += time.perf_counter() - self._t_start
            self._t_start = None
        self._kind = "decode"  # what follows a prefill's logits is decode
        return logits

    # ----- the forward passes -----
    def decode_step(
        self, tokens: jax.Array, states: list[LayerState], position
    ) -> tuple[jax.Array, list[LayerState]]:
        """`LayerwiseRunner.decode_step` with the experts paged (same arguments and results).

        With decode_paging="device" (and batch x top_k <= paged_max_copies) one program a step, which reads
        each routed expert from the held layers or the pool (set to whole layers at the first step after a
        prefill), or else from pinned host memory, as the device's router picks it
        (`hybridlm.offload.decode`); otherwise layer by layer (`decode_step_layerwise`).

        Raises:
          ValueError: tokens not one per sequence, a position outside the KV cache, or token ids outside the
            vocabulary (`check_decode_inputs`).
        """
        config = self.offload_config
        batch = np.shape(tokens)[0] if np.ndim(tokens) else 0
        if config.decode_paging == "host" or batch * self.top_k > config.paged_max_copies:
            return self.decode_step_layerwise(tokens, states, position)
        check_decode_inputs(self.config.vocab_size, tokens, states, position)
        self._ensure_pool(batch)
        logits, states = self.decoder.step(
            self, self.step_inputs(tokens, states, position), self._decode_stats
        )
        self._decode_stats.chunks += 1
        self._decode_stats.tokens += batch
        self._kind = "decode"
        return logits, states

    def decode_block(self, sampler, token, states, position, carry, steps: int) -> tuple:
        """`LayerwiseRunner.decode_block` with the experts paged: one program for the block with
        decode_paging="device" (`PagedDecoder.block`), else a host loop of `decode_step`s
        (`sampling.host_block`).

        Raises:
          ValueError: as `decode_step`, for the block's last position.
        """
        config = self.offload_config
        batch = np.shape(token)[0]
        if config.decode_paging == "host" or batch * self.top_k > config.paged_max_copies:
            return host_block(sampler, self.decode_step, token, states, position, carry, steps)
        check_decode_inputs(self.config.vocab_size, token, states, position + max(steps, 1) - 1)
        self._ensure_pool(batch)
        carry = carry if all(a.committed for a in carry) else commit(carry)  # one compilation per sampler
        out = self.decoder.block(
            self, sampler, self.step_inputs(token, states, position), carry, steps, self._decode_stats
        )
        self._decode_stats.chunks += steps
        self._decode_stats.tokens += batch * steps
        self._kind = "decode"
        return out

    def speculative_target(self) -> tuple:
        """`LayerwiseRunner.speculative_target` with the experts paged (`decode.OffloadTarget`): the pool is
        set for decode first (`PagedDecoder.make_view`), as a decode step would."""
        res, decoder = self.residency, self.decoder
        self._ensure_pool(1)
        if decoder.view is None:
            decoder.view = decoder.make_view(self._decode_stats)
        graphs, leaves = zip(*self.layers, strict=True)
        view = decoder.view
        target = OffloadTarget(
            res.host.layout, graphs, self.final_norm[0], view.sources, tuple(res.host.part_start)
        )
        host = tuple(tuple(parts) for parts in res.host.layers)
        args = (
            self.embed_table,
            leaves,
            self.final_norm[1],
            self.lm_head,
            host,
            res.cache.pool,
            view.slot_table,
        )
        return target, (*args, view.held)

    def forward_chunk(
        self,
        ids: jax.Array,
        states: list[LayerState],
        start,
        num_valid: int,
        timer: PhaseTimer | None = None,
        taps: tuple[int, ...] = (),
    ):
        """`LayerwiseRunner.forward_chunk` with experts paged from host memory (same arguments and results,
        taps included).

        With a timer, the router's time counts in the mixer's phase ("gdn" / "attention"): they run as one
        program (`programs.mix_route`, `programs.mix_route_copying`)."""
        taps = check_taps(taps, self.config.num_layers)
        timer = timer or PhaseTimer(False)
        config = self.offload_config
        batch, seq = ids.shape
        tokens = batch * seq
        self._ensure_pool(tokens)  # budget errors before any work
        self.decoder.view = None  # the pool changes below
        whole = self.uses_whole_layer(tokens)
        stats = self._prefill_stats if self._kind == "prefill" else self._decode_stats
        if self._t_start is None:
            self._t_start = time.perf_counter()
        stats.chunks += 1
        stats.tokens += tokens
        stream_layers = config.prefetch == "layer" or (config.prefetch != "none" and whole)
        start, num_valid_dev = chunk_inputs(start, num_valid)
        chunk = Chunk(
            stats=stats,
            batch=batch,
            seq=seq,
            num_valid=int(num_valid),
            start=start,
            num_valid_dev=num_valid_dev,
            # Whole-layer streaming runs on into the next chunk's first layers while this chunk's last ones
            # compute, so that a chunk does not begin with copies and no compute.
            more=self._kind == "prefill" and stats.chunks < self._num_chunks,
            stream_layers=stream_layers,
            use_router=config.prefetch in ("auto", "router") and not whole,
            twins=whole and stream_layers and config.in_program_copies,
        )
        x = timer("embed", phases.embed, self.embed_table, ids)
        # Committed to the device, so that each program compiles once: a copying program's outputs are
        # committed, a plain one's follow its inputs, and jit compiles again for the other kind of input.
        x, states = jax.device_put((x, states), self.dev_sharding)
        mode = self.schedule.whole if whole else self.schedule.exact
        x, states, tapped = self.schedule.run(
            chunk, mode, self.layers, self.config.layer_types, x, states, timer, taps
        )
        return (x, states, concat_taps(tapped, taps)) if taps else (x, states)

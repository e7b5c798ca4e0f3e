"""A model's config and expert storage before loading it, and the command line's plan of a run
(`model_source`, `plan_run`)."""

from __future__ import annotations

import os
from typing import NamedTuple

from hybridlm.config import ModelConfig, get_config
from hybridlm.planning.chunks import ChunkChoice, OffloadPlan, choose_chunk_size
from hybridlm.planning.memory import (
    InsufficientMemoryError,
    MemoryEstimate,
    check_fits,
    device_free_bytes,
    estimate_memory,
    expert_bytes,
    expert_weights,
    host_available_bytes,
    memory_left,
)


class ModelSource(NamedTuple):
    """What `estimate_memory` needs to know of a model before any weight is read."""

    config: ModelConfig
    expert_format: str  # a key of EXPERT_BYTES_PER_WEIGHT, or a GGUF file's description
    bytes_per_weight: float | None  # a GGUF file's experts as the loader keeps them; None: the format's
    device_bytes_per_weight: float | None = None  # in a pool slot, where it differs from bytes_per_weight


def model_source(
    model: str | os.PathLike | None,
    *,
    preset: str = "tiny",
    expert_format: str | None = None,
    dtype="bfloat16",
    offloaded: bool = False,
    mixed_formats: str = "widen",
) -> ModelSource:
    """The config and expert storage of a GGUF file (its header: metadata and tensor types, no tensor
    data), an HF checkpoint directory (config.json) or, with `model` None, the preset `preset`.

    Args:
      model: a .gguf file, an HF checkpoint directory, or None.
      preset: the preset when `model` is None.
      expert_format: "int8" / "int4" as random weights or an HF directory's experts are quantized; None
        keeps them in `dtype`. A GGUF file keeps its own.
      dtype: the trunk's dtype (and that of experts kept unquantized).
      offloaded: the experts go to pinned host memory, every layer in one format (`mixed_formats`); resident,
        each layer keeps its own.
      mixed_formats: as in `OffloadConfig`.

    Raises:
      ValueError: (GGUFError among them) an unreadable header or config.json, an unknown preset.
    """
    if model is None:
        try:
            config = get_config(preset)
        except KeyError as e:
            raise ValueError(str(e).strip("'\"")) from None
        return ModelSource(config, expert_format or _dtype_name(dtype), None)
    if os.path.isdir(model):
        return ModelSource(ModelConfig.from_hf(model), expert_format or _dtype_name(dtype), None)
    from hybridlm.checkpoints.gguf import config_from_gguf
    from hybridlm.checkpoints.gguf_header import read_header

    header = read_header(model)
    config = config_from_gguf(header)
    if config.moe is None:
        return ModelSource(config, _dtype_name(dtype), None)
    label, per_weight, device_per_weight = _gguf_expert_storage(
        header, config, dtype, offloaded, mixed_formats
    )
    return ModelSource(config, label, per_weight, device_per_weight)


def _dtype_name(dtype) -> str:
    return getattr(dtype, "__name__", None) or str(dtype)


def _gguf_expert_storage(
    header, config, dtype, offloaded: bool, mixed_formats: str
) -> tuple[str, float | None, float | None]:
    """(description, bytes per weight in host memory, in a device pool slot) of a GGUF file's routed experts
    as `load_gguf(keep_quantized="experts")` keeps them: each distinct (types, shapes) converted once from
    zero blocks of one expert."""
    import jax
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES

    from hybridlm.checkpoints import gguf_quants
    from hybridlm.checkpoints.gguf import expert_tensors
    from hybridlm.checkpoints.gguf_device import Q4KBlocks
    from hybridlm.checkpoints.mapping import gguf_sources
    from hybridlm.offload.expert_cache import ExpertLayout
    from hybridlm.offload.host import describe_layout, one_layout

    def kept(infos):
        if all(gguf_quants.can_keep(t.type, t.ne[0]) and len(t.ne) == 3 for t in infos) and (
            len({gguf_quants.KEPT_BITS[t.type] for t in infos}) == 1
        ):
            raws = [
                (
                    np.zeros(
                        (1, t.ne[1], t.ne[0] // GGML_QUANT_SIZES[t.type][0] * GGML_QUANT_SIZES[t.type][1]),
                        np.uint8,
                    ),
                    t.type,
                )
                for t in infos
            ]
            return gguf_quants.to_quantized_weights(raws)
        return jax.ShapeDtypeStruct((1, infos[0].ne[0], sum(t.ne[1] for t in infos)), dtype)

    names, params, seen = set(header.tensors), {}, {}
    arch = header.metadata["general.architecture"][1]
    expert_types = {t.type for t in expert_tensors(header)}
    if offloaded and expert_types == {gguf_quants.T.Q4_K}:  # host memory holds the file's own blocks
        kept = lambda infos: Q4KBlocks(  # noqa: E731
            jax.ShapeDtypeStruct(
                (1, sum(t.ne[1] for t in infos), infos[0].nbytes // infos[0].ne[2] // infos[0].ne[1]),
                np.uint8,
            ),
            infos[0].ne[0],
        )
    for src in gguf_sources(config, arch, names):
        if not src.experts or not all(n in names for n in src.tensors):
            continue  # the loader names a missing tensor
        infos = [header.tensors[n] for n in src.tensors]
        key = tuple((t.type, t.ne) for t in infos)
        if key not in seen:
            seen[key] = kept(infos)
        params.setdefault(src.params[0][1], {})[src.params[0][-1]] = seen[key]
    layouts = [ExpertLayout.of(p["experts_gate_up"], p["experts_down"]) for _, p in sorted(params.items())]
    if len(layouts) < config.num_layers:  # expert tensors missing: the loader refuses the file
        return _dtype_name(dtype), None, None
    weights = expert_weights(config)
    if offloaded:
        layout = one_layout(layouts, mixed_formats)
        # pool slots keep the host bytes (`offload.expert_cache.PackedExperts`): no separate slot size
        return f"GGUF: {describe_layout(layout)}", layout.nbytes / weights, None
    mean = sum(x.nbytes for x in layouts) / len(layouts)
    return f"GGUF: {describe_layout(max(layouts, key=lambda x: x.nbytes))}", mean / weights, None


# ----------------------------------------------------------------------------------------------------------
# The command line's plan
# ----------------------------------------------------------------------------------------------------------
def plan_run(
    *,
    model: str | None,
    preset: str,
    dtype,
    prompt_tokens,
    chunk_size: int | str = "auto",
    max_new_tokens: int = 0,
    expert_format: str | None = None,
    expert_budget: int | str | None = None,
    cache_policy: str = "static",
    prefetch: str = "auto",
    mixed_formats: str = "widen",
    batch: int = 1,
    check: bool = True,
    devices: int = 1,
) -> dict:
    """The memory estimate and chunk size of a run, before any weight is allocated (`hybridlm prefill`,
    `generate` and `--dry-run`).

    Args:
      model, preset, expert_format, dtype, mixed_formats: the model (`model_source`).
      prompt_tokens: a function (config) -> the prompt's tokens, called once the weights alone are known to
        fit (so that a model that cannot fit is refused before its prompt is tokenized).
      chunk_size: tokens a chunk, or "auto" (`choose_chunk_size`).
      max_new_tokens, batch: as the run's.
      expert_budget, cache_policy, prefetch: the offload options (budget None: resident).
      check: refuse what does not fit (`check_fits`); False reports it under "fits".
      devices: devices the resident experts are split over (`hybridlm.sharding`; each the first's memory).

    Returns:
      {"chunk_size", "chunk_reason", "fits", "refusal", "device_free_bytes", "host_available_bytes",
      "memory": the estimate's summary, "memory_text": its text}.

    Raises:
      InsufficientMemoryError: with check, a run that cannot fit.
      ValueError: an unreadable model, an unparsable budget.
    """
    import jax

    from hybridlm.offload.config import tuned_default
    from hybridlm.offload.expert_cache import parse_bytes

    backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
    offloaded = expert_budget is not None
    source = model_source(
        model,
        preset=preset,
        expert_format=expert_format,
        dtype=dtype,
        offloaded=offloaded,
        mixed_formats=mixed_formats,
    )
    config, budget = source.config, parse_bytes(expert_budget) if offloaded else None
    free = {"device_free": device_free_bytes(), "host_available": host_available_bytes()}

    def estimate(tokens: int, chunk: int) -> MemoryEstimate:
        return estimate_memory(
            config,
            prompt_tokens=tokens,
            max_new_tokens=max_new_tokens,
            chunk_size=chunk,
            expert_format=source.expert_format,
            trunk_dtype=dtype,
            expert_budget=budget,
            batch=batch,
            expert_host_bytes_per_weight=source.bytes_per_weight,
            backend=backend,
            devices=devices,
        )

    if check:
        check_fits(estimate(1, 16), **free)  # the weights alone
    tokens = prompt_tokens(config)
    if chunk_size == "auto":
        offload = None
        if offloaded and config.moe:
            host_bytes = expert_bytes(config, source.expert_format, source.bytes_per_weight)
            slot_bytes = (
                expert_bytes(config, source.expert_format, source.device_bytes_per_weight)
                if source.device_bytes_per_weight
                else host_bytes
            )
            offload = OffloadPlan(
                expert_bytes=slot_bytes,
                copy_bytes=host_bytes,
                budget=budget,
                cache_policy=cache_policy,
                prefetch=prefetch,
                whole_layer_factor=tuned_default("whole_layer_factor"),
            )
        chosen = choose_chunk_size(
            config,
            tokens,
            batch=batch,
            max_new_tokens=max_new_tokens,
            dtype=dtype,
            memory_left=memory_left(estimate(tokens, 16), **free),
            offload=offload,
            backend=backend,
        )
    else:
        chosen = ChunkChoice(int(chunk_size), f"{chunk_size} tokens: given (--chunk-size)")
    final = estimate(tokens, chosen.chunk_size)
    try:
        check_fits(final, **free)
        refusal = None
    except InsufficientMemoryError as e:
        if check:
            raise
        refusal = str(e)
    return {
        "chunk_size": chosen.chunk_size,
        "chunk_reason": chosen.reason,
        "fits": refusal is None,
        "refusal": refusal,
        "device_free_bytes": free["device_free"],
        "host_available_bytes": free["host_available"],
        "memory": final.summary(),
        "memory_text": str(final),
    }

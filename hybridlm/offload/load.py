"""Loading a model for expert offload without its experts on the device (GGUF files, HF directories)."""

from __future__ import annotations

import os

import jax

from hybridlm.model import EXPERT_PARAMS, HybridLM
from hybridlm.offload.config import MIXED_FORMATS, default_host_parts
from hybridlm.offload.host import HostExperts, host_experts_of_layers, reserve_pinned


def load_offloaded(
    path: str | os.PathLike,
    *,
    keep_quantized: str | None = "experts",
    expert_format: str | None = None,
    dtype=None,
    parts: int | None = None,
    mixed_formats: str = "widen",
    progress: bool = True,
) -> tuple[HybridLM, HostExperts]:
    """Loads a model with its routed experts packed into pinned host memory as they are read, one layer at a
    time.

    The device holds the trunk (embeddings, mixers, routers, shared experts, head) and, while a layer is
    packed, that layer's experts; the returned model holds 1-element placeholders for the experts. Pass both
    to `OffloadedRunner(model, config, host_experts=host)`, which runs the same logits as the model loaded
    whole (`hybridlm.load`; tested for GGUF files and HF directories).

    Args:
      path: a .gguf file or an HF checkpoint directory (config.json + *.safetensors).
      keep_quantized: GGUF: "experts" (default) keeps experts of every quantized type but Q8_K quantized in
        host memory (`hybridlm.checkpoints.gguf_quants.KEEPABLE_TYPES`) (`QuantizedWeights`, dequantized
        inside the kernels); "experts+head" / "all" also keep the trunk's lm head / projection matrices
        quantized on the device (`hybridlm.load`); None stores them dequantized, in `dtype`. Ignored for HF
        directories.
      expert_format: HF directories: None keeps the experts in `dtype`; "int8" / "int4" quantizes each layer's
        experts as it loads (`hybridlm.model.quantize_experts`), e.g. a bf16 checkpoint's 64 GB of Qwen3.6
        experts to ~20 GB of 4-bit ones. GGUF files: must be None (their own quantization is kept).
      dtype: parameter dtype, as `hybridlm.load`.
      parts: pinned host buffers a layer (`OffloadConfig.host_parts`; None: `default_host_parts()`).
      mixed_formats: where layers store their experts in different formats (llama-quantize's Q4_K_M keeps the
        ffn_down experts of half the layers as Q6_K, so those are 8-bit where the others are 4-bit), how they
        are brought to the one format of the host buffers and the device pool (`host_experts_of_layers`):
        "widen" (default; exact: one format that holds every layer's, for Q4_K_M downs as int8 with a float32
        scale and
        offset per 16: 3.0 instead of 2.25 MiB an expert at the Qwen3.6-35B-A3B shapes), "smallest"
        (requantized into the format of fewest bytes: not exact, the Q6_K downs get 4-bit rounding) or
        "refuse" (a ValueError naming the layers and formats).
      progress: show a progress bar over tensors.

    Returns:
      (model with placeholder experts, `HostExperts` [layers] of its experts).

    Raises:
      FileNotFoundError: no file or directory at `path`.
      ValueError: neither a directory nor a GGUF file, or expert_format given for a GGUF file or unknown (the
        errors of `hybridlm.load`, which reads the checkpoint); a model without MoE; layers whose experts are
        stored in different formats with mixed_formats="refuse", or an unknown mixed_formats; the loaders'
        errors (`GGUFError`, `CheckpointError`).
    """
    from hybridlm.loading import load

    if mixed_formats not in MIXED_FORMATS:  # before the file is read
        raise ValueError(f"unknown mixed_formats={mixed_formats!r}; choose from {MIXED_FORMATS}")
    path = os.fspath(path)
    if not os.path.isdir(path) and os.path.isfile(path):  # the experts' bytes are known from the header
        _reserve_for_gguf(path, parts)
    pending: dict[int, dict] = {}
    packed: dict[int, tuple] = {}

    def sink(layer: int, name: str, value) -> None:
        pending.setdefault(layer, {})[name] = value
        if len(pending[layer]) == len(EXPERT_PARAMS):
            weights = pending.pop(layer)
            layout, buffers = HostExperts.pack_layer(*(weights[n] for n in EXPERT_PARAMS), parts=parts)
            jax.block_until_ready(buffers)  # the layer's device copy is freed before the next one loads
            packed[layer] = (layout, buffers)

    model = load(
        path,
        dtype=dtype,
        keep_quantized=None if os.path.isdir(path) else keep_quantized,
        expert_format=expert_format,
        progress=progress,
        expert_sink=sink,
    )
    if model.config.moe is None:
        raise ValueError(f"{path} holds a dense model ({model.config.name}): there are no experts to offload")
    return model, host_experts_of_layers(packed, model.config.num_layers, mixed_formats)


def _reserve_for_gguf(path: str, parts: int | None) -> None:
    """Reserves pinned host memory for a GGUF file's routed experts (their bytes in the file: what Q4_K and
    Q8_0 experts take in host memory) before they are packed (`reserve_pinned`)."""
    from hybridlm.checkpoints.gguf import expert_tensors
    from hybridlm.checkpoints.gguf_header import GGUFError, read_header

    try:
        experts = expert_tensors(read_header(path))
    except GGUFError:
        return  # the loader reports it
    layers = {t.name.split(".")[1] for t in experts}
    if not experts or not layers:
        return
    total = sum(t.nbytes for t in experts)
    parts = default_host_parts() if parts is None else parts
    reserve_pinned(total, -(-total // (len(layers) * max(parts, 1))))

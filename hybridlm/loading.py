"""`load(path)`: one entry point for HF checkpoint directories and GGUF files."""

from __future__ import annotations

import os

import jax

from hybridlm.model import HybridLM


def load(
    path: str | os.PathLike,
    *,
    dtype=None,
    keep_quantized: str | None = None,
    expert_format: str | None = None,
    progress: bool = True,
    expert_sink=None,
    devices=None,
) -> HybridLM:
    """Loads a model from an HF checkpoint directory or a `.gguf` file.

    Args:
      path: a directory with config.json + *.safetensors, or a GGUF file.
      dtype: parameter dtype; None keeps the checkpoint's (HF) or uses bfloat16 for quantized GGUF tensors.
      keep_quantized: GGUF only: "experts" keeps the routed experts in their quantized blocks
        (`QuantizedWeights`, exactly), "experts+head" the lm head too, "all" every projection matrix too
        (`checkpoints.gguf.load_gguf`); None dequantizes everything.
      expert_format: HF directories only: "int8" / "int4" quantizes the routed experts as they load
        (`hybridlm.model.quantize_experts`); None keeps them in `dtype`.
      progress: show a progress bar for large checkpoints.
      expert_sink: None, or a function (layer, name, value) that takes each routed-expert parameter as it
        loads, the model holding 1-element placeholders instead (`hybridlm.model.loaded_value`; used by
        `hybridlm.offload.load_offloaded`).
      devices: None (one device), or a device count / sequence of devices: the routed experts are split over
        them and the rest replicated (`hybridlm.sharding`); each layer's experts go to their devices as they
        load, so no device holds more than its share.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: unknown architecture / model_type, or a malformed checkpoint (message names the tensor);
        keep_quantized given for a directory or expert_format for a GGUF file; devices more than present,
        or experts that do not split evenly over them; devices together with expert_sink.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if devices is not None:
        return _load_on_devices(path, devices, expert_sink, dtype, keep_quantized, expert_format, progress)
    if os.path.isdir(path):
        if keep_quantized is not None:
            raise ValueError("keep_quantized applies to GGUF files only")
        from hybridlm.checkpoints.hf import load_hf

        return load_hf(
            path, dtype=dtype, progress=progress, expert_format=expert_format, expert_sink=expert_sink
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or path.endswith(".gguf"):
        if expert_format is not None:
            raise ValueError(
                f"expert_format={expert_format!r} applies to HF checkpoint directories; a GGUF file "
                "keeps its own quantization (keep_quantized='experts')"
            )
        from hybridlm.checkpoints.gguf import load_gguf

        return load_gguf(
            path, dtype=dtype, keep_quantized=keep_quantized, progress=progress, expert_sink=expert_sink
        )
    raise ValueError(f"{path} is neither a checkpoint directory nor a GGUF file (magic {magic!r})")


def _load_on_devices(path, devices, expert_sink, dtype, keep_quantized, expert_format, progress) -> HybridLM:
    """`load` onto a mesh of `devices`: each routed-expert parameter split over them as it loads."""
    from hybridlm import sharding

    if expert_sink is not None:
        raise ValueError(
            "devices= and expert_sink= exclude each other (experts go to the devices or the sink)"
        )
    mesh = sharding.expert_mesh(devices)
    placed: dict[tuple[int, str], object] = {}

    n = mesh.shape[sharding.EXPERT_AXIS]

    def sink(layer: int, name: str, value) -> None:
        from hybridlm.checkpoints.gguf_device import Q4KBlocks

        if isinstance(value, Q4KBlocks):  # a file's Q4_K experts come to a sink as its blocks
            value = value.to_quantized()
        experts = jax.tree_util.tree_leaves(value)[0].shape[0]
        if experts % n:
            raise ValueError(
                f"{path}: {experts} experts a layer do not split evenly over {n} devices; use a device count "
                f"that divides {experts}"
            )
        placed[(layer, name)] = jax.block_until_ready(jax.device_put(value, sharding.expert_sharding(mesh)))

    model = load(
        path,
        dtype=dtype,
        keep_quantized=keep_quantized,
        expert_format=expert_format,
        progress=progress,
        expert_sink=sink if n > 1 else None,
    )
    for (layer, name), value in placed.items():
        getattr(model.layers[layer].ffn, name).set_value(value)
    return sharding.shard_model(model, mesh)


def load_mtp(path: str | os.PathLike, *, dtype=None, keep_quantized: str | None = None):
    """Loads the multi-token-prediction module (`hybridlm.mtp.MTPModule`) of an HF checkpoint directory
    (`mtp.*`) or a GGUF file (`blk.N.nextn.*` blocks); `load` of the same path gives the trunk it drafts for.

    Args:
      path: as `load`.
      dtype: parameter dtype; None: as `load` chooses.
      keep_quantized: GGUF only: what to keep quantized, as `load` does for the trunk ("experts": the MTP
        layers' routed experts; "all": their projections too; `gguf.load_gguf_mtp`).

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: the checkpoint holds no MTP weights, or they are malformed (message names the tensor);
        keep_quantized given for a directory, or not one of `checkpoints.gguf.KEEP_CHOICES`.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        if keep_quantized is not None:
            raise ValueError("keep_quantized applies to GGUF files only")
        from hybridlm.checkpoints.hf import load_hf_mtp

        return load_hf_mtp(path, dtype=dtype)
    from hybridlm.checkpoints.gguf import load_gguf_mtp

    return load_gguf_mtp(path, dtype=dtype, keep_quantized=keep_quantized)


def load_dflash(path: str | os.PathLike, target_config=None, *, dtype=None):
    """Loads a DFlash draft model (`hybridlm.dflash.DFlashDraft`): a z-lab HF checkpoint directory or a
    `qwen35-dflash-draft` GGUF file (docs/dflash.md §4).

    Args:
      path: a directory with config.json + *.safetensors, or a .gguf file.
      target_config: the `ModelConfig` of the target it will draft for, checked against the draft
        (`DFlashConfig.check_target`); None: not checked.
      dtype: parameter dtype; None: the file's (`fc.weight`'s).

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: a malformed checkpoint or config (the message names the key or tensor), or a draft that
        does not fit `target_config` (one message naming every mismatch).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if target_config is not None:  # before any tensor is read
        dflash_config(path).check_target(target_config)
    if os.path.isdir(path):
        from hybridlm.checkpoints.hf import load_hf_dflash

        return load_hf_dflash(path, dtype=dtype)
    from hybridlm.checkpoints.gguf_dflash import load_gguf_dflash

    return load_gguf_dflash(path, dtype=dtype)


def dflash_config(path: str | os.PathLike):
    """The `DFlashConfig` of a DFlash checkpoint directory (config.json) or GGUF file (its header), reading
    no tensor.

    Raises:
      FileNotFoundError: no checkpoint or no config.json.
      ValueError: a config the readers refuse (naming the key).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        import json

        from hybridlm.dflash import DFlashConfig

        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"no config.json at {config_path}")
        with open(config_path) as f:
            try:
                return DFlashConfig.from_hf(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    from hybridlm.checkpoints.gguf_dflash import dflash_config_from_gguf
    from hybridlm.checkpoints.gguf_header import read_header

    return dflash_config_from_gguf(read_header(path))

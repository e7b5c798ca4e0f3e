"""Loading HF checkpoint directories (config.json + *.safetensors), one tensor at a time.

Supported layouts: text-only Qwen3.5/3.6-MoE (`qwen3_5_moe_text`, weights under `model.`), the full multimodal
checkpoint (`qwen3_5_moe`, nested `text_config`, weights under `model.language_model.`, vision and MTP weights
ignored: `load_hf_mtp` reads the MTP weights), Qwen3-Next (`qwen3_next`, fused grouped `in_proj_qkvz` /
`in_proj_ba`, per-expert or stacked experts) and the dense `qwen3_5` variants.
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from hybridlm.checkpoints.gguf_device import read_exact, to_device
from hybridlm.checkpoints.mapping import IGNORED_HF_PREFIXES, dflash_hf_sources, hf_sources, mtp_hf_sources
from hybridlm.config import ModelConfig
from hybridlm.dflash import DFlashConfig, DFlashDraft
from hybridlm.model import EXPERT_FORMATS, EXPERT_PARAMS, HybridLM, loaded_value, quantize_experts
from hybridlm.mtp import MTPModule


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor at fault."""


def _tensor_index(directory: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors.index.json or by listing the files."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    out = {}
    for file in files:
        path = os.path.join(directory, file)
        try:
            with safe_open(path, framework="numpy") as f:
                out.update(dict.fromkeys(f.keys(), path))
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
    return out


_SAFETENSORS_DTYPES = {
    "BF16": jnp.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class _Reader:
    """Reads single tensors of safetensors files with `pread` (no memory map, so the file's pages stay out of
    the process's resident set), from the header each file starts with: an 8-byte length, then JSON
    {name: {dtype, shape, data_offsets}} (https://github.com/huggingface/safetensors, "Format")."""

    def __init__(self, index: dict[str, str]):
        self.index = index
        self.headers: dict[str, tuple[int, dict]] = {}

    def _entry(self, name: str) -> tuple[str, int, dict]:
        if name not in self.index:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        path = self.index[name]
        if path not in self.headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            self.headers[path] = (8 + size, header)
        start, header = self.headers[path]
        if name not in header:
            raise CheckpointError(f"{path} lacks tensor {name!r} that its index names")
        return path, start, header[name]

    def dtype(self, name: str):
        _, _, entry = self._entry(name)
        return jnp.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a host array (bf16 as ml_dtypes.bfloat16).

        Raises:
          CheckpointError: an unknown dtype, or data that does not match the shape or is not in the file."""
        path, start, entry = self._entry(name)
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path} has unsupported dtype {entry['dtype']}")
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise CheckpointError(f"tensor {name!r} in {path}: {end - begin} bytes for shape {shape}")
        try:
            with open(path, "rb") as f:
                raw = read_exact(f.fileno(), start + begin, end - begin, f"tensor {name!r} in {path}")
        except OSError as e:
            raise CheckpointError(str(e)) from None
        return raw.view(dtype).reshape(shape)


def _detect_prefix(names) -> str:
    if any(n.startswith("model.language_model.") for n in names):
        return "model.language_model."
    return "model."


def load_hf(
    directory: str | os.PathLike,
    *,
    dtype=None,
    progress: bool = True,
    expert_format: str | None = None,
    expert_sink=None,
) -> HybridLM:
    """Loads an HF checkpoint directory into a `HybridLM`.

    Args:
      directory: holds config.json and model*.safetensors (optionally sharded with an index).
      dtype: parameter dtype (jnp.float32 / jnp.bfloat16); None: the embedding's dtype in the file.
      progress: show a progress bar over tensors.
      expert_format: None keeps routed-expert weights in `dtype`; "int8" or "int4" quantizes them as they load
        (`quantize_int8` / `quantize_int4`, as `init_random(expert_format=...)`).
      expert_sink: None, or a function (layer, name, value) that takes each routed-expert parameter
        ("experts_gate_up" / "experts_down" [experts, ...]) as soon as it is loaded; the model then holds
        1-element placeholders for them (`hybridlm.offload.load_offloaded`).

    Returns:
      The model, with every parameter read from the checkpoint (A_log, dt_bias kept in float32).

    Raises:
      FileNotFoundError: no config.json.
      ValueError: unsupported `model_type` (from `ModelConfig.from_hf`); unknown expert_format.
      CheckpointError: a tensor is missing, has the wrong shape, or a file is unreadable.
    """
    if expert_format not in (None, *EXPERT_FORMATS):
        raise ValueError(f"unknown expert_format {expert_format!r}; choose from {EXPERT_FORMATS} or None")
    directory = os.fspath(directory)
    config = ModelConfig.from_hf(directory)
    index = _tensor_index(directory)
    reader = _Reader(index)
    prefix = _detect_prefix(index)
    names = set(index)
    if dtype is None:
        dtype = _file_dtype(reader, prefix + "embed_tokens.weight")
    abstract = nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    sources = list(hf_sources(config, names, prefix=prefix))
    used = set()
    for src in tqdm(
        sources,
        desc=f"loading {os.path.basename(directory.rstrip('/'))}",
        unit="tensor",
        disable=not progress or len(sources) < 200,
        leave=False,
    ):
        load_source(src, reader, variables, expert_format, expert_sink)
        used.update(src.tensors)
    unused = sorted(n for n in names - used if not n.startswith(IGNORED_HF_PREFIXES))
    if unused:
        raise CheckpointError(
            f"checkpoint has {len(unused)} tensors this config does not use, e.g. {unused[:3]}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


def _file_dtype(reader: _Reader, name: str):
    return reader.dtype(name)


def load_source(src, reader: _Reader, variables: dict, expert_format=None, expert_sink=None) -> None:
    """Reads one `ParamSource`'s tensors, builds the parameter on the device and sets it in `variables`
    (nnx path -> Variable).

    Raises:
      CheckpointError: a tensor is missing or gives the wrong shape."""
    # on the device: the transposes, stacks and dtype casts of the build run there, not in numpy
    arrays = [to_device(reader.get(n)) for n in src.tensors]
    value = src.build(*arrays)
    del arrays
    var = variables[src.path]
    want = var.get_value()
    if tuple(value.shape) != tuple(want.shape):
        raise CheckpointError(
            f"tensor {src.tensors[0]!r} gives {'.'.join(map(str, src.path))} shape "
            f"{tuple(value.shape)}, expected {tuple(want.shape)} for this config"
        )
    value = jnp.asarray(value, dtype=want.dtype)
    if expert_format is not None and src.path[-1] in EXPERT_PARAMS:
        value = quantize_experts(value, expert_format)
    var.set_value(loaded_value(src.path, value, want.dtype, expert_sink))


def mtp_prefix(names) -> str:
    """The prefix of a checkpoint's MTP tensors: "model.mtp." or "mtp."."""
    return "model.mtp." if any(n.startswith("model.mtp.") for n in names) else "mtp."


def load_hf_mtp(directory: str | os.PathLike, *, dtype=None) -> MTPModule:
    """Loads the MTP module (`mtp.*` tensors, docs/mtp.md §3) of an HF checkpoint directory.

    The layer count is the config's `mtp_num_hidden_layers` / `num_nextn_predict_layers`, else (Qwen3-Next,
    whose config has neither) the number of `mtp.layers.{j}` in the checkpoint. `load_hf` is unchanged: it
    still skips these tensors; embedding and lm head come from the trunk.

    Args:
      directory: as for `load_hf`.
      dtype: parameter dtype; None: the embedding's dtype in the file.

    Raises:
      CheckpointError: the checkpoint holds no MTP weights, or one is missing or mis-shaped.
    """
    directory = os.fspath(directory)
    config = ModelConfig.from_hf(directory)
    index = _tensor_index(directory)
    reader, names = _Reader(index), set(index)
    prefix = mtp_prefix(names)
    layers = {n[len(prefix + "layers.") :].split(".")[0] for n in names if n.startswith(prefix + "layers.")}
    if config.mtp_layers == 0:
        config = config.replace(mtp_layers=len(layers))
    if config.mtp_layers == 0 or prefix + "fc.weight" not in names:
        raise CheckpointError(f"{directory} holds no MTP weights (no {prefix}fc.weight or {prefix}layers.*)")
    if dtype is None:
        dtype = _file_dtype(reader, _detect_prefix(index) + "embed_tokens.weight")
    abstract = nnx.eval_shape(lambda: MTPModule(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    for src in mtp_hf_sources(config, names, prefix=prefix):
        load_source(src, reader, variables)
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


def load_hf_dflash(directory: str | os.PathLike, *, dtype=None) -> DFlashDraft:
    """Loads a z-lab DFlash draft checkpoint directory (config.json + model.safetensors; docs/dflash.md §4).

    Tensor names as published (`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.*`), with or
    without a `model.` prefix.

    Args:
      directory: holds config.json and *.safetensors (optionally sharded with an index).
      dtype: parameter dtype; None: `fc.weight`'s dtype in the file.

    Raises:
      FileNotFoundError: no config.json.
      ValueError: a config `DFlashConfig.from_hf` refuses.
      CheckpointError: a tensor missing, mis-shaped or left over, or a file unreadable.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            config = DFlashConfig.from_hf(json.load(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    index = _tensor_index(directory)
    reader, names = _Reader(index), set(index)
    prefix = "model." if "model.fc.weight" in names else ""
    if dtype is None:
        dtype = _file_dtype(reader, prefix + "fc.weight")
    abstract = nnx.eval_shape(lambda: DFlashDraft(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    used = set()
    for src in dflash_hf_sources(config.num_layers, prefix=prefix):
        load_source(src, reader, variables)
        used.update(src.tensors)
    unused = sorted(names - used)
    if unused:
        raise CheckpointError(
            f"DFlash checkpoint has {len(unused)} tensors this config does not use, e.g. {unused[:3]}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))

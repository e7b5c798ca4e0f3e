"""GGUF files of the DFlash draft model: `save_dflash_gguf` writes one, `load_gguf_dflash` reads it back.

Layout (docs/dflash.md §4): architecture `qwen35-dflash-draft` with Lucebox's tensor names and keys
(`dflash.fc.weight`, `dflash.hidden_norm.weight`, `output_norm.weight`, `blk.{i}.*`;
`{arch}.dflash.block_size`, `.dflash.mask_token_id`, `.dflash.n_target_layers` = the number of tapped layers,
`.dflash.target_layer_ids`),
llama.cpp's `{arch}.rope.scaling.*` keys for YaRN, and two keys of ours: `{arch}.dflash.target_block_count`
(the target's layer count) and `{arch}.rope.scaling.yarn_truncate`. `rope.scaling.attn_factor` is llama.cpp's:
a multiplier on YaRN's own 0.1 ln(s) + 1, so the resolved attention factor (mscale / mscale_all_dim or an
explicit one) is written divided by it and needs no keys of its own (1 for the published drafts).
Source: Lucebox `dflash/scripts/quantize_draft_q8.py` and `gguf_draft_loader.cpp` (Luce-Org/lucebox).
"""

from __future__ import annotations

import dataclasses
import os

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGUFValueType

from hybridlm.checkpoints import gguf_device, gguf_quants
from hybridlm.checkpoints.gguf import TENSOR_TYPES, stored_type
from hybridlm.checkpoints.gguf_header import GGUFError, Header, read_header
from hybridlm.checkpoints.gguf_metadata import (
    CONTEXT_LENGTH_RANGE,
    HEAD_COUNT_RANGE,
    HEAD_DIM_RANGE,
    RMS_NORM_EPS_RANGE,
    ROPE_FREQ_BASE_RANGE,
)
from hybridlm.checkpoints.mapping import DFLASH_GGUF_ARCH, dflash_gguf_sources
from hybridlm.dflash import DFlashConfig, DFlashDraft
from hybridlm.layers.rope import YarnScaling

_MAX = 1 << 24  # no DFlash size comes near 16 M


def _entry(header: Header, key: str, kinds, what: str, required: bool = True):
    full = f"{DFLASH_GGUF_ARCH}.{key}"
    entry = header.metadata.get(full)
    if entry is None:
        if required:
            raise GGUFError(f"DFlash GGUF lacks required key {full!r}")
        return None
    if entry[0] not in kinds:
        raise GGUFError(f"metadata {full!r} must be {what}, got {entry[0].name}")
    return entry[1]


_INTS = (
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
)
_FLOATS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


def _int(header, key, bounds=(1, _MAX), required=True):
    value = _entry(header, key, _INTS, "an integer", required)
    if value is not None and not bounds[0] <= value <= bounds[1]:
        raise GGUFError(
            f"metadata {DFLASH_GGUF_ARCH}.{key} = {value} is out of range [{bounds[0]}, {bounds[1]}]"
        )
    return None if value is None else int(value)


def _float(header, key, bounds, required=True):
    value = _entry(header, key, _FLOATS, "a float", required)
    if value is None:
        return None
    value = float(str(np.float32(value)))  # the shortest decimal that round-trips, as written
    if not bounds[0] <= value <= bounds[1]:  # NaN fails too
        raise GGUFError(
            f"metadata {DFLASH_GGUF_ARCH}.{key} = {value!r} is out of range [{bounds[0]}, {bounds[1]}]"
        )
    return value


def dflash_config_from_gguf(header: Header) -> DFlashConfig:
    """The `DFlashConfig` of a `qwen35-dflash-draft` header.

    target_layer_ids come from `dflash.target_layer_ids`; a Lucebox file without it (its loader then uses a
    per-model list) is refused.

    Raises:
      GGUFError: another architecture, a missing key, a value of the wrong type or out of range, or a
        config the values do not make (naming the key or the reason).
    """
    arch = header.metadata.get("general.architecture")
    if arch is None or arch[1] != DFLASH_GGUF_ARCH:
        raise GGUFError(
            f"not a DFlash draft: general.architecture {arch and arch[1]!r}, want {DFLASH_GGUF_ARCH!r}"
        )
    ids = _entry(
        header, "dflash.target_layer_ids", (GGUFValueType.ARRAY,), "an integer array", required=False
    )
    if ids is None:
        raise GGUFError(
            f"{DFLASH_GGUF_ARCH}.dflash.target_layer_ids is missing: the file does not say which target "
            "layers the draft reads"
        )
    if ids[0] not in _INTS:
        raise GGUFError(f"{DFLASH_GGUF_ARCH}.dflash.target_layer_ids must hold integers, got {ids[0].name}")
    ids = tuple(int(i) for i in ids[1])
    taps = _int(header, "dflash.n_target_layers", required=False)
    if taps is not None and taps != len(ids):
        raise GGUFError(
            f"{DFLASH_GGUF_ARCH}.dflash.n_target_layers={taps} but target_layer_ids has {len(ids)} entries"
        )
    scaling = None
    kind = _entry(header, "rope.scaling.type", (GGUFValueType.STRING,), "a string", required=False)
    if kind not in (None, "none", "yarn"):
        raise GGUFError(f"{DFLASH_GGUF_ARCH}.rope.scaling.type={kind!r} is not supported; 'yarn' or none")
    if kind == "yarn":
        truncate = _entry(
            header, "rope.scaling.yarn_truncate", (GGUFValueType.BOOL,), "a bool", required=False
        )
        scaling = YarnScaling(
            factor=_float(header, "rope.scaling.factor", (1e-3, 1e6)),
            original_max_position_embeddings=_int(
                header, "rope.scaling.original_context_length", CONTEXT_LENGTH_RANGE
            ),
            beta_fast=_float(header, "rope.scaling.yarn_beta_fast", (1e-6, 1e6), required=False) or 32.0,
            beta_slow=_float(header, "rope.scaling.yarn_beta_slow", (1e-6, 1e6), required=False) or 1.0,
            truncate=True if truncate is None else bool(truncate),
        )
        multiplier = _float(header, "rope.scaling.attn_factor", (1e-6, 1e6), required=False)
        if multiplier not in (None, 1.0):
            scaling = dataclasses.replace(scaling, attention_factor=multiplier * scaling.cos_sin_scale())
    name = header.metadata.get("general.name")
    try:
        return DFlashConfig(
            name=name[1] if name is not None and name[0] == GGUFValueType.STRING else "dflash",
            hidden_dim=_int(header, "embedding_length"),
            num_layers=_int(header, "block_count"),
            num_heads=_int(header, "attention.head_count", HEAD_COUNT_RANGE),
            num_kv_heads=_int(header, "attention.head_count_kv", HEAD_COUNT_RANGE),
            head_dim=_int(header, "attention.key_length", HEAD_DIM_RANGE),
            ffn_dim=_int(header, "feed_forward_length"),
            vocab_size=_int(header, "vocab_size"),
            target_layer_ids=ids,
            mask_token_id=_int(header, "dflash.mask_token_id", (0, _MAX)),
            num_target_layers=_int(header, "dflash.target_block_count", required=False),
            block_size=_int(header, "dflash.block_size", (2, 4096)),
            rms_norm_eps=_float(header, "attention.layer_norm_rms_epsilon", RMS_NORM_EPS_RANGE),
            rope_theta=_float(header, "rope.freq_base", ROPE_FREQ_BASE_RANGE),
            rope_scaling=scaling,
            max_position_embeddings=_int(header, "context_length", CONTEXT_LENGTH_RANGE),
        )
    except ValueError as e:
        raise GGUFError(f"DFlash GGUF metadata is inconsistent: {e}") from None


def load_gguf_dflash(path: str | os.PathLike, *, dtype=None, check_finite: bool = True) -> DFlashDraft:
    """Loads a `qwen35-dflash-draft` GGUF file (any tensor type the trunk loader reads, dequantized).

    Args:
      path: the .gguf file.
      dtype: parameter dtype; None: float32 if `dflash.fc.weight` is F32, else bfloat16.
      check_finite: refuse NaN / Inf weights.

    Raises:
      GGUFError: (a ValueError) a malformed file, another architecture, bad metadata
        (`dflash_config_from_gguf`), missing, extra or mis-shaped tensors, NaN/Inf weights.
      OSError: the file could not be read.
    """
    path = os.fspath(path)
    header = read_header(path)
    config = dflash_config_from_gguf(header)
    for info in header.tensors.values():
        if info.type not in gguf_quants.SUPPORTED_TYPES:
            raise GGUFError(f"tensor {info.name!r} has type {info.type.name}, which is not supported")
    if dtype is None:
        fc = header.tensors.get("dflash.fc.weight")
        dtype = jnp.float32 if fc is not None and fc.type == gguf_quants.T.F32 else jnp.bfloat16
    abstract = nnx.eval_shape(lambda: DFlashDraft(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    names = set(header.tensors)
    sources = list(dflash_gguf_sources(config.num_layers, names))
    extra = sorted(names - {n for src in sources for n in src.tensors})
    if extra:
        raise GGUFError(f"DFlash GGUF has {len(extra)} tensors this draft does not use, e.g. {extra[:3]}")
    with open(path, "rb") as f:
        for src in sources:
            missing = [n for n in src.tensors if n not in header.tensors]
            if missing:
                raise GGUFError(f"DFlash GGUF lacks tensor {missing[0]!r} ({config.num_layers} layers)")
            infos = [header.tensors[n] for n in src.tensors]
            arrays = [
                gguf_quants.dequantize(
                    gguf_device.host_view(gguf_device.read_tensor(f.fileno(), t), t), t.type
                )
                for t in infos
            ]
            try:
                values = src.load(*arrays)
            except (ValueError, IndexError) as e:
                raise GGUFError(f"tensor(s) {list(src.tensors)} do not fit the metadata: {e}") from None
            for param, value in zip(src.params, values, strict=True):
                want = variables[param].get_value()
                if tuple(value.shape) != tuple(want.shape):
                    raise GGUFError(
                        f"tensor(s) {list(src.tensors)} give {'.'.join(map(str, param))} shape "
                        f"{tuple(value.shape)}, expected {tuple(want.shape)} from the metadata"
                    )
                if check_finite and not np.isfinite(value).all():
                    raise GGUFError(f"tensor {src.tensors[0]!r} holds NaN or Inf values")
                variables[param].set_value(jnp.asarray(value, want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


def save_dflash_gguf(draft: DFlashDraft, path: str | os.PathLike, tensor_type: str = "f32") -> None:
    """Writes `draft` as a `qwen35-dflash-draft` GGUF file (the layout of the module docstring).

    Args:
      draft: the module.
      path: output file.
      tensor_type: as `save_gguf`'s (the `_m` mixes apply their base type): the type of every matrix; norms
        and 1-D tensors are F32, rows that do not fit a block fall back as `save_gguf`'s do.

    Raises:
      ValueError: unknown tensor_type.
    """
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type={tensor_type!r}; choose from {sorted(TENSOR_TYPES)}")
    c: DFlashConfig = draft.config
    wanted, file_type = TENSOR_TYPES[tensor_type]
    arch = DFLASH_GGUF_ARCH
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(c.name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_dim)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_uint32(f"{arch}.dflash.n_target_layers", len(c.target_layer_ids))
    w.add_uint32(f"{arch}.dflash.block_size", c.block_size)
    w.add_uint32(f"{arch}.dflash.mask_token_id", c.mask_token_id)
    w.add_array(f"{arch}.dflash.target_layer_ids", [int(i) for i in c.target_layer_ids])  # INT32
    if c.num_target_layers is not None:
        w.add_uint32(f"{arch}.dflash.target_block_count", c.num_target_layers)
    s = c.rope_scaling
    if s is not None:
        default = dataclasses.replace(s, mscale=None, mscale_all_dim=None, attention_factor=None)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
        w.add_rope_scaling_attn_factors(s.cos_sin_scale() / default.cos_sin_scale())
        w.add_bool(f"{arch}.rope.scaling.yarn_truncate", s.truncate)
    params = dict(nnx.to_flat_state(nnx.state(draft, nnx.Param)))
    for src in dflash_gguf_sources(c.num_layers):
        values = [np.asarray(jnp.asarray(params[p].get_value(), jnp.float32)) for p in src.params]
        for name, array in zip(src.tensors, src.save(*values), strict=True):
            array = np.ascontiguousarray(array, np.float32)
            qtype = stored_type(name, array.shape, wanted, src.f32)
            if qtype == gguf_quants.T.F32:
                w.add_tensor(name, array)
            elif qtype == gguf_quants.T.F16:
                w.add_tensor(name, array.astype(np.float16))
            else:
                w.add_tensor(name, gguf_quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()

"""GGUF (llama.cpp) files: load `qwen35moe` / `qwen35` / `qwen3next` models, and write them (`save_gguf`).

Loading validates the header with a bounded parser (`gguf_header.read_header`), builds the `ModelConfig` from
the `{arch}.*` metadata, then reads tensors one table row at a time (`mapping.gguf_sources`) from the
memory-mapped file (with the byte layout `gguf.GGUFReader` presents), dequantizes each with the gguf package's
numpy dequantizers and undoes the converter's transforms (norm +1, ssm_a = -exp(A_log), V-head reorder,
transposes). Peak host memory is the model plus the dequantized tensors of one table row.
`gguf.GGUFReader` itself is not used for loading: it builds a numpy view per metadata array element, which
makes the Qwen3.5 vocabulary's 750k tokenizer strings slow to read; the tests check that written files pass
`GGUFReader` and the gguf dump tool.
`save_gguf` applies the converter's transforms and writes what llama.cpp's `convert_hf_to_gguf.py` writes for
the same weights (names, shapes, F32 rules, metadata, tokenizer).
Spec: ../shared/spec/qwen35-hybrid-moe.md §10, §12.
"""

from __future__ import annotations

import math
import os

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType
from tqdm.auto import tqdm

from hybridlm.checkpoints import gguf_quants
from hybridlm.checkpoints.gguf_header import GGUFError, Header, TensorInfo, read_header
from hybridlm.checkpoints.mapping import gguf_sources
from hybridlm.config import AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig
from hybridlm.model import HybridLM, loaded_value
from pallas_kernels.quantized import QuantizedWeights

__all__ = [
    "SUPPORTED_ARCHS",
    "GGUFError",
    "config_from_gguf",
    "load_gguf",
    "load_gguf_tokenizer",
    "save_gguf",
]

T = GGMLQuantizationType
SUPPORTED_ARCHS = ("qwen35moe", "qwen35", "qwen3next")
_INT_TYPES = (
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
)
_FLOAT_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
_MAX_DIM = 1 << 24  # no model dimension of these families comes near 16 M


# ----------------------------------------------------------------------------------------------------------
# metadata -> ModelConfig
# ----------------------------------------------------------------------------------------------------------
class _Meta:
    """Typed access to `{arch}.*` metadata; every error names the key."""

    def __init__(self, header: Header, arch: str):
        self.md, self.arch = header.metadata, arch

    def _get(self, key, required):
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise GGUFError(f"GGUF metadata lacks required key {full!r}")
            return None, None
        return full, self.md[full]

    def int(self, key, default=None, *, required=False, per_layer=False, minimum=1):
        full, entry = self._get(key, required)
        if entry is None:
            return default
        vtype, value = entry
        if vtype == GGUFValueType.ARRAY and per_layer and value[0] in _INT_TYPES and value[1]:
            values = {int(v) for v in value[1] if int(v) != 0}  # per-layer arrays: 0 marks layers without it
            if len(values) != 1:
                raise GGUFError(
                    f"metadata {full!r} = {value[1][:8]}...: per-layer values that differ are not supported"
                )
            value = values.pop()
        elif vtype not in _INT_TYPES:
            raise GGUFError(f"metadata {full!r} must be an integer, got {vtype.name}")
        if not minimum <= value <= _MAX_DIM:
            raise GGUFError(f"metadata {full!r} = {value} is out of range [{minimum}, {_MAX_DIM}]")
        return int(value)

    def float(self, key, default=None, *, required=False):
        full, entry = self._get(key, required)
        if entry is None:
            return default
        vtype, value = entry
        if vtype not in _FLOAT_TYPES or not math.isfinite(value) or value <= 0:
            raise GGUFError(f"metadata {full!r} must be a positive finite float, got {vtype.name} {value!r}")
        # float32 keys: the shortest decimal that round-trips (1e-06, not 9.99999997e-07), as written.
        return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else float(value)

    def int_array(self, key):
        full, entry = self._get(key, False)
        if entry is None:
            return None
        vtype, value = entry
        if vtype != GGUFValueType.ARRAY or value[0] not in _INT_TYPES + (GGUFValueType.BOOL,):
            raise GGUFError(f"metadata {full!r} must be an integer array")
        return [int(v) for v in value[1]]

    def bool(self, key, default):
        full, entry = self._get(key, False)
        if entry is None:
            return default
        if entry[0] != GGUFValueType.BOOL:
            raise GGUFError(f"metadata {full!r} must be a bool, got {entry[0].name}")
        return bool(entry[1])


def _architecture(header: Header) -> str:
    entry = header.metadata.get("general.architecture")
    if entry is None:
        raise GGUFError("GGUF metadata lacks general.architecture")
    if entry[0] != GGUFValueType.STRING:
        raise GGUFError(f"general.architecture must be a string, got {entry[0].name}")
    if entry[1] not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {entry[1]!r}; supported: {list(SUPPORTED_ARCHS)}")
    return entry[1]


def config_from_gguf(header: Header) -> ModelConfig:
    """Builds the `ModelConfig` from a validated header's metadata
    (and tensor shapes where metadata is optional).

    Raises:
      GGUFError: unsupported architecture, a missing required key, a key of the wrong type, or sizes that
        disagree with each other.
    """
    arch = _architecture(header)
    m = _Meta(header, arch)
    block_count = m.int("block_count", required=True)
    nextn = m.int("nextn_predict_layers", 0, minimum=0)
    num_layers = block_count - nextn
    if num_layers < 1:
        raise GGUFError(
            f"{arch}.block_count={block_count} minus nextn_predict_layers={nextn} leaves no layers"
        )
    hidden = m.int("embedding_length", required=True)
    heads = m.int("attention.head_count", required=True, per_layer=True)
    kv_heads = m.int("attention.head_count_kv", heads, per_layer=True)
    head_dim = m.int("attention.key_length", hidden // heads)
    value_len = m.int("attention.value_length", head_dim)
    if value_len != head_dim:
        raise GGUFError(f"{arch}.attention.value_length={value_len} != key_length={head_dim} (not supported)")
    rope_dim = m.int("rope.dimension_count", head_dim)
    sections = m.int_array("rope.dimension_sections")
    if sections is not None:
        while len(sections) > 1 and sections[-1] == 0:  # padded to 4 entries
            sections = sections[:-1]
        sections = tuple(sections) if arch != "qwen3next" else None
    tok = header.tensors.get("token_embd.weight")
    vocab = m.int("vocab_size", tok.ne[1] if tok is not None and len(tok.ne) == 2 else None)
    if vocab is None:
        raise GGUFError("cannot tell the vocabulary size: no token_embd.weight and no vocab_size key")
    d_state = m.int("ssm.state_size", required=True)
    v_heads = m.int("ssm.time_step_rank", required=True)
    inner = m.int("ssm.inner_size", required=True)
    if inner != v_heads * d_state:
        raise GGUFError(
            f"{arch}.ssm.inner_size={inner} != ssm.time_step_rank*ssm.state_size={v_heads * d_state}"
        )
    moe, dense_ffn = None, None
    if arch == "qwen35":
        dense_ffn = m.int("feed_forward_length", required=True, per_layer=True)
    else:
        shexp = header.tensors.get("blk.0.ffn_gate_shexp.weight")
        moe = _config_part(
            arch,
            MoEConfig,
            num_experts=m.int("expert_count", required=True),
            top_k=m.int("expert_used_count", required=True),
            expert_ffn_dim=m.int("expert_feed_forward_length", required=True),
            shared_ffn_dim=m.int(
                "expert_shared_feed_forward_length",
                shexp.ne[1] if shexp is not None and len(shexp.ne) == 2 else 0,
                minimum=0,
            ),
            normalize_top_k=m.bool("expert_weights_norm", True),
        )
    recurrent = m.int_array("attention.recurrent_layers")
    layer_types = None
    if recurrent is not None:
        if len(recurrent) < num_layers:
            raise GGUFError(
                f"{arch}.attention.recurrent_layers has {len(recurrent)} entries for {num_layers} layers"
            )
        layer_types = tuple("linear_attention" if r else "full_attention" for r in recurrent[:num_layers])
    try:
        return ModelConfig(
            name=_string(header, "general.name") or arch,
            vocab_size=vocab,
            hidden_dim=hidden,
            num_layers=num_layers,
            full_attention_interval=m.int("full_attention_interval", 4),
            explicit_layer_types=layer_types,
            rms_norm_eps=m.float("attention.layer_norm_rms_epsilon", required=True),
            tie_word_embeddings="output.weight" not in header.tensors,
            max_position_embeddings=m.int("context_length", required=True),
            attention=AttentionConfig(
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rope_theta=m.float("rope.freq_base", 10_000.0),
                partial_rotary_factor=rope_dim / head_dim,
                mrope_sections=sections,
            ),
            gdn=GatedDeltaNetConfig(
                num_k_heads=m.int("ssm.group_count", required=True),
                num_v_heads=v_heads,
                key_dim=d_state,
                value_dim=d_state,
                conv_kernel=m.int("ssm.conv_kernel", required=True),
            ),
            moe=moe,
            dense_ffn_dim=dense_ffn,
        )
    except ValueError as e:
        raise GGUFError(f"GGUF metadata of {arch!r} is inconsistent: {e}") from None


def _config_part(arch, cls, **fields):
    try:
        return cls(**fields)
    except ValueError as e:
        raise GGUFError(f"GGUF metadata of {arch!r} is inconsistent: {e}") from None


def _string(header: Header, key: str) -> str | None:
    entry = header.metadata.get(key)
    return entry[1] if entry is not None and entry[0] == GGUFValueType.STRING else None


# ----------------------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------------------
def _is_trunk_tensor(name: str, num_layers: int) -> bool:
    """False for tensors the text trunk never reads (MTP / nextn blocks appended after the trunk)."""
    if name.startswith("blk."):
        try:
            return int(name.split(".")[1]) < num_layers and ".nextn." not in name
        except ValueError:
            return True
    return True


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype=None,
    keep_quantized: str | None = None,
    progress: bool = True,
    expert_sink=None,
) -> HybridLM:
    """Loads a llama.cpp GGUF file of a `qwen35moe`, `qwen35` or `qwen3next` model.

    Args:
      path: the .gguf file (one file; split `-00001-of-0000N` files are not supported).
      dtype: parameter dtype; None: float32 if the embedding is F32, else bfloat16.
      keep_quantized: None dequantizes everything; "experts" keeps routed-expert tensors stored as Q8_0,
        Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL or IQ4_XS (as 8-bit) or as Q4_0, Q4_1 or Q4_K (as 4-bit)
        `QuantizedWeights`, exactly (`gguf_quants.to_quantized_weights`); other types (F16, BF16, Q8_K), or
        input dims that do not split into whole 4-bit halves, are dequantized.
      progress: show a progress bar over tensors.
      expert_sink: None, or a function (layer, name, value) that takes each routed-expert parameter
        ("experts_gate_up" / "experts_down", a `QuantizedWeights` or a device array [experts, ...]) as soon as
        it is loaded; the model then holds 1-element placeholders for them (`hybridlm.offload.load_offloaded`
        packs them into pinned host memory one layer at a time).

    Returns:
      The model. A GDN model in Qwen3.5 GGUF order gets its V heads back in HF (grouped) order.

    Raises:
      GGUFError: (a ValueError) a malformed or hostile file, an unsupported architecture or tensor type,
        missing, extra or mis-shaped tensors; the message names the key or tensor.
    """
    path = os.fspath(path)
    if keep_quantized not in (None, "experts"):
        raise ValueError(f"keep_quantized={keep_quantized!r}; choose None or 'experts'")
    header = read_header(path)
    config = config_from_gguf(header)
    arch = _architecture(header)
    _check_tensor_table(header, config)
    if dtype is None:
        embed = header.tensors.get("token_embd.weight")
        dtype = jnp.float32 if embed is not None and embed.type == T.F32 else jnp.bfloat16
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    abstract = nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    names = set(header.tensors)
    sources = list(gguf_sources(config, arch, names))
    used = set()
    for src in tqdm(
        sources, desc=f"loading {os.path.basename(path)}", unit="tensor", disable=not progress, leave=False
    ):
        missing = [n for n in src.tensors if n not in names]
        if missing:
            raise GGUFError(
                f"GGUF file lacks tensor {missing[0]!r} (architecture {arch}, {config.num_layers} layers)"
            )
        wants = [variables[p].get_value() for p in src.params]
        want_count = sum(math.prod(w.shape) for w in wants)
        got_count = sum(math.prod(header.tensors[n].ne) for n in src.tensors)
        if got_count != want_count:
            raise GGUFError(
                f"tensor(s) {list(src.tensors)} with ne={[list(header.tensors[n].ne) for n in src.tensors]}"
                f" hold {got_count} values; the metadata implies {want_count} for "
                f"{['.'.join(map(str, p)) for p in src.params]}"
            )
        used.update(src.tensors)
        kept = _keep(src, header, mapped) if keep_quantized == "experts" and src.experts else None
        if kept is not None:
            _check_shape(src, 0, kept.shape, wants[0].shape)
            variables[src.params[0]].set_value(loaded_value(src.params[0], kept, wants[0].dtype, expert_sink))
            continue
        for i, (value, want) in enumerate(zip(_dequantized(src, header, mapped, arch), wants, strict=False)):
            _check_shape(src, i, value.shape, want.shape)
            variables[src.params[i]].set_value(
                loaded_value(src.params[i], jnp.asarray(value, dtype=want.dtype), want.dtype, expert_sink)
            )
    extra = sorted(n for n in names - used if _is_trunk_tensor(n, config.num_layers))
    if extra:
        raise GGUFError(
            f"GGUF file has {len(extra)} tensors a {arch} model of this config does not use, e.g. {extra[:3]}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


def _check_tensor_table(header, config) -> None:
    """Refuses a tensor table that cannot hold the model (bounding the work of building it) or that has a
    tensor type the loader cannot read.

    Raises:
      GGUFError: naming the layer and tensor counts, or the tensor and its type.
    """
    if config.num_layers > len(header.tensors):
        raise GGUFError(
            f"the metadata implies {config.num_layers} layers; the file has only "
            f"{len(header.tensors)} tensors"
        )
    for info in header.tensors.values():
        if info.type not in gguf_quants.SUPPORTED_TYPES:
            raise GGUFError(
                f"tensor {info.name!r} has type {info.type.name}, which is not supported; supported: "
                f"{[t.name for t in gguf_quants.SUPPORTED_TYPES]}"
            )


def _dequantized(src, header, mapped, arch) -> tuple:
    """The parameter values of one table row: its tensors dequantized, then the converter's transforms undone.

    Raises:
      GGUFError: the tensors do not fit the architecture's metadata (names them).
    """
    arrays = [
        gguf_quants.dequantize(tensor_data(mapped, header.tensors[n]), header.tensors[n].type)
        for n in src.tensors
    ]
    try:
        return src.load(*arrays)
    except (ValueError, IndexError) as e:
        raise GGUFError(f"tensor(s) {list(src.tensors)} do not fit {arch} metadata: {e}") from None


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a GGUF file (`tokenizer.ggml.*`, via the HF `tokenizers` library), or None when
    the file has none; same interface as `hybridlm.tokenizer.Tokenizer` (encode / decode / eos_token_id).

    Raises:
      GGUFError: malformed header or tokenizer metadata, or a tokenizer type other than byte-level BPE.
    """
    from hybridlm.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(path, read_header(path))


def _check_shape(src, i, got, want):
    if tuple(got) != tuple(want):
        raise GGUFError(
            f"tensor(s) {list(src.tensors)} give {'.'.join(map(str, src.params[i]))} shape "
            f"{tuple(got)}, expected {tuple(want)} from the metadata"
        )


def tensor_data(mapped: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes in the memory-mapped file, as `gguf.GGUFReader` presents them: F32/F16 typed in numpy
    shape (reversed ne), other types uint8 `[..., rows, bytes_per_row]`. No copy."""
    raw = mapped[info.offset : info.offset + info.nbytes]
    if info.type == T.F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.type == T.F16:
        return raw.view(np.float16).reshape(info.shape)
    block, type_size = GGML_QUANT_SIZES[info.type]
    return raw.reshape(*info.shape[:-1], info.ne[0] // block * type_size)


def _keep(src, header: Header, mapped) -> QuantizedWeights | None:
    """The expert parameter of `src` as QuantizedWeights, or None when its tensors cannot be kept exactly."""
    infos = [header.tensors[n] for n in src.tensors]
    if not all(gguf_quants.can_keep(t.type, t.ne[0]) and len(t.ne) == 3 for t in infos):
        return None
    bits = {gguf_quants.KEPT_BITS[t.type] for t in infos}
    if len(bits) != 1:
        return None
    return gguf_quants.to_quantized_weights([(tensor_data(mapped, t), t.type) for t in infos])


# ----------------------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------------------
TENSOR_TYPES = {
    "f32": (T.F32, LlamaFileType.ALL_F32),
    "f16": (T.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (T.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_k": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
}
# Fallbacks when ne0 does not fit the block (llama.cpp: the converter falls back to F16 for Q8_0;
# llama-quantize uses Q5_0 for Q4_K rows that are not a multiple of 256, Q5_1 for Q5_K ones,
# Q8_0 for Q6_K ones).
_FALLBACK = {
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
    T.Q5_0: T.F16,
    T.Q5_1: T.F16,
    T.Q8_0: T.F16,
    T.BF16: T.F16,
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quantize's rule for the layers whose ffn_down and attn_v get more bits in its _M mixes: the first
    and last eighth of the layers, and every third layer between (llama.cpp `use_more_bits`)."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def mix_type(
    tensor_type: str, name: str, num_layers: int, wanted: GGMLQuantizationType
) -> GGMLQuantizationType:
    """The type `tensor_type` asks for tensor `name`: "q4_k_m" / "q5_k_m" as llama-quantize's Q4_K_M / Q5_K_M
    mixes (Q6_K for output.weight and, in the layers of `use_more_bits`, for ffn_down* (routed and shared
    experts) and attn_v; Q4_K / Q5_K elsewhere); every other tensor_type is one type for every matrix."""
    if tensor_type not in ("q4_k_m", "q5_k_m"):
        return wanted
    parts = name.split(".")
    if name == "output.weight" or (
        parts[0] == "blk"
        and (parts[2].startswith("ffn_down") or parts[2] == "attn_v")
        and use_more_bits(int(parts[1]), num_layers)
    ):
        return T.Q6_K
    return wanted


def gguf_architecture(config: ModelConfig) -> str:
    """The GGUF architecture string for a config: qwen35 (dense), qwen3next (no M-RoPE), else qwen35moe."""
    if config.moe is None:
        return "qwen35"
    return "qwen3next" if config.attention.mrope_sections is None else "qwen35moe"


def stored_type(
    name: str, shape: tuple[int, ...], wanted: GGMLQuantizationType, forced_f32: bool
) -> GGMLQuantizationType:
    """The type `save_gguf` stores tensor `name` of numpy `shape` in: F32 by the converter's rules, else
    `wanted`, or its fallback when the row length does not fit the block."""
    if forced_f32 or len(shape) == 1 or name.endswith("_norm.weight") or wanted == T.F32:
        return T.F32
    qtype = wanted
    while qtype not in (T.F16, T.F32) and shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK[qtype]
    return qtype


def save_gguf(
    model: HybridLM,
    path: str | os.PathLike,
    tensor_type: str = "f32",
    *,
    tokenizer: bool = True,
    arch: str | None = None,
    progress: bool = False,
) -> None:
    """Writes `model` as the GGUF file llama.cpp's converter would write for the same weights.

    Args:
      model: the model (float or with `QuantizedWeights` experts, which are dequantized first).
      path: output file.
      tensor_type: "f32", "f16", "bf16", "q8_0", "q4_k", "q5_k" or "q6_k": the type of every matrix;
        "q4_k_m" / "q5_k_m": Q4_K / Q5_K with Q6_K for output.weight and for ffn_down* / attn_v in the layers
        of `use_more_bits`, as llama-quantize's Q4_K_M / Q5_K_M mixes (without its importance-matrix or
        iterative scale searches). Norms, 1-D tensors, ssm_a, ssm_dt, ssm_conv1d, the router and the
        shared-expert gate are always F32 (converter rules). Rows whose length does not fit the type's block
        fall back (Q4_K -> Q5_0 -> F16, Q5_K -> Q5_1 -> F16, Q6_K -> Q8_0 -> F16).
      tokenizer: also write the Qwen3.5 tokenizer (`tokenizer.ggml.*`), when the model's vocabulary has its
        size (248 320); smaller test vocabularies get none.
      arch: GGUF architecture; None: `gguf_architecture(config)`.
      progress: show a progress bar.

    Raises:
      ValueError: unknown tensor_type or arch, or a config GGUF cannot express (explicit layer types that are
        not the interval pattern).
    """
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type={tensor_type!r}; choose from {sorted(TENSOR_TYPES)}")
    config: ModelConfig = model.config
    arch = arch or gguf_architecture(config)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch={arch!r}; supported: {list(SUPPORTED_ARCHS)}")
    pattern = tuple(
        "full_attention" if (i + 1) % config.full_attention_interval == 0 else "linear_attention"
        for i in range(config.num_layers)
    )
    if config.layer_types != pattern:
        raise ValueError(
            "GGUF stores the layer pattern as full_attention_interval; this config's explicit "
            "layer_types do not follow it"
        )
    if config.gdn.key_dim != config.gdn.value_dim:
        raise ValueError(
            f"GGUF stores one ssm.state_size: key_dim={config.gdn.key_dim} != "
            f"value_dim={config.gdn.value_dim}"
        )
    wanted, file_type = TENSOR_TYPES[tensor_type]
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    write_metadata(writer, config, arch, file_type)
    if tokenizer and config.vocab_size == _qwen_vocab_size():
        from hybridlm.checkpoints.gguf_tokenizer import write_tokenizer

        write_tokenizer(writer)
    params = {path_: var for path_, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for src in tqdm(list(gguf_sources(config, arch)), desc="writing GGUF", disable=not progress, leave=False):
        values = [_as_numpy(params[p].get_value()) for p in src.params]
        for name, array in zip(src.tensors, src.save(*values), strict=False):
            array = np.ascontiguousarray(array, np.float32)
            qtype = stored_type(
                name, array.shape, mix_type(tensor_type, name, config.num_layers, wanted), src.f32
            )
            if qtype == T.F32:
                writer.add_tensor(name, array)
            elif qtype == T.F16:
                writer.add_tensor(name, array.astype(np.float16))
            else:
                writer.add_tensor(name, gguf_quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _as_numpy(value) -> np.ndarray:
    if isinstance(value, QuantizedWeights):
        value = value.dequantize(jnp.float32)
    return np.asarray(jnp.asarray(value, jnp.float32))


def _qwen_vocab_size() -> int:
    from hybridlm.tokenizer import QWEN35_VOCAB_SIZE

    return QWEN35_VOCAB_SIZE


def write_metadata(w: gguf.GGUFWriter, config: ModelConfig, arch: str, file_type) -> None:
    """The `{arch}.*` keys of llama.cpp's converter (TextModel / Qwen2MoeModel / Qwen3NextModel /
    _Qwen35MRopeMixin `set_gguf_parameters`)."""
    a, g = config.attention, config.gdn
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(config.name)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_dim)
    if config.dense_ffn_dim is not None:
        w.add_feed_forward_length(config.dense_ffn_dim)
    w.add_head_count(a.num_heads)
    w.add_head_count_kv(a.num_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    if config.moe is not None:
        w.add_expert_count(config.moe.num_experts)
        w.add_expert_used_count(config.moe.top_k)
        w.add_expert_feed_forward_length(config.moe.expert_ffn_dim)
        w.add_expert_shared_feed_forward_length(config.moe.shared_ffn_dim)
        if not config.moe.normalize_top_k:
            w.add_expert_weights_norm(False)
    w.add_file_type(file_type)
    w.add_ssm_conv_kernel(g.conv_kernel)
    w.add_ssm_state_size(g.key_dim)
    w.add_ssm_group_count(g.num_k_heads)
    w.add_ssm_time_step_rank(g.num_v_heads)
    w.add_ssm_inner_size(g.num_v_heads * g.value_dim)
    w.add_full_attention_interval(config.full_attention_interval)
    w.add_rope_dimension_count(a.rotary_dim)
    if arch != "qwen3next":
        sections = list(a.mrope_sections or (a.rotary_dim // 2,))
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

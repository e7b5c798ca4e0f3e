"""GGUF metadata -> `ModelConfig` for `qwen35moe` / `qwen35` / `qwen3next` files: typed, range-checked reads
of the `{arch}.*` keys, and a check of the tensor table's `blk.N` blocks against block_count and
nextn_predict_layers. Spec: ../shared/spec/qwen35-hybrid-moe.md §10.1, §12.13.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGUFValueType

from hybridlm.checkpoints.gguf_header import GGUFError, Header
from hybridlm.config import AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig

__all__ = [
    "CONTEXT_LENGTH_RANGE",
    "CONV_KERNEL_RANGE",
    "EXPERT_COUNT_RANGE",
    "HEAD_COUNT_RANGE",
    "HEAD_DIM_RANGE",
    "RMS_NORM_EPS_RANGE",
    "ROPE_FREQ_BASE_RANGE",
    "SUPPORTED_ARCHS",
    "architecture",
    "block_index",
    "config_from_gguf",
]

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
# Physical ranges of the metadata values (closed, except RMS_NORM_EPS_RANGE at 0). Released files sit well
# inside: eps 1e-6, rope base 1e7, context 262 144, 256 experts top-8 (Qwen3.5/3.6-35B-A3B) or 512 top-10
# (Qwen3-Next-80B), 2-32 heads of 128-256 dims, conv kernel 4; outside is a corrupted or mislabelled file.
RMS_NORM_EPS_RANGE = (0.0, 1e-2)
ROPE_FREQ_BASE_RANGE = (1.0, 1e9)
CONTEXT_LENGTH_RANGE = (1, 1 << 24)
EXPERT_COUNT_RANGE = (1, 4096)
HEAD_COUNT_RANGE = (1, 1024)  # attention query / key-value heads, Gated DeltaNet key / value heads
HEAD_DIM_RANGE = (1, 4096)  # attention key_length, Gated DeltaNet state size
CONV_KERNEL_RANGE = (1, 16)


class _Meta:
    """Typed access to `{arch}.*` metadata; every error names the key, its value and the accepted range."""

    def __init__(self, header: Header, arch: str):
        self.md, self.arch = header.metadata, arch

    def _get(self, key, required):
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise GGUFError(f"GGUF metadata lacks required key {full!r}")
            return None, None
        return full, self.md[full]

    def int(self, key, default=None, *, required=False, per_layer=False, bounds=(1, _MAX_DIM)):
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
        if not bounds[0] <= value <= bounds[1]:
            raise GGUFError(f"metadata {full!r} = {value} is out of range [{bounds[0]}, {bounds[1]}]")
        return int(value)

    def float(self, key, default=None, *, required=False, bounds, open_low=False):
        full, entry = self._get(key, required)
        if entry is None:
            return default
        vtype, value = entry
        if vtype not in _FLOAT_TYPES:
            raise GGUFError(f"metadata {full!r} must be a float, got {vtype.name} {value!r}")
        # float32 keys: the shortest decimal that round-trips (1e-06, not 9.99999997e-07), as written.
        value = float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else float(value)
        lo, hi = bounds
        if not ((lo < value) if open_low else (lo <= value)) or not value <= hi:  # NaN fails both
            raise GGUFError(
                f"metadata {full!r} = {value!r} is out of range {'(' if open_low else '['}{lo:g}, {hi:g}]"
            )
        return value

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

    def divides(self, key, value, multiple_key, multiple):
        if multiple % value:
            raise GGUFError(
                f"metadata {self.arch}.{multiple_key}={multiple} is not a multiple of "
                f"{self.arch}.{key}={value}"
            )


def architecture(header: Header) -> str:
    """The header's general.architecture, one of `SUPPORTED_ARCHS`.

    Raises:
      GGUFError: the key is missing, not a string, or an architecture not supported.
    """
    entry = header.metadata.get("general.architecture")
    if entry is None:
        raise GGUFError("GGUF metadata lacks general.architecture")
    if entry[0] != GGUFValueType.STRING:
        raise GGUFError(f"general.architecture must be a string, got {entry[0].name}")
    if entry[1] not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {entry[1]!r}; supported: {list(SUPPORTED_ARCHS)}")
    return entry[1]


def config_from_gguf(header: Header) -> ModelConfig:
    """Builds the `ModelConfig` from a validated header's metadata (and tensor shapes where metadata is
    optional), and checks the tensor table's blocks against it (`_check_blocks`).

    Raises:
      GGUFError: unsupported architecture, a missing required key, a key of the wrong type, a value outside
        its physical range (`RMS_NORM_EPS_RANGE`, `ROPE_FREQ_BASE_RANGE`, `CONTEXT_LENGTH_RANGE`,
        `EXPERT_COUNT_RANGE`, `HEAD_COUNT_RANGE`, `HEAD_DIM_RANGE`, `CONV_KERNEL_RANGE`), sizes that disagree
        with each other, or `blk.N` tensors that disagree with block_count / nextn_predict_layers.
    """
    arch = architecture(header)
    m = _Meta(header, arch)
    block_count = m.int("block_count", required=True)
    nextn = m.int("nextn_predict_layers", 0, bounds=(0, block_count - 1))
    num_layers = block_count - nextn
    _check_blocks(header, arch, block_count, nextn)
    hidden = m.int("embedding_length", required=True)
    tok = header.tensors.get("token_embd.weight")
    vocab = m.int("vocab_size", tok.ne[1] if tok is not None and len(tok.ne) == 2 else None)
    if vocab is None:
        raise GGUFError("cannot tell the vocabulary size: no token_embd.weight and no vocab_size key")
    dense = arch == "qwen35"
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
            # a file of fewer layers than the interval (all linear attention) is legal: cut-down test models
            full_attention_interval=m.int("full_attention_interval", 4, bounds=(1, max(block_count, 64))),
            explicit_layer_types=layer_types,
            rms_norm_eps=m.float(
                "attention.layer_norm_rms_epsilon", required=True, bounds=RMS_NORM_EPS_RANGE, open_low=True
            ),
            tie_word_embeddings="output.weight" not in header.tensors,
            max_position_embeddings=m.int("context_length", required=True, bounds=CONTEXT_LENGTH_RANGE),
            attention=_attention_config(m, hidden),
            gdn=_gdn_config(m),
            moe=None if dense else _moe_config(m, header),
            dense_ffn_dim=m.int("feed_forward_length", required=True, per_layer=True) if dense else None,
            mtp_layers=nextn,
        )
    except GGUFError:
        raise
    except ValueError as e:
        raise GGUFError(f"GGUF metadata of {arch!r} is inconsistent: {e}") from None


def _attention_config(m: _Meta, hidden: int) -> AttentionConfig:
    heads = m.int("attention.head_count", required=True, per_layer=True, bounds=HEAD_COUNT_RANGE)
    kv_heads = m.int("attention.head_count_kv", heads, per_layer=True, bounds=HEAD_COUNT_RANGE)
    m.divides("attention.head_count_kv", kv_heads, "attention.head_count", heads)
    head_dim = m.int("attention.key_length", hidden // heads, bounds=HEAD_DIM_RANGE)
    value_len = m.int("attention.value_length", head_dim, bounds=HEAD_DIM_RANGE)
    if value_len != head_dim:
        raise GGUFError(
            f"{m.arch}.attention.value_length={value_len} != key_length={head_dim} (not supported)"
        )
    rope_dim = m.int("rope.dimension_count", head_dim, bounds=(1, head_dim))
    sections = m.int_array("rope.dimension_sections")
    if sections is not None:
        while len(sections) > 1 and sections[-1] == 0:  # padded to 4 entries
            sections = sections[:-1]
        sections = tuple(sections) if m.arch != "qwen3next" else None
    return _config_part(
        m.arch,
        AttentionConfig,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=m.float("rope.freq_base", 10_000.0, bounds=ROPE_FREQ_BASE_RANGE),
        partial_rotary_factor=rope_dim / head_dim,
        mrope_sections=sections,
    )


def _gdn_config(m: _Meta) -> GatedDeltaNetConfig:
    d_state = m.int("ssm.state_size", required=True, bounds=HEAD_DIM_RANGE)
    v_heads = m.int("ssm.time_step_rank", required=True, bounds=HEAD_COUNT_RANGE)
    k_heads = m.int("ssm.group_count", required=True, bounds=HEAD_COUNT_RANGE)
    m.divides("ssm.group_count", k_heads, "ssm.time_step_rank", v_heads)
    inner = m.int("ssm.inner_size", required=True)
    if inner != v_heads * d_state:
        raise GGUFError(
            f"{m.arch}.ssm.inner_size={inner} != ssm.time_step_rank*ssm.state_size={v_heads * d_state}"
        )
    return _config_part(
        m.arch,
        GatedDeltaNetConfig,
        num_k_heads=k_heads,
        num_v_heads=v_heads,
        key_dim=d_state,
        value_dim=d_state,
        conv_kernel=m.int("ssm.conv_kernel", required=True, bounds=CONV_KERNEL_RANGE),
    )


def _moe_config(m: _Meta, header: Header) -> MoEConfig:
    shexp = header.tensors.get("blk.0.ffn_gate_shexp.weight")
    experts = m.int("expert_count", required=True, bounds=EXPERT_COUNT_RANGE)
    return _config_part(
        m.arch,
        MoEConfig,
        num_experts=experts,
        top_k=m.int("expert_used_count", required=True, bounds=(1, experts)),
        expert_ffn_dim=m.int("expert_feed_forward_length", required=True),
        shared_ffn_dim=m.int(
            "expert_shared_feed_forward_length",
            shexp.ne[1] if shexp is not None and len(shexp.ne) == 2 else 0,
            bounds=(0, _MAX_DIM),
        ),
        normalize_top_k=m.bool("expert_weights_norm", True),
    )


def _config_part(arch, cls, **fields):
    try:
        return cls(**fields)
    except ValueError as e:
        raise GGUFError(f"GGUF metadata of {arch!r} is inconsistent: {e}") from None


def block_index(name: str) -> int | None:
    """N for a tensor named `blk.N.*`, else None."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit():
        return int(parts[1])
    return None


def _check_blocks(header: Header, arch: str, block_count: int, nextn: int) -> None:
    """Checks the `blk.N` tensors against block_count and nextn_predict_layers: every trunk block
    0..block_count-nextn-1 holds tensors and no `nextn.*` ones; only the last `nextn` blocks, the MTP blocks
    the loader skips (spec §12.13), may hold those, and each of them that holds tensors holds one; no tensor
    lies in a block past block_count.

    Raises:
      GGUFError: naming the keys, their values and the offending tensors or block.
    """
    num_layers = block_count - nextn
    key = f"{arch}.nextn_predict_layers"
    keys = f"{arch}.block_count={block_count} and " + (
        f"{key}={nextn}" if key in header.metadata else f"no {key}"
    )
    blocks: dict[int, list[str]] = {}
    for name in header.tensors:
        index = block_index(name)
        if index is not None:
            blocks.setdefault(index, []).append(name)
    beyond = sorted(n for i, names in blocks.items() if i >= block_count for n in names)
    if beyond:
        raise GGUFError(
            f"{len(beyond)} tensors lie in blocks past {keys}, e.g. {beyond[:3]}: the block count is wrong "
            f"or the file holds blocks the model does not have"
        )
    for i in sorted(blocks):
        mtp = [n for n in blocks[i] if ".nextn." in n]
        if i < num_layers and mtp:
            allowed = f"only blocks {num_layers}..{block_count - 1} may" if nextn else "no block may"
            raise GGUFError(f"trunk block {i} holds MTP tensors {mtp[:3]}; with {keys} {allowed}")
        if i >= num_layers and not mtp:
            raise GGUFError(
                f"block {i} is an MTP block by {keys}, but holds no nextn.* tensor (it looks like a trunk "
                f"layer, e.g. {sorted(blocks[i])[:2]}): nextn_predict_layers is wrong"
            )
    missing = next((i for i in range(num_layers) if i not in blocks), None)  # stops by len(blocks) + 1
    if missing is not None:
        raise GGUFError(
            f"{keys} imply {num_layers} trunk layers, but the file holds no tensor of block {missing} "
            f"(blocks with tensors: {len(blocks)})"
        )


def _string(header: Header, key: str) -> str | None:
    entry = header.metadata.get(key)
    return entry[1] if entry is not None and entry[0] == GGUFValueType.STRING else None

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

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from tqdm.auto import tqdm

from hybridlm.checkpoints import gguf_device, gguf_quants
from hybridlm.checkpoints.gguf_header import GGUFError, Header, TensorInfo, read_header
from hybridlm.checkpoints.gguf_metadata import SUPPORTED_ARCHS, block_index, config_from_gguf
from hybridlm.checkpoints.gguf_metadata import architecture as _architecture  # the name load_gguf uses
from hybridlm.checkpoints.mapping import gguf_sources, mtp_gguf_sources
from hybridlm.config import ModelConfig
from hybridlm.model import HybridLM, loaded_value
from hybridlm.mtp import MTPModule
from pallas_kernels.quantized import QuantizedWeights

__all__ = [
    "SUPPORTED_ARCHS",
    "GGUFError",
    "config_from_gguf",
    "load_gguf",
    "load_gguf_mtp",
    "load_gguf_tokenizer",
    "save_gguf",
]

T = GGMLQuantizationType


# ----------------------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------------------
def _is_trunk_tensor(name: str, num_layers: int) -> bool:
    """False for the tensors of the MTP (nextn) blocks after the trunk, which the text trunk never reads;
    `config_from_gguf` has refused files whose blocks past the trunk are anything else."""
    index = block_index(name)
    return index is None or index < num_layers


# What `load_gguf(keep_quantized=...)` takes: nothing kept, the routed experts, those and the lm head, or
# every matrix the file's blocks can stand for (the trunk's projections too).
KEEP_CHOICES = (None, "experts", "experts+head", "all")
HEAD_TENSOR = "output.weight"


def _open_checked(path: str, keep_quantized: str | None):
    """(header, config, architecture) of a GGUF file whose tensor table was checked against its config.

    Raises:
      ValueError: keep_quantized not one of KEEP_CHOICES; GGUFError (a ValueError) for a malformed file.
    """
    if keep_quantized not in KEEP_CHOICES:
        raise ValueError(f"keep_quantized={keep_quantized!r}; choose one of {KEEP_CHOICES}")
    header = read_header(path)
    config = config_from_gguf(header)
    arch = _architecture(header)
    _check_tensor_table(header, config)
    return header, config, arch


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype=None,
    keep_quantized: str | None = None,
    progress: bool = True,
    expert_sink=None,
    check_finite: bool = True,
) -> HybridLM:
    """Loads a llama.cpp GGUF file of a `qwen35moe`, `qwen35` or `qwen3next` model.

    Tensors are read with `pread` a few ahead of their use (`read_ahead`), so the file's pages never count
    in the process's resident set; F32/F16/BF16/Q8_0 matrices are dequantized on the device
    (`gguf_device`), other types with the gguf package's numpy dequantizers.

    Args:
      path: the .gguf file (one file; split `-00001-of-0000N` files are not supported).
      dtype: parameter dtype; None: float32 if the embedding is F32, else bfloat16.
      keep_quantized: None dequantizes everything; "experts" keeps routed-expert tensors stored as Q8_0,
        Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL or IQ4_XS (as 8-bit) or as Q4_0, Q4_1 or Q4_K (as 4-bit)
        `QuantizedWeights`, exactly (`gguf_quants.to_quantized_weights`); other types (F16, BF16, Q8_K), or
        input dims that do not split into whole 4-bit halves, are dequantized. "experts+head" also keeps
        the lm head (`output.weight`) of an 8-bit type as a `QuantizedWeights` [1, hidden, vocab], which a
        decode step reads at about half the bytes of bfloat16 (`layers.linear.head_matmul`). "all" also
        keeps every projection matrix of the trunk (attention, Gated DeltaNet, shared expert) that a keepable
        type stores as `QuantizedWeights` [1, in, out], where the loader's reordering of its rows and columns
        (the V-head order) moves whole quantization blocks (`layers.linear.linear` runs them); the
        embedding, the router, norms and other vectors stay float.
      progress: show a progress bar over bytes read.
      expert_sink: None, or a function (layer, name, value) that takes each routed-expert parameter
        ("experts_gate_up" / "experts_down": a `QuantizedWeights`, a device array [experts, ...], or, when
        every expert tensor of the file is Q4_K and keep_quantized="experts", the file's own blocks as
        device `gguf_device.Q4KBlocks`) as soon as it is read; the model then holds 1-element placeholders
        for them (`hybridlm.offload.load_offloaded` packs them into pinned host memory a layer at a time).
      check_finite: refuse a file whose float weights or quantization scales hold NaN or Inf.

    Returns:
      The model. A GDN model in Qwen3.5 GGUF order gets its V heads back in HF (grouped) order.

    Raises:
      GGUFError: (a ValueError) a malformed or hostile file, an unsupported architecture or tensor type,
        missing, extra or mis-shaped tensors, NaN/Inf weights (check_finite); the message names the key or
        tensor.
      OSError: the file could not be read.
    """
    path = os.fspath(path)
    header, config, arch = _open_checked(path, keep_quantized)
    if dtype is None:
        embed = header.tensors.get("token_embd.weight")
        dtype = jnp.float32 if embed is not None and embed.type == T.F32 else jnp.bfloat16
    abstract = nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    names = set(header.tensors)
    sources = list(gguf_sources(config, arch, names))
    for src in sources:
        _check_source(src, header, variables, arch, config)
    used = {n for src in sources for n in src.tensors}
    extra = sorted(n for n in names - used if _is_trunk_tensor(n, config.num_layers))
    if extra:
        raise GGUFError(
            f"GGUF file has {len(extra)} tensors a {arch} model of this config does not use, e.g. {extra[:3]}"
        )
    keeping = _Keeping.of(keep_quantized, header, sources)

    finite: list[tuple[str, object]] = []
    total = sum(header.tensors[n].nbytes for n in used)
    with (
        open(path, "rb") as f,
        tqdm(
            total=total,
            desc=f"loading {os.path.basename(path)}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not progress,
            leave=False,
        ) as bar,
    ):
        previous = None
        on_device = functools.partial(_on_device, header=header, keeping=keeping)
        for src, raws in read_ahead(f.fileno(), header, sources, on_device):
            wants = [variables[p].get_value() for p in src.params]
            values = _source_values(src, raws, header, wants, arch, keeping, expert_sink is not None)
            for i, (param, value, want) in enumerate(zip(src.params, values, wants, strict=True)):
                _check_shape(src, i, value.shape, want.shape)
                if check_finite:
                    finite.append((src.tensors[0], _all_finite(value)))
                variables[param].set_value(loaded_value(param, value, want.dtype, expert_sink))
            # one source in flight: the host buffers of older ones are free before more are read
            jax.block_until_ready(previous)
            previous = [v.data if isinstance(v, gguf_device.Q4KBlocks) else v for v in values]
            bar.update(sum(r.nbytes for r in raws))
    if check_finite:
        _raise_if_not_finite(finite)
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


def load_gguf_mtp(
    path: str | os.PathLike, *, dtype=None, keep_quantized: str | None = None, check_finite: bool = True
) -> MTPModule:
    """Loads the MTP module of a GGUF file: the `blk.{N}.nextn.*` tensors and the MTP blocks' attention and
    MoE tensors (docs/mtp.md §3), N = the trunk's layer count. `load_gguf` is unchanged (it skips them).

    Args:
      path: the .gguf file.
      dtype: parameter dtype; None: as `load_gguf` chooses.
      keep_quantized: None dequantizes everything; "experts" (or "experts+head") keeps the MTP layers'
        routed experts as `QuantizedWeights`, "all" their projections too, by `load_gguf`'s rules and code
        path.
      check_finite: refuse NaN/Inf weights (scales and offsets only, for kept experts).

    Raises:
      ValueError: keep_quantized not one of KEEP_CHOICES.
      GGUFError: no MTP block (`nextn_predict_layers` absent or 0), a dedicated MTP embedding or head
        (`nextn.embed_tokens` / `nextn.shared_head_head`, not supported), missing or mis-shaped tensors,
        NaN/Inf weights.
    """
    path = os.fspath(path)
    header, config, arch = _open_checked(path, keep_quantized)
    if config.mtp_layers == 0:
        raise GGUFError(f"{path} has no MTP block ({arch}.nextn_predict_layers is absent or 0)")
    dedicated = sorted(
        n for n in header.tensors if ".nextn.embed_tokens" in n or ".nextn.shared_head_head" in n
    )
    if dedicated:
        raise GGUFError(f"MTP tensors {dedicated[:2]} (a dedicated MTP embedding / head) are not supported")
    if dtype is None:
        embed = header.tensors.get("token_embd.weight")
        dtype = jnp.float32 if embed is not None and embed.type == T.F32 else jnp.bfloat16
    abstract = nnx.eval_shape(lambda: MTPModule(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    sources = list(mtp_gguf_sources(config, arch, set(header.tensors)))
    for src in sources:
        _check_source(src, header, variables, arch, config)
    keeping = _Keeping.of(keep_quantized, header, sources, head=False)
    finite: list[tuple[str, object]] = []
    on_device = functools.partial(_on_device, header=header, keeping=keeping)
    with open(path, "rb") as f:
        for src, raws in read_ahead(f.fileno(), header, sources, on_device):
            wants = [variables[p].get_value() for p in src.params]
            values = _source_values(src, raws, header, wants, arch, keeping, False)
            for i, (param, value, want) in enumerate(zip(src.params, values, wants, strict=True)):
                _check_shape(src, i, value.shape, want.shape)
                if check_finite:
                    finite.append((src.tensors[0], _all_finite(value)))
                variables[param].set_value(value)  # `_source_values` gave it `want`'s dtype
    if check_finite:
        _raise_if_not_finite(finite)
    return nnx.merge(graphdef, nnx.from_flat_state(list(variables.items())))


# Host bytes read ahead of their use: with `gguf_device.COPY_SLICE` they bound the loader's host memory
# (buffers plus the runtime's pinned staging) whatever the tensor sizes.
_READ_AHEAD = 512 * 2**20


def expert_tensors(header: Header) -> list[TensorInfo]:
    """The trunk's routed-expert tensors (what keep_quantized="experts" keeps; MTP blocks excluded), in table
    order; read from the header only.

    Raises:
      GGUFError: as `config_from_gguf`."""
    config = config_from_gguf(header)
    return _expert_tensors(header, gguf_sources(config, _architecture(header), set(header.tensors)))


def _expert_tensors(header: Header, sources) -> list[TensorInfo]:
    return [header.tensors[n] for src in sources if src.experts for n in src.tensors if n in header.tensors]


def _keepable_head(header: Header) -> bool:
    """Whether the file's lm head can be kept quantized exactly (an 8-bit keepable type)."""
    info = header.tensors.get(HEAD_TENSOR)
    return (
        info is not None
        and gguf_quants.can_keep(info.type, info.ne[0])
        and gguf_quants.KEPT_BITS[info.type] == 8
    )


def _is_head(src) -> bool:
    return tuple(src.tensors) == (HEAD_TENSOR,)


@dataclasses.dataclass
class _Keeping:
    """What one load keeps in its file's blocks (`load_gguf`'s keep_quantized).

    Attributes:
      experts: the routed experts; raw_q4k: as the file's own Q4_K blocks (every expert tensor is Q4_K);
      head: the lm head; trunk: the trunk's projection matrices, with `orders` caching, per kind of source,
      the row and column orders the loader's transform gives (`_trunk_orders`).
    """

    experts: bool = False
    raw_q4k: bool = False
    head: bool = False
    trunk: bool = False
    orders: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, keep_quantized: str | None, header: Header, sources, head: bool = True) -> _Keeping:
        experts = keep_quantized is not None  # every KEEP_CHOICES value keeps the experts
        return cls(
            experts=experts,
            raw_q4k=experts and all(t.type == T.Q4_K for t in _expert_tensors(header, sources)),
            head=head and keep_quantized in ("experts+head", "all") and _keepable_head(header),
            trunk=keep_quantized == "all",
        )

    def keeps_trunk(self, src, header: Header) -> bool:
        """Whether `src` is a trunk matrix kept in its blocks: every tensor of one keepable type and input
        dim (the embedding, the router, norms and vectors are not)."""
        if not self.trunk or src.experts or src.f32 or _is_head(src) or src.params == (("embed",),):
            return False
        infos = [header.tensors[n] for n in src.tensors]
        return (
            len({t.type for t in infos}) == 1
            and len({t.ne[0] for t in infos}) == 1
            and all(len(t.ne) == 2 and gguf_quants.can_keep(t.type, t.ne[0]) for t in infos)
        )


def _on_device(src, *, header: Header, keeping: _Keeping) -> bool:
    """Whether a source's bytes go to the device as they are (kept Q4_K experts, matrices of DEVICE_TYPES)
    rather than through numpy."""
    if keeping.experts and src.experts:
        return keeping.raw_q4k
    if (keeping.head and _is_head(src)) or keeping.keeps_trunk(src, header):
        return False
    return not src.f32 and all(header.tensors[n].type in gguf_device.DEVICE_TYPES for n in src.tensors)


def read_ahead(fd: int, header: Header, sources, on_device, max_bytes: int = _READ_AHEAD, workers: int = 4):
    """Yields (source, [its tensors' bytes uint8 [nbytes]]) in order, reading up to `max_bytes` ahead with
    `workers` threads (`pread` and the host -> device copy release the GIL; the page cache serves several
    readers at once). The bytes of a source with `on_device(source)` true arrive as device arrays, copied by
    the reading thread, so that the host holds them only while they move."""

    def read(info, device):
        raw = gguf_device.read_tensor(fd, info)
        return gguf_device.to_device(raw) if device else raw  # the host buffer is free once copied

    pending: collections.deque = collections.deque()
    ahead = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for src in sources:
            infos = [header.tensors[n] for n in src.tensors]
            device = on_device(src)
            pending.append((src, [pool.submit(read, t, device) for t in infos]))
            ahead += sum(t.nbytes for t in infos)
            while ahead > max_bytes or len(pending) > 64:
                done, futures = pending.popleft()
                raws = [fut.result() for fut in futures]
                ahead -= sum(r.nbytes for r in raws)
                yield done, raws
        while pending:
            done, futures = pending.popleft()
            yield done, [fut.result() for fut in futures]


def _check_source(src, header, variables, arch, config) -> None:
    """Refuses a table row whose tensors are missing or hold another number of values than its parameters."""
    missing = [n for n in src.tensors if n not in header.tensors]
    if missing:
        raise GGUFError(
            f"GGUF file lacks tensor {missing[0]!r} (architecture {arch}, {config.num_layers} layers)"
        )
    want_count = sum(math.prod(variables[p].get_value().shape) for p in src.params)
    got_count = sum(math.prod(header.tensors[n].ne) for n in src.tensors)
    if got_count != want_count:
        raise GGUFError(
            f"tensor(s) {list(src.tensors)} with ne={[list(header.tensors[n].ne) for n in src.tensors]}"
            f" hold {got_count} values; the metadata implies {want_count} for "
            f"{['.'.join(map(str, p)) for p in src.params]}"
        )


def _source_values(src, raws, header, wants, arch, keeping: _Keeping, to_sink) -> tuple:
    """The parameter values of one table row from its tensors' bytes: kept expert blocks, a kept lm head or
    trunk matrix, device-dequantized matrices, or numpy-dequantized small and rare-type tensors, the
    converter's transforms undone."""
    infos = [header.tensors[n] for n in src.tensors]
    if keeping.head and _is_head(src):  # [vocab, bytes] -> one group [1, hidden, vocab]
        (info,) = infos
        view = gguf_device.host_view(raws[0], info)
        return (gguf_quants.to_quantized_weights([(view[None], info.type)]),)
    if keeping.keeps_trunk(src, header):
        kept = _keep_trunk(src, infos, raws, wants, keeping.orders)
        if kept is not None:
            return kept
    if keeping.experts and src.experts and keeping.raw_q4k:
        blocks = jnp.concatenate(
            [r.reshape(t.ne[2], t.ne[1], -1) for r, t in zip(raws, infos, strict=True)], axis=1
        )
        kept = gguf_device.Q4KBlocks(blocks, infos[0].ne[0])
        return (kept if to_sink else kept.to_quantized(),)
    if keeping.experts and src.experts:
        kept = _keep(src, header, raws)
        if kept is not None:
            return (kept,)
    if isinstance(raws[0], jax.Array):  # `on_device`: F32/F16/BF16/Q8_0 matrices
        arrays = [gguf_device.dequantize_on_device(r, t) for r, t in zip(raws, infos, strict=True)]
    else:
        arrays = [
            gguf_quants.dequantize(gguf_device.host_view(r, t), t.type)
            for r, t in zip(raws, infos, strict=True)
        ]
    try:
        values = src.load(*arrays)
    except (ValueError, IndexError) as e:
        raise GGUFError(f"tensor(s) {list(src.tensors)} do not fit {arch} metadata: {e}") from None
    return tuple(jnp.asarray(v, dtype=w.dtype) for v, w in zip(values, wants, strict=False))


def _all_finite(value):
    """A device boolean (or a host bool) saying that `value` holds no NaN/Inf (scales and offsets only, for
    quantized weights)."""
    if isinstance(value, gguf_device.Q4KBlocks):
        return gguf_device.scales_finite(value.data)
    if isinstance(value, QuantizedWeights):
        parts = [value.scales] + ([] if value.offsets is None else [value.offsets])
        return jnp.all(jnp.stack([jnp.isfinite(p).all() for p in parts]))
    return jnp.isfinite(value).all()


def _raise_if_not_finite(finite: list[tuple[str, object]]) -> None:
    flags = jax.device_get([flag for _, flag in finite])
    for (name, _), ok in zip(finite, flags, strict=True):
        if not ok:
            raise GGUFError(
                f"tensor {name!r} holds NaN or Inf values (a corrupted file?); "
                "check_finite=False loads it anyway"
            )


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


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a GGUF file (`tokenizer.ggml.*`, via the HF `tokenizers` library), or None when
    the file has none; same interface as `hybridlm.tokenizer.Tokenizer` (encode / decode / eos_token_id).

    Raises:
      GGUFError: malformed header or tokenizer metadata, or a tokenizer type other than byte-level BPE.
    """
    from hybridlm.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(path, read_header(path))


def _check_shape(src, i, got, want):
    if not src.experts and len(got) == len(want) + 1 and got[0] == 1:  # a kept head or trunk matrix
        got = got[1:]
    if tuple(got) != tuple(want):
        raise GGUFError(
            f"tensor(s) {list(src.tensors)} give {'.'.join(map(str, src.params[i]))} shape "
            f"{tuple(got)}, expected {tuple(want)} from the metadata"
        )


def _keep(src, header: Header, raws) -> QuantizedWeights | None:
    """The expert parameter of `src` as QuantizedWeights, or None when its tensors cannot be kept exactly."""
    infos = [header.tensors[n] for n in src.tensors]
    if not all(gguf_quants.can_keep(t.type, t.ne[0]) and len(t.ne) == 3 for t in infos):
        return None
    bits = {gguf_quants.KEPT_BITS[t.type] for t in infos}
    if len(bits) != 1:
        return None
    return gguf_quants.to_quantized_weights(
        [(gguf_device.host_view(r, t), t.type) for r, t in zip(raws, infos, strict=True)]
    )


def _keep_trunk(src, infos, raws, wants, orders: dict) -> tuple[QuantizedWeights, ...] | None:
    """The parameters of a trunk source as `QuantizedWeights` [1, in, out] in the model's row and column
    order, or None when the loader's transform is not a reordering of whole rows and quantization blocks."""
    key = (tuple(p[-2:] for p in src.params), tuple(tuple(t.ne) for t in infos))
    if key not in orders:
        orders[key] = _trunk_orders(src, infos, wants)
    if orders[key] is None:
        return None
    views = [(gguf_device.host_view(r, t)[None], t.type) for r, t in zip(raws, infos, strict=True)]
    try:
        return tuple(gguf_quants.to_quantized_weights(views, n_order=n, k_order=k) for n, k in orders[key])
    except ValueError:  # a column reorder that splits quantization blocks
        orders[key] = None
        return None


def _trunk_orders(src, infos, wants) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per parameter of a trunk source: (n_order, k_order), the file's output row and input column behind
    each of its output and input positions, found by running the loader's transform (`src.load`) on the
    tensors' element indices; None when a parameter is not such a reordering."""
    k = infos[0].ne[0]
    rows = [t.ne[1] for t in infos]
    if sum(rows) * k >= 2**31:
        return None
    starts = np.cumsum([0] + rows[:-1])
    cols = np.arange(k, dtype=np.int32)
    index = [
        (s + np.arange(r, dtype=np.int32))[:, None] * k + cols for s, r in zip(starts, rows, strict=True)
    ]
    try:
        values = [np.asarray(v) for v in src.load(*index)]
    except (ValueError, IndexError, TypeError):
        return None
    out = []
    for v, want in zip(values, wants, strict=True):
        if v.shape != tuple(want.shape) or v.ndim != 2:
            return None
        n_order, k_order = v[0] // k, v[:, 0] % k
        if not (v == k_order[:, None] + n_order[None, :] * k).all():
            return None
        out.append((n_order, k_order))
    return out


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
    mtp: MTPModule | None = None,
) -> None:
    """Writes `model` as the GGUF file llama.cpp's converter would write for the same weights.

    Args:
      model: the model (float or with `QuantizedWeights` experts or lm head, which are dequantized first).
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
      mtp: also write this MTP module as llama.cpp's converter does (`_Qwen35MtpMixin`): blocks
        num_layers.. with `nextn.*` tensors, block_count including them, `nextn_predict_layers`.

    Raises:
      ValueError: unknown tensor_type or arch, a config GGUF cannot express (explicit layer types that are
        not the interval pattern), or an `mtp` of another architecture than `model`.
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
    if mtp is not None and mtp.config.replace(mtp_layers=0) != config.replace(mtp_layers=0):
        raise ValueError("the MTP module's config differs from the model's (beyond mtp_layers)")
    wanted, file_type = TENSOR_TYPES[tensor_type]
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    write_metadata(writer, config, arch, file_type, mtp_layers=0 if mtp is None else mtp.config.mtp_layers)
    if tokenizer and config.vocab_size == _qwen_vocab_size():
        from hybridlm.checkpoints.gguf_tokenizer import write_tokenizer

        write_tokenizer(writer)
    parts = [(model, list(gguf_sources(config, arch)))]
    if mtp is not None:
        parts.append((mtp, list(mtp_gguf_sources(mtp.config, arch))))
    for module, sources in parts:
        params = {path_: var for path_, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}
        for src in tqdm(sources, desc="writing GGUF", disable=not progress, leave=False):
            values = [_as_numpy(params[p].get_value()) for p in src.params]
            if not src.experts:  # a kept head or trunk matrix [1, in, out]
                values = [v[0] if v.ndim == 3 and v.shape[0] == 1 else v for v in values]
            for name, array in zip(src.tensors, src.save(*values), strict=False):
                _add_tensor(
                    writer, name, array, mix_type(tensor_type, name, config.num_layers, wanted), src.f32
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _add_tensor(writer: gguf.GGUFWriter, name: str, array, wanted, forced_f32: bool) -> None:
    """Adds one tensor (numpy order, float) in the type `stored_type` picks."""
    array = np.ascontiguousarray(array, np.float32)
    qtype = stored_type(name, array.shape, wanted, forced_f32)
    if qtype == T.F32:
        writer.add_tensor(name, array)
    elif qtype == T.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf_quants.quantize(array, qtype), raw_dtype=qtype)


def _as_numpy(value) -> np.ndarray:
    if isinstance(value, QuantizedWeights):
        value = value.dequantize(jnp.float32)
    return np.asarray(jnp.asarray(value, jnp.float32))


def _qwen_vocab_size() -> int:
    from hybridlm.tokenizer import QWEN35_VOCAB_SIZE

    return QWEN35_VOCAB_SIZE


def write_metadata(
    w: gguf.GGUFWriter, config: ModelConfig, arch: str, file_type, mtp_layers: int = 0
) -> None:
    """The `{arch}.*` keys of llama.cpp's converter (TextModel / Qwen2MoeModel / Qwen3NextModel /
    _Qwen35MRopeMixin / _Qwen35MtpMixin `set_gguf_parameters`); mtp_layers > 0: MTP blocks after the trunk."""
    a, g = config.attention, config.gdn
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(config.name)
    w.add_block_count(config.num_layers + mtp_layers)
    if mtp_layers:
        w.add_nextn_predict_layers(mtp_layers)
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

"""`python -m benchmarks make-gguf`: a GGUF file of a preset's real shapes with random weights, written fast.

    python -m benchmarks make-gguf --preset qwen3.6-35b-a3b --out F.gguf [--experts q4_k] [--trunk q8_0] \
        [--seed 0] [--layers N] [--threads T] [--no-mtp]

The file has the tensor names, shapes, types and metadata `save_gguf` writes for the preset (the tensor table
comes from `mapping.gguf_sources`, the types from `gguf.stored_type`), and the real Qwen3.5/3.6 tokenizer when
the vocabulary is its 248 320 tokens. A preset with `mtp_layers` also gets its MTP blocks after the trunk, as
`save_gguf(..., mtp=...)` and llama.cpp's converter write them (`mapping.mtp_gguf_sources`, docs/mtp.md §3;
`--no-mtp`: none). Nothing is quantized: quantized tensors are random bytes whose block scales are then set so
that the weights have the spread `hybridlm.init_random` gives them (1/sqrt(fan_in) for projections), and F32
tensors (norms, ssm_a, dt bias, conv, router, shared-expert gate) get the values `save_gguf` writes for an
`init_random` model (the MTP block's by the same rules). Tensors are generated in chunks by a thread pool,
each chunk written at its own offset by the thread that made it, so memory stays at a few chunks per thread
whatever the file's size.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm.auto import tqdm

from hybridlm.checkpoints.gguf import TENSOR_TYPES, gguf_architecture, mix_type, stored_type, write_metadata
from hybridlm.checkpoints.mapping import gguf_sources, mtp_gguf_sources
from hybridlm.config import PRESETS, ModelConfig
from hybridlm.model import HybridLM
from hybridlm.mtp import MTPModule
from hybridlm.tokenizer import QWEN35_VOCAB_SIZE

T = GGMLQuantizationType
HELP = "write a GGUF file of a preset's shapes with random weights (Q4_K experts, Q8_0 trunk by default)"
# The tensor types the generator can write (`TENSOR_TYPES` names whose types and fallbacks it draws).
TYPE_NAMES = ("q4_k", "q4_k_m", "q6_k", "q8_0", "bf16", "f16", "f32")
# One unit of work: large enough to amortise the per-chunk setup, small enough to bound memory.
CHUNK_BYTES = 16 << 20

# Quantized blocks: (offset, length) of the bytes that hold the scales (the rest stays random codes), and the
# RMS of the codes around their zero point for uniform random bits, so that std = scale * code_rms.
_HEADS = {T.Q8_0: (0, 2), T.Q5_0: (0, 2), T.Q4_K: (0, 16), T.Q6_K: (192, 18)}
_CODE_RMS = {
    T.Q8_0: math.sqrt(5461.5),  # int8 q in [-128, 127]
    T.Q5_0: math.sqrt(85.5),  # q - 16, q in [0, 31]
    T.Q4_K: math.sqrt(21.25),  # q - 7.5, q in [0, 15] (dmin * m = 7.5 * d * sc)
    T.Q6_K: math.sqrt(341.5),  # q - 32, q in [0, 63]
}
_TABLE = 256  # distinct block scales per tensor, picked per block by a random byte
_NORMS = ("scale", "q_norm", "k_norm", "output_norm")  # stored as 1 + w (GGUF) or w ~ 1 (ssm_norm)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file and how its values are drawn.

    Attributes:
      name: GGUF tensor name.
      shape: numpy shape (reversed ggml `ne`), in elements.
      qtype: stored type.
      role: the `HybridLM` parameter it holds (last path element, e.g. "experts_down", "scale"): chooses the
        distribution as in `hybridlm.model.init_random`.
      std: standard deviation of the zero-mean roles (projections, embedding, router, conv, gates).
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    role: str
    std: float

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def _std(role: str, shape: tuple[int, ...]) -> float:
    """init_random's spread for a role; `shape[-1]` is the GGUF row length, the input dim of every matrix."""
    if role == "embed":
        return 1.0
    if role == "router":
        return 2.0 / math.sqrt(shape[-1])
    return 1.0 / math.sqrt(shape[-1])


def _param_shapes(module: type[nnx.Module], config: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: module(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def _stand_in(shape: tuple[int, ...]) -> np.ndarray:
    """A parameter for `GGUFSource.save` to transform: real zeros for vectors (norms and ssm_a do arithmetic),
    else an array of zero-byte items, which carries only its shape through transposes, slices and
    permutations."""
    return np.zeros(shape, np.float32) if len(shape) == 1 else np.empty(shape, np.dtype([]))


def tensor_specs(config: ModelConfig, experts: str = "q4_k", trunk: str = "q8_0") -> list[TensorSpec]:
    """The tensors `save_gguf` writes for `config` (and, when `config.mtp_layers` > 0, for an MTP module of
    it), in file order, with routed experts of type `experts` and every other matrix of type `trunk` (F32
    where the converter writes F32; fallbacks as in `save_gguf`).

    Raises:
      ValueError: a type not in `TYPE_NAMES`.
    """
    for arg, value in (("experts", experts), ("trunk", trunk)):
        if value not in TYPE_NAMES:
            raise ValueError(f"{arg}={value!r}; choose from {list(TYPE_NAMES)}")
    arch = gguf_architecture(config)
    parts = [(_param_shapes(HybridLM, config), gguf_sources(config, arch))]
    if config.mtp_layers:
        parts.append((_param_shapes(MTPModule, config), mtp_gguf_sources(config, arch)))
    memo, specs = {}, []
    for shapes, sources in parts:
        for src in sources:
            # Layers of one type share their transforms: one save per (params without layer index, shapes).
            in_shapes = tuple(shapes[p] for p in src.params)
            key = (tuple(p[2:] if p[0] == "layers" else p for p in src.params), in_shapes)
            if key not in memo:
                memo[key] = [tuple(a.shape) for a in src.save(*map(_stand_in, in_shapes))]
            type_name = experts if src.experts else trunk
            for name, shape in zip(src.tensors, memo[key], strict=True):
                wanted = mix_type(type_name, name, config.num_layers, TENSOR_TYPES[type_name][0])
                role = src.params[0][-1]
                qtype = stored_type(name, shape, wanted, src.f32)
                specs.append(TensorSpec(name, shape, qtype, role, _std(role, shape)))
    return specs


# ----------------------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------------------
def _scale_table(qtype: GGMLQuantizationType, std: float, rng: np.random.Generator) -> np.ndarray:
    """`_TABLE` random block-scale byte strings [table, head length] of `qtype` (see `_HEADS`), spread over a
    factor of 1.5 and normalised so that the weights' standard deviation is `std`. Q8_0 / Q5_0 / Q6_K scales
    take a random sign, which cancels their codes' -0.5 mean; Q4_K's minimum puts its zero at q = 7.5."""
    n = _TABLE
    if qtype == T.Q4_K:
        sub = rng.integers(32, 64, (n, 8))  # 6-bit sub-block scales
    elif qtype == T.Q6_K:
        sub = rng.integers(32, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))  # int8 sub-block scales
    else:
        sub = rng.choice([-1, 1], (n, 1))
    d = rng.uniform(0.8, 1.2, (n, 1))
    d *= std / (_CODE_RMS[qtype] * math.sqrt(np.mean(d**2 * np.mean(sub.astype(np.float64) ** 2, axis=1))))
    d16 = d.astype(np.float16)
    if qtype == T.Q6_K:
        return np.concatenate([sub.astype(np.int8).view(np.uint8), d16.view(np.uint8)], axis=1)
    if qtype != T.Q4_K:
        return (d16 * sub).astype(np.float16).view(np.uint8)
    dmin = (7.5 * d16.astype(np.float32)).astype(np.float16)
    sc = sub.astype(np.uint8)
    ratio = 7.5 * d16.astype(np.float32) / dmin.astype(np.float32)  # ~1, off by dmin's rounding
    m = np.clip(np.round(ratio * sub), 0, 63).astype(np.uint8)
    packed = np.empty((n, 12), np.uint8)  # ggml's get_scale_min_k4 layout (gguf_quants.quantize_q4_k)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([d16.view(np.uint8), dmin.view(np.uint8), packed], axis=1)


def _float_values(spec: TensorSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """n float32 values of a float tensor, as `save_gguf` writes an `init_random` model's."""
    if spec.role in _NORMS:
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
    if spec.role == "log_decay_rate":  # ssm_a = -exp(A_log) with A_log = log(U(1, 16))
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if spec.role == "delta_time_bias":
        return rng.uniform(-2.0, 1.0, n).astype(np.float32)
    return spec.std * rng.standard_normal(n, dtype=np.float32)


def _chunk(spec: TensorSpec, table: np.ndarray | None, seed: tuple[int, ...], count: int) -> np.ndarray:
    """`count` blocks of `spec` (elements for float types) as uint8 bytes; the same seed, the same bytes."""
    bitgen = np.random.SFC64(np.random.SeedSequence(seed))
    if spec.qtype in (T.F32, T.F16, T.BF16):
        x = _float_values(spec, np.random.Generator(bitgen), count)
        if spec.qtype == T.BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(np.float16 if spec.qtype == T.F16 else np.float32, copy=False).view(np.uint8)
    type_size = GGML_QUANT_SIZES[spec.qtype][1]
    blocks = bitgen.random_raw(-(-count * type_size // 8)).view(np.uint8)[: count * type_size]
    blocks = blocks.reshape(count, type_size)
    offset, length = _HEADS[spec.qtype]
    blocks[:, offset : offset + length] = table[blocks[:, offset]]  # a random byte picks each block's scales
    return blocks.reshape(-1)


def _pieces(specs: list[TensorSpec], seed: int, alignment: int) -> Iterator[tuple[int, Callable]]:
    """The data section as (offset from its start, function returning the bytes there): every tensor in
    chunks of about CHUNK_BYTES. The gaps up to each tensor's alignment are left as zeros."""
    offset = 0
    for i, spec in enumerate(specs):
        block, type_size = GGML_QUANT_SIZES[spec.qtype]
        blocks = math.prod(spec.shape) // block
        table = None
        if spec.qtype in _HEADS:
            table = _scale_table(spec.qtype, spec.std, np.random.default_rng((seed, i)))
        per_chunk = max(1, CHUNK_BYTES // type_size)
        for j, start in enumerate(range(0, blocks, per_chunk)):
            count = min(per_chunk, blocks - start)
            yield (
                offset + start * type_size,
                lambda s=spec, t=table, k=(seed, i, j), c=count: _chunk(s, t, k, c),
            )
        offset += gguf.GGUFWriter.ggml_pad(spec.nbytes, alignment)


def _write_at(fd: int, offset: int, make: Callable[[], np.ndarray]) -> int:
    """Writes make()'s bytes at `offset` of file `fd` (positioned writes: threads write at once)."""
    view = memoryview(make()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What `write_random_gguf` wrote: the file, its size in bytes, its tensors, and the wall time in s."""

    path: str
    file_bytes: int
    tensors: int
    seconds: float


def write_random_gguf(
    path: str | os.PathLike,
    config: ModelConfig,
    *,
    experts: str = "q4_k",
    trunk: str = "q8_0",
    seed: int = 0,
    tokenizer: bool = True,
    threads: int | None = None,
    progress: bool = True,
) -> WriteResult:
    """Writes a GGUF file with `config`'s tensors (`tensor_specs`) filled with random weights.

    Args:
      path: output file (overwritten).
      config: the architecture; `config.replace(num_layers=N)` writes fewer layers; `config.mtp_layers` MTP
        blocks follow the trunk (`config.replace(mtp_layers=0)`: none).
      experts: type of the routed-expert tensors, one of `TYPE_NAMES` ("q4_k_m": llama-quantize's mix, Q6_K
        ffn_down in the layers of `use_more_bits`).
      trunk: type of every other matrix (embedding, output, attention, GDN, shared expert).
      seed: the same seed gives the same bytes.
      tokenizer: write the Qwen3.5/3.6 tokenizer when the vocabulary has its size (248 320).
      threads: generator threads; None: `default_threads()`.
      progress: show a tqdm bar in bytes.

    Raises:
      ValueError: a type not in `TYPE_NAMES`.
    """
    start = time.perf_counter()
    specs = tensor_specs(config, experts, trunk)
    arch = gguf_architecture(config)
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    write_metadata(writer, config, arch, TENSOR_TYPES[experts][1], mtp_layers=config.mtp_layers)
    writer.add_description(f"random weights (python -m benchmarks make-gguf, seed {seed})")
    if tokenizer and config.vocab_size == QWEN35_VOCAB_SIZE:
        from hybridlm.checkpoints.gguf_tokenizer import write_tokenizer

        write_tokenizer(writer)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.float32, spec.nbytes, raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    out.flush()
    data_start = writer.ggml_pad(out.tell(), writer.data_alignment)
    total = sum(writer.ggml_pad(s.nbytes, writer.data_alignment) for s in specs)
    os.ftruncate(out.fileno(), data_start + total)  # the file's final size; the alignment gaps stay zero
    threads = threads or default_threads()
    bar = tqdm(
        total=sum(s.nbytes for s in specs),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"writing {os.path.basename(path)}",
        disable=not progress,
    )
    with ThreadPoolExecutor(threads) as pool, bar:
        pending = collections.deque()
        for offset, make in _pieces(specs, seed, writer.data_alignment):
            pending.append(pool.submit(_write_at, out.fileno(), data_start + offset, make))
            if len(pending) >= 2 * threads:  # bounded look-ahead: memory is ~2 chunks per thread
                bar.update(pending.popleft().result())
        while pending:
            bar.update(pending.popleft().result())
    writer.close()
    file_bytes = os.path.getsize(path)
    return WriteResult(os.fspath(path), file_bytes, len(specs), time.perf_counter() - start)


def default_threads() -> int:
    """One generator thread per CPU this process may run on, at most 32 (memory is ~2 chunks per thread)."""
    return max(
        1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    )


# ----------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------
def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _output_path(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `make-gguf` subcommand's options."""
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the architecture and its shapes")
    p.add_argument("--out", required=True, type=_output_path, metavar="F.gguf", help="the file to write")
    p.add_argument("--experts", default="q4_k", choices=TYPE_NAMES, help="routed-expert tensor type")
    p.add_argument("--trunk", default="q8_0", choices=TYPE_NAMES, help="type of every other matrix")
    p.add_argument("--seed", type=_at_least(0), default=0, help="the same seed writes the same bytes")
    p.add_argument("--layers", type=_at_least(1), default=None, metavar="N", help="write only N layers")
    p.add_argument(
        "--threads", type=_at_least(1), default=None, help="generator threads (default: one per CPU)"
    )
    p.add_argument(
        "--no-mtp", action="store_true", help="leave out the preset's MTP (nextn) blocks, if it has any"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict:
    """Writes the file `args` describe; returns the JSON record the CLI prints (sizes in bytes, time in s)."""
    config = PRESETS[args.preset]
    if args.layers is not None:
        config = config.replace(num_layers=args.layers)
    if args.no_mtp:
        config = config.replace(mtp_layers=0)
    threads = args.threads or default_threads()
    result = write_random_gguf(
        args.out,
        config,
        experts=args.experts,
        trunk=args.trunk,
        seed=args.seed,
        threads=threads,
        progress=not args.no_progress,
    )
    return {
        "name": "make-gguf",
        "path": result.path,
        "preset": args.preset,
        "layers": config.num_layers,
        "mtp_layers": config.mtp_layers,
        "experts": args.experts,
        "trunk": args.trunk,
        "seed": args.seed,
        "threads": threads,
        "tensors": result.tensors,
        "figures": {
            "file_bytes": result.file_bytes,
            "write_s": round(result.seconds, 3),
            "bytes_per_s": round(result.file_bytes / result.seconds),
        },
    }

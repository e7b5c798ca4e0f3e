"""A bounded, validating parser of the GGUF header (metadata + tensor table), run before `gguf.GGUFReader`.

`gguf.GGUFReader` trusts the counts and lengths in the file: a corrupted count can make it allocate huge
arrays or loop for a very long time. This parser reads the same header with every count, string length and
array length bounded by the bytes left in the file, and checks the tensor table (known types, 1..4 dimensions,
sizes that fit, aligned offsets inside the file, no duplicates) and that the tensors' byte sizes, which follow
from their types and ne, tile the data region exactly as GGUF writers lay it out, so that only a file that
passes is handed to the reader. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2
and 3, little-endian).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import mmap
import os
import struct

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 1  # arrays of scalars or strings; llama.cpp writes nothing deeper

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_MIN_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR.items()} | {
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: the message names the key, tensor or byte offset at fault."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous (input) dim; numpy shape = reversed
    type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (row-major) shape."""
        return tuple(reversed(self.ne))


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[
        str, tuple[GGUFValueType, object]
    ]  # key -> (type, value); arrays as (ARRAY, (elem type, list))
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"truncated GGUF file: {what} needs {n} bytes at offset {self.pos}, file has {self.size}"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at offset {self.pos - length} is not valid UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        """An array of `count` strings (the tokenizer's 248k tokens and merges): one tight loop."""
        buf, pos, size = self.buf, self.pos, self.size
        raw = []
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            length = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if pos + length > size:
                self.pos = pos
                self.need(length, f"{what}[{i}] ({length} bytes)")
            raw.append(buf[pos : pos + length])
            pos += length
        self.pos = pos
        try:
            return [r.decode("utf-8") for r in raw]
        except UnicodeDecodeError:
            raise GGUFError(f"{what} has an element that is not valid UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{what} has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"{what} is an array of arrays (not supported)")
            etype = self.unpack("<I", f"element type of {what}")
            count = self.unpack("<Q", f"length of {what}")
            if etype not in _MIN_SIZE:
                raise GGUFError(f"{what} has unknown element type {etype}")
            etype = GGUFValueType(etype)
            if count * _MIN_SIZE[etype] > self.size - self.pos:
                raise GGUFError(
                    f"{what} claims {count} elements, more than the file's remaining "
                    f"{self.size - self.pos} bytes can hold"
                )
            if etype in _SCALAR:  # one struct call for the whole array
                fmt = _SCALAR[etype]
                n = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)) if count else []
                self.pos += n * count
                return (etype, values)
            if etype == GGUFValueType.STRING:
                return (etype, self.strings(count, what))
            return (etype, [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)])
        return self.unpack(_SCALAR[vtype], what)


def read_header(path: str | os.PathLike) -> Header:
    """`parse_header` of the file, cached by path, size and modification time: one command needs the header
    (with its hundreds of thousands of tokenizer strings) for the config, the memory plan, the tokenizer and
    the loader, and parses it once."""
    path = os.fspath(path)
    st = os.stat(path)
    return _cached_header(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_header(path: str, size: int, mtime_ns: int) -> Header:
    return parse_header(path)


def parse_header(path: str | os.PathLike) -> Header:
    """Parses and validates the header and tensor table of a GGUF file without trusting any count in it.

    Raises:
      GGUFError: wrong magic, unsupported version or byte order, truncated header, malformed metadata,
        duplicated keys or tensor names, unknown tensor types, absurd dimensions, tensor data outside the
        file, misaligned tensor data, or tensors that do not tile the data region (a gap, an overlap, or data
        after the last tensor beyond alignment padding: a type or ne rewritten in the table).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, size)
        magic = bytes(buf[:4])
        if magic != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        c.pos = 4
        version = c.unpack("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise GGUFError(f"{path}: big-endian GGUF (version {swapped}) is not supported")
            raise GGUFError(
                f"{path}: unsupported GGUF version {version}; supported: {list(SUPPORTED_VERSIONS)}"
            )
        n_tensors = c.unpack("<Q", "tensor count")
        n_kv = c.unpack("<Q", "metadata count")
        if n_kv * (8 + 4 + 1) > size - c.pos:
            raise GGUFError(f"{path}: metadata count {n_kv} cannot fit in the file ({size} bytes)")
        if n_tensors * (8 + 4 + 8 + 4 + 8) > size - c.pos:
            raise GGUFError(f"{path}: tensor count {n_tensors} cannot fit in the file ({size} bytes)")
        metadata: dict[str, tuple[GGUFValueType, object]] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.unpack("<I", f"type of metadata {key!r}")
            value = c.value(vtype, f"metadata {key!r}")
            if key in metadata:
                raise GGUFError(f"{path}: duplicated metadata key {key!r}")
            metadata[key] = (GGUFValueType(vtype), value)
        alignment = 32
        if "general.alignment" in metadata:
            atype, alignment = metadata["general.alignment"]
            if atype != GGUFValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
                raise GGUFError(f"{path}: general.alignment must be a power-of-two uint32, got {alignment!r}")
        raw_tensors = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            n_dims = c.unpack("<I", f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1..{MAX_DIMS}")
            ne = tuple(c.unpack("<Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims))
            ttype = c.unpack("<I", f"type of tensor {name!r}")
            offset = c.unpack("<Q", f"data offset of tensor {name!r}")
            raw_tensors.append((name, ne, ttype, offset))
        data_offset = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ttype, offset in raw_tensors:
        if name in tensors:
            raise GGUFError(f"{path}: duplicated tensor name {name!r}")
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise GGUFError(f"tensor {name!r} has unknown type id {ttype}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFError(f"tensor {name!r} has type {qtype.name} with no known block size")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if min(ne) < 1:
            raise GGUFError(f"tensor {name!r} has a zero dimension: ne={list(ne)}")
        if ne[0] % block:
            raise GGUFError(
                f"tensor {name!r} ({qtype.name}) has ne[0]={ne[0]}, not a multiple of the block size {block}"
            )
        nbytes = math.prod(ne) // block * type_size  # exact Python ints: no overflow
        start = data_offset + offset
        if offset % alignment:
            raise GGUFError(
                f"tensor {name!r} data offset {offset} is not a multiple of the alignment {alignment}"
            )
        if start + nbytes > size:
            raise GGUFError(
                f"tensor {name!r} ({qtype.name}, ne={list(ne)}, {nbytes} bytes at file offset {start}) "
                f"extends past the end of the file ({size} bytes): truncated file, or wrong type or shape"
            )
        tensors[name] = TensorInfo(name, ne, qtype, start, nbytes)
    _check_tiling(tensors, data_offset, alignment, size)
    return Header(version, metadata, tensors, alignment, data_offset, size)


def _describe(t: TensorInfo, data_offset: int) -> str:
    where = t.offset - data_offset
    return f"{t.name!r} ({t.type.name}, ne={list(t.ne)}, {t.nbytes} bytes at data offset {where})"


def _check_tiling(tensors: dict[str, TensorInfo], data_offset: int, alignment: int, size: int) -> None:
    """Checks that the tensors, in offset order, tile the data region as GGUF writers lay it out: the first at
    data offset 0, each next one at the previous end rounded up to the alignment, the file ending within
    alignment padding of the last. A type or ne rewritten in the table changes a tensor's byte size, so it
    shows up here as a gap, an overlap or a wrong file end.

    Raises:
      GGUFError: naming the tensor whose span disagrees, its type and ne, and the expected vs found span.
    """
    if not tensors:
        return
    spans = sorted(tensors.values(), key=lambda t: (t.offset, t.name))
    if spans[0].offset != data_offset:
        raise GGUFError(
            f"tensor data does not start at data offset 0: the first tensor "
            f"{_describe(spans[0], data_offset)} leaves {spans[0].offset - data_offset} bytes before it "
            f"unaccounted for"
        )
    for a, b in itertools.pairwise(spans):
        end = a.offset + a.nbytes
        expected = -(-end // alignment) * alignment
        if b.offset < end:
            raise GGUFError(
                f"tensors {a.name!r} and {b.name!r} have overlapping data: {_describe(a, data_offset)} ends "
                f"at data offset {end - data_offset}, {b.name!r} starts at {b.offset - data_offset} "
                f"(a wrong type or shape in the tensor table?)"
            )
        if b.offset != expected:
            raise GGUFError(
                f"tensor {_describe(a, data_offset)} should span {expected - a.offset} bytes (with "
                f"alignment padding) up to the next tensor, but the file gives it {b.offset - a.offset} "
                f"(up to {b.name!r} at data offset {b.offset - data_offset}): wrong type or shape in the "
                f"tensor table"
            )
    last = spans[-1]
    end = last.offset + last.nbytes
    if size - end >= alignment:
        raise GGUFError(
            f"the last tensor {_describe(last, data_offset)} ends at file offset {end}, but the file has "
            f"{size} bytes: {size - end} bytes after it, more than alignment padding ({alignment - 1}); "
            f"trailing data, or a wrong type or shape in the tensor table"
        )

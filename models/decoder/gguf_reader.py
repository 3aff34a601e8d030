"""A lean reader of GGUF files (versions 2 and 3, little-endian): metadata and tensor views.

Why not `gguf.GGUFReader`: it keeps a numpy view of the file for every element of every
metadata array (SmolLM2's 49,152 tokens, their types and 48,900 merges: ~170 MB of views
for a 98 MB file). Here each array of numbers is one `np.frombuffer` turned into a list and
each string is decoded once, so reading the header costs little more than its values.

Metadata values are what `gguf.ReaderField.contents()` gives (str, int, float, bool, or a
flat list of them), under the same keys, `GGUF.version`, `GGUF.tensor_count` and
`GGUF.kv_count` included. Tensor `data` is a read-only view of the memory-mapped file with
GGUFReader's dtype and shape (`drop_pages` lets the pages go once a loader has copied them).
Each tensor record is checked (known type code, whole blocks per row, data inside the file)
before its data is mapped; those errors are `ModelFileError`s naming the file and the
tensor, any other malformed framing a ValueError.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from models.decoder.weights import ModelFileError

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_NUMBER_TYPES: dict[GGUFValueType, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}
# Tensor types GGUFReader maps as elements; every other type (blocks, BF16) is bytes.
_ELEMENT_TYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@attrs.frozen
class GGUFTensor:
    """One tensor of a GGUF file; `shape` is in ggml order (`shape[0]` is the row length)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute position in the file
    data: npt.NDArray[Any] = attrs.field(eq=False, repr=False)


@attrs.frozen
class GGUFContents:
    """What `read_gguf` found: decoded metadata, tensor records and the data section's start."""

    version: int
    metadata: dict[str, object]
    tensors: tuple[GGUFTensor, ...]
    alignment: int
    data_offset: int
    buffer: mmap.mmap = attrs.field(eq=False, repr=False)

    def drop_pages(self) -> None:
        """Let the kernel take every page of the map out of memory (a loader calls it after
        copying each tensor).

        Left mapped, the pages a loader read would count in the process's peak on top of
        its copies; dropping only a tensor's own range is not enough, since a page fault
        maps its neighbours too. They are clean pages of a read-only map: a later read of
        a tensor's `data` reads the file again.
        """
        _drop_pages(self.buffer, 0, len(self.buffer))


@attrs.frozen
class _TensorInfo:
    """A tensor info as the header states it (offset relative to the data section)."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    offset: int


def _drop_pages(buffer: mmap.mmap, start: int, n_bytes: int) -> None:
    """`madvise(MADV_DONTNEED)` over the pages holding bytes `[start, start + n_bytes)`."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or n_bytes <= 0 or buffer.closed:
        return
    first = start - start % mmap.PAGESIZE
    buffer.madvise(advice, first, min(start + n_bytes, len(buffer)) - first)


class _Cursor:
    """Little-endian fields of the mapped file in order, never read past its end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def take(self, n_bytes: int) -> int:
        """The position of the next `n_bytes`, which the cursor then moves past."""
        start, end = self.pos, self.pos + n_bytes
        if n_bytes < 0 or end > len(self.buffer):
            raise ValueError(
                f"GGUF header ends early: {n_bytes} bytes wanted at byte {start}, the file "
                f"has {len(self.buffer)}"
            )
        self.pos = end
        return start

    def u32(self) -> int:
        return int(_U32.unpack_from(self.buffer, self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self.buffer, self.take(8))[0])

    def string(self) -> str:
        length = self.u64()
        start = self.take(length)
        return self.buffer[start : start + length].decode("utf-8")

    def numbers(self, kind: GGUFValueType, count: int) -> list[Any]:
        """`count` numbers of type `kind` as Python values, read in one `np.frombuffer`."""
        dtype = _NUMBER_TYPES[kind]
        start = self.take(count * dtype.itemsize)
        values: list[Any] = np.frombuffer(self.buffer, dtype, count, start).tolist()
        return values


def _value_type(code: int) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise ValueError(f"GGUF metadata value type {code} is unknown") from None


def _read_value(cursor: _Cursor, kind: GGUFValueType) -> object:
    """One metadata value; arrays (of arrays too) come back as one flat list, as in gguf."""
    if kind == GGUFValueType.STRING:
        return cursor.string()
    if kind in _NUMBER_TYPES:
        return cursor.numbers(kind, 1)[0]
    if kind != GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata value type {kind.name} is not readable")
    item = _value_type(cursor.u32())
    count = cursor.u64()
    if item in _NUMBER_TYPES:
        return cursor.numbers(item, count)
    if item == GGUFValueType.STRING:
        return [cursor.string() for _ in range(count)]
    flat: list[object] = []
    for _ in range(count):
        inner = _read_value(cursor, item)
        flat.extend(inner if isinstance(inner, list) else [inner])
    return flat


def _read_metadata(
    cursor: _Cursor, version: int, n_tensors: int, n_kv: int
) -> tuple[dict[str, object], int]:
    """The key/value section and the file's alignment."""
    metadata: dict[str, object] = {
        "GGUF.version": version,
        "GGUF.tensor_count": n_tensors,
        "GGUF.kv_count": n_kv,
    }
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"GGUF metadata key {key!r} appears twice")
        kind = _value_type(cursor.u32())
        metadata[key] = _read_value(cursor, kind)
        if key == "general.alignment":
            alignment = _checked_alignment(kind, metadata[key])
    return metadata, alignment


def _checked_alignment(kind: GGUFValueType, value: object) -> int:
    if kind != GGUFValueType.UINT32 or not isinstance(value, int):
        raise ValueError(f"GGUF general.alignment is of type {kind.name}: allowed is UINT32")
    if value <= 0 or value & (value - 1):
        raise ValueError(f"GGUF general.alignment is {value}: allowed is a power of two")
    return value


def _read_tensor_infos(cursor: _Cursor, count: int) -> list[_TensorInfo]:
    infos = []
    for _ in range(count):
        name = cursor.string()
        n_dims = cursor.u32()
        dims = tuple(cursor.u64() for _ in range(n_dims))
        infos.append(_TensorInfo(name, dims, cursor.u32(), cursor.u64()))
    return infos


def _checked_type(
    info: _TensorInfo, where: str, data_start: int, size: int
) -> tuple[GGMLQuantizationType, int]:
    """The tensor's type and byte count, refused as a ModelFileError when they cannot be."""
    try:
        qtype = GGMLQuantizationType(info.type_code)
    except ValueError:
        known = sorted(t.name for t in GGMLQuantizationType)
        raise ModelFileError(
            f"{where} has unknown type code {info.type_code}: known types are {', '.join(known)}"
        ) from None
    values, type_size = GGML_QUANT_SIZES[qtype]
    if info.dims and info.dims[0] % values:
        raise ModelFileError(
            f"{where} of type {qtype.name} has rows of {info.dims[0]} values, not a "
            f"multiple of the type's block of {values}: the file is corrupt"
        )
    n_bytes = int(np.prod(info.dims)) * type_size // values
    end = data_start + info.offset + n_bytes
    if end > size:
        raise ModelFileError(
            f"{where} of type {qtype.name} ends at byte {end} but the file has "
            f"{size}: the file is truncated"
        )
    return qtype, n_bytes


def _tensor(buffer: mmap.mmap, info: _TensorInfo, path: Path, data_start: int) -> GGUFTensor:
    """A checked tensor record with its data viewed as GGUFReader views it."""
    where = f"GGUF file {str(path)!r}: tensor {info.name!r}"
    qtype, n_bytes = _checked_type(info, where, data_start, len(buffer))
    n_elements = int(np.prod(info.dims))
    shape = tuple(reversed(info.dims))
    start = data_start + info.offset
    if qtype in _ELEMENT_TYPES:
        data = np.frombuffer(buffer, _ELEMENT_TYPES[qtype], n_elements, start)
    else:
        data = np.frombuffer(buffer, np.uint8, n_bytes, start)
        shape = tuple(quant_shape_to_byte_shape(shape, qtype))
    return GGUFTensor(
        name=info.name,
        tensor_type=qtype,
        shape=info.dims,
        n_elements=n_elements,
        n_bytes=n_bytes,
        data_offset=start,
        data=data.reshape(shape),
    )


def _read_header(buffer: mmap.mmap, path: Path) -> GGUFContents:
    cursor = _Cursor(buffer)
    start = cursor.take(4)
    magic = buffer[start : start + 4]
    if magic != b"GGUF":
        raise ValueError(f"GGUF magic is {magic!r}, not b'GGUF'")
    version = cursor.u32()
    if version not in SUPPORTED_VERSIONS:
        swapped = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(
            f"GGUF version {version}{swapped} is not readable: allowed are "
            f"{list(SUPPORTED_VERSIONS)}, little-endian"
        )
    n_tensors, n_kv = cursor.u64(), cursor.u64()
    metadata, alignment = _read_metadata(cursor, version, n_tensors, n_kv)
    infos = _read_tensor_infos(cursor, n_tensors)
    data_start = -(-cursor.pos // alignment) * alignment
    names = [info.name for info in infos]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"GGUF tensor name(s) {twice} appear twice")
    tensors = tuple(_tensor(buffer, info, path, data_start) for info in infos)
    _drop_pages(buffer, 0, cursor.pos)  # the header is decoded: its pages are not needed
    return GGUFContents(version, metadata, tensors, alignment, data_start, buffer)


def read_gguf(path: str | Path) -> GGUFContents:
    """Read the GGUF file at `path`; tensor data stays in the (read-only) memory map.

    The map is released when the last tensor view is: the reader keeps no handle of its own.
    """
    file = Path(path)
    with file.open("rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return _read_header(buffer, file)

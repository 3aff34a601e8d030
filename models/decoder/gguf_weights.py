"""Weights of a decoder family from a GGUF file: checked framing, names, and block weights.

`GGUFFile.open` refuses a damaged file before any tensor is read: an unknown type code, a
row length that is not a multiple of its type's block, or a tensor that runs past the end of
the file is named with the tensor, its type and the file. `load_gguf` then maps llama.cpp's
names onto the canonical (HF) ones (the family's weight-name map, `Family.gguf_layer_names`)
and, by `weights`:

* `"stored"`: tensors in Q4_0, Q4_1, Q8_0, Q4_K or Q6_K stay in their blocks
  (`runtime.quant.QuantizedMatrix`, repacked exactly, never through a float copy); every
  other type is dequantized to `dtype`, and the result says which types were.
* `"float32"` / `"bfloat16"`: every tensor is dequantized (the behaviour before blocks).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import attrs
import numpy as np
import torch

from models.decoder.config import DecoderArgs
from models.decoder.gguf_reader import GGUFContents, GGUFTensor, read_gguf
from models.decoder.weight_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, layer_name
from models.decoder.weights import (
    ModelFileError,
    WeightValue,
    check_readable_file,
    check_shapes,
    expected_shapes,
)
from models.families import Family, family_for_gguf
from runtime.quant.gguf_blocks import STORED_TYPES, permute_rows, repack

logger = logging.getLogger(__name__)

WeightsMode = Literal["stored", "stored-int8", "float32", "bfloat16"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("stored", "stored-int8", "float32", "bfloat16")
# Modes that keep the blocks; "stored-int8" also lets warmup run them with int8 activations.
BLOCK_MODES: tuple[WeightsMode, ...] = ("stored", "stored-int8")
_MAX_LISTED = 8

_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def gguf_name_map(
    tensor_names: Iterable[str], layer_names: Mapping[str, str] = GGUF_LAYER_NAMES
) -> dict[str, str]:
    """GGUF tensor name -> canonical name, built once; names it does not know are left out.

    `layer_names`: the family's map of layer tensor names (`attn_q` -> `self_attn.q_proj.weight`).
    """
    out: dict[str, str] = {}
    for name in tensor_names:
        if name in GGUF_GLOBAL_NAMES:
            out[name] = GGUF_GLOBAL_NAMES[name]
            continue
        match = _GGUF_LAYER.match(name)
        if match and match.group(2) in layer_names:
            out[name] = layer_name(int(match.group(1)), layer_names[match.group(2)])
    return out


@attrs.frozen
class GGUFFile:
    """An opened GGUF file: decoded metadata and the (memory-mapped) tensor records."""

    path: Path
    contents: GGUFContents

    @property
    def metadata(self) -> Mapping[str, object]:
        return self.contents.metadata

    @property
    def tensors(self) -> tuple[GGUFTensor, ...]:
        return self.contents.tensors

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        file = Path(path)
        size = check_readable_file(file, "GGUF file")
        with file.open("rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ModelFileError(
                f"{str(file)!r} is not a GGUF file: it starts with {magic!r}, a GGUF file with "
                "b'GGUF'"
            )
        try:
            contents = read_gguf(file)
        except ModelFileError:
            raise
        except Exception as error:  # a damaged header fails in many ways
            raise ModelFileError(
                f"GGUF file {str(file)!r} ({size} bytes) is truncated or corrupt: "
                f"{type(error).__name__}: {error}"
            ) from error
        return cls(path=file, contents=contents)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)

    @property
    def family(self) -> Family:
        """The registered family of this file's `general.architecture` (refused when none)."""
        return family_for_gguf(self.metadata.get("general.architecture"))

    def args(self) -> DecoderArgs:
        """The architecture, read by the file's family's config class."""
        return self.family.config_class.from_gguf_metadata(self.metadata, self.tensor_names)


def rope_row_order(out_features: int, n_heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K row interleave (see `unpermute_rope_rows`)."""
    rows = torch.arange(out_features).reshape(out_features, 1)
    return unpermute_rope_rows(rows, n_heads).reshape(-1)


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion permutation of Q/K rows.

    llama.cpp stores each head's rows interleaved (pairs rotate as (x0, x1), (x2, x3), ...);
    HF's layout, which the model uses, keeps the two rotary halves contiguous.
    """
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
    )


def _dequantize_gguf_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in PyTorch (row-major, reversed ggml) shape."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(reversed(tensor.shape))
    qtype = tensor.tensor_type
    raw = tensor.data
    if qtype == GGMLQuantizationType.F32:
        array = np.asarray(raw, dtype=np.float32)
        return torch.from_numpy(array.copy()).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.asarray(raw, dtype=np.float16).copy()).reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(raw).view(np.int16).copy()
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)
    try:
        array = quants.dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has quantization type {qtype.name}, which the gguf "
            "package cannot dequantize"
        ) from exc
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape)


@attrs.frozen
class GGUFWeights:
    """Canonical tensors of a GGUF file and what loading did to each type.

    `stored` and `dequantized` count tensors per GGUF type name (`{"Q4_1": 210}`).
    """

    state: dict[str, WeightValue]
    stored: Mapping[str, int]
    dequantized: Mapping[str, int]

    def summary(self) -> str:
        """One line for the journal: `stored Q4_1 x210, Q8_0 x1; dequantized F32 x61`."""

        def listed(counts: Mapping[str, int]) -> str:
            return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))

        parts = []
        if self.stored:
            parts.append(f"stored {listed(self.stored)}")
        if self.dequantized:
            parts.append(f"dequantized {listed(self.dequantized)}")
        return "; ".join(parts) or "no tensors"


def _load_one(
    tensor: GGUFTensor,
    canonical: str,
    args: DecoderArgs,
    keep_blocks: bool,
    dtype: torch.dtype,
    rope_permuted: bool,
) -> tuple[WeightValue, str, bool]:
    """One canonical tensor, its GGUF type name, and whether it stayed in blocks.

    `rope_permuted`: the file's Q/K rows are llama.cpp-interleaved (undone here)."""
    type_name = tensor.tensor_type.name
    heads = None
    if rope_permuted and canonical.endswith("self_attn.q_proj.weight"):
        heads = args.n_heads
    elif rope_permuted and canonical.endswith("self_attn.k_proj.weight"):
        heads = args.n_kv_heads
    shape = tuple(reversed(tensor.shape))
    if keep_blocks and type_name in STORED_TYPES and len(shape) == 2:
        matrix = repack(type_name, tensor.data, shape[0], shape[1])
        if heads is not None:
            matrix = permute_rows(matrix, rope_row_order(shape[0], heads))
        return matrix, type_name, True
    value = _dequantize_gguf_tensor(tensor)
    if heads is not None:
        value = unpermute_rope_rows(value, heads)
    return value.to(dtype).contiguous(), type_name, False


def load_gguf(
    gguf_file: GGUFFile,
    args: DecoderArgs,
    *,
    dtype: torch.dtype = torch.float32,
    weights: WeightsMode = "float32",
) -> GGUFWeights:
    """A GGUF file's tensors as canonical HF-layout tensors (see the module docstring)."""
    tensors = {t.name: t for t in gguf_file.tensors}
    family = gguf_file.family
    name_map = gguf_name_map(tensors, family.gguf_layer_names)
    unknown = sorted(set(tensors) - set(name_map))
    if unknown:
        logger.warning(
            "ignoring %d GGUF tensor(s) with no mapping: %s",
            len(unknown),
            ", ".join(unknown[:_MAX_LISTED]),
        )
    shapes = {
        canonical: tuple(reversed(tensors[name].shape)) for name, canonical in name_map.items()
    }
    check_shapes(args, shapes, source=str(gguf_file.path))
    wanted = set(expected_shapes(args))
    out: dict[str, WeightValue] = {}
    stored: dict[str, int] = {}
    dequantized: dict[str, int] = {}
    for name, canonical in name_map.items():
        if canonical not in wanted:
            continue
        value, type_name, kept = _load_one(
            tensors[name],
            canonical,
            args,
            weights in BLOCK_MODES,
            dtype,
            family.gguf_rope_permuted,
        )
        gguf_file.contents.drop_pages()  # copied: the file's pages need not add to the peak
        counts = stored if kept else dequantized
        counts[type_name] = counts.get(type_name, 0) + 1
        out[canonical] = value
    loaded = GGUFWeights(state=out, stored=stored, dequantized=dequantized)
    logger.info("loaded %d tensors from GGUF %s: %s", len(out), gguf_file.path, loaded.summary())
    return loaded

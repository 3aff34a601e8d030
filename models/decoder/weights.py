"""Weights of the decoder: safetensors directories, GGUF files and seeded random weights.

Every source produces one state dict keyed by the canonical (Hugging Face) names, validated
against the shapes `DecoderArgs` implies before the tensor model sees it. Names are mapped once
per source, tensors are converted one at a time (peak memory stays near one copy of the
weights plus the largest single tensor), and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from models.decoder.config import DecoderArgs
from models.decoder.layers import DecoderLayer
from models.decoder.weight_names import EMBED, FINAL_NORM, LM_HEAD, layer_name
from models.families import family_for_args
from runtime.quant.matrix import QuantizedMatrix

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Present in some HF checkpoints, derived from the config here, so safe to drop silently.
_IGNORED_NAMES = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_MAX_LISTED = 8

WeightValue = torch.Tensor | QuantizedMatrix
"""A canonical tensor: plain, or a projection kept in its quantized blocks (GGUF)."""


class ModelFileError(ValueError):
    """A model file that is missing, unreadable, truncated, corrupt or of the wrong format.

    The message names the path and what is wrong with it.
    """


class ModelFileMissing(ModelFileError, FileNotFoundError):
    """A model file or folder that does not exist (also a `FileNotFoundError`)."""


def check_readable_file(path: Path, what: str) -> int:
    """The size of `path`, or a `ModelFileError` saying why it cannot be read as `what`."""
    if not path.exists():
        raise ModelFileMissing(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise ModelFileError(f"{what} {str(path)!r} is not a regular file")
    try:
        with path.open("rb") as handle:
            handle.read(1)
    except OSError as error:
        raise ModelFileError(
            f"{what} {str(path)!r} cannot be read: {error.strerror or error}"
        ) from error
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(f"{what} {str(path)!r} is empty (0 bytes)")
    return size


def check_finite(state: Mapping[str, WeightValue], *, source: str) -> None:
    """Refuse weights holding NaN or infinity, naming the first such tensor.

    A non-finite weight turns every logit into NaN, and greedy decoding then repeats token
    0 forever without any error; refusing at load makes the bad file visible. Block weights
    are judged by their scales (and mins): the integers in between are finite.
    """
    for name, value in state.items():
        tensors = [value] if isinstance(value, torch.Tensor) else value.float_parts()
        for tensor in tensors:
            if tensor.is_floating_point() and not _all_finite(tensor):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ModelFileError(
                    f"weights from {source} are not finite: tensor {name!r} holds {bad} NaN "
                    f"or infinite value(s) of {tensor.numel()}; the file is corrupt or was "
                    "converted wrongly"
                )


_FINITE_CHUNK = 1 << 20  # values per `isfinite` call


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, judged a slice of rows at a time.

    `torch.isfinite` on a float tensor makes an absolute-value copy and two masks: on a
    whole float32 embedding that is ~170 MB of transient for a 113 MB tensor.
    """
    if tensor.dim() == 0:
        return bool(torch.isfinite(tensor))
    rows = max(1, _FINITE_CHUNK // max(1, tensor[0].numel()))
    return all(bool(torch.isfinite(part).all()) for part in torch.split(tensor, rows))


class WeightsError(ValueError):
    """A checkpoint does not fit the architecture: lists missing and mis-shaped tensors."""

    def __init__(
        self,
        source: str,
        missing: Iterable[str] = (),
        mismatched: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ) -> None:
        self.source = source
        self.missing = tuple(missing)
        self.mismatched = tuple(mismatched)
        parts = []
        if self.missing:
            shown = ", ".join(self.missing[:_MAX_LISTED])
            more = len(self.missing) - _MAX_LISTED
            parts.append(
                f"{len(self.missing)} missing tensor(s): {shown}"
                + (f" (and {more} more)" if more > 0 else "")
            )
        if self.mismatched:
            shown = ", ".join(
                f"{name} has shape {list(got)}, expected {list(want)}"
                for name, want, got in self.mismatched[:_MAX_LISTED]
            )
            more = len(self.mismatched) - _MAX_LISTED
            parts.append(
                f"{len(self.mismatched)} mis-shaped tensor(s): {shown}"
                + (f" (and {more} more)" if more > 0 else "")
            )
        super().__init__(f"weights from {source} do not match the model: " + "; ".join(parts))


def decoder_layer_class(args: DecoderArgs) -> type[DecoderLayer]:
    """The layer class of `args`' family's tensor model (`DecoderModel.layer_class`)."""
    family = family_for_args(args)
    found = getattr(family.model_class(), "layer_class", None)
    if not (isinstance(found, type) and issubclass(found, DecoderLayer)):
        raise TypeError(
            f"model family {family.name!r}: model {family.model!r} has no layer_class that is "
            f"a DecoderLayer subclass (found {found!r})"
        )
    return found


def expected_shapes(args: DecoderArgs) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the model needs (no `lm_head` when tied).

    A layer's tensors are its family's layer class's (`DecoderLayer.weight_shapes`: the
    attention, the q/k norms with `qk_norm`, and the MLP block's)."""
    layer_shapes = decoder_layer_class(args).weight_shapes(args)
    shapes: dict[str, tuple[int, ...]] = {EMBED: (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        for suffix, shape in layer_shapes.items():
            shapes[layer_name(i, suffix)] = shape
    shapes[FINAL_NORM] = (args.dim,)
    if not args.tie_word_embeddings:
        shapes[LM_HEAD] = (args.vocab_size, args.dim)
    return shapes


def check_shapes(
    args: DecoderArgs, shapes: Mapping[str, tuple[int, ...]], *, source: str
) -> list[str]:
    """Raise `WeightsError` naming missing/mis-shaped tensors; return the unexpected names."""
    expected = expected_shapes(args)
    missing = [name for name in expected if name not in shapes]
    mismatched = [
        (name, want, tuple(shapes[name]))
        for name, want in expected.items()
        if name in shapes and tuple(shapes[name]) != want
    ]
    if missing or mismatched:
        raise WeightsError(source, missing, mismatched)
    tolerated = {LM_HEAD} if args.tie_word_embeddings else set()
    unexpected = [
        name
        for name in shapes
        if name not in expected and name not in tolerated and not _IGNORED_NAMES.match(name)
    ]
    if unexpected:
        logger.warning(
            "ignoring %d unexpected tensor(s) from %s: %s",
            len(unexpected),
            source,
            ", ".join(sorted(unexpected)[:_MAX_LISTED]),
        )
    return unexpected


def validate_state_dict(
    args: DecoderArgs, state_dict: Mapping[str, WeightValue], *, source: str = "state dict"
) -> dict[str, WeightValue]:
    """Check names and shapes; return only the tensors the model uses."""
    check_shapes(args, {k: tuple(v.shape) for k, v in state_dict.items()}, source=source)
    expected = expected_shapes(args)
    return {name: state_dict[name] for name in expected}


# ----------------------------------------------------------------------------- safetensors
def _safetensors_files(directory: Path) -> dict[str, list[str]]:
    """File -> tensor names, from the sharded index when present, else from every file."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file in files:
            if not (directory / file).is_file():
                raise ModelFileMissing(
                    f"shard {file!r} listed in {index} does not exist in {directory}"
                )
            check_safetensors_file(directory / file)
        return files
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    if not found:
        raise ModelFileMissing(
            f"no *.safetensors files (and no {SAFETENSORS_INDEX}) in directory {str(directory)!r}"
        )
    from safetensors import safe_open

    files = {}
    for file in found:
        check_safetensors_file(directory / file)
        with safe_open(str(directory / file), framework="pt") as handle:
            files[file] = list(handle.keys())
    return files


def check_safetensors_file(path: Path) -> None:
    """Validate a safetensors file's framing: header length, JSON header, data extent."""
    size = check_readable_file(path, "safetensors file")
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ModelFileError(
                f"safetensors file {str(path)!r} is truncated: {size} bytes, shorter than its "
                "8-byte header length"
            )
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise ModelFileError(
                f"safetensors file {str(path)!r} is corrupt or not a safetensors file: its "
                f"header claims {header_len} bytes but the file has {size}"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [
            int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"
        ]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError) as error:
        raise ModelFileError(
            f"safetensors file {str(path)!r} is corrupt or not a safetensors file: its header "
            f"is not valid JSON tensor metadata ({error})"
        ) from error
    data = size - 8 - header_len
    if ends and max(ends) > data:
        raise ModelFileError(
            f"safetensors file {str(path)!r} is truncated: its tensors need {max(ends)} data "
            f"bytes but the file holds {data}"
        )


def _canonical_hf_name(name: str) -> str:
    """HF base-model checkpoints omit the `model.` prefix; map them onto the causal-LM names."""
    if name.startswith(("model.", "lm_head.")):
        return name
    return "model." + name


def load_safetensors(
    directory: str | Path, args: DecoderArgs, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Load a HF directory's `*.safetensors` (sharded or not) as canonical tensors of `dtype`.

    Shapes are checked from the headers before any tensor data is read.
    """
    from safetensors import safe_open

    root = Path(directory)
    files = _safetensors_files(root)
    name_map = {name: _canonical_hf_name(name) for names in files.values() for name in names}
    shapes: dict[str, tuple[int, ...]] = {}
    for file, names in files.items():
        with safe_open(str(root / file), framework="pt") as handle:
            for name in names:
                shapes[name_map[name]] = tuple(handle.get_slice(name).get_shape())
    check_shapes(args, shapes, source=str(root))
    wanted = set(expected_shapes(args))
    out: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with safe_open(str(root / file), framework="pt") as handle:
            for name in names:
                canonical = name_map[name]
                if canonical in wanted:
                    out[canonical] = handle.get_tensor(name).to(dtype)
    logger.info("loaded %d tensors from %d safetensors file(s) in %s", len(out), len(files), root)
    return out


# ------------------------------------------------------------------------------ tiny-random
def random_state_dict(
    args: DecoderArgs, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded random weights whose greedy continuations vary (tied heads included).

    Small embeddings and stronger residual-branch outputs keep the residual stream from
    being dominated by the input embedding, which would make a tied head repeat one token.
    """
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(args).items():
        if len(shape) == 1:
            value = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name == EMBED:
            value = 0.2 * torch.randn(shape, generator=generator)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            value = 3.0 * torch.randn(shape, generator=generator) / (shape[1] ** 0.5)
        else:
            value = torch.randn(shape, generator=generator) / (shape[1] ** 0.5)
        out[name] = value.to(dtype)
    return out

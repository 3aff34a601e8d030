"""The model-family registry: which family a checkpoint belongs to, and what it brings.

A family is a package `models/<name>/` whose `family.py` defines `FAMILY: Family`, or any
installed distribution's `llm_runtime.families` entry point naming such a value. The registry
finds them all on first use, so adding a family edits no shared file. A family registers:

* its name and how its checkpoints are recognised: the HF `config.json` `model_type` /
  `architectures` and the GGUF `general.architecture` its config class accepts
  (`DecoderArgs.HF_MODEL_TYPES`, `HF_ARCHITECTURES`, `GGUF_ARCHITECTURES`);
* its config class (a `DecoderArgs` subclass: reading a checkpoint's config, its presets);
* its tensor model (an import path, loaded on use; the shared `DecoderModel` or a subclass,
  whose `layer_class` says the layer, and so the MLP block: dense SwiGLU or routed experts);
* its weight-name map (GGUF layer tensor names onto canonical ones, and whether llama.cpp
  permuted the Q/K rows of its files);
* its answers to the runtime's optional paths: whether the fused native decode stack can run
  it (else the reason, recorded in the kernel plan: the per-op path runs), and the vLLM
  facade's capabilities.

Every loader, the CLI, lanes, `bringup`, the benchmarks and the vLLM plugin look families up
here and never import one by name. An unknown architecture is refused naming it and listing
the registered families (`UnknownArchitectureError`, a `ValueError`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from models.decoder.config import DecoderArgs, parse_tiny_random_name
from models.decoder.weight_names import GGUF_LAYER_NAMES

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "llm_runtime.families"
DEFAULT_MODEL = "models.decoder.model:DecoderModel"
DEFAULT_VLLM_CAPABILITIES: Mapping[str, bool] = {
    "supports_prefix_caching": True,
    "supports_sample_on_device": True,
    "supports_async_decode": True,
    "supports_sleep_mode": True,
}


class UnknownArchitectureError(ValueError):
    """A checkpoint of an architecture no registered family recognises."""


@attrs.frozen
class Family:
    """What one model family brings to the runtime (see the module docstring)."""

    name: str
    config_class: type[DecoderArgs]
    description: str = ""
    model: str = DEFAULT_MODEL
    """The tensor model class, `module:Class` (imported when a model is built)."""
    gguf_layer_names: Mapping[str, str] = attrs.field(factory=lambda: dict(GGUF_LAYER_NAMES))
    """GGUF layer tensor name (`blk.N.<name>.weight`) -> canonical suffix in the layer."""
    gguf_rope_permuted: bool = True
    """Whether llama.cpp's converter interleaved this architecture's Q/K rows (it does for
    `llama`, not for NeoX-rotary families such as `qwen3`); loading undoes it."""
    fused_decode_unsupported: str | None = None
    """None when the fused native decode stack can run this family, else why not (the kernel
    plan records it; decode runs the per-op path)."""
    vllm_capabilities: Mapping[str, bool] = attrs.field(
        factory=lambda: dict(DEFAULT_VLLM_CAPABILITIES)
    )
    """What the family's vLLM facade offers (`model_capabilities`)."""

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        return self.config_class.HF_MODEL_TYPES

    @property
    def hf_architectures(self) -> tuple[str, ...]:
        return self.config_class.HF_ARCHITECTURES

    @property
    def gguf_architectures(self) -> tuple[str, ...]:
        return self.config_class.GGUF_ARCHITECTURES

    @property
    def presets(self) -> Mapping[str, DecoderArgs]:
        return self.config_class.PRESETS

    def model_class(self) -> type:
        """The tensor model class (imported now)."""
        module, _, attribute = self.model.partition(":")
        found: type = getattr(importlib.import_module(module), attribute)
        return found

    def describe(self) -> str:
        """`qwen3 (HF model_type qwen3, Qwen3ForCausalLM; GGUF qwen3)`."""
        hf = ", ".join((*self.hf_model_types, *self.hf_architectures)) or "none"
        gguf = ", ".join(self.gguf_architectures) or "none"
        return f"{self.name} (HF model_type {hf}; GGUF {gguf})"


DECODER = Family(
    name="decoder",
    config_class=DecoderArgs,
    description="the shared dense decoder with no checkpoint of its own (bare DecoderArgs)",
)
"""What a bare `DecoderArgs` builds: the shared dense decoder (never recognised from a file)."""


_lock = threading.Lock()
_registry: dict[str, Family] | None = None


def _family_modules() -> list[str]:
    """`models.<pkg>.family` for every family package beside this file."""
    root = Path(__file__).resolve().parent
    return [f"models.{path.parent.name}.family" for path in sorted(root.glob("*/family.py"))]


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module_name in _family_modules():
        module = importlib.import_module(module_name)
        _add(found, module.FAMILY, module_name)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _add(found, entry.load(), f"entry point {entry.name} = {entry.value}")
    return found


def _add(found: dict[str, Family], family: object, where: str) -> None:
    """Add `family`, refusing one that is not a `Family` or that claims what another has."""
    if not isinstance(family, Family):
        raise TypeError(f"{where} must define a models.families.Family, got {family!r}")
    for other in found.values():
        clashes = [
            f"{what} {sorted(set(mine) & set(theirs))}"
            for what, mine, theirs in (
                ("name", (family.name,), (other.name,)),
                ("HF model_type", family.hf_model_types, other.hf_model_types),
                ("HF architectures", family.hf_architectures, other.hf_architectures),
                ("GGUF architecture", family.gguf_architectures, other.gguf_architectures),
                ("preset", tuple(family.presets), tuple(other.presets)),
            )
            if set(mine) & set(theirs)
        ]
        if clashes:
            raise ValueError(
                f"model family {family.name!r} ({where}) claims what family {other.name!r} "
                f"has registered: {'; '.join(clashes)}"
            )
    found[family.name] = family


def _families() -> dict[str, Family]:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _discover()
        return _registry


def families() -> tuple[Family, ...]:
    """Every registered family, in name order."""
    return tuple(sorted(_families().values(), key=lambda family: family.name))


def register(family: Family) -> None:
    """Add `family` to the registry (a plugin or a test; packages are found on their own)."""
    registry = _families()
    with _lock:
        _add(registry, family, "register()")


def unregister(name: str) -> None:
    """Remove a family added with `register` (tests)."""
    registry = _families()
    with _lock:
        registry.pop(name, None)


def registered_summary() -> str:
    """The registered families, one clause each (what an unknown-architecture error lists)."""
    return "; ".join(family.describe() for family in families())


def family(name: str) -> Family:
    """The family called `name`."""
    found = _families().get(name)
    if found is None:
        raise UnknownArchitectureError(
            f"model family {name!r} is not registered: registered are {registered_summary()}"
        )
    return found


def family_for_hf_config(config: Mapping[str, object]) -> Family:
    """The family of a HF `config.json` (by `model_type`, else by `architectures`)."""
    model_type = config.get("model_type")
    raw = config.get("architectures")
    architectures = [str(a) for a in raw] if isinstance(raw, list) else []
    for candidate in families():
        if model_type in candidate.hf_model_types:
            return candidate
    if model_type is None:
        for candidate in families():
            if set(architectures) & set(candidate.hf_architectures):
                return candidate
    raise UnknownArchitectureError(
        f"config model_type={model_type!r} (architectures {architectures}) is not a "
        f"registered model family: registered are {registered_summary()}"
    )


def family_for_architectures(architectures: Iterable[str]) -> Family:
    """The family of a HF `architectures` list (what vLLM hands the plugin)."""
    names = list(architectures)
    for name in names:
        for candidate in families():
            if name in candidate.hf_architectures:
                return candidate
    raise UnknownArchitectureError(
        f"architectures {names} are not a registered model family: registered are "
        f"{registered_summary()}"
    )


def family_for_gguf(architecture: object) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    for candidate in families():
        if architecture in candidate.gguf_architectures:
            return candidate
    raise UnknownArchitectureError(
        f"GGUF general.architecture={architecture!r} is not a registered model family: "
        f"registered are {registered_summary()}"
    )


def family_for_args(args: DecoderArgs) -> Family:
    """The family whose config class `args` is (the nearest registered base class; the
    shared `DECODER` for a bare `DecoderArgs`)."""
    by_class = {family.config_class: family for family in _families().values()}
    for cls in type(args).__mro__:
        if cls in by_class:
            return by_class[cls]
    return DECODER


def preset_names() -> list[str]:
    """Every `tiny-random-<preset>` name the registered families offer (and `tiny-random`)."""
    names = [f"tiny-random-{name}" for f in families() for name in f.presets]
    return ["tiny-random", *sorted(names)]


def tiny_random_args(name: str) -> DecoderArgs | None:
    """The preset a `tiny-random[-<preset>]` name means, None for any other name; an unknown
    preset is refused listing the known ones."""
    preset = parse_tiny_random_name(name)
    if preset is None:
        return None
    for candidate in families():
        if preset in candidate.presets:
            return candidate.presets[preset]
    raise ValueError(
        f"model name {name!r} names an unknown tiny-random preset {preset!r}: allowed are "
        f"{preset_names()}"
    )


def all_presets() -> Sequence[str]:
    """Every preset name (without the `tiny-random-` prefix), in order."""
    return sorted(name for f in families() for name in f.presets)

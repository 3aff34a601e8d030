"""The vLLM engine's construction arguments for `DecoderVLLMModel`, checked before any load.

The engine passes `hf_config`, `mesh_device`, capacity and `optimizations`; the runtime
settings it does not know travel as `VLLMFacadeOptions` keywords. Everything here is checked
(and the engine's view of the architecture compared with the loaded weights) so that a bad
argument is refused before weights load or device memory is touched.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from models.decoder.sources import SMOLLM2_NAME, LoadedModel
from runtime.backends import make_device
from runtime.backends.base import Device
from runtime.config import TraceConfig, WarmupConfig, require_positive_int
from runtime.validation import is_int

OPTIMIZATIONS: dict[str | None, torch.dtype] = {
    None: torch.float32,
    "accuracy": torch.float32,
    "performance": torch.bfloat16,
}
"""The engine's `optimizations` setting -> the weight and KV cache dtype."""

WEIGHTS_SOURCE_KEY = "llm_runtime_weights_source"
"""The config key `models.vllm_plugin.hf_folder` writes for a folder made from a GGUF."""

HUB_ALIASES: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2_NAME,
    "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF": SMOLLM2_NAME,
}
"""Hub ids the engine may report whose weights this project ships locally."""

_HF_FIELDS: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"),
    ("hidden_size", "dim"),
    ("vocab_size", "vocab_size"),
)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


@attrs.frozen
class VLLMFacadeOptions:
    """Runtime settings the engine does not pass (give them as `initialize_vllm_model` keywords).

    `trace_mode` must agree with the engine's trace mode; `block_size` only shapes the
    placeholder geometry before the engine's `allocate_kv_cache` fixes the real one.
    """

    model: str | None = None
    trace_mode: str = "decode_only"
    block_size: int = 32
    max_prefill_chunk_size: int = 256
    device_sampling: bool = True
    warmup: WarmupConfig | None = None
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise TypeError(f"model must be a non-empty model name or path, got {self.model!r}")
        TraceConfig.of(self.trace_mode)
        require_positive_int("block_size", self.block_size)
        require_positive_int("max_prefill_chunk_size", self.max_prefill_chunk_size)
        if self.max_prefill_chunk_size % self.block_size:
            raise ValueError(
                f"max_prefill_chunk_size ({self.max_prefill_chunk_size}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        check_bool("device_sampling", self.device_sampling)
        if self.warmup is not None and not isinstance(self.warmup, WarmupConfig):
            raise TypeError(f"warmup must be a WarmupConfig or None, got {self.warmup!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


def engine_options(
    *,
    max_batch_size: int,
    max_seq_len: int | None,
    tt_data_parallel: int,
    optimizations: str | None,
    options: Mapping[str, Any],
) -> VLLMFacadeOptions:
    """`initialize_vllm_model`'s arguments checked, the extra keywords as facade options."""
    require_positive_int("max_batch_size", max_batch_size)
    require_positive_int("tt_data_parallel", tt_data_parallel)
    if max_seq_len is not None:
        require_positive_int("max_seq_len", max_seq_len)
    if optimizations not in OPTIMIZATIONS:
        raise ValueError(
            f"optimizations must be one of {list(OPTIMIZATIONS)}, got {optimizations!r}"
        )
    if tt_data_parallel != 1:
        raise ValueError(
            f"tt_data_parallel={tt_data_parallel} needs a lane group "
            "(runtime.lane_group.LaneGroupExecutor), which this facade does not build yet; "
            "start the engine with data parallel size 1"
        )
    allowed = [field.name for field in attrs.fields(VLLMFacadeOptions)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"initialize_vllm_model got unknown option(s) {unknown}; allowed options: {allowed}"
        )
    return VLLMFacadeOptions(**options)


def _hf_value(hf_config: Any, name: str) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name)
    return getattr(hf_config, name, None)


def engine_model_name(hf_config: Any, override: str | None) -> str:
    """What to load: `override` (the engine's model) unless it is a folder written from a
    GGUF, whose config names the GGUF (`WEIGHTS_SOURCE_KEY`): then the GGUF's own blocks."""
    source = _hf_value(hf_config, WEIGHTS_SOURCE_KEY)
    if override is not None and not _names_source(override):
        return override
    if isinstance(source, str) and source:
        return source
    if override is not None:
        return override
    for field in ("name_or_path", "_name_or_path"):
        value = _hf_value(hf_config, field)
        if isinstance(value, str | Path) and str(value):
            return HUB_ALIASES.get(str(value), str(value))
    raise ValueError(
        "hf_config names no model (name_or_path is empty); pass model=<name or path> to "
        "initialize_vllm_model"
    )


def _names_source(model: str) -> bool:
    """Whether `model` is a folder whose config.json names a weights source."""
    config = Path(model) / "config.json"
    try:
        return WEIGHTS_SOURCE_KEY in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def check_hf_config(hf_config: Any, loaded: LoadedModel) -> None:
    """The engine's view of the architecture must be the one the weights were loaded for."""
    for hf_name, arg_name in _HF_FIELDS:
        value = _hf_value(hf_config, hf_name)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            expected = getattr(loaded.args, arg_name)
            if int(value) != expected:
                raise ValueError(
                    f"hf_config.{hf_name}={value} disagrees with the loaded model "
                    f"{loaded.source.name!r} ({arg_name}={expected})"
                )


def engine_device(mesh_device: Any) -> Device:
    if mesh_device is None:
        return make_device("cpu")
    if isinstance(mesh_device, Device):
        return mesh_device
    if isinstance(mesh_device, str | torch.device):
        return make_device(str(mesh_device))
    raise TypeError(
        "mesh_device must be None (cpu), a device spec such as 'cpu' or 'cuda:0', a "
        f"torch.device or a runtime Device, got {type(mesh_device).__name__}"
    )

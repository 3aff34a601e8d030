"""The runtime settings a vLLM user passes through `additional_config`.

vLLM forwards `--additional-config '{"llm_runtime": {...}}'` (or `LLM(additional_config=...)`)
untouched to every process; this module reads the `llm_runtime` section once, checks every
value and names the key, the value and what is allowed when one is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from runtime.config import TRACE_MODES, TraceConfig

SECTION = "llm_runtime"


@attrs.frozen
class PluginSettings:
    """What the worker needs beyond vLLM's own configuration."""

    trace_mode: str = "none"
    max_prefill_chunk_size: int | None = None
    device_sampling: bool | None = None
    """None: sample on the device where the facade declares it; False: always vLLM's sampler
    on host logits; True: require the facade's device sampling (refused where it has none)."""

    @property
    def trace(self) -> TraceConfig:
        """What `trace_mode` traces (only `TraceConfig` reads the mode names)."""
        return TraceConfig.of(self.trace_mode)

    @classmethod
    def from_additional_config(cls, additional: Any) -> PluginSettings:
        raw = additional.get(SECTION, {}) if isinstance(additional, Mapping) else {}
        where = f"additional_config[{SECTION!r}]"
        if not isinstance(raw, Mapping):
            raise TypeError(f"{where} must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; allowed are {sorted(known)}")
        trace_mode = raw.get("trace_mode", "none")
        if trace_mode not in TRACE_MODES:
            raise ValueError(
                f"{where}['trace_mode'] must be one of {list(TRACE_MODES)}, got {trace_mode!r}"
            )
        chunk = raw.get("max_prefill_chunk_size")
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(
                f"{where}['max_prefill_chunk_size'] must be a positive integer, got {chunk!r}"
            )
        device_sampling = raw.get("device_sampling")
        if device_sampling is not None and not isinstance(device_sampling, bool):
            raise ValueError(
                f"{where}['device_sampling'] must be true, false or null (null: where the "
                f"model's facade supports it), got {device_sampling!r}"
            )
        return cls(
            trace_mode=trace_mode, max_prefill_chunk_size=chunk, device_sampling=device_sampling
        )

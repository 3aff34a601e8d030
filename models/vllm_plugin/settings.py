"""The runtime settings a vLLM user passes through `additional_config`.

vLLM forwards `--additional-config '{"llm_runtime": {...}}'` (or `LLM(additional_config=...)`)
untouched to every process; this module reads the `llm_runtime` section once, checks every
value and names the key, the value and what is allowed when one is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from runtime.config import TRACE_MODES, TraceConfig

SECTION = "llm_runtime"
DEFAULT_STATS_INTERVAL_S = 30.0


@attrs.frozen
class PluginSettings:
    """What the worker needs beyond vLLM's own configuration."""

    trace_mode: str = "none"
    max_prefill_chunk_size: int | None = None
    device_sampling: bool | None = None
    """None: sample on the device where the facade declares it; False: always vLLM's sampler
    on host logits; True: require the facade's device sampling (refused where it has none)."""
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    """Seconds between the worker's counter reports (a log line, and `stats_file`); 0: only
    at shutdown (`stats_report`)."""
    stats_file: str | None = None
    """Where the worker rewrites its counters as JSON at each report (None: log line only)."""

    @property
    def trace(self) -> TraceConfig:
        """What `trace_mode` traces (only `TraceConfig` reads the mode names)."""
        return TraceConfig.of(self.trace_mode)

    @classmethod
    def from_additional_config(cls, additional: object) -> PluginSettings:
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
        interval, stats_file = _stats_settings(raw, where)
        return cls(
            trace_mode=trace_mode,
            max_prefill_chunk_size=chunk,
            device_sampling=device_sampling,
            stats_interval_s=interval,
            stats_file=stats_file,
        )


def _stats_settings(raw: Mapping[str, object], where: str) -> tuple[float, str | None]:
    """`stats_interval_s` (seconds >= 0) and `stats_file` (a path or None), checked."""
    interval = raw.get("stats_interval_s", DEFAULT_STATS_INTERVAL_S)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
        raise ValueError(
            f"{where}['stats_interval_s'] must be a number of seconds >= 0 (0: report the "
            f"counters only at shutdown), got {interval!r}"
        )
    stats_file = raw.get("stats_file")
    if stats_file is not None and (not isinstance(stats_file, str) or not stats_file):
        raise ValueError(
            f"{where}['stats_file'] must be a file path (a non-empty string) or null, got "
            f"{stats_file!r}"
        )
    return float(interval), stats_file

"""The worker's counters, readable from a running `vllm serve` without vLLM's dev mode.

`LLM.collective_rpc("runtime_stats")` reads them in the offline API, but a server exposes
collective RPC only in dev mode (`VLLM_SERVER_DEV_MODE=1`), and the counters live in the
engine-core process, not the API server. So the worker reports them itself: at the first
step after every `stats_interval_s` seconds, and when it shuts down, it logs one INFO line
(`llm-runtime stats: decode_calls=... `) and, where `stats_file` is set, rewrites that JSON
file atomically (write a sibling, then rename), so a reader never sees half a file.

Imports no vLLM, so the main suite tests it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

logger = logging.getLogger(__name__)

RUNNER_COUNTERS: tuple[str, ...] = (
    "prefill_calls",
    "prefill_rows",
    "cached_prefill_rows",
    "partial_prefill_rows",
    "resumed_requests",
    "prefix_hit_requests",
    "decode_calls",
    "decode_rows",
    "prefill_seconds",
    "decode_seconds",
    "device_sampled_rows",
    "host_runtime_sampled_rows",
    "host_sampled_rows",
    "host_sampling_calls",
    "async_steps",
    "steps_finished_by_next_step",
)
"""The model runner's own counters (the facade's executor adds its own to a report)."""

StatsSource = Callable[[], Mapping[str, float]]
"""What the reporter reads: the runner's counters, collected on the step's own thread."""


def stats_line(stats: Mapping[str, float]) -> str:
    """`name=value` pairs, integers without a fraction, seconds to the millisecond."""
    parts = []
    for name, value in stats.items():
        shown = str(int(value)) if float(value).is_integer() else f"{value:.3f}"
        parts.append(f"{name}={shown}")
    return " ".join(parts)


def numeric_counters(summary: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    """A facade's counters as flat numbers: nested mappings become `outer.inner` names,
    anything that is not a number is left out."""
    found: dict[str, float] = {}
    for name, value in summary.items():
        if isinstance(value, Mapping):
            found.update(numeric_counters(value, f"{prefix}{name}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[f"{prefix}{name}"] = float(value)
    return found


def stats_path(
    stats_file: str | None, *, data_parallel_size: int, data_parallel_rank: int
) -> Path | None:
    """Where one engine's worker writes its counters: `stats_file`, with `.rank<N>` added
    when vLLM runs more than one data-parallel engine (each has its own worker)."""
    if stats_file is None:
        return None
    if data_parallel_size > 1:
        return Path(f"{stats_file}.rank{data_parallel_rank}")
    return Path(stats_file)


@attrs.define
class StatsReporter:
    """Reports the counters at most every `interval_s` seconds of serving (0: only at close).

    `step()` is called once per scheduler step; it costs one clock read unless a report is
    due. `close()` reports a last time (the shutdown's final counters).
    """

    interval_s: float
    path: Path | None = None
    clock: Callable[[], float] = time.monotonic
    _last: float | None = attrs.field(default=None, init=False)
    reports: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ValueError(
                f"interval_s must be >= 0 seconds (0: only at close), got {self.interval_s!r}"
            )

    def step(self, source: StatsSource) -> bool:
        """Report if the interval passed since the last report (or the first step); True if so."""
        now = self.clock()
        if self._last is None:
            self._last = now
            return False
        if self.interval_s <= 0 or now - self._last < self.interval_s:
            return False
        self._last = now
        self.report(source())
        return True

    def close(self, source: StatsSource) -> None:
        """The last report, at shutdown."""
        self.report(source(), final=True)

    def report(self, stats: Mapping[str, float], *, final: bool = False) -> None:
        """One log line and, with a path, the JSON file."""
        self.reports += 1
        logger.info("llm-runtime stats%s: %s", " (final)" if final else "", stats_line(stats))
        if self.path is not None:
            write_stats_file(self.path, stats, final=final)


def write_stats_file(path: Path, stats: Mapping[str, float], *, final: bool = False) -> None:
    """`{"pid", "time", "final", "stats": {...}}`, replaced atomically."""
    document = {"pid": os.getpid(), "time": time.time(), "final": final, "stats": dict(stats)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(document, indent=1, sort_keys=True))
    os.replace(partial, path)

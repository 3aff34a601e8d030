"""`benchmarks/kv_read_patterns.py` builds its reader, reads every pattern and splits the pairs
by the host's memory mode (its flags: `test_benchmark_flags.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kv_read_patterns import main, modes
from runtime.backends import native_kernels

REASON = native_kernels.unavailable_reason()


@pytest.mark.parametrize(
    ("rates", "groups"),
    [
        ([30.0, 55.0, 31.0, 60.0, 29.0, 44.0], [[4, 0], [2, 5], [1, 3]]),  # spread 2.07x: thirds
        ([30.0, 55.0, 31.0, 60.0, 29.0], [[4, 0], [2], [1, 3]]),
        ([30.0, 33.0, 31.0, 36.0], [[0, 2, 1, 3]]),  # within MODE_GAP: one mode
        ([40.0, 80.0], [[0, 1]]),  # too few to split
    ],
)
def test_pairs_split_into_thirds_by_rate_only_where_the_rates_spread(
    rates: list[float], groups: list[list[int]]
) -> None:
    assert modes(rates) == groups


@pytest.mark.skipif(REASON is not None, reason=f"the reader needs a C compiler (gcc): {REASON}")
def test_a_short_run_reports_every_pattern_against_the_sequential_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "patterns.json"
    assert main(["--rounds", "2", "--layers", "1", "--pause", "0", "--json", str(target)]) == 0
    report = json.loads(target.read_text(encoding="utf-8"))
    patterns = report["patterns"]
    assert len(patterns) == 6 and "pages shuffled, no prefetch" in patterns
    # 32 rows of 48-520 keys, one layer, 3 heads of 64 floats, K and V
    assert 2 * 32 * 48 * 3 * 64 * 4 <= report["step_bytes"] <= 2 * 32 * 520 * 3 * 64 * 4
    assert len(report["rounds"]) == 2
    for pairs in report["rounds"]:  # per pattern: the sequential GB/s before it, its ratio
        assert len(pairs) == len(patterns) and all(rate > 0 and r > 0 for rate, r in pairs)
    counted = [sum(mode["pairs"][name] for mode in report["modes"]) for name in patterns]
    assert counted == [2] * len(patterns)
    printed = capsys.readouterr().out
    assert all(name in printed for name in patterns)

"""`--kernels FILE` on the command line: bringup records a plan, a second run replays it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from models.cli import main

SMALL = ["--model", "tiny-random", "--block-size", "16", "--prefill-chunk", "32"]


def _kernel_line(output: str) -> str:
    """The journal's kernel summary of the compile transition."""
    found = re.search(
        r"compile: ALLOCATED -> COMPILED .*?; "
        r"(kernels .*?decode attention \w+; fused decode(?: off|(?:@\d+,?)+)(?: \([^)]*\))?)",
        output,
    )
    assert found is not None, output
    return found.group(1)


def test_bringup_records_and_replays_the_kernel_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coverage = tmp_path / "coverage.json"
    assert main(["bringup", *SMALL, "--coverage-out", str(coverage)]) == 0
    first = _kernel_line(capsys.readouterr().out)
    assert first.startswith("kernels measured: ")
    recorded = json.loads(coverage.read_text(encoding="utf-8"))["kernels"]
    assert recorded["summary"] == first and recorded["source"] == "measured"
    assert main(["bringup", *SMALL, "--kernels", str(coverage)]) == 0
    second = _kernel_line(capsys.readouterr().out)
    assert second.startswith("kernels replayed from coverage.json (measured): ")
    assert second.split(": ", 1)[1] == first.split(": ", 1)[1]


def test_unreadable_kernels_file_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{}", encoding="utf-8")
    assert main(["bringup", *SMALL, "--kernels", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--kernels {path}: is not a kernel plan" in err

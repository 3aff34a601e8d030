"""`benchmarks/decode_step_breakdown.py` refuses bad flags before loading a model or timing,
and says what a negative rest means."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.decode_step_breakdown import _rest_lines, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "argument --reps: 0 is invalid: allowed is an integer >= 1"),
        (["--passes", "-1"], "argument --passes: -1 is invalid: allowed is an integer >= 1"),
        (["--threads", "x"], "argument --threads: 'x' is not an integer"),
        (["--peak-gflops", "-1"], "argument --peak-gflops: -1 is invalid"),
        (["--rows", "7"], "argument --rows: invalid choice: 7"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_json_path_in_a_missing_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / "out.json"
    with pytest.raises(SystemExit):
        main(["--json", str(target)])
    assert f"the folder {target.parent} does not exist" in capsys.readouterr().err


def test_a_positive_rest_is_one_line() -> None:
    lines = _rest_lines(80.0, 72.5)
    assert len(lines) == 1
    assert lines[0].startswith("rest (per-op step - parts)")
    assert lines[0].endswith("7.50 ms")


def test_a_negative_rest_says_to_measure_longer() -> None:
    lines = _rest_lines(70.0, 72.5)
    assert lines[0].endswith("-2.50 ms")
    assert "raise --reps or --passes" in lines[1]

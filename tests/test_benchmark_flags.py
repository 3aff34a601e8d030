"""The benchmark scripts refuse bad flags, naming them, before loading a model, building a
reader or timing anything."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import decode_step_breakdown, kv_read_patterns

Main = Callable[[list[str] | None], int]
SCRIPTS: dict[str, Main] = {
    "breakdown": decode_step_breakdown.main,
    "patterns": kv_read_patterns.main,
}
AT_LEAST_1 = "is invalid: allowed is an integer >= 1"


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("breakdown", ["--reps", "0"], f"argument --reps: 0 {AT_LEAST_1}"),
        ("breakdown", ["--passes", "-1"], f"argument --passes: -1 {AT_LEAST_1}"),
        ("breakdown", ["--pairs", "0"], f"argument --pairs: 0 {AT_LEAST_1}"),
        ("breakdown", ["--threads", "x"], "argument --threads: 'x' is not an integer"),
        ("breakdown", ["--peak-gflops", "-1"], "argument --peak-gflops: -1 is invalid"),
        ("breakdown", ["--rows", "7"], "argument --rows: invalid choice: 7"),
        ("breakdown", ["--pages", "random"], "argument --pages: invalid choice: 'random'"),
        ("patterns", ["--rounds", "0"], f"argument --rounds: 0 {AT_LEAST_1}"),
        ("patterns", ["--pause", "-1"], "--pause: -1 is invalid: allowed are 0-60 seconds"),
        ("patterns", ["--pause", "soon"], "argument --pause: 'soon' is not a number"),
        ("patterns", ["--layers", "x"], "argument --layers: 'x' is not an integer"),
        ("patterns", ["--seed", "-1"], "--seed: -1 is invalid: allowed is an integer >= 0"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(
    script: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script](argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_json_path_in_a_missing_folder_is_refused(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / "out.json"
    with pytest.raises(SystemExit):
        SCRIPTS[script](["--json", str(target)])
    assert f"argument --json: {target}: the folder {target.parent} does not exist" in (
        capsys.readouterr().err
    )

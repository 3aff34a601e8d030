"""`llm-runtime generate|bringup --lanes N`: same greedy output as one lane, clear usage errors."""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import pytest

from models.cli import main

SMALL = ["--model", "tiny-random", "--block-size", "16", "--prefill-chunk", "32"]
PROMPTS = ["--prompt", "hello there", "--prompt", "abc", "--prompt", "xyz 123"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def completions(text: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [row for row in rows if "summary" not in row]


def test_generate_over_two_lanes_matches_one_lane(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", *SMALL, *PROMPTS, "--max-new-tokens", "6", "--max-batch", "4", "--json"]
    status, one, _ = run(capsys, *common)
    assert status == 0
    for transport in ("process", "inprocess"):
        status, two, err = run(capsys, *common, "--lanes", "2", "--lane-transport", transport)
        assert status == 0, err
        assert [c["token_ids"] for c in completions(two)] == [
            c["token_ids"] for c in completions(one)
        ]
    assert multiprocessing.active_children() == []


def test_bringup_journals_every_lane_and_the_barrier(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys,
        "bringup",
        *SMALL,
        "--trace",
        "all",
        "--max-batch",
        "4",
        "--lanes",
        "2",
        "--lane-transport",
        "inprocess",
    )
    assert status == 0, err
    assert "barrier: 2 lanes pending -> captured together" in out
    journal = out.split("journal:", 1)[1]
    for lane in (0, 1):
        assert f"lane{lane}.DecoderExecutor.capture: COMPILED -> CAPTURED [ok]" in journal
    assert "LaneGroupExecutor.capture: COMPILED -> CAPTURED [ok]" in journal


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lanes", "2", "--max-batch", "3"], "--max-batch"),
        (
            ["--lanes", "2", "--lane-transport", "inprocess", "--threads-per-lane", "2"],
            "--threads-per-lane",
        ),
    ],
)
def test_bad_lane_arguments_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = run(capsys, "generate", *SMALL, *argv)
    assert status == 2
    assert message in err
    assert "--model" not in err  # refused at argument time, before anything loads


def test_zero_lanes_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "generate", *SMALL, "--lanes", "0")
    assert status == 2 and "--lanes" in err


def test_bench_lanes_reports_both_rates_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys,
        "bench",
        "--model",
        "tiny-random",
        "--prefill-chunk",
        "32",
        "--batch-sizes",
        "2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
        "--lanes",
        "2",
        "--lane-transport",
        "inprocess",
        "--json",
    )
    assert status == 0, err
    row = json.loads(out)["results"][0]
    assert row["lane_group"]["lanes"] == 2
    assert row["runtime"]["torch_threads"] == 2
    assert row["lanes_ratio"] > 0 and row["lanes_end_to_end_ratio"] > 0
    (step,) = row["lane_group"]["per_decode_step"]
    assert step["decode_steps"] == 2
    assert step["slowest_lane_us_per_step"] > 0 and step["transport_us_per_step"] >= 0


def test_bench_batch_must_split_over_the_lanes(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench", *SMALL, "--batch-sizes", "3", "--lanes", "2")
    assert status == 2 and "--lanes 2" in err

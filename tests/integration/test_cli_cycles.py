"""`llm-runtime bringup --cycle N [--sleep-level 1|2]`: drain/sleep/wake cycles after bring-up,
each step's time and bytes, identical output per cycle, nothing live while asleep."""

from __future__ import annotations

import pytest

from models.cli.bringup_cycles import CycleRecord
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.test_cli import SMALL, run

CYCLE = [*SMALL, "--max-batch", "2", "--progress", "never"]


def table_of(out: str) -> str:
    return out.split("\n\n")[0]


def test_cycles_at_level_1_match_and_sleep_empty(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bringup", *CYCLE, "--trace", "decode_only", "--cycle", "2")
    assert status == 0, err
    table = table_of(out)
    for step in ("drain #1", "sleep(1) #1", "wake #1", "request #1", "wake #2", "request #2"):
        assert step in table
    sleep_row = next(line for line in table.splitlines() if line.startswith("sleep(1) #2"))
    assert "released" in sleep_row and "kB" in sleep_row and "while asleep: 0" in sleep_row
    wake_row = next(line for line in table.splitlines() if line.startswith("wake #2"))
    assert "restored" in wake_row and "coverage manifest unchanged" in wake_row
    assert table.count("same as the first request") == 2
    assert "2 cycle(s): output identical to the first request in every cycle: yes" in out
    assert "live allocations while asleep: [0, 0]" in out


def test_cycles_at_level_2_wake_in_stages_and_reload(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bringup", *CYCLE, "--cycle", "1", "--sleep-level", "2")
    assert status == 0, err
    table = table_of(out)
    for step in ("sleep(2) #1", "wake weights #1", "reload_weights #1", "wake kv_cache #1"):
        assert step in table
    assert "weights dropped, buffers kept" in table and "copied in place" in table
    assert "1 cycle(s): output identical to the first request in every cycle: yes" in out


def test_cycles_over_two_lanes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bringup", *SMALL, "--max-batch", "4", "--lanes", "2", "--cycle", "1"]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert "2 lanes asleep at level 1; live allocations 0" in table_of(out)
    assert "live allocations while asleep: [0]" in out


def test_the_host_diagram_shows_the_sleep_phases(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "lifecycle", "diagram", "--machine", "host")
    assert status == 0
    for edge in (
        "SERVING --> DRAINING: drain",
        "DRAINED --> SLEEPING: sleep",
        "SLEEPING --> WEIGHTS_AWAKE: wake_weights",
        "WEIGHTS_AWAKE --> DRAINED: wake_kv_cache",
        "DRAINED --> SERVING: serve",
    ):
        assert edge in out


def test_a_bad_sleep_level_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bringup", *SMALL, "--cycle", "1", "--sleep-level", "3")
    assert status == 2 and "--sleep-level" in err


def test_the_verdict_names_what_went_wrong() -> None:
    record = CycleRecord(outputs=["a", "a"], asleep_allocations=[0])
    assert record.verdict() is None
    record.outputs.append("b")
    assert "outputs differ" in (record.verdict() or "")
    record = CycleRecord(outputs=["a", "a"], asleep_allocations=[0, 3])
    assert "live allocations while asleep: [0, 3]" in (record.verdict() or "")


def test_ctrl_c_in_a_cycle_prints_the_steps_done_closes_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from models.decoder.executor import DecoderExecutor

    wake = DecoderExecutor.wake
    calls: list[int] = []

    def interrupted_second_wake(self: DecoderExecutor, tags: object = None) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        wake(self, tags)  # type: ignore[arg-type]

    monkeypatch.setattr(DecoderExecutor, "wake", interrupted_second_wake)
    status, out, err = run(capsys, "bringup", *CYCLE, "--cycle", "3")
    assert status == 130, err
    assert "interrupted in wake #2: the steps before it are printed above" in err
    table = table_of(out)
    assert "request #1" in table and "same as the first request" in table
    assert next(line for line in table.splitlines() if line.startswith("wake #2")).count(
        "INTERRUPTED"
    )
    assert "close() attempt 1: ok, phase TERMINAL" in out

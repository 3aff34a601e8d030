"""`PendingStep`: a step's output is read once, by whoever needs it first, from any thread."""

from __future__ import annotations

import threading

import pytest

from models.vllm_plugin.pending_step import PendingStep


def test_the_step_finishes_once_whoever_asks_first() -> None:
    calls: list[str] = []
    step = PendingStep(7, lambda: calls.append(threading.current_thread().name) or "output")
    assert not step.finished
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(step.get_output())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert step.finished
    assert results == ["output"] * 8
    assert len(calls) == 1  # one read of the device, whichever thread got there
    assert step.get_output() == "output"


def test_a_failed_read_is_reported_to_every_caller_naming_the_step() -> None:
    calls = 0

    def finish() -> object:
        nonlocal calls
        calls += 1
        raise ValueError("device lost")

    step = PendingStep(3, finish)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"step 3 failed while reading its output: device"):
            step.get_output()
    assert calls == 1


def test_an_interrupt_propagates_unchanged_and_later_reads_fail() -> None:
    def finish() -> object:
        raise KeyboardInterrupt

    step = PendingStep(1, finish)
    with pytest.raises(KeyboardInterrupt):
        step.get_output()
    with pytest.raises(RuntimeError, match="step 1 failed"):
        step.get_output()


def test_a_second_caller_waits_while_another_thread_is_finishing() -> None:
    """`finish()` returns only once the output is there, even when another thread runs it."""
    started, release = threading.Event(), threading.Event()

    def slow() -> object:
        started.set()
        release.wait(5)
        return "tokens"

    step = PendingStep(2, slow)
    reader = threading.Thread(target=step.get_output)
    reader.start()
    assert started.wait(5)
    assert not step.finished  # taken by the reader, not done yet
    waiter_result: list[bool] = []
    waiter = threading.Thread(target=lambda: waiter_result.append(step.finish()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # blocked until the reader's finish completes
    release.set()
    reader.join(5)
    waiter.join(5)
    assert waiter_result == [False] and step.finished and step.get_output() == "tokens"

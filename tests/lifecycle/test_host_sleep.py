"""The generic host's drain, sleep, staged wake and reload (no torch, no device).

A small host records which hooks ran; the checks are the framework's: each stage is its own
journaled transition, no-ops say so, refusals teach and change nothing, a failed hook leaves
the phase (or FAULTED when it left resources), and serving waits while weights are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lifecycle import LifecycleHost, Phase, PhaseError
from lifecycle.sleep_args import check_sleep_level, check_wake_tags


class SleepyHost(LifecycleHost):
    """Records every sleep hook; `fail` names a hook that raises once."""

    def __init__(self) -> None:
        super().__init__(owner_name="SleepyHost")
        self.ran: list[str] = []
        self.fail: str | None = None
        self.leave_resources = False
        self.dropped = False

    def _hook(self, name: str) -> str:
        if self.fail == name:
            self.fail = None
            error = RuntimeError(f"{name} failed")
            error.resources_left = self.leave_resources  # type: ignore[attr-defined]
            raise error
        self.ran.append(name)
        return name

    def _do_drain(self) -> str:
        return self._hook("drain")

    def _do_sleep(self, level: int) -> str:
        self.dropped = self.dropped or level == 2
        return self._hook(f"sleep{level}")

    def _do_wake_weights(self) -> str:
        return self._hook("wake_weights")

    def _do_wake_kv_cache(self) -> str:
        return self._hook("wake_kv_cache")

    def _prepare_reload(self, source: object) -> object:
        if source != "same":
            raise ValueError(f"source must be 'same', got {source!r}")
        return source

    def _do_reload_weights(self, prepared: object) -> str:
        self.dropped = False
        return self._hook("reload")

    def _resume_blocked(self) -> str | None:
        return "weights dropped; reload_weights() first" if self.dropped else None

    def _do_close(self) -> Sequence[BaseException]:
        return ()


def serving() -> SleepyHost:
    host = SleepyHost()
    host.start()
    return host


def triggers(host: LifecycleHost) -> list[str]:
    return [f"{e.trigger}:{e.dest}" for e in host.journal if e.outcome.value == "ok"]


def test_a_full_cycle_takes_each_stage_as_its_own_transition() -> None:
    host = serving()
    host.drain()
    host.sleep()
    host.wake()
    assert host.phase is Phase.SERVING
    assert host.ran == ["drain", "sleep1", "wake_weights", "wake_kv_cache"]
    assert triggers(host)[-6:] == [
        "drain:DRAINING",
        "drained:DRAINED",
        "sleep:SLEEPING",
        "wake_weights:WEIGHTS_AWAKE",
        "wake_kv_cache:DRAINED",
        "serve:SERVING",
    ]


def test_level_2_waits_in_drained_until_a_reload() -> None:
    host = serving()
    host.drain()
    host.sleep(2)
    host.wake()
    assert host.phase is Phase.DRAINED
    assert "stays DRAINED: weights dropped" in host.journal.entries[-1].detail
    with pytest.raises(PhaseError, match="reload_weights") as refused:
        host.serve()
    assert "serve" not in host.next_calls and "serve" not in refused.value.next_calls
    assert "reload_weights" in host.next_calls
    host.reload_weights("same")
    assert "serve" in host.next_calls
    host.serve()
    assert host.phase is Phase.SERVING


def test_no_ops_are_journaled_and_run_nothing() -> None:
    host = serving()
    host.wake()
    host.drain()
    host.drain()
    host.sleep()
    host.sleep(2)
    host.wake(tags=("weights",))
    host.wake(tags=("weights",))
    assert host.ran == ["drain", "sleep1", "wake_weights"]
    noops = [e.detail for e in host.journal if e.detail.startswith("no-op")]
    assert noops == [
        "no-op: already awake in SERVING",
        "no-op: nothing in flight in DRAINED",
        "no-op: already SLEEPING; sleep(level=2) changes nothing",
        "no-op: the weights are already awake",
    ]


@pytest.mark.parametrize(
    ("prepare", "call", "match"),
    [
        ([], lambda h: h.sleep(), r"drain\(\) first"),
        ([], lambda h: h.reload_weights("same"), r"drain\(\) first"),
        (["drain", "sleep"], lambda h: h.wake(tags=("kv_cache",)), r"weights awake first"),
        (["drain", "sleep"], lambda h: h.reload_weights("same"), r"weights are asleep"),
        (["drain", "sleep"], lambda h: h.start(), r"start\(\) runs once"),
        (["drain"], lambda h: h.capture(), r"not legal in DRAINED"),
    ],
)
def test_refusals_teach_and_change_nothing(prepare: list[str], call: object, match: str) -> None:
    host = serving()
    for name in prepare:
        getattr(host, name)()
    phase, ran = host.phase, list(host.ran)
    with pytest.raises(PhaseError, match=match):
        call(host)  # type: ignore[operator]
    assert host.phase is phase and host.ran == ran


def test_bad_arguments_are_refused_before_any_hook() -> None:
    host = serving()
    host.drain()
    with pytest.raises(ValueError, match="level must be 1"):
        host.sleep(0)
    with pytest.raises(ValueError, match="source must be 'same'"):
        host.reload_weights("other")
    assert host.phase is Phase.DRAINED and host.ran == ["drain"]


@pytest.mark.parametrize(
    ("hook", "phase_after"),
    [
        ("drain", Phase.DRAINING),
        ("sleep1", Phase.DRAINED),
        ("wake_weights", Phase.SLEEPING),
        ("wake_kv_cache", Phase.WEIGHTS_AWAKE),
    ],
)
def test_a_failed_stage_stays_put_and_retries(hook: str, phase_after: Phase) -> None:
    host = serving()
    host.fail = hook
    with pytest.raises(RuntimeError, match="failed"):
        host.drain()
        host.sleep()
        host.wake()
    assert host.phase is phase_after
    if phase_after is Phase.DRAINING:
        host.drain()
    if host.phase is Phase.DRAINED:
        host.sleep()
    host.wake()
    assert host.phase is Phase.SERVING


def test_a_failed_stage_that_left_resources_faults() -> None:
    host = serving()
    host.drain()
    host.fail, host.leave_resources = "sleep1", True
    with pytest.raises(RuntimeError):
        host.sleep()
    assert host.phase is Phase.FAULTED
    host.close()
    assert host.phase is Phase.TERMINAL


def test_argument_checks() -> None:
    assert check_sleep_level(2) == 2
    for bad in (0, 3, True, "1", 1.0):
        with pytest.raises(ValueError, match="level must be 1"):
            check_sleep_level(bad)
    assert check_wake_tags(None) == ("weights", "kv_cache")
    assert check_wake_tags(["kv_cache", "weights"]) == ("weights", "kv_cache")
    with pytest.raises(TypeError, match="tags must be a sequence"):
        check_wake_tags("weights")
    with pytest.raises(ValueError, match=r"got \('kv',\)"):
        check_wake_tags(("kv",))

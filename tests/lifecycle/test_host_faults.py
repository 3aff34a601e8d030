"""A failed call that leaves a component holding something moves the host to FAULTED."""

from __future__ import annotations

import pytest

from lifecycle import FaultedError, LifecycleHost, Phase, guarded


class LeakyHost(LifecycleHost):
    """Its `warm()` fails and leaves one orphan when `leak` is set; close() releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.orphans = 0
        self.leak = False

    def _held_resources(self) -> tuple[str, ...]:
        return (f"{self.orphans} orphan(s)",) if self.orphans else ()

    @guarded(Phase.ALLOCATED, Phase.COMPILED)
    def warm(self) -> None:
        with self._faulting("warm"):
            if self.leak:
                self.orphans += 1
                raise RuntimeError("warm failed and could not release its output")
            raise ValueError("bad shape")  # a plain failure leaves nothing behind

    def _do_close(self) -> list[BaseException]:
        self.orphans = 0
        return []


def allocated() -> LeakyHost:
    host = LeakyHost()
    host.resolve_capacity()
    host.seal()
    host.allocate()
    return host


def test_a_plain_failure_keeps_the_phase_and_its_next_calls() -> None:
    host = allocated()
    with pytest.raises(ValueError):
        host.warm()
    assert host.phase is Phase.ALLOCATED and host.next_calls == ("compile",)


def test_a_failure_that_leaves_resources_faults_and_says_close() -> None:
    host = allocated()
    host.leak = True
    with pytest.raises(RuntimeError) as caught:
        host.warm()
    assert host.phase is Phase.FAULTED and host.next_calls == ("close",)
    assert any("is FAULTED: call close()" in note for note in caught.value.__notes__)
    with pytest.raises(FaultedError, match=r"only close\(\) is legal"):
        host.warm()
    host.close()
    assert host.phase is Phase.TERMINAL and host.orphans == 0
    entry = next(e for e in host.journal.entries if e.trigger == "fault")
    assert "warm failed and left 1 orphan(s)" in entry.detail

"""LifecycleHost: phase calls, teaching errors, close semantics, faults."""

from __future__ import annotations

import pytest

from lifecycle import FaultedError, Outcome, Phase, PhaseError, TerminalError
from tests.lifecycle.hosts import Pool, ToyHost


def test_start_runs_every_phase_and_journals_them() -> None:
    pool = Pool()
    host = ToyHost(pool, traced=True)
    host.start()
    assert host.phase is Phase.SERVING
    reached = [e.dest for e in host.journal.entries if e.outcome is Outcome.OK]
    assert reached == [
        "CAPACITY_RESOLVED",
        "SEALED",
        "ALLOCATED",
        "COMPILED",
        "CAPTURED",
        "SERVING",
    ]
    allocate = next(e for e in host.journal.entries if e.trigger == "allocate")
    assert allocate.detail == "2 buffers"
    assert len(pool.live) == 2


def test_untraced_host_serves_from_compiled_and_refuses_capture() -> None:
    host = ToyHost(Pool(), traced=False)
    host.resolve_capacity()
    host.seal()
    host.allocate()
    host.compile()
    with pytest.raises(PhaseError, match="nothing to capture; call serve"):
        host.capture()
    assert host.phase is Phase.COMPILED
    host.serve()
    assert host.phase is Phase.SERVING


def test_traced_host_must_capture_before_serving() -> None:
    host = ToyHost(Pool(), traced=True)
    host.resolve_capacity()
    host.seal()
    host.allocate()
    host.compile()
    with pytest.raises(PhaseError, match=r"call capture\(\)"):
        host.serve()
    assert host.phase is Phase.COMPILED


def test_request_before_serving_teaches_next_call() -> None:
    host = ToyHost(Pool())
    host.resolve_capacity()
    host.seal()
    host.allocate()
    with pytest.raises(PhaseError) as caught:
        host.request()
    assert str(caught.value) == (
        "ToyHost: request() is not legal in ALLOCATED; it is legal in SERVING; next: compile()"
    )
    assert host.phase is Phase.ALLOCATED


def test_guard_table_of_host() -> None:
    table = ToyHost.guard_table()
    assert table["request"] == {Phase.SERVING}
    assert table["warm"] == {Phase.ALLOCATED, Phase.COMPILED}
    assert table["seal"] == {Phase.CAPACITY_RESOLVED}
    assert table["serve"] == {Phase.COMPILED, Phase.CAPTURED, Phase.DRAINED}


def test_close_is_idempotent_and_terminal_absorbing() -> None:
    pool = Pool()
    host = ToyHost(pool)
    host.start()
    host.close()
    host.close()
    assert host.phase is Phase.TERMINAL
    assert pool.live == set()
    assert pool.double_releases == 0
    with pytest.raises(TerminalError, match="ToyHost is terminal; construct a new one"):
        host.request()
    with pytest.raises(TerminalError):
        host.resolve_capacity()


def test_failed_close_moves_to_closing_and_retries() -> None:
    pool = Pool()
    host = ToyHost(pool, buffers=3)
    host.start()
    pool.fail_release = 2
    with pytest.raises(RuntimeError, match="injected release failure") as caught:
        host.close()
    assert len(caught.value.cleanup_failures) == 1  # type: ignore[attr-defined]
    assert host.phase is Phase.CLOSING
    assert len(pool.live) == 2
    with pytest.raises(FaultedError, match=r"call close\(\) again"):
        host.request()
    host.close()
    assert host.phase is Phase.TERMINAL
    assert pool.live == set()
    assert pool.double_releases == 0


def test_failed_allocate_rolls_back_and_keeps_phase() -> None:
    pool = Pool()
    host = ToyHost(pool, buffers=3)
    host.resolve_capacity()
    host.seal()
    pool.fail_allocate = 1
    with pytest.raises(MemoryError):
        host.allocate()
    assert host.phase is Phase.SEALED
    assert pool.live == set()
    host.allocate()
    assert host.phase is Phase.ALLOCATED


def test_failed_allocate_with_failed_rollback_faults() -> None:
    pool = Pool()
    host = ToyHost(pool, buffers=3)
    host.resolve_capacity()
    host.seal()
    pool.next_id = 0
    # Second allocation fails; rolling back the first also fails -> FAULTED.
    original = pool.allocate
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            pool.fail_release = 1
            raise MemoryError("second buffer")
        return original()

    pool.allocate = flaky  # type: ignore[method-assign]
    with pytest.raises(MemoryError) as caught:
        host.allocate()
    assert caught.value.cleanup_failures  # type: ignore[attr-defined]
    assert host.phase is Phase.FAULTED
    with pytest.raises(FaultedError, match=r"only close\(\) is legal"):
        host.compile()
    host.close()
    assert host.phase is Phase.TERMINAL
    assert pool.live == set()


def test_context_manager_closes() -> None:
    pool = Pool()
    with ToyHost(pool) as host:
        host.start()
    assert host.phase is Phase.TERMINAL
    assert pool.live == set()

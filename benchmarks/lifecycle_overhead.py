"""Cost of a guarded method call against the same call unguarded, and of a phase transition.

Run: `.venv/bin/python benchmarks/lifecycle_overhead.py` (or `llm-runtime bench lifecycle`
once the bench command exists). Prints medians over repeated `timeit` batches; the target is
under 1 microsecond of guard overhead per call. Numbers are printed, never asserted in tests.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import timeit
from collections.abc import Callable

from lifecycle import LifecycleHost, Phase, guarded
from lifecycle.phases import HOST_TABLE


class Bench(LifecycleHost):
    """A host whose guarded and unguarded methods do the same trivial work."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def plain(self, value: int) -> int:
        self.total += value
        return self.total

    @guarded(Phase.SERVING)
    def checked(self, value: int) -> int:
        self.total += value
        return self.total


def per_call_ns(fn: Callable[[], object], *, number: int, repeat: int = 7) -> float:
    """Median nanoseconds per call over `repeat` batches of `number` calls."""
    batches = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(batches) / number * 1e9


def main() -> None:
    host = Bench()
    host.start()
    plain = per_call_ns(lambda: host.plain(1), number=200_000)
    checked = per_call_ns(lambda: host.checked(1), number=200_000)

    machines = [HOST_TABLE.build() for _ in range(2_000)]
    started = time.perf_counter()
    for machine in machines:
        machine.fire("resolve_capacity")
    transition = (time.perf_counter() - started) / len(machines) * 1e9
    build_only = per_call_ns(lambda: HOST_TABLE.build(), number=500)

    refused = Bench()

    def refusal() -> None:
        with contextlib.suppress(RuntimeError):
            refused.checked(1)

    refusal_ns = per_call_ns(refusal, number=20_000)
    print("lifecycle overhead (median of 7 batches, this machine)")
    print(f"  unguarded call          {plain:10.1f} ns")
    print(f"  guarded call            {checked:10.1f} ns")
    print(f"  guard overhead          {checked - plain:10.1f} ns   (target < 1000 ns)")
    print(f"  phase transition (fire) {transition:10.1f} ns   (journaled)")
    print(f"  build a host machine    {build_only:10.1f} ns")
    print(f"  refused call (error)    {refusal_ns:10.1f} ns   (journaled, builds the message)")


if __name__ == "__main__":
    main()

"""`bringup --cycle N [--sleep-level 1|2]`: the drain/sleep/wake cycles after the bring-up.

Why: an RL loop sleeps and wakes the engine many times an hour; bring-up rehearses it and
shows, per step, the time and the bytes released and restored (the host's journal details),
that the device holds no allocation while asleep and that every cycle's request gives the
same output as the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from models.cli.executor_view import CliExecutor

Step = tuple[str, Callable[[], object]]


@attrs.define
class CycleRecord:
    """What the cycles saw: each request's text and the live allocations while asleep."""

    outputs: list[str] = attrs.field(factory=list)
    asleep_allocations: list[int] = attrs.field(factory=list)

    def verdict(self) -> str | None:
        """None when every cycle matched and slept empty, else what went wrong."""
        if any(text != self.outputs[0] for text in self.outputs[1:]):
            return f"outputs differ between cycles: {self.outputs!r}"
        if any(self.asleep_allocations):
            return f"live allocations while asleep: {self.asleep_allocations}"
        return None

    def summary(self) -> str:
        cycles = len(self.outputs) - 1
        return (
            f"{cycles} cycle(s): output identical to the first request in every cycle: "
            f"{'yes' if all(t == self.outputs[0] for t in self.outputs) else 'NO'}; live "
            f"allocations while asleep: {self.asleep_allocations}"
        )


def _live_allocations(executor: CliExecutor) -> int:
    device = getattr(executor, "device", None)
    if device is not None:
        return int(device.live_allocations)
    return int(getattr(executor, "live_allocations", 0))


def cycle_steps(
    executor: CliExecutor,
    *,
    cycles: int,
    level: int,
    source: str,
    request: Callable[[], str],
    record: CycleRecord,
) -> list[Step]:
    """The steps of `cycles` drain/sleep/wake cycles, each ending with `request`."""

    def sleep() -> str:
        executor.sleep(level)
        live = _live_allocations(executor)
        record.asleep_allocations.append(live)
        return f"live allocations while asleep: {live}"

    def ask() -> str:
        text = request()
        record.outputs.append(text)
        same = "same as the first request" if text == record.outputs[0] else "DIFFERENT"
        return f"{same}: {text}"

    steps: list[Step] = []
    for cycle in range(1, cycles + 1):
        steps.append((f"drain #{cycle}", executor.drain))
        steps.append((f"sleep({level}) #{cycle}", sleep))
        if level == 2:
            steps.append((f"wake weights #{cycle}", lambda: executor.wake(tags=("weights",))))
            steps.append((f"reload_weights #{cycle}", lambda: executor.reload_weights(source)))
            steps.append((f"wake kv_cache #{cycle}", lambda: executor.wake(tags=("kv_cache",))))
        else:
            steps.append((f"wake #{cycle}", executor.wake))
        steps.append((f"request #{cycle}", ask))
    return steps

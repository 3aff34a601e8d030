"""Progress from inside a process lane: plain lines on the worker's stderr, lane by lane.

A process lane loads, measures kernels and warms up in its own worker, where the parent's
`ConsoleProgress` cannot reach. `LaneWorkerProgress` is what the parent hands each worker
instead: it pickles as two fields, and in the worker prints through a `ConsoleProgress` on
the stderr the worker inherited from the parent, every line prefixed with the lane
(`lane 0: warmup decode 3/12: ...`). Plain lines only: several processes cannot share one
terminal's bars. Lanes are identical and start together, so only lane 0 reports its steps;
the parent reports each lane as it becomes ready.
"""

from __future__ import annotations

import sys
from typing import TextIO

import attrs

from models.progress import ConsoleProgress


class _LanePrefixed:
    """The parts of a text stream `ConsoleProgress` writes to: whole lines, each prefixed and
    written in one call, so lines of several processes on one stderr never interleave."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._stream.write("".join(f"{self._prefix}{line}\n" for line in lines if line))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False  # plain lines even on a terminal


@attrs.define
class LaneWorkerProgress:
    """A progress sink for lane `lane`'s worker (built in the parent, used in the worker)."""

    lane: int
    console: ConsoleProgress | None = attrs.field(default=None, eq=False, repr=False)

    def _sink(self) -> ConsoleProgress:
        if self.console is None:
            stream = _LanePrefixed(sys.stderr, f"lane {self.lane}: ")
            self.console = ConsoleProgress(stream, force=True)  # type: ignore[arg-type]
        return self.console

    def __getstate__(self) -> dict[str, int]:
        return {"lane": self.lane}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.lane = state["lane"]
        self.console = None

    def __call__(self, label: str, index: int, total: int) -> None:
        self._sink()(label, index, total)

    def step(
        self, name: str, *, total: int | None = None, each: bool = False, estimate: bool = True
    ) -> object:
        return self._sink().step(name, total=total, each=each, estimate=estimate)

    def announce(self, message: str) -> None:
        self._sink().announce(message)

    def cases_done(self) -> None:
        self._sink().cases_done()

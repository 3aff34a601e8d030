"""Progress for the steps a person waits on: model load, KV allocation, warmup, capture,
generation.

One object serves the command line and the Python API: pass it as `progress=` to
`load_executor` (it is also the warmup coordinator's `(label, index, total)` callback) and to
`Generator.stream`. `ConsoleProgress` draws rich bars on a terminal and prints one plain line
per finished step elsewhere (only when asked: the CLI's `--progress always`); `NullProgress`
shows nothing. Output goes to stderr, so stdout stays clean for text and JSON.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO, runtime_checkable


@runtime_checkable
class ProgressSink(Protocol):
    """What the runtime reports to: steps with an optional count, and warmup cases."""

    def __call__(self, label: str, index: int, total: int) -> None:
        """Warmup case `index` of `total` (1-based) starts; `label` describes it."""

    def step(
        self, name: str, *, total: int | None = None, each: bool = False, estimate: bool = True
    ) -> Any:
        """A context manager around one slow step; its value has `advance(n, detail)`.

        `each`: the advances are worth lines of their own (kernel measurements, lane
        start-up), so a pipe sees `i/n` and an estimate while the step runs, not only its end
        (`ConsoleProgress` prints at most one such line a second). `estimate=False`: the
        items run in parallel, so the mean time so far does not predict the rest.
        """

    def announce(self, message: str) -> None:
        """A one-line notice (e.g. what a benchmark phase will measure and for how long)."""

    def cases_done(self) -> None:
        """The warmup cases reported through `__call__` are finished."""


EACH_LINE_INTERVAL_S = 1.0
"""On a pipe, a step with `each=True` prints at most one `i/n` line per this many seconds
(a fast step prints only its finishing line; a slow one says where it is every second)."""


class _NullStep:
    def advance(self, count: int = 1, detail: str = "") -> None:
        pass


class NullProgress:
    """Shows nothing (a pipe, `--progress never`, or an API caller who passed nothing)."""

    def __call__(self, label: str, index: int, total: int) -> None:
        pass

    @contextmanager
    def step(
        self, name: str, *, total: int | None = None, each: bool = False, estimate: bool = True
    ) -> Iterator[_NullStep]:
        yield _NullStep()

    def announce(self, message: str) -> None:
        pass

    def cases_done(self) -> None:
        pass


class _Step:
    """One running step: a rich task on a terminal, a finishing line elsewhere."""

    def __init__(
        self,
        owner: ConsoleProgress,
        name: str,
        total: int | None,
        *,
        each: bool = False,
        estimate: bool = True,
    ) -> None:
        self.owner = owner
        self.name = name
        self.total = total
        self.each = each
        self.estimate = estimate
        self.done = 0
        self.detail = ""
        self.started = self.last_line = time.perf_counter()
        self.task: Any = None
        if owner._bars is not None:
            self.task = owner._bars.add_task(name, total=total)

    def advance(self, count: int = 1, detail: str = "") -> None:
        self.done += count
        if detail:
            self.detail = detail
        if self.task is not None:
            label = f"{self.name} ({detail})" if detail else self.name
            self.owner._bars.update(self.task, advance=count, description=label)
        elif self.each and count and self.done != self.total:
            now = time.perf_counter()
            if now - self.last_line >= EACH_LINE_INTERVAL_S:
                self.last_line = now
                total = self.total or "?"
                self.owner._line(f"{self.name} {self.done}/{total}: {detail}{self.eta()}")

    def eta(self, finished: int | None = None) -> str:
        """`; about N s left` from the mean time per finished item so far ('' when unknown
        or under a second)."""
        finished = self.done if finished is None else finished
        if not self.estimate or not self.total or finished <= 0 or finished >= self.total:
            return ""
        left = (time.perf_counter() - self.started) / finished * (self.total - finished)
        return f"; about {_seconds(left)} left" if left >= 1.0 else ""

    def finish(self, *, stopped: bool = False) -> None:
        """The step's last line: `done in`, or `stopped after` when it raised (or was
        interrupted), so a pipe never reads an unfinished step as done."""
        seconds = time.perf_counter() - self.started
        if self.task is not None:
            self.owner._bars.remove_task(self.task)
        count = f" {self.done}/{self.total}" if self.total else ""
        detail = f"; {self.detail}" if self.detail and not self.each else ""
        ended = "stopped after" if stopped else "done in"
        self.owner._line(f"{self.name}{count}: {ended} {seconds:.1f} s{detail}")


class ConsoleProgress:
    """rich progress on stderr (bars on a terminal, one line per finished step otherwise)."""

    def __init__(self, stream: TextIO | None = None, *, force: bool = False) -> None:
        from rich.console import Console

        self._stream = stream or sys.stderr
        self.console = Console(file=self._stream, stderr=stream is None)
        self.interactive = bool(self.console.is_terminal)
        self.enabled = self.interactive or force
        self._bars: Any = None
        self._depth = 0
        self._warmup: _Step | None = None

    def _start_bars(self) -> None:
        if self._bars is None and self.interactive:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bars = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
                # stdout text passes through the live display only when stdout is the same
                # kind of terminal; piped stdout (JSON for a script) is never touched.
                redirect_stdout=_is_terminal(sys.stdout),
                redirect_stderr=False,
            )
            self._bars.start()

    def _stop_bars(self) -> None:
        if self._bars is not None and self._depth == 0 and self._warmup is None:
            self._bars.stop()
            self._bars = None

    def _line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bars is not None:
            self._bars.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self._stream, flush=True)

    @contextmanager
    def step(
        self, name: str, *, total: int | None = None, each: bool = False, estimate: bool = True
    ) -> Iterator[_Step]:
        """Show `name` while the block runs; a finishing line says how long it took.

        With `each`, a pipe also gets `name i/n: detail; about N s left` lines while it
        runs (at most one per `EACH_LINE_INTERVAL_S`); a terminal shows the same in the bar.
        """
        self._finish_warmup()
        if self.enabled:
            self._start_bars()
        self._depth += 1
        step = _Step(self, name, total, each=each, estimate=estimate)
        stopped = True
        try:
            yield step
            stopped = False
        finally:
            self._depth -= 1
            step.finish(stopped=stopped)
            self._stop_bars()

    def __call__(self, label: str, index: int, total: int) -> None:
        """The warmup coordinator's callback: case `index` of `total` starts.

        A terminal shows it in the warmup bar; a pipe gets one line per case, `warmup
        OPERATION i/n: label`, with an estimate of the time left from the mean case so far.
        """
        if not self.enabled:
            return
        if self._warmup is None or index == 1:
            self._finish_warmup()
            self._start_bars()
            operation = label.split()[0] if label.split() else "cases"
            self._warmup = _Step(self, f"warmup {operation} shapes", total)
        warmup = self._warmup
        eta = warmup.eta(index - 1)
        if index > 1:
            warmup.advance(1, label)
        if warmup.task is not None:
            self._bars.update(warmup.task, description=f"{warmup.name} ({label}{eta})")
        else:
            operation = warmup.name.removeprefix("warmup ").removesuffix(" shapes")
            self._line(f"warmup {operation} {index}/{total}: {label}{eta}")
        if index == total:
            warmup.advance(0, label)

    def _finish_warmup(self) -> None:
        if self._warmup is not None:
            warmup, self._warmup = self._warmup, None
            warmup.done = warmup.total or warmup.done
            warmup.detail = ""  # the last case's label; the count says enough
            warmup.finish()
            self._stop_bars()

    def cases_done(self) -> None:
        """Warmup finished: its line is printed now, not when the next step starts."""
        self._finish_warmup()

    def announce(self, message: str) -> None:
        """Print a notice now (plain text; shown on a pipe too when enabled)."""
        self._finish_warmup()
        self._line(message)

    def close(self) -> None:
        """End any display still running (the warmup bar closes on the next step)."""
        self._finish_warmup()
        self._depth = 0
        self._stop_bars()


def _seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min"


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress_for(mode: str, stream: TextIO | None = None) -> ConsoleProgress | NullProgress:
    """The CLI's choice: `auto` shows progress only on a terminal, `always` also on a pipe."""
    if mode == "never":
        return NullProgress()
    console = ConsoleProgress(stream, force=mode == "always")
    return console if console.enabled else NullProgress()


def as_progress(progress: Any) -> Any:
    """A `ProgressSink` for whatever an API caller passed (None, a callback, or a sink)."""
    if progress is None:
        return NullProgress()
    if all(callable(getattr(progress, name, None)) for name in ("step", "announce", "cases_done")):
        return progress
    if callable(progress):
        return _CallbackProgress(progress)
    raise TypeError(
        f"progress must be None, a ConsoleProgress/NullProgress (models.progress) or a "
        f"callback(label, index, total), got {type(progress).__name__}"
    )


class _CallbackProgress(NullProgress):
    """A bare warmup callback: warmup cases reach it; other steps are not shown."""

    def __init__(self, callback: Any) -> None:
        self._callback = callback

    def __call__(self, label: str, index: int, total: int) -> None:
        self._callback(label, index, total)

"""An append-only record of every transition attempt, for bring-up debugging.

Entries are never edited or removed; `llm-runtime bringup` prints them. Reading the journal
answers "what happened, in which order, how long did it take, and what failed".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from enum import StrEnum

import attrs


class Outcome(StrEnum):
    """How a transition attempt ended."""

    OK = "ok"
    REFUSED = "refused"
    FAILED = "failed"


@attrs.frozen
class JournalEntry:
    """One attempt: a trigger fired (or refused, or failed) on one machine."""

    sequence: int
    machine: str
    trigger: str
    source: str
    dest: str
    wall_time: float
    duration_s: float
    outcome: Outcome
    error: str | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for humans."""
        line = (
            f"#{self.sequence:<3} {self.machine}.{self.trigger}: {self.source} -> {self.dest} "
            f"[{self.outcome.value}] {self.duration_s * 1e3:.3f} ms"
        )
        if self.detail:
            line += f" ({self.detail})"
        if self.error:
            line += f" error: {self.error}"
        return line


class Journal:
    """Thread-safe append-only list of `JournalEntry`; several machines may share one."""

    __slots__ = ("_entries", "_lock")

    def __init__(self) -> None:
        self._entries: list[JournalEntry] = []
        self._lock = threading.Lock()

    def record(
        self,
        *,
        machine: str,
        trigger: str,
        source: str,
        dest: str,
        started: float,
        duration_s: float,
        outcome: Outcome,
        error: BaseException | None = None,
        detail: str = "",
    ) -> JournalEntry:
        """Append one attempt and return it."""
        with self._lock:
            entry = JournalEntry(
                sequence=len(self._entries) + 1,
                machine=machine,
                trigger=trigger,
                source=source,
                dest=dest,
                wall_time=started,
                duration_s=duration_s,
                outcome=outcome,
                error=None if error is None else f"{type(error).__name__}: {error}",
                detail=detail,
            )
            self._entries.append(entry)
            return entry

    @property
    def entries(self) -> tuple[JournalEntry, ...]:
        """A snapshot; later appends do not change it."""
        with self._lock:
            return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[JournalEntry]:
        return iter(self.entries)

    def durations_by_dest(self, machine: str | None = None) -> dict[str, float]:
        """Seconds spent in successful transitions, keyed by the phase they reached."""
        totals: dict[str, float] = {}
        for entry in self.entries:
            if entry.outcome is Outcome.OK and (machine is None or entry.machine == machine):
                totals[entry.dest] = totals.get(entry.dest, 0.0) + entry.duration_s
        return totals

    def format(self) -> str:
        """The whole journal, one line per entry."""
        return "\n".join(entry.describe() for entry in self.entries)


def now() -> float:
    """Wall-clock time for entries (seconds since the epoch)."""
    return time.time()

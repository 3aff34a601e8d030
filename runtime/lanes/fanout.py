"""Fan one call out over several lanes: issue it to all before waiting on any.

Every lane call of a `LaneGroupExecutor` goes through `LaneFanOut`: each wait is bounded,
whatever a lane raised becomes a `LaneFailure` naming the lane, the first failure is raised
with the other lanes' failures attached, and after each call the lanes' journal entries are
forwarded into the group's journal (as `lane<i>.<machine>` rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from lifecycle.journal import Journal, Outcome
from runtime.lanes.protocol import Lane, LaneCall, LaneFailure
from runtime.steps import PrefillStep

logger = logging.getLogger(__name__)

OUTPUT_THREAD_PREFIX = "llm-runtime-dp-output"
TERMINAL_TEXT = "LaneGroupExecutor is terminal; construct a new group"

KwargsFor = Callable[[int], dict[str, object]]
"""A lane call's keyword arguments, per lane index (a `step`, or a lifecycle call's)."""


def _no_kwargs(index: int) -> dict[str, object]:
    return {}


class LaneFanOut:
    """The lanes of one group, the output-read pool, and the calls in flight on it."""

    def __init__(self, lanes: tuple[Lane, ...], journal: Journal, call_timeout_s: float | None):
        self.lanes = lanes
        self.journal = journal
        self.call_timeout_s = call_timeout_s
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=len(lanes), thread_name_prefix=OUTPUT_THREAD_PREFIX
        )
        self._in_flight: list[Future[object]] = []
        self._cleaned = [False] * len(lanes)

    def wait(self, index: int, call: LaneCall, method: str) -> object:
        """The call's value within the bound; any other error becomes a `LaneFailure`."""
        try:
            return call.wait(self.call_timeout_s)
        except LaneFailure:
            raise
        except BaseException as error:
            raise LaneFailure(
                index, f"{method}() failed: {type(error).__name__}: {error}"
            ) from error

    def each(
        self,
        method: str,
        kwargs_for: KwargsFor | None = None,
        *,
        lanes: Sequence[int] | None = None,
    ) -> list[object]:
        """Issue `method` to every chosen lane (default: all), then wait on each."""
        chosen = list(range(len(self.lanes))) if lanes is None else list(lanes)
        results = self.methods(dict.fromkeys(chosen, method), kwargs_for or _no_kwargs)
        return [results[index] for index in chosen]

    def methods(self, method_of: dict[int, str], kwargs_for: KwargsFor) -> dict[int, object]:
        """Issue each lane its own method, then wait on each; first failure wins."""
        calls: list[tuple[int, LaneCall]] = []
        failures: list[BaseException] = []
        for index in sorted(method_of):
            try:
                calls.append(
                    (index, self.lanes[index].submit(method_of[index], **kwargs_for(index)))
                )
            except BaseException as error:
                failures.append(
                    error
                    if isinstance(error, LaneFailure)
                    else lane_failure(index, f"{method_of[index]}(): {error}", error)
                )
        results: dict[int, object] = {}
        for index, call in calls:
            try:
                results[index] = self.wait(index, call, method_of[index])
            except BaseException as failure:
                failures.append(failure)
        self.drain_journals()
        if failures:
            raise_with_lane_failures(failures)
        return results

    def concurrently(
        self,
        method: str,
        kwargs_for: KwargsFor,
        *,
        skip: Sequence[int] = (),
        skipped: object = None,
    ) -> list[object]:
        """Run one call per lane on the output pool (reads overlap across lanes)."""
        pool = self._pool
        if pool is None:
            raise RuntimeError(TERMINAL_TEXT)

        def one(index: int) -> object:
            call = self.lanes[index].submit(method, **kwargs_for(index))
            return self.wait(index, call, method)

        futures = [
            None if index in skip else pool.submit(one, index) for index in range(len(self.lanes))
        ]
        self._in_flight = [f for f in futures if f is not None]
        results: list[object] = []
        failures: list[BaseException] = []
        for index, future in enumerate(futures):
            if future is None:
                results.append(skipped)
                continue
            try:
                results.append(future.result())
            except LaneFailure as failure:
                failures.append(failure)
            except BaseException as error:
                failures.append(lane_failure(index, f"{method}() failed: {error}", error))
        self._in_flight = []
        self.drain_journals()
        if failures:
            raise_with_lane_failures(failures)
        return results

    def _traced(self, lane: int, execution: str | None) -> bool:
        if execution == "eager":
            return False
        return execution == "traced" or self.lanes[lane].facts.prefill_traced

    def preflight_traced(self, routed: dict[int, PrefillStep]) -> dict[int, object]:
        """Preflight every traced participating lane before any lane runs (its tickets)."""
        tickets: dict[int, object] = {}
        for lane, step in routed.items():
            if not self._traced(lane, step.execution):
                continue
            try:
                call = self.lanes[lane].submit(
                    "preflight_prefill", step=attrs.evolve(step, execution=None)
                )
                tickets[lane] = call.wait(self.call_timeout_s)
            except BaseException as error:
                self.drain_journals()
                # A LaneFailure (a RuntimeError) names the lane, as every other lane call does.
                raise LaneFailure(
                    lane,
                    f"Required traced prefill is unavailable for DP lane {lane}; no DP lane "
                    f"executed: {type(error).__name__}: {error}",
                ) from error
        self.drain_journals()
        return tickets

    def drain_journals(self) -> None:
        """Forward every lane's new journal entries into the group's journal."""
        for index, lane in enumerate(self.lanes):
            for row in lane.drain_journal():
                detail = row["detail"] or ""
                if row["error"]:
                    detail = f"{detail} {row['error']}".strip()
                self.journal.record(
                    machine=f"lane{index}.{row['machine']}",
                    trigger=row["trigger"],
                    source=row["source"],
                    dest=row["dest"],
                    started=row["wall_time"],
                    duration_s=row["duration_s"],
                    outcome=Outcome(row["outcome"]),
                    detail=detail,
                )

    def close(self) -> list[BaseException]:
        """Wait for in-flight reads, close every lane not yet closed, stop the pool."""
        failures: list[BaseException] = []
        for future in self._in_flight:
            try:
                future.result(timeout=self.call_timeout_s or 600.0)
            except BaseException as error:  # already reported by the call that started it
                logger.debug("in-flight lane read ended with %s", error)
        self._in_flight = []
        for index, lane in enumerate(self.lanes):
            if self._cleaned[index]:
                continue
            try:
                lane.close()
                self._cleaned[index] = True
            except LaneFailure as failure:
                failures.append(failure)
            except BaseException as error:
                failures.append(
                    lane_failure(index, f"cleanup failed: {type(error).__name__}: {error}", error)
                )
        self.drain_journals()
        if self._pool is not None:
            try:
                self._pool.shutdown(wait=True)
                self._pool = None
            except BaseException as error:
                failures.append(error)
        return failures


def lane_failure(index: int, message: str, cause: BaseException) -> LaneFailure:
    """A `LaneFailure` naming lane `index` whose `__cause__` is the lane's own error (as
    `raise ... from cause` would set it), so its type and traceback stay readable."""
    failure = LaneFailure(index, message)
    failure.__cause__ = cause
    return failure


def close_all(lanes: Sequence[Lane]) -> list[BaseException]:
    """Close every lane, collecting (not raising) what failed."""
    failures: list[BaseException] = []
    for lane in lanes:
        try:
            lane.close()
        except BaseException as error:
            failures.append(error)
    return failures


def raise_with_lane_failures(failures: Sequence[BaseException]) -> None:
    """Raise the first failure; the others ride along as `lane_failures` and a note."""
    primary = failures[0]
    if len(failures) > 1:
        primary.lane_failures = tuple(failures[1:])  # type: ignore[attr-defined]
        primary.add_note(
            f"{len(failures) - 1} other DP lane(s) failed too: "
            + "; ".join(str(f) for f in failures[1:])
        )
    raise primary

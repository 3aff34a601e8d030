"""A lane group's drain, sleep, staged wake and reload: each stage on every lane, or none.

Why a module of its own: the group's barrier is what stops the data-parallel sleep bugs (an
idle lane's forward while another lane's KV cache is asleep). Each stage is fanned out to
every lane and the group's phase moves only once every lane reached it; the group's own
guards refuse prefill and decode in every phase but SERVING, so no lane is handed work while
any lane sleeps. A lane failure ends the group as every failed group call does (every lane
released, TERMINAL); a reload is checked on every lane before any lane copies a byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from lifecycle import LifecycleHost, Phase, guarded
from lifecycle.host import RELOAD_PHASES, RELOAD_REFUSALS, SLEEP_PHASES, SLEEP_REFUSALS
from lifecycle.phases import AWAKE_PHASES
from runtime.lanes.fanout import LaneFanOut
from runtime.lanes.protocol import Lane, LaneFacts, LaneFailure, RemoteLaneError

T = TypeVar("T")
P = Phase


def _agreed(facts: Sequence[LaneFacts], phase: Phase, stage: str) -> None:
    """Every lane reached `phase` after `stage` (the stage barrier)."""
    behind = [f"lane {i}={f.phase}" for i, f in enumerate(facts) if f.phase != phase.value]
    if behind:
        raise RuntimeError(
            f"DP lanes did not all reach {phase.value} after {stage}: {', '.join(behind)}"
        )


class GroupSleep(LifecycleHost):
    """The fan-out of drain, sleep, wake and reload over a group's lanes."""

    lanes: tuple[Lane, ...]
    _lanes: LaneFanOut
    kv_generation: int

    def _guard(self, operation: str, work: Callable[[], T]) -> T:
        raise NotImplementedError

    @property
    def facts(self) -> tuple[LaneFacts, ...]:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    # -- public calls, each guarded by the group's phase and by its failure policy -------------

    @guarded(P.SERVING, P.DRAINING, P.DRAINED, P.SLEEPING, P.WEIGHTS_AWAKE)
    def drain(self) -> None:
        """Drain every lane (SERVING -> DRAINING -> DRAINED)."""
        self._guard("drain", lambda: LifecycleHost.drain(self))

    @guarded(*SLEEP_PHASES, reasons=SLEEP_REFUSALS)
    def sleep(self, level: int = 1) -> None:
        """Put every lane to sleep at `level` (1 or 2)."""
        self._guard("sleep", lambda: LifecycleHost.sleep(self, level))

    @guarded(P.SLEEPING, P.WEIGHTS_AWAKE, *AWAKE_PHASES)
    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake the named stages on every lane, one stage at a time across the group."""
        self._guard("wake", lambda: LifecycleHost.wake(self, tags))

    @guarded(*RELOAD_PHASES, reasons=RELOAD_REFUSALS)
    def reload_weights(self, source: object) -> None:
        """Check `source` on every lane, then reload every lane in place."""
        self._check_reload_everywhere(source)
        self._guard("reload_weights", lambda: LifecycleHost.reload_weights(self, source))

    def _check_reload_everywhere(self, source: object) -> None:
        """A source any lane refuses is refused here, with that lane's error (no lane copied)."""
        try:
            self._lanes.each("check_reload_source", lambda index: {"source": source})
        except LaneFailure as failure:
            refusal = failure.__cause__
            if isinstance(refusal, RemoteLaneError) and refusal.type_name in (
                "WeightMismatchError",
                "ValueError",
                "TypeError",
            ):
                refusal = ValueError(refusal.remote_message)
            if not isinstance(refusal, ValueError | TypeError):
                raise
            refusal.add_note(f"(DP lane {failure.lane} of {len(self.lanes)})")
            raise refusal from None

    # -- hooks -----------------------------------------------------------------------------------

    def _stage(self, method: str, kwargs: dict[str, object], phase: Phase) -> None:
        self._lanes.each(method, lambda index: dict(kwargs))
        self._refresh()
        _agreed(self.facts, phase, f"{method}({', '.join(map(str, kwargs.values()))})")

    def _do_drain(self) -> str:
        self._stage("drain", {}, P.DRAINED)
        return f"{len(self.lanes)} lanes drained"

    def _do_sleep(self, level: int) -> str:
        self._stage("sleep", {"level": level}, P.SLEEPING)
        live = sum(f.live_allocations for f in self.facts)
        return f"{len(self.lanes)} lanes asleep at level {level}; live allocations {live}"

    def _do_wake_weights(self) -> str:
        self._stage("wake", {"tags": ("weights",)}, P.WEIGHTS_AWAKE)
        return f"{len(self.lanes)} lanes' weights awake"

    def _do_wake_kv_cache(self) -> str:
        self._lanes.each("wake", lambda index: {"tags": ("kv_cache",)})
        self._refresh()
        awake = {P.DRAINED.value, P.SERVING.value}
        behind = [f"lane {i}={f.phase}" for i, f in enumerate(self.facts) if f.phase not in awake]
        if behind:
            raise RuntimeError(f"DP lanes did not all wake their KV cache: {', '.join(behind)}")
        self.kv_generation += 1
        live = sum(f.live_allocations for f in self.facts)
        return f"{len(self.lanes)} lanes' KV caches awake; live allocations {live}"

    def _resume_blocked(self) -> str | None:
        for index, fact in enumerate(self.facts):
            if fact.serving_blocked:
                return f"DP lane {index}: {fact.serving_blocked}"
        return None

    def _prepare_reload(self, source: object) -> object:
        return source

    def _do_reload_weights(self, prepared: object) -> str:
        self._lanes.each("reload_weights", lambda index: {"source": prepared})
        self._refresh()
        return f"{len(self.lanes)} lanes reloaded in place"

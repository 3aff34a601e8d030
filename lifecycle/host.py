"""`LifecycleHost`: the base class model-family executors subclass.

The host owns one phase machine (`lifecycle.phases`). Its public phase methods are guarded
and transactional: a subclass overrides the `_do_*` hooks with the work of each transition
(resolve capacity, seal, allocate, compile, capture, serve, close) and never touches the
machine itself. A hook returns a short detail string for the journal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import ClassVar, TypeVar

from lifecycle.errors import attach_cleanup_failures, left_resources
from lifecycle.journal import Journal
from lifecycle.machine import MachineTable, StateMachine, guard_table, guarded
from lifecycle.phases import AWAKE_PHASES, HOST_TABLE, LIVE_PHASES, START_PHASES, Phase
from lifecycle.sleep_args import check_sleep_level, check_wake_tags

T = TypeVar("T")

P = Phase
_AFTER_START: dict[Enum, str] = {
    phase: "the host has started; start() runs once"
    for phase in LIVE_PHASES
    if phase not in START_PHASES
}
_DRAIN_FIRST = "drain() first: nothing may be in flight"
# Why `sleep` and `reload_weights` are refused where they are (a lane group guards the same).
SLEEP_REFUSALS: Mapping[Enum, str] = {
    P.SERVING: _DRAIN_FIRST,
    P.DRAINING: "drain() has not finished; call drain()",
}
# Where `sleep` and `reload_weights` are legal (a lane group guards its own the same way).
SLEEP_PHASES = (P.DRAINED, P.WEIGHTS_AWAKE, P.SLEEPING)
RELOAD_PHASES = (P.DRAINED, P.WEIGHTS_AWAKE)
RELOAD_REFUSALS: Mapping[Enum, str] = {
    P.SERVING: _DRAIN_FIRST,
    P.SLEEPING: "the weights are asleep: call wake(tags=('weights',)) first",
}
FAULT_ADVICE = (
    "call close(): it retries every release and ends the host (TERMINAL), or leaves it "
    "CLOSING when something still cannot be released (close() again retries); then "
    "construct a new one"
)

logger = logging.getLogger(__name__)


class LifecycleHost:
    """A phase-guarded owner of device resources.

    Phase order: CONSTRUCTED -> CAPACITY_RESOLVED -> SEALED -> ALLOCATED -> COMPILED ->
    (CAPTURED ->) SERVING; `close()` from anywhere reaches TERMINAL, or CLOSING while
    cleanup left resources. Subclasses set `PHASE_TABLE` to a `host_table(next_calls=...)`
    to teach their own onward calls.
    """

    PHASE_TABLE: ClassVar[MachineTable] = HOST_TABLE

    def __init__(
        self,
        *,
        owner_name: str | None = None,
        journal: Journal | None = None,
        table: MachineTable | None = None,
    ) -> None:
        self._lifecycle: StateMachine = (table or self.PHASE_TABLE).build(
            owner=owner_name or type(self).__name__, journal=journal
        )
        self._lifecycle.adjust_next_calls = self._adjust_next_calls

    def _adjust_next_calls(self, state: Enum, calls: tuple[str, ...]) -> tuple[str, ...]:
        """Onward calls that can succeed: no `serve()` while serving is blocked."""
        if state is P.DRAINED and self._resume_blocked():
            return tuple(call for call in calls if call != "serve")
        return calls

    # -- introspection -------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """The current phase."""
        state = self._lifecycle.state
        assert isinstance(state, Phase)
        return state

    @property
    def journal(self) -> Journal:
        """Every transition attempt so far (shared with components built on the same journal)."""
        return self._lifecycle.journal

    @property
    def owner_name(self) -> str:
        """The name used in error messages and journal entries."""
        return self._lifecycle.owner

    @property
    def is_terminal(self) -> bool:
        """Whether the host reached TERMINAL (absorbing)."""
        return self._lifecycle.state is Phase.TERMINAL

    @property
    def next_calls(self) -> tuple[str, ...]:
        """The calls that can succeed from the current phase (what errors and tools print)."""
        return self._lifecycle.next_calls()

    @classmethod
    def guard_table(cls) -> dict[str, frozenset[Phase]]:
        """Operation -> phases where it is legal, for docs, diagrams and property tests."""
        return {
            name: frozenset(Phase(s.value) for s in states)
            for name, states in guard_table(cls).items()
        }

    # -- hooks a subclass overrides --------------------------------------------------------

    def _do_resolve_capacity(self, num_blocks: int | None) -> str:
        """Make physical KV capacity final. Returns a journal detail."""
        return ""

    def _do_seal(self) -> str:
        """Freeze runtime configuration."""
        return ""

    def _do_allocate(self) -> str:
        """Allocate and bind device memory (the paged KV cache)."""
        return ""

    def _do_compile(self) -> str:
        """Compile every configured program (the whole warmup)."""
        return ""

    def _do_capture(self) -> str:
        """Capture traces; after this, nothing new may compile."""
        return ""

    def _do_serve(self) -> str:
        """Last checks before requests may run."""
        return ""

    def _requires_capture(self) -> bool:
        """Whether `serve()` needs `capture()` first (a trace mode other than none)."""
        return False

    def _do_close(self) -> Sequence[BaseException]:
        """Release everything owned, attempting every step; return the failures."""
        return ()

    def _held_resources(self) -> tuple[str, ...]:
        """What components hold that a failed release left behind (empty when nothing)."""
        return ()

    def _do_drain(self) -> str:
        """Complete or retire every in-flight lease and read (admission is already closed)."""
        return ""

    def _do_sleep(self, level: int) -> str:
        """Release traces, programs and the KV cache; move or drop the weights (`level`)."""
        return ""

    def _do_wake_weights(self) -> str:
        """Bring the weights (and every non-weight buffer) back onto the device."""
        return ""

    def _do_wake_kv_cache(self) -> str:
        """Allocate the KV cache, warm up and capture again, as start-up does."""
        return ""

    def _prepare_reload(self, source: object) -> object:
        """Check `source` against the resident weights before any device work."""
        return source

    def _do_reload_weights(self, prepared: object) -> str:
        """Copy checked weights in place."""
        return ""

    def _resume_blocked(self) -> str | None:
        """Why DRAINED may not serve yet (e.g. level-2 weights not reloaded), or None."""
        return None

    # -- faults ----------------------------------------------------------------------------

    def _fault_if_holding(self, operation: str, error: BaseException) -> None:
        """After `operation` failed: move to FAULTED when anything is left unreleased.

        A component that could not release something refuses further work until it is
        cleaned up, so the phase's onward calls would all fail; the host says so by moving to
        FAULTED (only `close()` is legal) and notes the advice on the error.
        """
        held = self._held_resources()
        if self.phase in LIVE_PHASES and (held or left_resources(error)):
            what = ", ".join(held) or "resources its rollback could not release"
            self._lifecycle.fire("fault", detail=f"{operation} failed and left {what}")
        if self.phase is Phase.FAULTED:
            note = f"{self.owner_name} is FAULTED: {FAULT_ADVICE}"
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)

    @contextmanager
    def _faulting(self, operation: str) -> Iterator[None]:
        """Run a guarded call's work; a failure that leaves resources faults the host."""
        try:
            yield
        except BaseException as error:
            self._fault_if_holding(operation, error)
            raise

    def _transact(self, trigger: str, work: Callable[[], T]) -> T:
        with self._faulting(trigger):
            return self._lifecycle.transact(trigger, work, detail=_same_detail)

    # -- guarded phase calls ---------------------------------------------------------------

    @guarded(Phase.CONSTRUCTED)
    def resolve_capacity(self, num_blocks: int | None = None) -> None:
        """CONSTRUCTED -> CAPACITY_RESOLVED."""
        self._transact("resolve_capacity", lambda: self._do_resolve_capacity(num_blocks))

    @guarded(Phase.CAPACITY_RESOLVED)
    def seal(self) -> None:
        """CAPACITY_RESOLVED -> SEALED."""
        self._transact("seal", self._do_seal)

    @guarded(Phase.SEALED)
    def allocate(self) -> None:
        """SEALED -> ALLOCATED."""
        self._transact("allocate", self._do_allocate)

    @guarded(Phase.ALLOCATED)
    def compile(self) -> None:
        """ALLOCATED -> COMPILED."""
        self._transact("compile", self._do_compile)

    @guarded(Phase.COMPILED)
    def capture(self) -> None:
        """COMPILED -> CAPTURED."""
        if not self._requires_capture():
            raise self._lifecycle.refusal(
                "capture",
                {Phase.COMPILED},
                reason="trace mode none has nothing to capture; call serve()",
            )
        self._transact("capture", self._do_capture)

    @guarded(Phase.COMPILED, Phase.CAPTURED, Phase.DRAINED)
    def serve(self) -> None:
        """COMPILED (no traces) or CAPTURED -> SERVING; DRAINED -> SERVING resumes."""
        if self.phase is Phase.COMPILED and self._requires_capture():
            raise self._lifecycle.refusal(
                "serve", {Phase.CAPTURED}, reason="traces must be captured first; call capture()"
            )
        blocked = self._resume_blocked() if self.phase is Phase.DRAINED else None
        if blocked:
            raise self._lifecycle.refusal("serve", {Phase.DRAINED}, reason=blocked)
        self._transact("serve", self._do_serve)

    @guarded(
        *START_PHASES,
        reasons={**_AFTER_START, Phase.SERVING: "the host is already serving; start() runs once"},
    )
    def start(self) -> None:
        """Run every phase from wherever the host is up to SERVING (once: refused after)."""
        if self.phase is Phase.CONSTRUCTED:
            self.resolve_capacity()
        if self.phase is Phase.CAPACITY_RESOLVED:
            self.seal()
        if self.phase is Phase.SEALED:
            self.allocate()
        if self.phase is Phase.ALLOCATED:
            self.compile()
        if self.phase is Phase.COMPILED and self._requires_capture():
            self.capture()
        if self.phase in (Phase.COMPILED, Phase.CAPTURED):
            self.serve()
        if self.phase is not Phase.SERVING:
            raise self._lifecycle.refusal("start", {Phase.SERVING} - {self.phase})

    # -- drain, sleep, wake, reload ------------------------------------------------------------

    @guarded(P.SERVING, P.DRAINING, P.DRAINED, P.SLEEPING, P.WEIGHTS_AWAKE)
    def drain(self) -> None:
        """SERVING -> DRAINING (admission closed) -> DRAINED (in-flight work retired).

        A failed retirement leaves DRAINING, where `drain()` again retries; in DRAINED and
        while asleep there is nothing in flight and the call is a journaled no-op.
        """
        if self.phase not in (P.SERVING, P.DRAINING):
            self._lifecycle.note("drain", f"nothing in flight in {self.phase.name}")
            return
        if self.phase is P.SERVING:
            self._lifecycle.fire("drain", detail="admission closed")
        self._transact("drained", self._do_drain)

    @guarded(*SLEEP_PHASES, reasons=SLEEP_REFUSALS)
    def sleep(self, level: int = 1) -> None:
        """DRAINED or WEIGHTS_AWAKE -> SLEEPING; a no-op (journaled) while SLEEPING.

        Level 1 keeps the weights in host memory; level 2 drops them (`reload_weights`
        after the weights wake). Non-weight buffers are kept at both levels.
        """
        level = check_sleep_level(level)
        if self.phase is P.SLEEPING:
            self._lifecycle.note("sleep", f"already SLEEPING; sleep(level={level}) changes nothing")
            return
        self._transact("sleep", lambda: self._do_sleep(level))

    @guarded(P.SLEEPING, P.WEIGHTS_AWAKE, *AWAKE_PHASES)
    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake the named stages in order: weights (-> WEIGHTS_AWAKE), then the KV cache
        (allocate, warm up, capture: -> DRAINED, then SERVING unless serving is blocked).

        None wakes both. A stage already awake is a journaled no-op.
        """
        wanted = check_wake_tags(tags)
        if self.phase in AWAKE_PHASES:
            self._lifecycle.note("wake", f"already awake in {self.phase.name}")
            return
        if self.phase is P.SLEEPING and "weights" not in wanted:
            raise self._lifecycle.refusal(
                "wake",
                {P.WEIGHTS_AWAKE},
                reason="wake(tags=('kv_cache',)) needs the weights awake first: call "
                "wake(tags=('weights',)) or wake()",
            )
        if self.phase is P.SLEEPING:
            self._transact("wake_weights", self._do_wake_weights)
        elif "weights" in wanted:
            self._lifecycle.note("wake", "the weights are already awake")
        if "kv_cache" in wanted:
            self._transact("wake_kv_cache", self._do_wake_kv_cache)
            self._resume_after_wake()

    def _resume_after_wake(self) -> None:
        blocked = self._resume_blocked()
        if blocked:
            self._lifecycle.note("serve", f"stays DRAINED: {blocked}")
            return
        self._transact("serve", self._do_serve)

    @guarded(*RELOAD_PHASES, reasons=RELOAD_REFUSALS)
    def reload_weights(self, source: object) -> None:
        """Replace the weights in place from `source` (same names, shapes and dtypes).

        Checked before any device work; a mismatch is refused naming the first tensor.
        """
        prepared = self._prepare_reload(source)
        self._transact("reload_weights", lambda: self._do_reload_weights(prepared))

    def close(self) -> None:
        """Release everything; legal in every phase, idempotent once TERMINAL.

        Every cleanup step is attempted. When any failed, the host moves to CLOSING and the
        first failure is raised with the rest attached as `cleanup_failures`; calling
        `close()` again retries what is left.
        """
        if self._lifecycle.state is Phase.TERMINAL:
            return
        clock = time.perf_counter()
        try:
            failures = list(self._do_close())
        except Exception as error:  # a hook that raised instead of collecting
            failures = [error]
        elapsed = time.perf_counter() - clock
        if not failures:
            self._lifecycle.fire("close", detail="all resources released", duration_s=elapsed)
            return
        self._lifecycle.fire(
            "close_incomplete",
            detail=f"{len(failures)} cleanup failure(s); close() again retries",
            duration_s=elapsed,
        )
        logger.warning("%s: cleanup left %d failure(s)", self.owner_name, len(failures))
        primary = failures[0]
        attach_cleanup_failures(primary, failures[1:])
        raise primary

    def cleanup(self) -> None:
        """The seed's name for `close()`."""
        self.close()

    def __enter__(self) -> LifecycleHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _same_detail(detail: object) -> str:
    return str(detail)

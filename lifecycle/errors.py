"""The lifecycle error family.

Every error subclasses a built-in (`RuntimeError` here) so seed-style callers that catch the
built-in keep working, and every message teaches: what was called, where the object is, where
the call is legal and what to call next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn


class LifecycleError(RuntimeError):
    """Base class of every error raised by the lifecycle framework."""


def _call_list(calls: Iterable[str]) -> str:
    return ", ".join(f"{call}()" for call in calls)


class PhaseError(LifecycleError):
    """An operation was called in a phase where it is not legal.

    Raised by guards before any work runs; the object's phase is unchanged.
    """

    def __init__(
        self,
        *,
        owner: str,
        operation: str,
        phase: str,
        legal_phases: Sequence[str],
        next_calls: Sequence[str],
        reason: str | None = None,
    ) -> None:
        self.owner = owner
        self.operation = operation
        self.phase = phase
        self.legal_phases = tuple(legal_phases)
        self.next_calls = tuple(next_calls)
        self.reason = reason
        parts = [f"{operation}() is not legal in {phase}"]
        if reason:
            parts[0] += f": {reason}"
        if self.legal_phases:
            parts.append(f"it is legal in {', '.join(self.legal_phases)}")
        if self.next_calls:
            parts.append(f"next: {_call_list(self.next_calls)}")
        super().__init__(f"{owner}: " + "; ".join(parts))


class TerminalError(PhaseError):
    """A call other than `close()` reached an object that is already terminal."""


class FaultedError(PhaseError):
    """A call reached an object whose failed transition left resources it could not release."""


class TransitionRefused(PhaseError):
    """A trigger was fired from a state that has no such transition."""


CLEANUP_NOTE_PREFIX = "Cleanup also encountered"


def attach_cleanup_failures(
    primary: BaseException, failures: Sequence[BaseException], *, note: str | None = None
) -> BaseException:
    """Record later cleanup failures on the primary error without hiding it.

    Failures accumulate on `primary.cleanup_failures` (a tuple) and a PEP 678 note reads
    "Cleanup also encountered N failure(s)", followed by `note` (context such as which owner
    was cleaning up) when given. `primary` itself and failures already attached are skipped,
    so repeated attachment never duplicates or creates cycles. Returns `primary`.
    """
    existing: tuple[BaseException, ...] = tuple(getattr(primary, "cleanup_failures", ()))
    seen = {id(primary), *(id(failure) for failure in existing)}
    added: list[BaseException] = []
    for failure in failures:
        if id(failure) not in seen:
            seen.add(id(failure))
            added.append(failure)
    if not added:
        return primary
    primary.cleanup_failures = existing + tuple(added)  # type: ignore[attr-defined]
    summary = "; ".join(f"{type(failure).__name__}: {failure}" for failure in added)
    context = f" while {note}" if note else ""
    primary.add_note(f"{CLEANUP_NOTE_PREFIX} {len(added)} failure(s){context}: {summary}")
    return primary


def raise_cleanup_failures(failures: Sequence[BaseException]) -> NoReturn:
    """Raise the first failure with the rest attached as its `cleanup_failures`."""
    if not failures:
        raise ValueError(
            "raise_cleanup_failures needs at least one failure, got an empty sequence; "
            "check for failures before calling it"
        )
    first = failures[0]
    attach_cleanup_failures(first, failures[1:])
    raise first


def left_resources(error: BaseException) -> bool:
    """Whether a failed transition's work left owned resources unreleased.

    Work signals it by raising an error with non-empty `cleanup_failures` (its rollback also
    failed) or with a true `resources_left` attribute.
    """
    return bool(getattr(error, "cleanup_failures", ())) or bool(
        getattr(error, "resources_left", False)
    )

"""The rules that keep a lane group's lanes in step, checked on their facts alone.

After every warmup the lanes must agree on their phase and on the readiness of their
trace-activation barrier; capture is one barrier across lanes, legal only when every lane has
its capture pending. A violation raises before anything is captured.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.lanes.protocol import NO_BARRIER, PENDING, LaneFacts


def check_same_readiness(facts: Sequence[LaneFacts], where: str) -> None:
    """Every lane's barrier is in the same state."""
    states = {f.readiness for f in facts}
    if len(states) > 1:
        listed = ", ".join(f"lane {i}={f.readiness}" for i, f in enumerate(facts))
        raise RuntimeError(
            f"DP lanes have mixed trace activation readiness {where}: {listed}; "
            "nothing was captured"
        )


def agreed_phase_after_warmup(
    facts: Sequence[LaneFacts], operation: str, enable_trace: bool | None
) -> str:
    """The one phase every lane reached after `operation` (traced warmup needs barriers)."""
    if enable_trace and any(f.readiness == NO_BARRIER for f in facts):
        raise RuntimeError("Every DP lane must expose the trace activation barrier")
    check_same_readiness(facts, f"after {operation}")
    phases = {f.phase for f in facts}
    if len(phases) != 1:
        raise RuntimeError(
            f"DP lanes disagree on their phase after {operation}: "
            + ", ".join(f"lane {i}={f.phase}" for i, f in enumerate(facts))
        )
    return phases.pop()


def check_capture_barrier(facts: Sequence[LaneFacts]) -> None:
    """Every lane has its capture pending, so all may capture together."""
    check_same_readiness(facts, "at the capture barrier")
    if facts[0].readiness != PENDING:
        raise RuntimeError(
            f"DP lanes are {facts[0].readiness} at the capture barrier; warm up every traced "
            "operation on every lane first (warmup_prefill() and warmup_decode())"
        )

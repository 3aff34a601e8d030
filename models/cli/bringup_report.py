"""What `bringup` prints: the phase table, the coverage manifest, what a step's journal entries
and counters say, what can be called after a failure, and a `--fault` plan that never fired."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle import PhaseError
from models.cli.errors import one_line

if TYPE_CHECKING:
    from lifecycle.journal import JournalEntry
    from models.cli.executor_view import CliExecutor
    from runtime.warmup_manifest import CoverageManifest


def next_calls(executor: CliExecutor, error: BaseException) -> tuple[str, ...]:
    """What can succeed now: the refusal's list, else the phase's (they agree by design)."""
    if isinstance(error, PhaseError) and error.next_calls:
        return tuple(error.next_calls)
    return tuple(executor.next_calls)


def journal_detail(entries: Sequence[JournalEntry]) -> str:
    """The distinct details of the journal entries one step appended, in order."""
    parts: list[str] = []
    for entry in entries:
        if entry.outcome.value != "ok":
            part = f"{entry.machine}.{entry.trigger} {entry.outcome.value}"
        else:
            part = entry.detail
        if part and part not in parts:
            parts.append(part)
    return "; ".join(parts)


def counts(executor: CliExecutor) -> tuple[int, int]:
    """(programs compiled, traces captured) so far (a lane group reports per-lane journals)."""
    compiler = getattr(executor, "program_compiler", None)
    if compiler is None:
        return 0, 0
    programs = len(compiler.compiled_programs)
    tracer = getattr(executor, "trace_compiler", None)
    return programs, int(tracer.capture_count) if tracer is not None else 0


def count_detail(before: tuple[int, int], after: tuple[int, int]) -> str:
    parts = []
    if after[0] > before[0]:
        parts.append(f"+{after[0] - before[0]} programs compiled")
    if after[1] > before[1]:
        parts.append(f"+{after[1] - before[1]} traces captured")
    return ", ".join(parts)


def print_table(rows: list[tuple[str, str, str]]) -> None:
    header = ("phase", "seconds", "what happened")
    width0 = max(len(header[0]), *(len(r[0]) for r in rows)) if rows else len(header[0])
    width1 = max(len(header[1]), *(len(r[1]) for r in rows)) if rows else len(header[1])
    print(f"{header[0]:<{width0}}  {header[1]:>{width1}}  {header[2]}")
    print(f"{'-' * width0}  {'-' * width1}  {'-' * 13}")
    for phase, seconds, detail in rows:
        print(f"{phase:<{width0}}  {seconds:>{width1}}  {detail}")


def print_manifest(manifest: CoverageManifest | None, coverage_out: str | None) -> None:
    if manifest is None:
        print("coverage manifest: none (warmup did not complete)")
        return
    print(
        f"coverage manifest: {len(manifest.eager_program_signatures)} eager programs, "
        f"{len(manifest.traced_source_program_signatures)} traced programs, "
        f"{len(manifest.trace_signatures)} traces, {len(manifest.aliases)} aliases"
    )
    if coverage_out is not None:
        Path(coverage_out).write_text(manifest.dumps() + "\n", encoding="utf-8")
        print(f"coverage manifest written to {coverage_out}")


def fault_report(executor: CliExecutor, spec: str | None) -> str | None:
    """Say so when a --fault plan never fired (the rehearsal rehearsed nothing)."""
    device = getattr(executor, "device", None)  # a lane group's devices live in its lanes
    if spec is None or device is None or int(getattr(device, "injected_total", 1)):
        return None
    calls = ", ".join(f"{op} x{n}" for op, n in device.attempts.items() if n)
    return (
        f"--fault {spec} never fired: nothing was rehearsed (device calls made: "
        f"{calls or 'none'}); choose a call number within these counts"
    )


def print_failure(executor: CliExecutor, step: str, cause: BaseException) -> None:
    """The failed step, its notes and the calls that can succeed now."""
    print()
    what = "INTERRUPTED" if isinstance(cause, KeyboardInterrupt) else "FAILED"
    print(f"{what} in {step} (phase {executor.phase}): {type(cause).__name__}: {one_line(cause)}")
    for note in getattr(cause, "__notes__", ()):
        print(f"  note: {one_line(note)}")
    calls = next_calls(executor, cause)
    print(f"legal next calls: {', '.join(f'{c}()' for c in calls) or 'none'}")

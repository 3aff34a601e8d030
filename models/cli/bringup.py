"""`llm-runtime bringup`: every lifecycle phase one call at a time, timed, then the table, the
coverage manifest and the journal (`models.cli.bringup_report`); `--fault` rehearses failures.

A failed step stops the walk; close() is then retried (twice) so the report says whether
resources are still held.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from models.cli.bringup_cycles import CycleRecord, cycle_steps
from models.cli.bringup_report import (
    count_detail,
    counts,
    fault_report,
    journal_detail,
    print_failure,
    print_manifest,
    print_table,
)
from models.cli.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    one_line,
    print_error,
)
from models.cli.loading import (
    check_lane_arguments,
    close_progress,
    load_from_args,
    progress_from_args,
)

if TYPE_CHECKING:
    from lifecycle.journal import JournalEntry
    from models.cli.executor_view import CliExecutor
    from runtime.warmup_manifest import CoverageManifest

logger = logging.getLogger(__name__)

BRINGUP_PROMPT = "The lifecycle of an executor"

Step = tuple[str, Callable[[], object]]
Row = tuple[str, str, str]


def bringup(args: argparse.Namespace) -> int:
    """Check the arguments, load, walk the phases and print what happened."""
    _check_bringup_arguments(args)
    progress = progress_from_args(args)
    executor = load_from_args(args, progress, faults=args.fault)
    if args.num_blocks is not None:
        _check_kv_memory(executor, args.num_blocks)
    record = CycleRecord()
    rows, manifest, failure = _run_steps(executor, _steps(executor, args, record))
    close_progress(progress)
    print_table(rows)
    print()
    if args.cycle and failure is None:
        print(record.summary())
        problem = record.verdict()
        if problem is not None:
            failure = ("cycles", RuntimeError(problem))
        print()
    print_manifest(manifest, args.coverage_out)
    if failure is not None:
        print_failure(executor, *failure)
        _close_after_failure(executor)
    unfired = fault_report(executor, args.fault)
    if unfired is not None:
        print()
        print(unfired)
    print()
    print("journal:")
    print(executor.journal.format())
    if unfired is not None:
        logger.warning("%s", unfired)
    if failure is not None and isinstance(failure[1], KeyboardInterrupt):
        print_error(f"interrupted in {failure[0]}: the steps before it are printed above")
        return EXIT_INTERRUPTED
    if failure is not None:
        print_error(f"bring-up failed in {failure[0]}: {failure[1]}")
        return EXIT_FAILURE
    return EXIT_OK


def _check_bringup_arguments(args: argparse.Namespace) -> None:
    from runtime.backends.faults import FaultPlan

    if args.fault is not None:
        try:
            FaultPlan.parse(args.fault)
        except ValueError as error:
            raise UsageError(f"--fault: {one_line(error)}") from error
    _check_output_path("--coverage-out", args.coverage_out)
    check_lane_arguments(args)


def _check_output_path(flag: str, value: str | None) -> None:
    """An output file's folder must exist and be writable (checked before any work)."""
    if value is None:
        return
    path = Path(value)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {value!r} is a directory; give a file path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {value!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {value!r}: folder {str(folder)!r} is not writable")


def _check_kv_memory(executor: CliExecutor, blocks: int) -> None:
    from models.executor import KVCapacityError

    check = getattr(executor, "check_kv_memory", None)
    if check is None:
        return  # a lane group: each lane checks its own pool in resolve_capacity
    try:
        check(blocks)
    except KVCapacityError as error:
        executor.close()
        raise UsageError(f"--num-blocks {blocks}: {one_line(error)}") from error


def _steps(executor: CliExecutor, args: argparse.Namespace, record: CycleRecord) -> list[Step]:
    """The phase calls in lifecycle order (capture only for a traced executor), then the
    request, `--cycle` sleep/wake cycles and close."""
    from runtime.config import TraceConfig

    num_blocks = args.num_blocks

    def request() -> str:
        text = _bringup_request(executor)
        if not record.outputs:
            record.outputs.append(text)
        return text

    steps: list[Step] = [
        ("resolve_capacity", lambda: executor.resolve_capacity(num_blocks)),
        ("seal", executor.seal),
        ("allocate", executor.allocate),
        ("warmup_prefill", executor.warmup_prefill),
        ("warmup_decode", executor.warmup_decode),
    ]
    if TraceConfig.of(executor.trace_mode).enabled:
        steps.append(("capture", executor.capture))
    steps.append(("serve", executor.serve))
    steps.append(("request", request))
    steps += cycle_steps(
        executor,
        cycles=args.cycle,
        level=args.sleep_level,
        source=args.model,
        request=lambda: _bringup_request(executor),
        record=record,
    )
    steps.append(("close", executor.close))
    return steps


def _bringup_request(executor: CliExecutor) -> str:
    from models.generation.generator import Generator
    from models.generation.params import GenerationParams

    generator = Generator(executor)
    completion = generator.generate([BRINGUP_PROMPT], GenerationParams(max_new_tokens=4))[0]
    stats = generator.last_stats
    return (
        f"prefill {stats.prefill_tokens} tokens, decoded {stats.decode_tokens} tokens "
        f"({completion.finish_reason}): {completion.text!r}"
    )


def _run_steps(
    executor: CliExecutor, steps: list[Step]
) -> tuple[list[Row], CoverageManifest | None, tuple[str, BaseException] | None]:
    """Time each step with what its journal entries and counters say; stop at a failure.

    Returns the table rows, the coverage manifest (read just before close) and the failure.
    """
    rows: list[Row] = []
    manifest: CoverageManifest | None = None
    for name, call in steps:
        if name == "close":
            manifest = executor.coverage_manifest
            memory = getattr(executor, "memory_summary", None)
            if callable(memory):
                rows.append(("resident", "", str(memory())))
        before = len(executor.journal)
        counted = counts(executor)
        clock = time.perf_counter()
        try:
            result = call()
        except (Exception, KeyboardInterrupt) as error:
            seconds = time.perf_counter() - clock
            detail = journal_detail(_step_entries(executor, name, before))
            what = "INTERRUPTED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            rows.append((name, f"{seconds:.3f}", f"{what}: {one_line(error)} {detail}".strip()))
            return rows, manifest, (name, error)
        seconds = time.perf_counter() - clock
        parts = (
            count_detail(counted, counts(executor)) if name != "close" else "",
            journal_detail(_step_entries(executor, name, before)),
            result if isinstance(result, str) else "",
        )
        rows.append((name, f"{seconds:.3f}", "; ".join(p for p in parts if p)))
    return rows, manifest, None


def _step_entries(executor: CliExecutor, name: str, before: int) -> list[JournalEntry]:
    """The journal entries of one step; a cycle step (`wake #2`) keeps the host's own and,
    in a lane group, each lane host's (`lane0.DecoderExecutor`), whose details carry the bytes
    released and restored (not every warmup case)."""
    entries = list(executor.journal.entries[before:])
    if "#" in name:
        owner = executor.owner_name
        entries = [
            e
            for e in entries
            if e.machine == owner or (e.machine.startswith("lane") and e.machine.count(".") == 1)
        ]
    return entries


def _close_after_failure(executor: CliExecutor) -> None:
    """Close up to twice, printing what each attempt left (a retry may free the rest)."""
    for attempt in (1, 2):
        if executor.is_terminal:
            break
        try:
            executor.close()
            print(f"close() attempt {attempt}: ok, phase {executor.phase}")
        except Exception as close_error:
            left = getattr(close_error, "cleanup_failures", ())
            print(
                f"close() attempt {attempt} left {1 + len(left)} cleanup failure(s), "
                f"phase {executor.phase}: {one_line(close_error)}"
            )
            for extra in left:
                print(f"  also: {type(extra).__name__}: {one_line(extra)}")
    if not executor.is_terminal:
        print(f"resources are still held (phase {executor.phase}); close() again retries")

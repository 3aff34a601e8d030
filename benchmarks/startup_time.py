"""Start-up seconds of the README's Python example: `load_executor(...).start()` by phase.

Run: `.venv/bin/python benchmarks/startup_time.py --model smollm2-135m --trace decode_only`.
Prints one JSON line: load seconds, `start()` seconds, the journal's seconds per phase
(ALLOCATED, COMPILED = warmup, CAPTURED = trace capture), program, trace and capture counts,
the seconds spent deriving coverage and compiling cases, and the slowest warmup cases from
the journal's per-case entries (where start-up time goes). Compare commits by running it on
each, one after the other, under `flock /tmp/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import time

from models import load_executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trace", choices=("none", "decode_only", "all"), default="decode_only")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--top", type=int, default=8, help="slowest warmup cases to list")
    args = parser.parse_args()
    started = time.perf_counter()
    executor = load_executor(args.model, trace_mode=args.trace, max_batch_size=args.max_batch)
    loaded = time.perf_counter()
    executor.start()
    ready = time.perf_counter()
    journal = executor.journal
    cases = sorted(
        (e for e in journal.entries if e.machine.endswith(".warmup")), key=lambda e: -e.duration_s
    )
    phases = journal.durations_by_dest(executor.owner_name)
    tracer = executor.trace_compiler
    derived = executor.warmup.derivation_seconds
    report = {
        "model": args.model,
        "trace": args.trace,
        "load_s": round(loaded - started, 2),
        "start_s": round(ready - loaded, 2),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "derive_coverage_s": round(derived, 2),
        "compile_cases_s": round(sum(e.duration_s for e in cases), 2),
        "cases": len(cases),
        "programs": len(executor.program_compiler.compiled_programs),
        "shared_compile_forwards": executor.prefill_runtime.shared_compile_forwards,
        "traces": tracer.trace_count if tracer else 0,
        "captures": tracer.capture_count if tracer else 0,
        "slowest_cases": [[round(e.duration_s, 2), e.detail] for e in cases[: args.top]],
    }
    executor.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()

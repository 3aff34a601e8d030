"""What paging costs a decode step's K/V reads, with no math: each access pattern's time
against a sequential read of the same bytes in the same round (issue 25, item 3).

Run: `python benchmarks/kv_read_patterns.py [--rounds N] [--pause S] [--threads N] [--json
FILE]` (about a minute at the defaults). Needs a C compiler (`CC`, `cc` or `gcc`), as the
native kernels do.

Method: `kv_read_patterns.c`, built here as the native kernels are (`-O3 -march=native
-fopenmp`), lays out the batch-32 case of `decode_step_breakdown.py` (32 rows of 48-520 keys,
SmolLM2's 30 layers of 3 KV heads of 64 float32, K and V caches on transparent huge pages)
and reads it as the attention kernel's page walk does (rows longest first, shared
dynamically by the threads; per page and head the keys and values side by side), in several
page orders, and once as one sequential stream per thread, its lines added into a float
vector (the floor of item 3: the fastest C loop measured, 0.98-1.0x of `torch.sum` over the
same huge pages). Each pattern is timed right after a sequential read, as a pair; the report
is each pattern's median time over its pairs' sequential reads. On shared hosts the read
rate is bimodal (on the Zen 4 VMs of this project: 28-36 or 47-62 GB/s, switching within
seconds to minutes, and every rate between), so the pairs are also reported by thirds of
their sequential rates, where those spread: the fast mode's ratios apart from the slow one's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.cli.argument_types import (
    non_negative_int,
    number_between,
    positive_int,
    writable_file,
)
from models.cli.main import _silence_stdout
from runtime.backends.cpu_features import CpuFeatures

SOURCE = Path(__file__).with_name("kv_read_patterns.c")
# The case's shape (SmolLM2-135M's batch-32 step).
CASE_FIELDS = ("rows", "min_keys", "max_keys", "layers", "kv_heads", "head_dim")
CASE = (32, 48, 520, 30, 3, 64)
# Sequential rates further apart than this (fastest over slowest of two groups) are two
# memory modes of the host, reported apart.
MODE_GAP = 1.25


def build(directory: Path) -> Path:
    """The pattern reader, compiled into `directory` (SystemExit naming the compiler on failure)."""
    from runtime.backends import native_kernels

    compiler = native_kernels.c_compiler()
    binary = directory / "kv_read_patterns"
    command = [compiler, "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"compiling {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr}")
    return binary


def run(
    binary: Path, rounds: int, threads: int, case: tuple[int, ...], seed: int, pause: float
) -> dict[str, object]:
    """The reader's rounds: `{"step_bytes", "patterns", "rounds"}`, each round a list of
    `[sequential GB/s, pattern time / sequential time]` pairs, one per pattern."""
    command = [str(binary), str(rounds), str(threads), *map(str, case), str(seed)]
    command.append(str(round(pause * 1000)))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{binary.name} failed: {result.stderr.strip()}")
    header, *lines = result.stdout.splitlines()
    report: dict[str, object] = json.loads(header)
    timed = []
    for line in lines:
        fields = [float(field) for field in line.split()]
        timed.append([fields[i : i + 2] for i in range(0, len(fields), 2)])
    report["rounds"] = timed
    return report


def modes(rates: list[float]) -> list[list[int]]:
    """Indices of `rates` by read mode, slowest first: where the rates spread wider than
    MODE_GAP (fastest over slowest), their slowest, middle and fastest thirds; else one group.
    (Thirds, not a split at a gap: on these hosts the rate also takes every value between
    its two modes.)"""
    order = sorted(range(len(rates)), key=rates.__getitem__)
    if len(order) < 3 or rates[order[-1]] < MODE_GAP * rates[order[0]]:
        return [order]
    third = len(order) / 3
    return [order[round(i * third) : round((i + 1) * third)] for i in range(3)]


class Mode(TypedDict):
    """One read mode's pairs: their sequential rates, and per pattern its pairs and median."""

    sequential_gb_s: list[float]
    pairs: dict[str, int]
    median_ratio: dict[str, float]


def summary(report: dict[str, object]) -> list[Mode]:
    """Per read mode: each pattern's pairs there, their sequential rates and median ratio."""
    rounds = report["rounds"]
    patterns = report["patterns"]
    assert isinstance(rounds, list) and isinstance(patterns, list)
    pairs = [(j, rate, ratio) for pairs in rounds for j, (rate, ratio) in enumerate(pairs)]
    groups: list[Mode] = []
    for members in modes([rate for _, rate, _ in pairs]):
        rates = [pairs[i][1] for i in members]
        by_pattern: dict[str, list[float]] = {name: [] for name in patterns}
        for i in members:
            by_pattern[patterns[pairs[i][0]]].append(pairs[i][2])
        groups.append(
            {
                "sequential_gb_s": [min(rates), max(rates)],
                "pairs": {name: len(ratios) for name, ratios in by_pattern.items()},
                "median_ratio": {
                    name: statistics.median(ratios) for name, ratios in by_pattern.items() if ratios
                },
            }
        )
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=30)
    parser.add_argument(
        "--pause",
        type=number_between(0.0, 60.0, "seconds"),
        default=1.0,
        help="seconds between rounds, so that they sample the host's memory modes (default 1)",
    )
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the rows' key counts"
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=CASE[3],
        help="layers of K/V read a step (default 30: 405 MB; fewer for a quick look)",
    )
    parser.add_argument(
        "--json", type=writable_file, default=None, help="also write the numbers to this file"
    )
    args = parser.parse_args(argv)
    case = (*CASE[:3], args.layers, *CASE[4:])
    with tempfile.TemporaryDirectory() as scratch:
        binary = build(Path(scratch))
        report = run(binary, args.rounds, args.threads, case, args.seed, args.pause)
    groups = summary(report)
    patterns, step_bytes = report["patterns"], report["step_bytes"]
    assert isinstance(patterns, list) and isinstance(step_bytes, int)
    print(f"K/V a step: {step_bytes / 1e6:.0f} MB, {args.threads} threads")
    for group in groups:
        low, high = group["sequential_gb_s"]
        print(f"\nsequential read {low:.1f}-{high:.1f} GB/s; time over it, median of its pairs:")
        for name, ratio in group["median_ratio"].items():
            print(f"  {ratio:5.2f}x  {name} ({group['pairs'][name]} pairs)")
    if args.json is not None:
        document = {
            "cpu": CpuFeatures.probe().summary(),
            "threads": args.threads,
            "case": dict(zip(CASE_FIELDS, case, strict=True)),
            "load_average": os.getloadavg(),
            **report,
            "modes": groups,
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("kv_read_patterns.py: interrupted, nothing written", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:
        _silence_stdout()

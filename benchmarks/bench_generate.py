"""Generation throughput of this runtime's `Generator` against Hugging Face transformers `generate`.

`python benchmarks/bench_generate.py [ARGS]` is `llm-runtime bench [ARGS]`; the benchmark
itself (method, engines, report) lives in the package, `models/benchmark/`, so the installed
command never loads files from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # direct runs: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The names the comparison scripts (vllm_compare.py, llama_cpp_compare.py) read from here.
from models.benchmark import (
    BenchConfig,
    BenchUsageError,
    RunTimes,
    bench_batch,
    bench_lanes,
    format_report,
    format_row,
    load_transformers,
    make_prompts,
    run_benchmark,
)
from models.benchmark import hf_run as _hf_run
from models.benchmark import runtime_executor as _runtime_executor
from models.benchmark import runtime_run as _runtime_run
from models.generation import GenerationParams, Generator

__all__ = [
    "BenchConfig",
    "BenchUsageError",
    "GenerationParams",
    "Generator",
    "RunTimes",
    "_hf_run",
    "_runtime_executor",
    "_runtime_run",
    "bench_batch",
    "bench_lanes",
    "format_report",
    "format_row",
    "load_transformers",
    "make_prompts",
    "run_benchmark",
]

if __name__ == "__main__":
    from models.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))

"""Sleep and wake seconds against the cold start-up, in one process (issue 24's measure).

Run: `.venv/bin/python benchmarks/sleep_wake.py [--model smollm2-135m] [--json OUT]`.
For each trace mode (`none`, `decode_only` by default): the cold start-up (`load_executor`
then `start()`), a greedy generation, then a level-1 cycle (`drain`, `sleep(1)`, `wake()`)
and a level-2 cycle (`drain`, `sleep(2)`, `wake(("weights",))`, `reload_weights(model)`,
`wake(("kv_cache",))`), each step timed, the device's live allocations while asleep, and
whether the tokens after each cycle equal those before. The target is a full `wake()` in
under 25% of the cold start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models import load_executor
from models.generation import GenerationParams, Generator
from runtime.backends.cpu_features import CpuFeatures

PROMPTS = ["The three primary colours are", "Once upon a time", "def fibonacci(n):"]


def _timed(call: Callable[[], object]) -> float:
    clock = time.perf_counter()
    call()
    return round(time.perf_counter() - clock, 3)


def _tokens(executor: object, new_tokens: int) -> list[tuple[int, ...]]:
    params = GenerationParams(max_new_tokens=new_tokens)
    return [c.token_ids for c in Generator(executor).generate(PROMPTS, params)]  # type: ignore[arg-type]


def measure(model: str, trace: str, max_batch: int, new_tokens: int) -> dict[str, object]:
    """One trace mode: cold start, then a level-1 and a level-2 cycle."""
    clock = time.perf_counter()
    executor = load_executor(model, trace_mode=trace, max_batch_size=max_batch)
    executor.start()
    cold = round(time.perf_counter() - clock, 3)
    before = _tokens(executor, new_tokens)
    row: dict[str, object] = {"trace": trace, "cold_start_s": cold}
    try:
        row["level1"] = {
            "drain_s": _timed(executor.drain),
            "sleep_s": _timed(lambda: executor.sleep(1)),
            "live_allocations_asleep": int(executor.device.live_allocations),
            "wake_s": _timed(executor.wake),
            "same_tokens": _tokens(executor, new_tokens) == before,
        }
        row["level2"] = {
            "drain_s": _timed(executor.drain),
            "sleep_s": _timed(lambda: executor.sleep(2)),
            "live_allocations_asleep": int(executor.device.live_allocations),
            "wake_weights_s": _timed(lambda: executor.wake(("weights",))),
            "reload_s": _timed(lambda: executor.reload_weights(model)),
            "wake_kv_cache_s": _timed(lambda: executor.wake(("kv_cache",))),
            "same_tokens": _tokens(executor, new_tokens) == before,
        }
    finally:
        executor.close()
    level1 = row["level1"]
    assert isinstance(level1, dict)
    row["wake_over_cold_start"] = round(level1["wake_s"] / cold, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trace", nargs="+", default=["none", "decode_only"])
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {
        "model": args.model,
        "cpu": CpuFeatures.probe().summary(),
        "threads": args.threads,
        "load_average_start": os.getloadavg(),
        "rows": [measure(args.model, t, args.max_batch, args.new_tokens) for t in args.trace],
        "load_average_end": os.getloadavg(),
    }
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

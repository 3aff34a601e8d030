"""This runtime's side of the benchmark: an executor sized to one batch, and one timed run."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol, TypeVar

import attrs

from models.benchmark.config import BenchConfig, BenchUsageError
from models.generation.generator import GenerationExecutor, Generator
from models.generation.params import GenerationParams


class BenchExecutor(GenerationExecutor, Protocol):
    """What the benchmark calls on the executor it generates with, besides generation."""

    def resolve_capacity(self, num_blocks: int | None = None) -> None: ...

    def start(self) -> None: ...

    def close(self) -> None: ...


class BenchLaneGroup(BenchExecutor, Protocol):
    """A lane group: it also counts its host bookkeeping per decode step."""

    def reset_step_counters(self) -> None: ...

    def runtime_summary(self) -> Mapping[str, int | float]: ...


ExecutorT = TypeVar("ExecutorT", bound=BenchExecutor)


def runtime_executor(config: BenchConfig, batch: int) -> BenchExecutor:
    """One lane of `batch` slots, started (SERVING) with its KV pool sized to the prompts."""
    from models import load_executor

    with _usage_errors():
        executor: BenchExecutor = load_executor(config.model, **_load_options(config, batch, 1))
    return _started(executor)


def runtime_lane_group(config: BenchConfig, batch: int) -> BenchLaneGroup:
    """`config.lanes` lanes of `batch / lanes` slots together, started (SERVING)."""
    from models import load_executor

    options = _load_options(config, batch, config.lanes)
    with _usage_errors():
        group: BenchLaneGroup = load_executor(config.model, **options)
    return _started(group)


def _load_options(config: BenchConfig, batch: int, lanes: int) -> dict[str, object]:
    """`load_executor`'s arguments for `lanes` lanes holding `batch` rows in all."""
    longest = config.prompt_len[1] + config.new_tokens
    block = config.block_size
    per_request = -(-longest // block)
    options: dict[str, object] = {
        "device": config.device,
        "dtype": config.dtype,
        "weights": config.weights,
        "trace_mode": config.trace_mode,
        "block_size": block,
        "max_batch_size": batch,
        "max_prefill_chunk_size": config.prefill_chunk,
        "max_seq_len": per_request * block,
        # Per lane; warmup prefills a whole chunk (plus one block) into one row.
        "num_blocks": max(-(-config.prefill_chunk // block) + 1, batch // lanes * per_request),
        "kernels": config.kernels,
    }
    if lanes > 1:
        options["lanes"] = lanes
        options["lane_transport"] = config.lane_transport
        options["threads_per_lane"] = (
            config.threads_per_lane if config.lane_transport == "process" else None
        )
    return options


@contextmanager
def _usage_errors() -> Iterator[None]:
    """A missing model or a refused argument is the user's error (exit 2)."""
    from models.decoder.sources import ModelNotAvailableError

    try:
        yield
    except (ModelNotAvailableError, ValueError) as error:
        raise BenchUsageError(str(error)) from error


def _started(executor: ExecutorT) -> ExecutorT:
    executor.resolve_capacity()  # num_blocks above: KV blocks per lane
    executor.start()
    return executor


@attrs.frozen
class RunTimes:
    """One timed generation: decode-only seconds and wall seconds of the whole call."""

    decode_seconds: float
    total_seconds: float


def runtime_run(generator: Generator, prompts: list[list[int]], new_tokens: int) -> RunTimes:
    """One timed generation: decode seconds (the Generator's step counter) and wall seconds."""
    params = GenerationParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    completions = generator.generate(prompts, params)
    total = time.perf_counter() - start
    produced = {len(c.token_ids) for c in completions}
    if produced != {new_tokens}:
        raise RuntimeError(f"expected {new_tokens} tokens per row, got lengths {produced}")
    stats = generator.last_stats
    if stats.decode_steps != new_tokens - 1 or stats.preemptions:
        raise RuntimeError(
            f"expected {new_tokens - 1} decode steps without preemption, got "
            f"{stats.decode_steps} steps and {stats.preemptions} preemptions"
        )
    return RunTimes(decode_seconds=stats.decode_seconds, total_seconds=total)

"""This runtime's side of the benchmark: an executor sized to one batch, and one timed run."""

from __future__ import annotations

import time
from typing import Any

import attrs

from models.benchmark.config import BenchConfig, BenchUsageError
from models.generation.generator import Generator
from models.generation.params import GenerationParams


def runtime_executor(config: BenchConfig, batch: int, *, lanes: int = 1) -> Any:
    from models import load_executor
    from models.llama.sources import ModelNotAvailableError

    longest = config.prompt_len[1] + config.new_tokens
    block = config.block_size
    per_request = -(-longest // block)
    try:
        executor = load_executor(
            config.model,
            device=config.device,
            dtype=config.dtype,
            trace_mode=config.trace_mode,
            block_size=block,
            max_batch_size=batch,
            max_prefill_chunk_size=config.prefill_chunk,
            max_seq_len=per_request * block,
            # Per lane; warmup prefills a whole chunk (plus one block) into one row.
            num_blocks=max(-(-config.prefill_chunk // block) + 1, batch // lanes * per_request),
            kernels=config.kernels,
            **(
                {
                    "lanes": lanes,
                    "lane_transport": config.lane_transport,
                    "threads_per_lane": config.threads_per_lane
                    if config.lane_transport == "process"
                    else None,
                }
                if lanes > 1
                else {}
            ),
        )
    except (ModelNotAvailableError, ValueError) as error:
        raise BenchUsageError(str(error)) from error
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

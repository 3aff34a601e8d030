"""The measurement: per batch size, the engines alternate over the repeats; best rates win."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from models.benchmark.config import BenchConfig, BenchUsageError, make_prompts
from models.benchmark.report import (
    AnchorRates,
    BenchReport,
    BenchRow,
    EngineRates,
    LaneGroupRates,
    LaneRates,
    format_row,
)
from models.benchmark.runtime_engine import (
    BenchExecutor,
    BenchLaneGroup,
    RunTimes,
    runtime_executor,
    runtime_lane_group,
    runtime_run,
)
from models.benchmark.transformers_engine import hf_run, load_transformers
from models.generation.generator import Generator
from runtime.backends.cpu_features import CpuFeatures

if TYPE_CHECKING:
    from transformers.generation.utils import GenerationMixin

logger = logging.getLogger(__name__)

Log = Callable[[str], None]


def bench_batch(config: BenchConfig, batch: int, hf: GenerationMixin | None, log: Log) -> BenchRow:
    """One batch size: our lane of `batch` slots and (optionally) transformers, alternating."""
    if config.lanes > 1:
        return bench_lanes(config, batch, log)
    log(f"batch {batch}: loading the model and warming up a lane of {batch} slot(s)")
    clock = time.perf_counter()
    executor = runtime_executor(config, batch)
    try:
        prompts = make_prompts(config, batch, _vocab_size(executor))
        generator = Generator(executor, enable_prefix_cache=False)
        runtime_run(generator, prompts, 2)  # compiles every shape this batch uses
        log(f"batch {batch}: ready in {time.perf_counter() - clock:.1f} s")
        # One warm 2-token run per engine times a prefill and a decode step: the estimate.
        estimate = _estimate_run(runtime_run(generator, prompts, 2), config.new_tokens)
        if hf is not None:
            hf_run(hf, prompts, 2, pad=0)
            estimate += _estimate_run(hf_run(hf, prompts, 2, pad=0), config.new_tokens)
        log(
            f"batch {batch}: measuring {config.repeats} repeat(s) of {config.new_tokens} "
            f"tokens x {batch} row(s){' per engine' if hf is not None else ''} "
            f"(estimated {config.repeats * estimate:.1f} s)"
        )
        ours: list[RunTimes] = []
        theirs: list[RunTimes] = []
        for repeat in range(config.repeats):
            log(f"batch {batch}: repeat {repeat + 1}/{config.repeats}")
            ours.append(runtime_run(generator, prompts, config.new_tokens))
            if hf is not None:
                theirs.append(hf_run(hf, prompts, config.new_tokens, pad=0))
        runtime: LaneRates = {
            **_rates(ours, batch, config.new_tokens),
            "prefill_seconds": generator.last_stats.prefill_seconds,
            "kernels": getattr(getattr(executor, "warmup", None), "kernel_choice", None),
        }
        row = _row(batch, prompts, config.new_tokens, runtime)
        if hf is not None:
            other = _rates(theirs, batch, config.new_tokens)
            row["transformers"] = other
            mine = runtime
            # `ratio` is the decode-only ratio (the original metric, kept under its name).
            row["ratio"] = mine["decode_tokens_per_second"] / other["decode_tokens_per_second"]
            row["end_to_end_ratio"] = (
                mine["end_to_end_tokens_per_second"] / other["end_to_end_tokens_per_second"]
            )
        return row
    finally:
        executor.close()


def bench_lanes(config: BenchConfig, batch: int, log: Log) -> BenchRow:
    """One batch size: N lanes of batch/N slots against one lane of `batch` slots."""
    threads = config.lanes * (config.threads_per_lane or 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the anchor lane gets every thread the lanes get together
    anchor = runtime_executor(config, batch)
    group: BenchLaneGroup | None = None
    try:
        group = runtime_lane_group(config, batch)
        prompts = make_prompts(config, batch, _vocab_size(anchor))
        one = Generator(anchor, enable_prefix_cache=False)
        many = Generator(group, enable_prefix_cache=False)
        runtime_run(one, prompts, 2)
        runtime_run(many, prompts, 2)
        ours: list[RunTimes] = []
        lanes: list[RunTimes] = []
        overhead: list[Mapping[str, int | float]] = []
        for repeat in range(config.repeats):
            log(f"batch {batch}: repeat {repeat + 1}/{config.repeats}")
            ours.append(runtime_run(one, prompts, config.new_tokens))
            group.reset_step_counters()
            lanes.append(runtime_run(many, prompts, config.new_tokens))
            overhead.append(group.runtime_summary())
        mine: AnchorRates = {**_rates(ours, batch, config.new_tokens), "torch_threads": threads}
        theirs: LaneGroupRates = {
            **_rates(lanes, batch, config.new_tokens),
            "lanes": config.lanes,
            "lane_transport": config.lane_transport,
            "threads_per_lane": config.threads_per_lane or 1,
            "per_decode_step": overhead,
        }
        row = _row(batch, prompts, config.new_tokens, mine)
        row["lane_group"] = theirs
        row["lanes_ratio"] = theirs["decode_tokens_per_second"] / mine["decode_tokens_per_second"]
        row["lanes_end_to_end_ratio"] = (
            theirs["end_to_end_tokens_per_second"] / mine["end_to_end_tokens_per_second"]
        )
        return row
    finally:
        if group is not None:
            group.close()
        anchor.close()
        torch.set_num_threads(previous)


def _row(
    batch: int, prompts: list[list[int]], new_tokens: int, runtime: LaneRates | AnchorRates
) -> BenchRow:
    """A report row: the batch, its prompt lengths, the tokens per row and our rates."""
    lengths = [len(p) for p in prompts]
    return {
        "batch_size": batch,
        "prompt_len_min": min(lengths),
        "prompt_len_max": max(lengths),
        "prompt_len_mean": sum(lengths) / len(lengths),
        "new_tokens": new_tokens,
        "runtime": runtime,
    }


def _vocab_size(executor: BenchExecutor) -> int:
    vocab = executor.model.vocab_size
    if vocab is None:
        raise RuntimeError("the executor's model does not report its vocabulary size")
    return int(vocab)


def _estimate_run(two_tokens: RunTimes, new_tokens: int) -> float:
    """Seconds one run of `new_tokens` should take, from a timed 2-token run."""
    step = two_tokens.decode_seconds
    return max(0.0, two_tokens.total_seconds - step) + step * (new_tokens - 1)


def _rates(runs: list[RunTimes], batch: int, new_tokens: int) -> EngineRates:
    """Per-run seconds and the best decode-only and end-to-end rates (tokens/s) of one engine."""
    decode = [run.decode_seconds for run in runs]
    total = [run.total_seconds for run in runs]
    return {
        "decode_seconds": decode,
        "decode_tokens_per_second": batch * (new_tokens - 1) / min(decode),
        "total_seconds": total,
        "end_to_end_tokens_per_second": batch * new_tokens / min(total),
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def run_benchmark(config: BenchConfig, *, log: Log | None = None) -> BenchReport:
    """Measure every batch size; returns a JSON-ready report."""
    config.check()
    say = log or (lambda message: logger.info("%s", message))
    from models.decoder.sources import ModelNotAvailableError, resolve_source

    try:
        resolve_source(config.model)
    except ModelNotAvailableError as error:
        raise BenchUsageError(str(error)) from error
    except ValueError as error:
        raise BenchUsageError(f"--model {config.model}: {error}") from error
    say(
        f"bench: {len(config.batch_sizes)} batch size(s) {list(config.batch_sizes)}, "
        f"{config.repeats} repeat(s) each; every phase is announced with its estimated length"
    )
    hf: GenerationMixin | None = None
    if config.compare:
        say("loading transformers' model (--compare transformers)")
        hf = load_transformers(config.model, config.dtype)
    results: list[BenchRow] = []
    load_start = os.getloadavg()
    for batch in config.batch_sizes:
        row = bench_batch(config, batch, hf, say)
        results.append(row)
        say(format_row(row))
    return {
        "model": config.model,
        "cpu": CpuFeatures.probe().summary(),
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "device": config.device,
        "dtype": config.dtype,
        "weights": config.weights,
        "trace_mode": config.trace_mode,
        "torch_threads": torch.get_num_threads(),
        "method": (
            "decode tokens/s = batch*(new_tokens-1) / decode seconds (ours: step counter; "
            "transformers: streamer, first to last generated token); end-to-end tokens/s = "
            "batch*new_tokens / wall seconds of the whole generate call (prompt processing "
            f"included); best of {config.repeats} alternating repeats per metric; greedy, EOS "
            "ignored, prefix cache off"
        ),
        "results": results,
    }

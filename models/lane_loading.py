"""Build a `LaneGroupExecutor` of N identical lanes for `load_executor(..., lanes=N)`.

`max_batch_size` is the group's global capacity (split evenly over the lanes); `num_blocks`
is per lane, since every lane owns its own KV pool. In-process lanes take one device each
(`cuda` -> `cuda:0`, `cuda:1`, ...; several CPU lanes share the CPU); process lanes spawn one
worker per lane with `threads_per_lane` torch threads (and its own `CUDA_VISIBLE_DEVICES` on
CUDA).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from lifecycle.errors import attach_cleanup_failures
from models.lane_progress import LaneWorkerProgress
from models.progress import ConsoleProgress, as_progress
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, ProcessLane, spawn_process_lanes

if TYPE_CHECKING:
    from models.decoder.kernels import KernelPlan
    from runtime.backends.cpu_features import CpuFeatures
    from runtime.config import WarmupConfig

logger = logging.getLogger(__name__)

LANE_TRANSPORTS = ("process", "inprocess")


class LaneExecutorOptions(TypedDict, total=False):
    """The `load_executor` arguments every lane is built with (see `models.decoder.executor`).

    `device` and `max_batch_size` are not here: the group derives each lane's from its own.
    """

    dtype: str
    weights: str
    trace_mode: str
    block_size: int
    num_blocks: int | None
    max_prefill_chunk_size: int
    max_seq_len: int | None
    device_sampling: bool
    warmup: WarmupConfig | None
    faults: str | None
    progress: object
    seed: int
    kernels: str | Path | KernelPlan | None
    cpu_features: CpuFeatures | None


def check_lane_arguments(
    lanes: int, lane_transport: str, threads_per_lane: int | None, max_batch_size: int
) -> None:
    """Every lane argument checked before anything loads (the flag names are the CLI's)."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes (--lanes) must be a positive integer, got {lanes!r}")
    if lane_transport not in LANE_TRANSPORTS:
        raise ValueError(
            f"lane_transport (--lane-transport) must be one of {', '.join(LANE_TRANSPORTS)}, "
            f"got {lane_transport!r}"
        )
    if threads_per_lane is not None:
        if (
            isinstance(threads_per_lane, bool)
            or not isinstance(threads_per_lane, int)
            or threads_per_lane < 1
        ):
            raise ValueError(
                f"threads_per_lane (--threads-per-lane) must be a positive integer, got "
                f"{threads_per_lane!r}"
            )
        if lane_transport != "process":
            raise ValueError(
                "threads_per_lane (--threads-per-lane) applies to lane_transport='process' "
                "only: in-process lanes share this process's torch threads"
            )
    if max_batch_size % lanes:
        raise ValueError(
            f"max_batch_size (--max-batch) {max_batch_size} must split evenly over "
            f"{lanes} lanes (it is the global capacity: lanes x per-lane slots)"
        )


def _with_progress(
    options: LaneExecutorOptions, progress: LaneWorkerProgress | None
) -> LaneExecutorOptions:
    """A worker's options: the parent's, with the worker's own progress sink (or none)."""
    worker: LaneExecutorOptions = {**options}
    worker["progress"] = progress
    return worker


def _lane_device(device: str, index: int) -> str:
    if device == "cuda":
        return f"cuda:{index}"
    return device


def load_lane_group(
    model: str | Path,
    *,
    lanes: int,
    lane_transport: str = "process",
    threads_per_lane: int | None = None,
    max_batch_size: int = 8,
    device: str = "cpu",
    call_timeout_s: float | None = None,
    **kwargs: Unpack[LaneExecutorOptions],
) -> LaneGroupExecutor:
    """Load `lanes` identical lane executors and group them (CONSTRUCTED)."""
    check_lane_arguments(lanes, lane_transport, threads_per_lane, max_batch_size)
    per_lane = max_batch_size // lanes
    if lane_transport == "inprocess":
        built = _load_inprocess_lanes(model, lanes, per_lane, device, kwargs)
        return LaneGroupExecutor(built, call_timeout_s=call_timeout_s)
    threads = threads_per_lane or 1
    process_lanes = _spawn_lanes(model, lanes, per_lane, device, threads, call_timeout_s, kwargs)
    return LaneGroupExecutor(process_lanes, call_timeout_s=call_timeout_s)


def _load_inprocess_lanes(
    model: str | Path, lanes: int, per_lane: int, device: str, options: LaneExecutorOptions
) -> list[InProcessLane]:
    """One executor per lane in this process; a failure closes the lanes already built."""
    from models.decoder.executor import load_executor

    built: list[InProcessLane] = []
    sink = as_progress(options.get("progress"))
    try:
        with sink.step(f"load {lanes} in-process lanes", total=lanes, each=True) as step:
            for index in range(lanes):
                executor = load_executor(
                    model, max_batch_size=per_lane, device=_lane_device(device, index), **options
                )
                built.append(InProcessLane(executor, index=index))
                step.advance(1, f"lane {index} loaded")
    except BaseException as error:
        failures: list[BaseException] = []
        for lane in built:
            try:
                lane.close()
            except BaseException as failure:
                failures.append(failure)
        attach_cleanup_failures(error, failures, note="closing the lanes already built")
        raise
    return built


def _spawn_lanes(
    model: str | Path,
    lanes: int,
    per_lane: int,
    device: str,
    threads: int,
    call_timeout_s: float | None,
    options: LaneExecutorOptions,
) -> list[ProcessLane]:
    """One worker process per lane. A sink of this process cannot run in a worker: this one
    shows the lanes starting, and a console's lane 0 prints its own lines (load, kernels,
    warmup) prefixed by lane."""
    from models.decoder.executor import load_executor

    sink = as_progress(options.pop("progress", None))
    shown = isinstance(sink, ConsoleProgress) and sink.enabled
    cuda = device.startswith("cuda")
    factories = [
        functools.partial(
            load_executor,
            str(model),
            max_batch_size=per_lane,
            device="cuda:0" if cuda else device,
            **_with_progress(options, LaneWorkerProgress(index) if shown and index == 0 else None),
        )
        for index in range(lanes)
    ]
    envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(lanes)] if cuda else None
    sink.announce(
        f"start {lanes} lane processes: each worker imports torch and loads {model} "
        f"({os.cpu_count() or 1} CPU cores for {lanes} x {threads} threads)"
    )
    started = sink.step(f"start {lanes} lane processes", total=lanes, each=True, estimate=False)
    with started as step:
        return spawn_process_lanes(
            factories,
            threads=threads,
            envs=envs,
            call_timeout_s=call_timeout_s or 600.0,
            ready=lambda index: step.advance(1, f"lane {index} loaded"),
        )

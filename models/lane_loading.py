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
from typing import Any

from lifecycle.errors import attach_cleanup_failures
from models.lane_progress import LaneWorkerProgress
from models.progress import ConsoleProgress, as_progress
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, spawn_process_lanes

logger = logging.getLogger(__name__)

LANE_TRANSPORTS = ("process", "inprocess")


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


def _lane_device(device: str, index: int) -> str:
    if device == "cuda":
        return f"cuda:{index}"
    return device


def load_lane_group(
    model: Any,
    *,
    lanes: int,
    lane_transport: str = "process",
    threads_per_lane: int | None = None,
    max_batch_size: int = 8,
    device: str = "cpu",
    call_timeout_s: float | None = None,
    **kwargs: Any,
) -> LaneGroupExecutor:
    """Load `lanes` identical lane executors and group them (CONSTRUCTED)."""
    from models.llama.executor import load_executor

    check_lane_arguments(lanes, lane_transport, threads_per_lane, max_batch_size)
    per_lane = max_batch_size // lanes
    if lane_transport == "inprocess":
        built: list[InProcessLane] = []
        sink = as_progress(kwargs.get("progress"))
        try:
            with sink.step(f"load {lanes} in-process lanes", total=lanes, each=True) as step:
                for index in range(lanes):
                    executor = load_executor(
                        model,
                        max_batch_size=per_lane,
                        device=_lane_device(device, index),
                        **kwargs,
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
        return LaneGroupExecutor(built, call_timeout_s=call_timeout_s)
    # A sink of this process cannot run in a worker: this one shows the lanes starting, and
    # a console's workers print their own lines (load, kernels, warmup) prefixed by lane.
    sink = as_progress(kwargs.pop("progress", None))
    shown = isinstance(sink, ConsoleProgress) and sink.enabled
    cuda = device.startswith("cuda")
    factories = [
        functools.partial(
            load_executor,
            str(model),
            max_batch_size=per_lane,
            device="cuda:0" if cuda else device,
            progress=LaneWorkerProgress(index) if shown and index == 0 else None,
            **kwargs,
        )
        for index in range(lanes)
    ]
    envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(lanes)] if cuda else None
    sink.announce(
        f"start {lanes} lane processes: each worker imports torch and loads {model} "
        f"({os.cpu_count() or 1} CPU cores for {lanes} x {threads_per_lane or 1} threads)"
    )
    started = sink.step(f"start {lanes} lane processes", total=lanes, each=True, estimate=False)
    with started as step:
        process_lanes = spawn_process_lanes(
            factories,
            threads=threads_per_lane or 1,
            envs=envs,
            call_timeout_s=call_timeout_s or 600.0,
            ready=lambda index: step.advance(1, f"lane {index} loaded"),
        )
    return LaneGroupExecutor(process_lanes, call_timeout_s=call_timeout_s)

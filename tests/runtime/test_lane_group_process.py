"""Process lanes (one spawned worker each) on tiny-random fp32, kept few: spawning costs seconds.

One module-scoped group of two traced lanes serves the equality checks (traced by default,
eager through the per-lane `execution` argument) and greedy generation; the SIGKILL test runs
last on the same group, because it ends it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lifecycle import Phase
from models.generation.generator import GenerationParams, Generator
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import LaneFailure, ProcessLane, spawn_process_lanes
from tests.integration.executor_setup import tiny_executor
from tests.runtime.lane_fakes import stuck_lane
from tests.runtime.test_lane_group_real import (
    assert_same_to_tolerance,
    decode_request,
    prefill_request,
)


@pytest.fixture(scope="module")
def one_lane() -> Iterator[Any]:
    executor = tiny_executor(max_batch_size=4, trace_mode="all")
    executor.start()
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def process_group() -> Iterator[LaneGroupExecutor]:
    factory = functools.partial(tiny_executor, max_batch_size=2, trace_mode="all")
    group = LaneGroupExecutor(spawn_process_lanes([factory, factory], threads=1))
    group.start()
    yield group
    group.close()


@pytest.mark.parametrize("execution", [None, "eager"])
def test_process_lanes_equal_one_lane(
    one_lane: Any, process_group: LaneGroupExecutor, execution: str | None
) -> None:
    layout = one_lane.page_table_layout
    prefill = prefill_request(layout.prefill_width)
    for_one = {} if execution is None else {"execution": execution}
    for_group = {} if execution is None else {"execution": [execution, execution]}
    outputs = []
    for target, extra in ((one_lane, for_one), (process_group, for_group)):
        steps = [target.prefill_forward(**prefill, **extra)]
        for step in range(2):
            request = decode_request(prefill, layout.decode_width, step)
            steps.append(target.decode_forward(**request, **extra))
        outputs.append(steps)
    for want, have in zip(*outputs, strict=True):
        assert_same_to_tolerance(want, have)
    assert process_group.phase is Phase.SERVING


def test_lanes_replay_lane_zeros_kernel_plan(process_group: LaneGroupExecutor) -> None:
    """One lane times the kernels; the other replays that plan, so every lane computes alike."""
    plans = [lane.facts.coverage_manifest.kernels for lane in process_group.lanes]
    assert plans[0] is not None and plans[0]["source"] == "measured"
    assert plans[1] == plans[0]


def test_workers_use_their_own_threads_and_send_tensors_through_shared_memory(
    process_group: LaneGroupExecutor,
) -> None:
    assert [lane.facts.torch_threads for lane in process_group.lanes] == [1, 1]
    lane = process_group.lanes[0]
    width = process_group.page_table_layout.decode_width
    logits = lane.submit(
        "decode_forward",
        tokens=torch.tensor([3, 4]),
        start_pos=torch.tensor([-1, -1]),
        page_table=torch.zeros((2, width), dtype=torch.int32),
        execution="eager",
    ).wait(60.0)
    assert isinstance(logits, torch.Tensor) and logits.is_shared()


def test_process_lanes_generate_the_same_greedy_text(
    one_lane: Any, process_group: LaneGroupExecutor
) -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [20, 21]]
    params = GenerationParams(max_new_tokens=5)
    want = [c.token_ids for c in Generator(one_lane).generate(prompts, params)]
    have = [c.token_ids for c in Generator(process_group).generate(prompts, params)]
    assert want == have


def test_an_unresponsive_worker_is_a_lane_failure_within_its_bound() -> None:
    group = LaneGroupExecutor(spawn_process_lanes([stuck_lane], call_timeout_s=1.0))
    group.start()
    with pytest.raises(LaneFailure, match=r"DP lane 0: worker pid \d+ did not answer"):
        group.decode_forward(
            tokens=torch.zeros(2, dtype=torch.long),
            start_pos=torch.zeros(2, dtype=torch.long),
            page_table=torch.zeros((2, 1), dtype=torch.int32),
        )
    assert group.phase is Phase.TERMINAL
    lane = group.lanes[0]
    assert isinstance(lane, ProcessLane) and not lane.process.is_alive()


def test_a_sigkilled_worker_fails_the_group_naming_the_lane(
    one_lane: Any, process_group: LaneGroupExecutor
) -> None:
    """Runs last: it ends the shared group."""
    lanes = process_group.lanes
    assert all(isinstance(lane, ProcessLane) for lane in lanes)
    victim = lanes[1]
    assert isinstance(victim, ProcessLane)
    os.kill(victim.process.pid, signal.SIGKILL)
    layout = one_lane.page_table_layout
    request = decode_request(prefill_request(layout.prefill_width), layout.decode_width, 0)
    with pytest.raises(LaneFailure, match=r"DP lane 1: worker pid \d+ died \(signal 9\)"):
        process_group.decode_forward(**request)
    assert process_group.phase is Phase.TERMINAL
    survivor = lanes[0]
    assert isinstance(survivor, ProcessLane)
    assert survivor.final_live_allocations == 0  # cleaned by its own close, then joined
    assert process_group.live_allocations == 0
    assert multiprocessing.active_children() == []
    process_group.close()  # a second close is a no-op
    assert process_group.phase is Phase.TERMINAL

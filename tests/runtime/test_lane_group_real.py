"""Real in-process lanes on tiny-random fp32: 2 lanes equal 1 lane of the same capacity.

Also: greedy generation over a group, and a lane whose device fails mid-decode (the
fault-injecting backend) taking the whole group down cleanly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lifecycle import Phase
from models.executor import KVCapacityError
from models.generation.generator import GenerationParams, Generator
from runtime.backends.faults import FaultCall, FaultPlan
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, LaneFailure
from tests.integration.executor_setup import contiguous_tables, prompts_batch, tiny_executor

LENGTHS = [5, 7, 3, 6]
SLOTS = [3, 0, 2, 1]


def inprocess_group(
    lanes: int, per_lane: int, *, trace_mode: str = "none", **options: Any
) -> LaneGroupExecutor:
    return LaneGroupExecutor(
        [
            InProcessLane(
                tiny_executor(max_batch_size=per_lane, trace_mode=trace_mode, **options), index=i
            )
            for i in range(lanes)
        ]
    )


def prefill_request(width: int) -> dict[str, Any]:
    return {
        "tokens": prompts_batch(LENGTHS),
        "page_table": contiguous_tables(LENGTHS, width=width),
        "prompt_lens": torch.tensor(LENGTHS),
        "empty_slots": SLOTS,
    }


def decode_request(prefill: dict[str, Any], decode_width: int, step: int) -> dict[str, Any]:
    """Every slot decodes its own row's next token (lane-local block ids, same per lane)."""
    page_table = torch.zeros((4, decode_width), dtype=torch.int32)
    positions = torch.zeros(4, dtype=torch.int64)
    for row, slot in enumerate(SLOTS):
        page_table[slot] = prefill["page_table"][row, :decode_width]
        positions[slot] = LENGTHS[row] + step
    return {
        "tokens": torch.tensor([3, 4, 5, 6]) + step,
        "start_pos": positions,
        "page_table": page_table,
    }


def same(want: Any, have: Any) -> bool:
    """Equal tensors (bit for bit), or equal tuples of tensors / None."""
    if isinstance(want, tuple):
        return isinstance(have, tuple) and all(same(a, b) for a, b in zip(want, have, strict=True))
    if want is None:
        return have is None
    return bool(want.shape == have.shape and torch.equal(want, have))


def assert_same_to_tolerance(want: Any, have: Any) -> None:
    """Equal structure, tensors equal to float tolerance.

    Kernel forms are chosen per row bucket at warmup (a lane of 2 rows may use a different
    matrix product than a lane of 4), so logits of 2 lanes match 1 lane only to rounding.
    """
    if isinstance(want, tuple):
        assert isinstance(have, tuple) and len(have) == len(want)
        for a, b in zip(want, have, strict=True):
            assert_same_to_tolerance(a, b)
    elif want is None:
        assert have is None
    else:
        assert want.shape == have.shape
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def run_requests(target: Any, *, steps: int = 3, **extra: Any) -> list[torch.Tensor]:
    target.start()
    layout = target.page_table_layout
    prefill = prefill_request(layout.prefill_width)
    outputs = [target.prefill_forward(**prefill, **extra)]
    for step in range(steps):
        outputs.append(
            target.decode_forward(**decode_request(prefill, layout.decode_width, step), **extra)
        )
    return outputs


@pytest.mark.parametrize("trace_mode", ["none", "all"])
def test_two_lanes_equal_one_lane_of_the_same_capacity(trace_mode: str) -> None:
    one = tiny_executor(max_batch_size=4, trace_mode=trace_mode, device_sampling=False)
    group = inprocess_group(2, 2, trace_mode=trace_mode, device_sampling=False)
    try:
        expected = run_requests(one)
        got = run_requests(group)
        for want, have in zip(expected, got, strict=True):
            assert_same_to_tolerance(want, have)
    finally:
        one.close()
        group.close()
    assert group.live_allocations == 0


def test_sampled_tokens_equal_one_lane_on_device_sampling() -> None:
    from runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, top_k=1, top_p=1.0)
    one = tiny_executor(max_batch_size=4, trace_mode="decode_only")
    group = inprocess_group(2, 2, trace_mode="decode_only")
    try:
        expected = run_requests(one, sampling_params=greedy)
        got = run_requests(group, sampling_params=greedy)
        for want, have in zip(expected, got, strict=True):
            assert same(want, have), (want, have)
        assert got[-1].dtype == torch.int64
    finally:
        one.close()
        group.close()


def test_greedy_generation_is_identical_over_two_lanes() -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24]]
    params = GenerationParams(max_new_tokens=6)
    one = tiny_executor(max_batch_size=4)
    group = inprocess_group(2, 2)
    try:
        one.start()
        group.start()
        want = [c.token_ids for c in Generator(one).generate(prompts, params)]
        generator = Generator(group)
        have = [c.token_ids for c in generator.generate(prompts, params)]
        assert len(generator.block_managers) == 2
    finally:
        one.close()
        group.close()
    assert want == have


def test_a_lane_whose_device_fails_mid_decode_takes_the_group_down_cleanly() -> None:
    armed = {"on": False}

    def fail_once(call: FaultCall) -> bool:
        if armed["on"]:
            armed["on"] = False
            return True
        return False

    lanes = [
        InProcessLane(tiny_executor(max_batch_size=2, device_sampling=False), index=0),
        InProcessLane(
            tiny_executor(
                max_batch_size=2,
                device_sampling=False,
                faults=FaultPlan.matching("from_host", fail_once),  # type: ignore[arg-type]
            ),
            index=1,
        ),
    ]
    group = LaneGroupExecutor(lanes)
    outputs = run_requests(group, steps=1)
    assert outputs[-1].shape[0] == 4
    armed["on"] = True
    layout = group.page_table_layout
    request = decode_request(prefill_request(layout.prefill_width), layout.decode_width, 1)
    with pytest.raises(LaneFailure, match="DP lane 1") as caught:
        group.decode_forward(**request)
    assert "injected fault" in str(caught.value)
    assert group.phase is Phase.TERMINAL
    assert all(lane.executor.phase is Phase.TERMINAL for lane in lanes)
    assert group.live_allocations == 0
    group.close()  # a no-op
    assert group.phase is Phase.TERMINAL


def test_group_reports_kv_bytes_and_checks_memory_like_its_lanes() -> None:
    """A group of real lanes answers `kv_cache_bytes` / `check_kv_memory` / `device` itself."""
    group = inprocess_group(2, 2)
    try:
        lanes = group.executors
        assert group.kv_cache_bytes(3) == sum(lane.kv_cache_bytes(3) for lane in lanes)
        group.check_kv_memory(2)  # a couple of tiny blocks fit on the host
        with pytest.raises(KVCapacityError, match="at most") as refused:
            group.check_kv_memory(10**12)  # far beyond any host: the lane's own refusal
        assert any("DP lane 0" in note for note in refused.value.__notes__)
        assert group.device.names == ("cpu", "cpu")
        assert group.device.injected_total == 0
        assert group.phase is Phase.CONSTRUCTED
    finally:
        group.close()

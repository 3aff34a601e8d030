"""A caller error is refused at the lane group's boundary and leaves the group as it was.

Two in-process lanes and two process lanes, each trace mode, on tiny-random fp32: every
refusal class (a bad shape, dtype, range, keyword, slot, block id, position, execution or
sampling request) raises the caller's error before any lane is called; the group stays
SERVING, every lane's held resources and KV blocks are unchanged, and the next valid decode
and prefill return exactly the logits the group returned before it saw the refused call
(the same step on an unchanged state; decode rewrites the same K/V values).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch

from lifecycle import Phase
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, spawn_process_lanes
from runtime.lanes.fanout import LaneFanOut
from runtime.lanes.protocol import LaneFailure
from runtime.sampling import SamplingParams
from runtime.steps import DecodeStep, ExecutionTarget, PrefillStep
from tests.integration.executor_setup import kv_snapshot, tiny_executor
from tests.runtime.lane_fakes import fake_group
from tests.runtime.test_lane_group_real import decode_request, prefill_request

PER_LANE = 2
MODES = ("none", "decode_only", "all")


@attrs.frozen
class Served:
    """A serving group and the answers of its valid calls before any refusal."""

    group: LaneGroupExecutor
    prefill: dict[str, Any]
    decode: dict[str, Any]
    prefill_logits: torch.Tensor
    decode_logits: torch.Tensor


def _build(transport: str, mode: str) -> LaneGroupExecutor:
    if transport == "inprocess":
        return LaneGroupExecutor(
            [
                InProcessLane(tiny_executor(max_batch_size=PER_LANE, trace_mode=mode), index=i)
                for i in range(2)
            ]
        )
    factory = functools.partial(tiny_executor, max_batch_size=PER_LANE, trace_mode=mode)
    return LaneGroupExecutor(spawn_process_lanes([factory, factory], threads=1))


@pytest.fixture(
    scope="module",
    params=[(t, m) for t in ("inprocess", "process") for m in MODES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    transport, mode = request.param
    group = _build(transport, mode)
    group.start()
    layout = group.page_table_layout
    assert layout is not None
    prefill = prefill_request(layout.prefill_width)
    prefill_logits = group.prefill_forward(**prefill)
    decode = decode_request(prefill, layout.decode_width, 0)
    decode_logits = group.decode_forward(**decode)
    assert isinstance(prefill_logits, torch.Tensor) and isinstance(decode_logits, torch.Tensor)
    yield Served(group, prefill, decode, prefill_logits, decode_logits)
    group.close()


Call = Callable[[Served], object]


def _prefill_with(**changes: Any) -> Call:
    def call(s: Served) -> object:
        return s.group.prefill_forward(**{**s.prefill, **changes})

    return call


def _decode_with(**changes: Any) -> Call:
    def call(s: Served) -> object:
        return s.group.decode_forward(**{**s.decode, **changes})

    return call


def _decode_changed(name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Call:
    def call(s: Served) -> object:
        return s.group.decode_forward(**{**s.decode, name: change(s.decode[name])})

    return call


def _prefill_changed(name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Call:
    def call(s: Served) -> object:
        return s.group.prefill_forward(**{**s.prefill, name: change(s.prefill[name])})

    return call


def _set(tensor: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


_STOCHASTIC_TOP_K = SamplingParams(temperature=1.0, top_k=10**6)

REFUSALS: dict[str, tuple[type[Exception], str, Call]] = {
    "prefill prompt_lens beyond the tokens": (
        ValueError,
        "start_pos <= prompt_len <= token width",
        _prefill_with(prompt_lens=torch.tensor([99, 7, 3, 6])),
    ),
    "prefill float tokens": (
        ValueError,
        "tokens must have an integer dtype",
        _prefill_changed("tokens", lambda t: t.float()),
    ),
    "prefill unknown keyword": (
        TypeError,
        "unexpected keyword argument 'bogus'",
        _prefill_with(bogus=1),
    ),
    "prefill block id beyond the pool": (
        ValueError,
        r"block ids in \[0, 48\)",
        _prefill_changed("page_table", lambda t: _set(t, (1, 0), 10_000)),
    ),
    "prefill slot beyond the group": (
        ValueError,
        "maps to an invalid DP lane",
        _prefill_with(empty_slots=[3, 0, 2, 4]),
    ),
    "prefill repeated slot": (
        ValueError,
        "empty_slots must contain unique",
        _prefill_with(empty_slots=[3, 0, 3, 1]),
    ),
    "prefill unsupported top_k": (
        ValueError,
        "outside the device-supported range",
        _prefill_with(sampling_params=_STOCHASTIC_TOP_K),
    ),
    "prefill unknown execution": (
        ValueError,
        "execution must be None, 'eager' or 'traced'",
        _prefill_with(execution=["fast", "fast"]),
    ),
    "decode float start_pos": (
        ValueError,
        "start_pos must be an integer tensor",
        _decode_changed("start_pos", lambda t: t.float()),
    ),
    "decode short batch": (
        ValueError,
        "DP decode expects fixed global batch 4",
        _decode_changed("tokens", lambda t: t[:3]),
    ),
    "decode token id beyond the vocabulary": (
        ValueError,
        "allowed token ids of an active row",
        _decode_changed("tokens", lambda t: _set(t, (2,), 10**6)),
    ),
    "decode position beyond capacity": (
        ValueError,
        "exceeds the configured paged-KV capacity",
        _decode_changed("start_pos", lambda t: _set(t, (1,), 10_000)),
    ),
    "decode block id beyond the pool": (
        ValueError,
        r"block ids in \[0, 48\)",
        _decode_changed("page_table", lambda t: _set(t, (3, 0), 48)),
    ),
    "decode unknown keyword": (
        TypeError,
        "unexpected keyword argument 'seeds'",
        _decode_with(seeds=[1]),
    ),
    "decode non-bool reset_batch": (
        TypeError,
        "reset_batch must be a bool",
        _decode_with(reset_batch=1),
    ),
    "decode sampling without an active row": (
        ValueError,
        "at least one active decode row",
        _decode_with(
            start_pos=torch.full((4,), -1, dtype=torch.int64),
            sampling_params=SamplingParams(temperature=0.0),
        ),
    ),
    "decode unsupported top_k": (
        ValueError,
        "outside the device-supported range",
        _decode_with(sampling_params=_STOCHASTIC_TOP_K),
    ),
}


def _kv_of(group: LaneGroupExecutor) -> list[list[torch.Tensor]] | None:
    """Every in-process lane's K/V tensors (None for process lanes: they live elsewhere)."""
    executors = [getattr(lane, "executor", None) for lane in group.lanes]
    if any(executor is None for executor in executors):
        return None
    return [kv_snapshot(executor) for executor in executors]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_call_leaves_the_group_serving_and_unchanged(served: Served, case: str) -> None:
    error, match, call = REFUSALS[case]
    group = served.group
    held = group.held_resources()
    kv = _kv_of(group)
    with pytest.raises(error, match=match):
        call(served)
    assert group.phase is Phase.SERVING
    assert group.held_resources() == held
    if kv is not None:
        after = _kv_of(group)
        assert after is not None
        assert all(
            torch.equal(a, b)
            for lane, lane_after in zip(kv, after, strict=True)
            for a, b in zip(lane, lane_after, strict=True)
        )
    assert torch.equal(group.decode_forward(**served.decode), served.decode_logits)


def test_after_refusals_prefill_answers_as_before(served: Served) -> None:
    for error, _match, call in REFUSALS.values():
        with pytest.raises(error):
            call(served)
    assert served.group.phase is Phase.SERVING
    assert torch.equal(served.group.prefill_forward(**served.prefill), served.prefill_logits)
    assert torch.equal(served.group.decode_forward(**served.decode), served.decode_logits)


# -- the KV cache spec, and cleanup errors ----------------------------------------------------


def test_a_server_shape_that_does_not_match_is_refused_before_any_lane_allocates() -> None:
    group = _build("inprocess", "none")
    try:
        group.resolve_capacity()
        shapes = group.facts[0].kv_cache_shapes
        assert shapes, "a real lane reports its model-derived K/V shapes"
        blocks, heads, block, head_dim = shapes[0]
        wrong = (blocks + 1, heads, block, head_dim)
        with pytest.raises(ValueError, match="does not match the model-derived shapes"):
            group.allocate_kv_cache(wrong, torch.float32, len(shapes))
        assert group.phase is Phase.CAPACITY_RESOLVED
        assert group.live_allocations == 0
        assert all(lane.facts.phase == "CAPACITY_RESOLVED" for lane in group.lanes)
        with pytest.raises(TypeError, match="together or not at all"):
            group.allocate_kv_cache(shapes[0])
        handles = group.allocate_kv_cache(shapes[0], torch.float32, len(shapes))
        assert len(handles) == 2 and group.phase is Phase.ALLOCATED
    finally:
        group.close()


def test_a_lane_cleanup_error_is_the_cause_of_its_lane_failure() -> None:
    group, fakes = fake_group(2)
    error = OSError("device lost while releasing")
    fakes[1].fail["close"] = error
    fanout: LaneFanOut = group._lanes
    failures = fanout.close()
    assert len(failures) == 1
    failure = failures[0]
    assert isinstance(failure, LaneFailure) and failure.lane == 1
    assert failure.__cause__ is error
    assert fakes[0].closed == 1
    assert fanout.close() == []  # the failed lane is retried and now closes
    assert fakes[1].closed == 1


# -- one typed step, one target API ----------------------------------------------------------


def test_a_group_and_both_executors_are_execution_targets() -> None:
    group = _build("inprocess", "all")
    try:
        lane = group.lanes[0]
        assert isinstance(lane, InProcessLane)
        executor: Any = lane.executor
        targets: list[ExecutionTarget] = [group, executor.eager_executor, executor.traced_executor]
        assert all(isinstance(target, ExecutionTarget) for target in targets)
        assert not isinstance(lane, ExecutionTarget)  # a lane is driven by call name
    finally:
        group.close()


def test_each_lane_receives_one_typed_step_keeping_page_table() -> None:
    group, fakes = fake_group(2)
    group.start()
    seen: list[object] = []
    original = group.lanes[1].submit

    def spy(method: str, /, **kwargs: object) -> Any:
        seen.append(kwargs.get("step"))
        return original(method, **kwargs)

    group.lanes[1].submit = spy  # type: ignore[method-assign]
    table = torch.tensor([[5], [6]], dtype=torch.int32)
    group.prefill_forward(
        tokens=torch.zeros((2, 3), dtype=torch.long), page_table=table, empty_slots=[2, 3]
    )
    group.decode_forward(
        tokens=torch.zeros(4, dtype=torch.long),
        start_pos=torch.zeros(4, dtype=torch.long),
        page_table=torch.arange(4, dtype=torch.int32).reshape(4, 1),
    )
    prefill, decode = seen
    assert isinstance(prefill, PrefillStep) and isinstance(decode, DecodeStep)
    assert prefill.page_table.tolist() == [[5], [6]] and prefill.empty_slots == [0, 1]
    assert decode.page_table.tolist() == [[2], [3]]
    received = [kwargs for name, kwargs in fakes[1].calls if name == "decode_forward"]
    assert received[-1]["page_table"].tolist() == [[2], [3]]  # the same name at the executor
    group.close()


def test_sampling_values_beyond_the_batch_are_sliced_as_the_lanes_see_them() -> None:
    """A sampling sequence longer than the rows is accepted (each lane takes its rows), one
    that does not reach a row is refused, and the group serves on."""
    group = _build("inprocess", "none")
    try:
        group.start()
        layout = group.page_table_layout
        assert layout is not None
        prefill = prefill_request(layout.prefill_width)
        greedy = SamplingParams(temperature=[0.0] * 6, top_k=[1] * 6)
        tokens, logprobs = group.prefill_forward(**prefill, sampling_params=greedy)
        assert tokens.shape == (4,) and logprobs is None
        short = SamplingParams(temperature=[1.0, 1.0], top_k=[2, 2])
        with pytest.raises(ValueError, match="does not cover row"):
            group.prefill_forward(**prefill, sampling_params=short)
        assert group.phase is Phase.SERVING
        again, _ = group.prefill_forward(**prefill, sampling_params=greedy)
        assert torch.equal(again, tokens)
    finally:
        group.close()

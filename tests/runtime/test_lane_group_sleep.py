"""A lane group's drain, sleep, staged wake and reload: every lane or none.

Greedy output after each form equals the output before; every lane sits in the group's stage
(the barrier); no lane is handed work while any lane sleeps (the data-parallel "idle rank's
dummy forward in the weights-only window" bug); a reload any lane refuses changes no lane.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from lifecycle import Phase, PhaseError
from models.decoder.sources import load_model
from models.generation import GenerationParams, Generator
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, spawn_process_lanes
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.executor_setup import tiny_executor

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]


def greedy(target: LaneGroupExecutor) -> list[tuple[int, ...]]:
    params = GenerationParams(max_new_tokens=5)
    return [c.token_ids for c in Generator(target).generate(PROMPTS, params)]


def lane_phases(group: LaneGroupExecutor) -> set[str]:
    group._refresh()
    return {fact.phase for fact in group.facts}


@pytest.fixture(params=["none", "decode_only"])
def group(request: pytest.FixtureRequest) -> Iterator[LaneGroupExecutor]:
    lanes = [
        InProcessLane(tiny_executor(max_batch_size=2, trace_mode=request.param), index=i)
        for i in range(2)
    ]
    target = LaneGroupExecutor(lanes)
    target.start()
    yield target
    target.close()
    assert all(lane.live_allocations == 0 for lane in target.lanes)


def test_sleep_and_wake_forms_keep_the_output(group: LaneGroupExecutor) -> None:
    generator = Generator(group)
    params = GenerationParams(max_new_tokens=5)
    before = [c.token_ids for c in generator.generate(PROMPTS, params)]
    group.drain()
    group.sleep(1)
    assert lane_phases(group) == {"SLEEPING"}
    assert group.live_allocations == 0
    group.wake()
    assert group.phase is Phase.SERVING and lane_phases(group) == {"SERVING"}
    # the same generator: its prefix cache of the old KV cache must not be reused
    assert [c.token_ids for c in generator.generate(PROMPTS, params)] == before
    group.drain()
    group.sleep(2)
    group.wake(tags=("weights",))
    assert lane_phases(group) == {"WEIGHTS_AWAKE"}
    group.reload_weights("tiny-random")
    group.wake(tags=("kv_cache",))
    assert greedy(group) == before


def test_no_lane_runs_while_another_is_asleep(group: LaneGroupExecutor) -> None:
    group.drain()
    group.sleep(1)
    group.wake(tags=("weights",))
    calls: list[str] = []
    for lane in group.lanes:
        submit = lane.submit

        def counting(method: str, /, _submit=submit, **kwargs: object) -> object:  # type: ignore[no-untyped-def]
            calls.append(method)
            return _submit(method, **kwargs)

        lane.submit = counting  # type: ignore[method-assign]
    with pytest.raises(PhaseError, match=r"wake\(tags=\('kv_cache',\)\)"):
        group.decode_forward(
            tokens=torch.zeros(4, dtype=torch.long),
            start_pos=torch.full((4,), -1, dtype=torch.long),
            page_table=torch.zeros(4, 4, dtype=torch.int32),
        )
    assert calls == [] and group.phase is Phase.WEIGHTS_AWAKE
    group.sleep(1)  # back to sleep from the weights-only stage
    group.sleep(1)  # a no-op
    assert lane_phases(group) == {"SLEEPING"}
    assert [e for e in group.journal if e.detail.startswith("no-op: already SLEEPING")]


def test_a_reload_one_lane_refuses_changes_no_lane(group: LaneGroupExecutor) -> None:
    before = greedy(group)
    group.drain()
    state = load_model("tiny-random", seed=1, with_tokenizer=False).model.canonical_state_dict()
    name = "model.norm.weight"
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \[63\]"):
        group.reload_weights(dict(state, **{name: state[name][:-1]}))
    assert group.phase is Phase.DRAINED
    group.serve()
    assert greedy(group) == before


def test_process_lanes_sleep_and_wake() -> None:
    factory = functools.partial(tiny_executor, max_batch_size=2, trace_mode="decode_only")
    group = LaneGroupExecutor(spawn_process_lanes([factory, factory], threads=1))
    try:
        group.start()
        before = greedy(group)
        group.drain()
        group.sleep(2)
        assert lane_phases(group) == {"SLEEPING"}
        assert group.live_allocations == 0
        group.wake()
        assert group.phase is Phase.DRAINED  # level 2: zeros are never served
        group.reload_weights("tiny-random")
        group.serve()
        assert greedy(group) == before
    finally:
        group.close()

"""A Hypothesis state machine over a SERVING lane group: valid calls interleaved with refused ones.

Two in-process lanes and two process lanes, each trace mode. A valid call is the prefill of
four prompts into global slots or the decode step after it; either leaves the KV state as
it found it (it rewrites the same K/V values), so its logits always equal the group's
answer before any refused call. An invalid call is drawn from every refusal class, with
drawn rows and values; after it the phase is SERVING, the held resources are unchanged, and
the next valid call's logits equal those of the group that never saw it. Process lanes
spawn workers, so their examples are few.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from lifecycle import Phase
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, spawn_process_lanes
from runtime.sampling import SamplingParams
from tests.integration.executor_setup import tiny_executor
from tests.runtime.test_lane_group_real import decode_request, prefill_request

PER_LANE = 2
ROWS = 2 * PER_LANE
VOCAB_LIMIT = 10**6


class Served:
    """A serving group and its answers to the two valid calls, before any refusal."""

    def __init__(self, group: LaneGroupExecutor) -> None:
        layout = group.page_table_layout
        assert layout is not None and group.num_blocks is not None
        self.group = group
        self.num_blocks = group.num_blocks
        self.prefill = prefill_request(layout.prefill_width)
        self.decode = decode_request(self.prefill, layout.decode_width, 0)
        self.prefill_logits = group.prefill_forward(**self.prefill)
        self.decode_logits = group.decode_forward(**self.decode)


def _set(tensor: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


Invalid = Callable[[Served, int, int], object]
"""One refusal class: (the group, a drawn row, a drawn excess >= 0) -> the refused call."""


def _prefill(s: Served, **changes: object) -> object:
    return s.group.prefill_forward(**{**s.prefill, **changes})


def _decode(s: Served, **changes: object) -> object:
    return s.group.decode_forward(**{**s.decode, **changes})


INVALID: dict[str, tuple[type[Exception], Invalid]] = {
    "prefill prompt_lens beyond the tokens": (
        ValueError,
        lambda s, row, excess: _prefill(
            s,
            prompt_lens=_set(
                s.prefill["prompt_lens"], (row,), s.prefill["tokens"].shape[1] + 1 + excess
            ),
        ),
    ),
    "prefill float tokens": (
        ValueError,
        lambda s, row, excess: _prefill(s, tokens=s.prefill["tokens"].float()),
    ),
    "prefill unknown keyword": (TypeError, lambda s, row, excess: _prefill(s, seeds=[row])),
    "prefill block id beyond the pool": (
        ValueError,
        lambda s, row, excess: _prefill(
            s, page_table=_set(s.prefill["page_table"], (row, 0), s.num_blocks + excess)
        ),
    ),
    "prefill block id below -1": (
        ValueError,
        lambda s, row, excess: _prefill(
            s, page_table=_set(s.prefill["page_table"], (row, 0), -2 - excess)
        ),
    ),
    "prefill slot beyond the group": (
        ValueError,
        lambda s, row, excess: _prefill(
            s,
            empty_slots=[
                ROWS + excess if r == row else slot
                for r, slot in enumerate(s.prefill["empty_slots"])
            ],
        ),
    ),
    "prefill unsupported top_k": (
        ValueError,
        lambda s, row, excess: _prefill(
            s, sampling_params=SamplingParams(temperature=1.0, top_k=VOCAB_LIMIT + excess)
        ),
    ),
    "prefill traced where the mode does not trace": (
        ValueError,
        lambda s, row, excess: (
            _prefill(s, execution=["traced", "traced"])
            if s.group.trace_mode != "all"
            else _prefill(s, execution=["fast", "fast"])
        ),
    ),
    "decode float start_pos": (
        ValueError,
        lambda s, row, excess: _decode(s, start_pos=s.decode["start_pos"].float()),
    ),
    "decode short batch": (
        ValueError,
        lambda s, row, excess: _decode(s, tokens=s.decode["tokens"][: ROWS - 1 - row % (ROWS - 1)]),
    ),
    "decode token id beyond the vocabulary": (
        ValueError,
        lambda s, row, excess: _decode(
            s, tokens=_set(s.decode["tokens"], (row,), VOCAB_LIMIT + excess)
        ),
    ),
    "decode position beyond capacity": (
        ValueError,
        lambda s, row, excess: _decode(
            s, start_pos=_set(s.decode["start_pos"], (row,), 10_000 + excess)
        ),
    ),
    "decode block id beyond the pool": (
        ValueError,
        lambda s, row, excess: _decode(
            s, page_table=_set(s.decode["page_table"], (row, 0), s.num_blocks + excess)
        ),
    ),
    "decode unknown keyword": (TypeError, lambda s, row, excess: _decode(s, lane=row)),
    "decode non-bool reset_batch": (
        TypeError,
        lambda s, row, excess: _decode(s, reset_batch=row + 1),
    ),
    "decode sampling without an active row": (
        ValueError,
        lambda s, row, excess: _decode(
            s,
            start_pos=torch.full((ROWS,), -1 - excess, dtype=torch.int64),
            sampling_params=SamplingParams(temperature=0.0),
        ),
    ),
    "decode kv_cache not one per lane": (
        ValueError,
        lambda s, row, excess: _decode(s, kv_cache=[None] * (3 + row)),
    ),
}


def _build(transport: str, mode: str) -> LaneGroupExecutor:
    factory = functools.partial(tiny_executor, max_batch_size=PER_LANE, trace_mode=mode)
    if transport == "inprocess":
        return LaneGroupExecutor([InProcessLane(factory(), index=i) for i in range(2)])
    return LaneGroupExecutor(spawn_process_lanes([factory, factory], threads=1))


class RefusalMachine(RuleBasedStateMachine):
    """Valid and invalid calls on one serving group (shared across examples: a valid call
    never changes its state, which is what this machine checks)."""

    def __init__(self, served: Served) -> None:
        super().__init__()
        self.served = served
        self.held = self.served.group.held_resources()

    @rule()
    def valid_prefill(self) -> None:
        out = self.served.group.prefill_forward(**self.served.prefill)
        assert torch.equal(out, self.served.prefill_logits)

    @rule()
    def valid_decode(self) -> None:
        out = self.served.group.decode_forward(**self.served.decode)
        assert torch.equal(out, self.served.decode_logits)

    @rule(
        case=st.sampled_from(sorted(INVALID)),
        row=st.integers(0, ROWS - 1),
        excess=st.integers(0, 10**5),
    )
    def invalid(self, case: str, row: int, excess: int) -> None:
        error, call = INVALID[case]
        with pytest.raises(error):
            call(self.served, row, excess)
        assert self.served.group.held_resources() == self.held

    @invariant()
    def serving(self) -> None:
        assert self.served.group.phase is Phase.SERVING


SHAPES = [("inprocess", m, 12) for m in ("none", "decode_only", "all")] + [
    ("process", m, 3) for m in ("none", "decode_only", "all")
]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda p: f"{p[0]}-{p[1]}")
def shape(request: pytest.FixtureRequest) -> Iterator[tuple[Served, int]]:
    transport, mode, examples = request.param
    group = _build(transport, mode)
    group.start()
    yield Served(group), examples
    group.close()


def test_refusals_interleaved_with_valid_calls(shape: tuple[Served, int]) -> None:
    served, examples = shape
    run_state_machine_as_test(
        lambda: RefusalMachine(served),
        settings=settings(
            max_examples=examples,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )

"""The decode boundary: `DecodeRuntime.prepare` returns a frozen, checked step; a refused step
leaves the runtime as it was; a bad read flag loses nothing; the checks stand on their own."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch

from runtime.decode import DecodeRuntime, PreparedDecode
from runtime.decode_batch import (
    LaneInputs,
    check_lane_inputs,
    check_token_ids,
    page_table_copy_counts,
)
from tests.runtime.tiny_setup import TinySetup, block_page_table, build_tiny_setup

LANE = 4
TOKENS = torch.tensor([21, 0, 42, 0])
START = torch.tensor([5, -1, 3, -1])


@pytest.fixture
def setup() -> Iterator[TinySetup]:
    built = build_tiny_setup()
    yield built
    built.close()


def runtime(setup: TinySetup) -> DecodeRuntime:
    return DecodeRuntime(setup.decode_config(lane_capacity=LANE))


def test_a_prepared_step_is_frozen(setup: TinySetup) -> None:
    prepared = runtime(setup).prepare(TOKENS, START, block_page_table(LANE, 2))
    assert isinstance(prepared, PreparedDecode)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        prepared.reset_batch = True  # type: ignore[misc]
    assert prepared.active_rows == 2
    assert prepared.page_table.dtype == torch.int32
    assert tuple(prepared.page_table.shape) == (LANE, setup.layout.decode_width)


def test_a_refused_step_changes_nothing(setup: TinySetup) -> None:
    rt = runtime(setup)
    table = block_page_table(LANE, 2)
    first = rt.prepare(TOKENS, START, table)
    rt.note_submitted(first)
    allocations = setup.device.live_allocations
    narrow = block_page_table(LANE, 1)
    with pytest.raises(ValueError, match="page table is too narrow for decode row 0"):
        rt.prepare(TOKENS, START, narrow)
    assert setup.device.live_allocations == allocations
    # The cache and the submitted table are untouched: the same table is still a hit and
    # unchanged against the last submitted step.
    hits = rt.page_table_cache_hits
    again = rt.prepare(TOKENS, START, table)
    assert rt.page_table_cache_hits == hits + 1
    assert again.page_table is first.page_table and not again.page_table_changed


def test_consume_with_a_bad_read_flag_releases_the_output(setup: TinySetup) -> None:
    rt = runtime(setup)
    result = rt.invoke(rt.prepare(TOKENS, START, block_page_table(LANE, 2)))
    assert setup.device.live_allocations > setup.resident_allocations
    with pytest.raises(TypeError, match="read_from_device must be a bool"):
        rt.consume(result, read_from_device=1)  # type: ignore[arg-type]
    assert setup.device.live_allocations == setup.resident_allocations
    assert rt.transient_orphan_count == 0 and rt.outstanding_lease_count == 0


def test_lane_checks_copy_and_name_each_tensor() -> None:
    tokens = torch.tensor([1, 2], dtype=torch.int32)
    lane = check_lane_inputs(2, tokens, torch.tensor([0, -1]), torch.zeros(2, 3).int())
    assert lane.tokens.dtype == torch.int64 and lane.tokens.data_ptr() != tokens.data_ptr()
    assert lane.active.tolist() == [True, False]
    with pytest.raises(ValueError, match="page_table must be an integer tensor"):
        check_lane_inputs(2, tokens, torch.tensor([0, -1]), torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"start_pos must be a torch\.Tensor \[lane\]"):
        check_lane_inputs(2, tokens, [0, -1], torch.zeros(2, 3, dtype=torch.int32))


def test_token_ids_are_checked_on_active_rows_only() -> None:
    lane = LaneInputs(
        tokens=torch.tensor([5, 999]),
        positions=torch.tensor([0, -1]),
        page_table=torch.zeros(2, 1, dtype=torch.int32),
    )
    check_token_ids(lane, vocab_size=10)
    with pytest.raises(ValueError, match=r"tokens row 0 is 5; allowed .* \[0, 4\)"):
        check_token_ids(lane, vocab_size=4)


def test_copy_counts_add_a_look_ahead_block_only_with_feedback(setup: TinySetup) -> None:
    layout = setup.layout
    block = layout.block_size
    table = block_page_table(2, 4)
    at_boundary = torch.tensor([block - 1, -1])
    plain = page_table_copy_counts(table, at_boundary, layout=layout, device_feedback=False)
    ahead = page_table_copy_counts(table, at_boundary, layout=layout, device_feedback=True)
    assert plain.tolist() == [1, 0] and ahead.tolist() == [2, 0]
    beyond = torch.tensor([layout.raw_capacity_width * block, -1])
    with pytest.raises(ValueError, match="exceeds the configured paged-KV capacity"):
        page_table_copy_counts(
            block_page_table(2, 4, width=layout.decode_width),
            beyond,
            layout=layout,
            device_feedback=False,
        )

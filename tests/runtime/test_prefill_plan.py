"""The prefill planner: the reference's worked examples and every validation rule."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from runtime.config import RuntimePolicy
from runtime.prefill.plan import (
    batched_prefill_disabled_by_env,
    plan_prefill_requests,
    prefill_chunk_size,
    restore_source_order,
)
from runtime.prefill.request import PrefillChunk, PrefillRequest

BLOCK = 32


def make_inputs(
    lengths: Sequence[int], *, width: int | None = None, table_width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens unique per (row, column) and a page table whose cells are all distinct >= 1."""
    batch = len(lengths)
    width = max(lengths) if width is None else width
    table_width = -(-width // BLOCK) if table_width is None else table_width
    tokens = torch.arange(batch * width, dtype=torch.long).reshape(batch, width) + 1
    table = torch.arange(batch * table_width, dtype=torch.int32).reshape(batch, table_width) + 1
    return tokens, table, torch.tensor(list(lengths))


def plan(lengths: Sequence[int], **overrides: Any) -> tuple[PrefillRequest, ...]:
    tokens, table, prompts = make_inputs(lengths)
    arguments: dict[str, Any] = {
        "tokens": tokens,
        "page_table": table,
        "prompt_lens": prompts,
        "block_size": BLOCK,
        "max_batch_size": 32,
        "max_prefill_chunk_size": 2048,
        "supports_batched_prefill": True,
        "max_prefill_batch_size": 8,
    }
    arguments.update(overrides)
    return plan_prefill_requests(**arguments)


def shape(requests: Sequence[PrefillRequest]) -> list[tuple[str, tuple[int, ...], int, int]]:
    return [
        (r.kind, r.source_rows, r.padded_batch_size, r.padded_sequence_length) for r in requests
    ]


@pytest.fixture(autouse=True)
def _batching_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISABLE_BATCHED_PREFILL", raising=False)


# --- worked examples of the reference -------------------------------------------------------


def test_three_rows_of_80_share_one_padded_wave_of_4_with_their_slots() -> None:
    tokens, table, _ = make_inputs([80, 80, 80])
    (request,) = plan([80, 80, 80], empty_slots=(7, 3, 11))
    assert shape([request]) == [("batched", (0, 1, 2), 4, 128)]
    assert request.slots == (7, 3, 11)
    assert request.last_token_indices == (79, 79, 79)
    assert torch.equal(request.tokens[:3, :80], tokens)
    assert not request.tokens[:3, 80:].any() and not request.tokens[3].any()
    assert request.page_table.dtype == torch.int32 and request.tokens.dtype == torch.long
    assert request.page_table_width == 4  # ceil(128 / 32) without a canonical width
    assert torch.equal(request.page_table[:3, :3], table[:, :3])
    assert (request.page_table[:3, 3] == -1).all() and (request.page_table[3] == -1).all()
    assert request.chunks == (PrefillChunk(slice(0, 128), 0, 128, None, True),)
    assert not request.uses_chunked_prefill


def test_lengths_33_128_129_give_a_wave_then_a_single() -> None:
    requests = plan([33, 128, 129], empty_slots=(4, 1, 9))
    assert shape(requests) == [("batched", (0, 1), 2, 128), ("single", (2,), 1, 1024)]
    assert requests[0].slots == (4, 1) and requests[1].slots == (9,)


def test_32_rows_of_1024_with_cap_8_run_as_32_singles() -> None:
    requests = plan([1024] * 32)
    assert [r.source_rows for r in requests] == [(row,) for row in range(32)]
    assert {r.kind for r in requests} == {"single"}


def test_30_rows_of_128_with_cap_32_run_as_one_wave_of_32() -> None:
    assert shape(plan([128] * 30, max_prefill_batch_size=32)) == [
        ("batched", tuple(range(30)), 32, 128)
    ]


@pytest.mark.parametrize(("rows", "padded"), [(15, 16), (3, 4), (2, 2), (8, 8), (9, 16)])
def test_active_rows_round_up_to_the_next_supported_batch(rows: int, padded: int) -> None:
    (request,) = plan([100] * rows, max_prefill_batch_size=32)
    assert request.padded_batch_size == padded and request.active_batch_size == rows


def test_9_rows_with_lane_capacity_12_and_cap_16_run_as_singles() -> None:
    requests = plan([128] * 9, max_batch_size=12, max_prefill_batch_size=16)
    assert len(requests) == 9 and {r.kind for r in requests} == {"single"}


def test_33_rows_have_no_supported_batch_and_run_as_singles() -> None:
    requests = plan([128] * 33, max_batch_size=64, max_prefill_batch_size=32)
    assert len(requests) == 33 and {r.kind for r in requests} == {"single"}


def test_32_rows_batch_at_2048_but_not_at_4096_tokens() -> None:
    common = {"max_prefill_batch_size": 32, "max_prefill_chunk_size": 4096}
    assert shape(plan([2048] * 32, **common)) == [("batched", tuple(range(32)), 32, 2048)]
    assert shape(plan([4096] * 16, **common)) == [("batched", tuple(range(16)), 16, 4096)]
    singles = plan([4096] * 32, **common)  # 32 x 4096 = 131072 is not < the limit
    assert len(singles) == 32 and not any(r.uses_chunked_prefill for r in singles)


def test_cached_4129_token_prompt_chunks_at_absolute_starts_96_and_2144() -> None:
    tokens, table, _ = make_inputs([4129], table_width=264)
    (request,) = plan_prefill_requests(
        tokens=tokens,
        page_table=table,
        start_pos=[96],
        block_size=BLOCK,
        max_batch_size=32,
        max_prefill_chunk_size=2048,
        supports_batched_prefill=True,
        max_actual_page_table_width=200,
        canonical_page_table_width=264,
    )
    assert (request.kind, request.padded_sequence_length, request.page_table_width) == (
        "single",
        4096,
        264,
    )
    assert request.uses_chunked_prefill and request.cached_tokens == (96,)
    assert request.last_token_indices == (4128,)
    assert torch.equal(request.tokens[0, :4033], tokens[0, 96:])
    assert not request.tokens[0, 4033:].any()
    # the full table keeps SDPA-safe 0 filler beyond the 130 allocated blocks
    assert torch.equal(request.page_table[0, :130], table[0, :130])
    assert not request.page_table[0, 130:].any()
    first, second = request.chunks
    assert (first.chunk_start_idx, second.chunk_start_idx) == (96, 2144)
    assert (first.token_slice, second.token_slice) == (slice(0, 2048), slice(2048, 4096))
    assert (first.contains_last_token, second.contains_last_token) == (False, True)
    assert first.chunk_page_table_width == second.chunk_page_table_width == 64
    assert first.chunk_page_table is not None and second.chunk_page_table is not None
    assert torch.equal(first.chunk_page_table[0], table[0, 3:67])
    assert torch.equal(second.chunk_page_table[0, :63], table[0, 67:130])
    assert second.chunk_page_table[0, 63] == -1


def test_uncached_4097_token_prompt_stops_at_the_third_of_four_chunks() -> None:
    tokens, table, _ = make_inputs([4097], table_width=264)
    (request,) = plan_prefill_requests(
        tokens=tokens,
        page_table=table,
        block_size=BLOCK,
        max_batch_size=32,
        max_prefill_chunk_size=2048,
        supports_batched_prefill=True,
        max_actual_page_table_width=200,
        canonical_page_table_width=264,
    )
    assert request.padded_sequence_length == 8192
    assert [c.chunk_start_idx for c in request.chunks] == [0, 2048, 4096]
    assert request.final_chunk.token_slice == slice(4096, 6144)
    assert [c.contains_last_token for c in request.chunks] == [False, False, True]
    final_table = request.final_chunk.chunk_page_table
    assert final_table is not None
    assert final_table[0, 0] == table[0, 128] and (final_table[0, 1:] == -1).all()


def test_cached_prefix_that_fits_one_chunk_is_still_chunked() -> None:
    tokens, table, _ = make_inputs([100])
    (request,) = plan([100], start_pos=[64])
    assert request.uses_chunked_prefill and request.padded_sequence_length == 128
    assert request.page_table_width == 6  # ceil((128 + 64) / 32)
    assert request.page_table[0].tolist() == [*table[0, :4].tolist(), 0, 0]
    (chunk,) = request.chunks
    assert (chunk.chunk_start_idx, chunk.chunk_size, chunk.token_slice) == (64, 128, slice(0, 128))
    assert chunk.chunk_page_table is not None
    assert chunk.chunk_page_table[0].tolist() == [*table[0, 2:4].tolist(), -1, -1]
    assert torch.equal(request.tokens[0, :36], tokens[0, 64:100])


def test_regular_single_table_keeps_minus_one_tail() -> None:
    _, table, _ = make_inputs([200])
    (request,) = plan([200])
    assert (request.kind, request.padded_sequence_length) == ("single", 1024)
    assert request.page_table_width == 32 and not request.uses_chunked_prefill
    assert torch.equal(request.page_table[0, :7], table[0, :7])
    assert (request.page_table[0, 7:] == -1).all()


def test_canonical_width_applies_to_waves_and_singles() -> None:
    requests = plan([100, 100, 300], max_actual_page_table_width=10, canonical_page_table_width=40)
    assert [r.page_table_width for r in requests] == [40, 40]


def test_fully_cached_and_empty_rows_are_not_planned() -> None:
    tokens, table, _ = make_inputs([64, 64, 64])
    requests = plan_prefill_requests(
        tokens=tokens,
        page_table=table,
        prompt_lens=[64, 0, 64],
        start_pos=[64, 0, 0],
        block_size=BLOCK,
        max_batch_size=32,
        max_prefill_chunk_size=2048,
        supports_batched_prefill=True,
    )
    assert shape(requests) == [("single", (2,), 1, 128)]
    assert plan([64], start_pos=[64]) == ()


def test_waves_come_first_in_bucket_order_then_singles_by_source_row() -> None:
    requests = plan([2000, 1000, 100, 1000, 100, 3000, 100, 1500])
    assert shape(requests) == [
        ("batched", (0, 7), 2, 2048),
        ("batched", (1, 3), 2, 1024),
        ("batched", (2, 4, 6), 4, 128),
        ("single", (5,), 1, 4096),
    ]
    requests = plan([3000, 100, 2000, 100])
    assert shape(requests) == [
        ("batched", (1, 3), 2, 128),
        ("single", (0,), 1, 4096),
        ("single", (2,), 1, 2048),
    ]


@pytest.mark.parametrize(
    ("lengths", "overrides"),
    [
        ([128], {}),
        ([128, 128], {"supports_batched_prefill": False}),
        ([128, 128], {"disable_batched_prefill": True}),
        ([128, 128], {"start_pos": [0, 32]}),
        ([3000, 3000], {}),
        ([128] * 9, {"max_prefill_batch_size": 8}),
        ([128] * 5, {"max_batch_size": 6, "max_prefill_batch_size": 32}),
    ],
    ids=["one-row", "unsupported", "disabled", "cached", "too-long", "over-cap", "over-lane"],
)
def test_buckets_fall_back_to_singles(lengths: list[int], overrides: dict[str, Any]) -> None:
    requests = plan(lengths, **overrides)
    assert [r.source_rows for r in requests] == [(row,) for row in range(len(lengths))]


def test_token_limit_comes_from_policy() -> None:
    policy = RuntimePolicy(
        prefill_padding_buckets=(128, 1024),
        chunk_size_multiple=2048,
        decode_lane_capacity_limit=32,
        max_batched_prefill_tokens=512,
    )
    assert shape(plan([100] * 3, policy=policy))[0][0] == "single"  # 4 x 128 = 512
    assert shape(plan([100] * 2, policy=policy)) == [("batched", (0, 1), 2, 128)]


def test_torch_policy_pads_to_powers_of_two_from_32_and_chunks_by_its_multiple() -> None:
    policy = RuntimePolicy.torch_default(chunk_size_multiple=32)
    assert shape(plan([20, 30], policy=policy, max_prefill_chunk_size=64)) == [
        ("batched", (0, 1), 2, 32)
    ]
    (request,) = plan([100], policy=policy, max_prefill_chunk_size=96)
    assert request.padded_sequence_length == 128
    assert [c.chunk_size for c in request.chunks] == [64, 64]  # 96 does not divide 128


# --- legacy path (supports_batched_prefill=None) --------------------------------------------


def test_legacy_batches_contiguous_128_rows_ignoring_max_prefill_batch_size() -> None:
    requests = plan([100] * 4, supports_batched_prefill=None, max_prefill_batch_size=1)
    assert shape(requests) == [("batched", (0, 1, 2, 3), 4, 128)]


@pytest.mark.parametrize(
    ("lengths", "overrides"),
    [
        ([100, 100], {"empty_slots": (1, 0)}),
        ([100, 300], {}),
        ([100, 100, 64], {"start_pos": [0, 0, 64]}),
        ([100, 100], {"start_pos": [0, 32]}),
        ([300, 300], {}),
        ([100] * 5, {"max_batch_size": 6}),
        ([100, 100], {"disable_batched_prefill": True}),
        ([100], {}),
    ],
    ids=[
        "slots",
        "two-buckets",
        "fully-cached",
        "cached",
        "not-128",
        "lane",
        "disabled",
        "one-row",
    ],
)
def test_legacy_falls_back_to_singles(lengths: list[int], overrides: dict[str, Any]) -> None:
    requests = plan(lengths, supports_batched_prefill=None, **overrides)
    assert {r.kind for r in requests} == {"single"}


def test_legacy_token_limit() -> None:
    policy = RuntimePolicy(
        prefill_padding_buckets=(128, 1024),
        chunk_size_multiple=2048,
        decode_lane_capacity_limit=32,
        max_batched_prefill_tokens=512,
    )
    assert {r.kind for r in plan([100] * 4, supports_batched_prefill=None, policy=policy)} == {
        "single"
    }
    assert shape(plan([100] * 2, supports_batched_prefill=None, policy=policy)) == [
        ("batched", (0, 1), 2, 128)
    ]


# --- DISABLE_BATCHED_PREFILL -----------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", " yes "])
def test_true_ish_env_value_disables_batching_on_every_call(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert plan([100, 100])[0].kind == "batched"
    monkeypatch.setenv("DISABLE_BATCHED_PREFILL", value)
    assert {r.kind for r in plan([100, 100])} == {"single"}
    assert {r.kind for r in plan([100, 100], supports_batched_prefill=None)} == {"single"}
    monkeypatch.delenv("DISABLE_BATCHED_PREFILL")
    assert plan([100, 100])[0].kind == "batched"


@pytest.mark.parametrize("value", ["0", "false", "off", "2"])
def test_other_env_values_are_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    unique = f"{value}-{id(caplog)}"  # the warning is emitted once per distinct value
    monkeypatch.setenv("DISABLE_BATCHED_PREFILL", unique)
    with caplog.at_level(logging.WARNING, logger="runtime.prefill.plan"):
        assert plan([100, 100])[0].kind == "batched"
        assert plan([100, 100])[0].kind == "batched"
    warnings = [r for r in caplog.records if "DISABLE_BATCHED_PREFILL" in r.getMessage()]
    assert len(warnings) == 1 and unique in warnings[0].getMessage()


def test_env_helper_reads_a_given_mapping(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.prefill.plan"):
        assert batched_prefill_disabled_by_env({"DISABLE_BATCHED_PREFILL": "yes"})
        assert not batched_prefill_disabled_by_env({"DISABLE_BATCHED_PREFILL": ""})
        assert not batched_prefill_disabled_by_env({})
    assert not caplog.records


# --- input validation ------------------------------------------------------------------------


def _bad(**overrides: Any) -> None:
    plan([100, 100], **overrides)


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ({"tokens": [[1, 2]]}, ValueError, "tokens must be a rank-2 torch tensor"),
        ({"tokens": torch.ones(2, dtype=torch.long)}, ValueError, "tokens must be a rank-2"),
        ({"tokens": torch.ones(2, 100)}, ValueError, "tokens must have an integer dtype"),
        ({"page_table": torch.ones(2, dtype=torch.int32)}, ValueError, "page_table must be"),
        ({"page_table": torch.ones(3, 4, dtype=torch.int32)}, ValueError, "same batch"),
        ({"prompt_lens": torch.ones(2, 1, dtype=torch.long)}, ValueError, "prompt_lens must be"),
        ({"prompt_lens": [100]}, ValueError, "prompt_lens has 1 entries"),
        ({"prompt_lens": [100.0, 100.0]}, ValueError, "prompt_lens must contain only ints"),
        ({"start_pos": [0, 0, 0]}, ValueError, "start_pos has 3 entries"),
        ({"empty_slots": (0,)}, ValueError, "empty_slots has 1 entries"),
        ({"empty_slots": (3, 3)}, ValueError, "empty_slots must contain unique lane-local"),
        ({"empty_slots": (0, 32)}, ValueError, "empty_slots must contain unique lane-local"),
        ({"empty_slots": (-1, 0)}, ValueError, "empty_slots must contain unique lane-local"),
        ({"max_actual_page_table_width": 8}, ValueError, "must be given together"),
        ({"canonical_page_table_width": 8}, ValueError, "must be given together"),
        (
            {"max_actual_page_table_width": 0, "canonical_page_table_width": 8},
            ValueError,
            "max_actual_page_table_width must be a positive integer",
        ),
        (
            {"max_actual_page_table_width": 16, "canonical_page_table_width": 8},
            ValueError,
            "canonical_page_table_width must be >= max_actual_page_table_width",
        ),
        (
            {"max_actual_page_table_width": 4, "canonical_page_table_width": 12},
            ValueError,
            "multiple of 8",
        ),
        ({"prompt_lens": [101, 100]}, ValueError, "0 <= start_pos <= prompt_len <= token width"),
        ({"prompt_lens": [-1, 100]}, ValueError, "0 <= start_pos <= prompt_len"),
        ({"start_pos": [-32, 0]}, ValueError, "0 <= start_pos <= prompt_len"),
        ({"start_pos": [0, 128]}, ValueError, "0 <= start_pos <= prompt_len"),
        ({"start_pos": [0, 16]}, ValueError, "cached prefill start for row 1 must be block"),
        ({"block_size": 0}, ValueError, "block_size must be a positive integer"),
        ({"max_batch_size": True}, ValueError, "max_batch_size must be a positive integer"),
        ({"max_prefill_chunk_size": -1}, ValueError, "max_prefill_chunk_size must be"),
        ({"max_prefill_batch_size": 0}, ValueError, "max_prefill_batch_size must be"),
        ({"supports_batched_prefill": 1}, TypeError, "supports_batched_prefill must be bool"),
        ({"disable_batched_prefill": None}, TypeError, "disable_batched_prefill must be bool"),
        ({"policy": "ttnn"}, TypeError, "policy must be a RuntimePolicy"),
    ],
)
def test_invalid_inputs_are_rejected(
    overrides: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        _bad(**overrides)


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        plan_prefill_requests(
            tokens=torch.zeros(0, 4, dtype=torch.long),
            page_table=torch.zeros(0, 1, dtype=torch.int32),
            block_size=BLOCK,
            max_batch_size=4,
            max_prefill_chunk_size=2048,
        )


def test_prompt_beyond_paged_kv_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds the configured paged-KV capacity of 3 blocks"):
        plan([100, 100], max_actual_page_table_width=3, canonical_page_table_width=8)


def test_narrow_caller_page_table_is_rejected() -> None:
    _, table, _ = make_inputs([100, 100], table_width=3)
    with pytest.raises(ValueError, match="page table is too narrow for row 0"):
        plan([100, 100], page_table=table)
    with pytest.raises(ValueError, match="page table is too narrow for row 1"):
        plan([64, 100], page_table=table, start_pos=[0, 32])


def test_request_beyond_canonical_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds the canonical page-table capacity"):
        plan([4097], max_actual_page_table_width=200, canonical_page_table_width=200)


def test_chunk_lengths_must_be_multiples_of_the_policy_multiple() -> None:
    with pytest.raises(ValueError, match="prefill chunk lengths must be multiples of 2048"):
        plan([3000], max_prefill_chunk_size=3000)
    with pytest.raises(ValueError, match="prefill chunk lengths must be positive"):
        prefill_chunk_size(4096, 0)
    with pytest.raises(ValueError, match="multiples of 32"):
        prefill_chunk_size(128, 48, policy=RuntimePolicy.torch_default(chunk_size_multiple=32))


@pytest.mark.parametrize(
    ("padded", "maximum", "size"),
    [(128, 2048, 128), (2048, 2048, 2048), (8192, 2048, 2048), (8192, 6144, 4096)],
)
def test_chunk_size_is_the_largest_dividing_multiple(padded: int, maximum: int, size: int) -> None:
    assert prefill_chunk_size(padded, maximum) == size


# --- value validation ------------------------------------------------------------------------


def _chunk(**overrides: Any) -> PrefillChunk:
    fields: dict[str, Any] = {
        "token_slice": slice(0, 128),
        "chunk_start_idx": 0,
        "chunk_size": 128,
        "chunk_page_table": None,
        "contains_last_token": True,
    }
    fields.update(overrides)
    return PrefillChunk(**fields)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"token_slice": (0, 128)}, "token_slice must be a slice"),
        ({"token_slice": slice(0, 128, 2)}, "step must be None or 1"),
        ({"token_slice": slice(None, 128)}, "explicit ints"),
        ({"token_slice": slice(0, None)}, "explicit ints"),
        ({"token_slice": slice(128, 128)}, "0 <= start < stop"),
        ({"token_slice": slice(-1, 127)}, "0 <= start < stop"),
        ({"token_slice": slice(0, 64)}, "covers 64 tokens, chunk_size is 128"),
        ({"chunk_start_idx": -1}, "chunk_start_idx must be an int >= 0"),
        ({"chunk_size": 0, "token_slice": slice(0, 1)}, "chunk_size must be a positive"),
        ({"chunk_page_table": torch.zeros(4)}, "rank-2 torch tensor"),
        ({"chunk_page_table": [[1]]}, "rank-2 torch tensor"),
    ],
)
def test_invalid_chunks_are_rejected(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        _chunk(**overrides)


def _request(**overrides: Any) -> PrefillRequest:
    fields: dict[str, Any] = {
        "kind": "batched",
        "source_rows": (0, 1),
        "slots": (0, 1),
        "tokens": torch.zeros(2, 128, dtype=torch.long),
        "page_table": torch.full((2, 4), -1, dtype=torch.int32),
        "prompt_lengths": (100, 100),
        "cached_tokens": (0, 0),
        "last_token_indices": (99, 99),
        "padded_sequence_length": 128,
        "padded_batch_size": 2,
        "chunks": (_chunk(),),
        "uses_chunked_prefill": False,
    }
    fields.update(overrides)
    return PrefillRequest(**fields)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"kind": "wave"}, "kind must be one of"),
        ({"source_rows": ()}, "source_rows must be a non-empty tuple of ints"),
        ({"slots": [0, 1]}, "slots must be a non-empty tuple of ints"),
        ({"slots": (0,)}, "slots has 1 entries, source_rows has 2"),
        ({"last_token_indices": (99,)}, "last_token_indices has 1 entries"),
        ({"slots": (1, 1)}, "must be unique"),
        ({"kind": "single"}, "single request has exactly one row"),
        ({"padded_batch_size": 1, "tokens": torch.zeros(1, 128)}, "exceed padded_batch_size"),
        ({"tokens": torch.zeros(2, 64)}, "tokens shape (2, 64) must be"),
        ({"tokens": torch.zeros(256)}, "tokens must be a rank-2 torch tensor"),
        ({"page_table": torch.zeros(3, 4)}, "page_table has 3 rows"),
        ({"last_token_indices": (100, 99)}, "row positions must satisfy"),
        ({"cached_tokens": (0, 100)}, "row positions must satisfy"),
        ({"padded_sequence_length": 0}, "padded_sequence_length must be a positive"),
        ({"chunks": ()}, "chunks must be a non-empty tuple"),
        ({"chunks": ("chunk",)}, "only PrefillChunk"),
        ({"chunks": (_chunk(contains_last_token=False),)}, "exactly one chunk, the final one"),
        (
            {
                "chunks": (
                    _chunk(token_slice=slice(0, 64), chunk_size=64),
                    _chunk(token_slice=slice(64, 128), chunk_size=64, contains_last_token=False),
                )
            },
            "exactly one chunk, the final one",
        ),
        ({"chunks": (_chunk(token_slice=slice(64, 192)),)}, "extends beyond"),
        ({"uses_chunked_prefill": True}, "uses_chunked_prefill=True must equal"),
        (
            {"chunks": (_chunk(chunk_page_table=torch.zeros(1, 4, dtype=torch.int32)),)},
            "chunk page table has 1 rows",
        ),
    ],
)
def test_invalid_requests_are_rejected(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _request(**overrides)


def test_requests_compare_by_value_including_tensors() -> None:
    assert _request() == _request()
    assert hash(_request()) == hash(_request())
    assert _request() != _request(page_table=torch.full((2, 4), 0, dtype=torch.int32))
    assert _request() != _request(page_table=torch.full((2, 4), -1, dtype=torch.int64))
    assert plan([100, 200, 3000], start_pos=[0, 32, 0]) == plan(
        [100, 200, 3000], start_pos=[0, 32, 0]
    )
    assert _chunk(chunk_page_table=torch.zeros(1, 4)) != _chunk()


# --- restoring source order ------------------------------------------------------------------


def test_restore_source_order_places_results_and_leaves_unplanned_rows_empty() -> None:
    requests = plan([100, 100, 500, 64], start_pos=[0, 0, 0, 64])
    per_request = [tuple(f"row{row}" for row in r.source_rows) for r in requests]
    assert restore_source_order(requests, per_request, 4) == ("row0", "row1", "row2", None)


def test_restore_source_order_validates_its_inputs() -> None:
    requests = plan([100, 100, 500])
    with pytest.raises(ValueError, match="per_request_rows has 1 entries"):
        restore_source_order(requests, [("a", "b")], 3)
    with pytest.raises(ValueError, match="has 2 active rows, got 1 results"):
        restore_source_order(requests, [("a",), ("c",)], 3)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        restore_source_order(requests, [("a", "b"), ("c",)], 2)
    with pytest.raises(ValueError, match="appears twice"):
        restore_source_order([requests[1], requests[1]], [("c",), ("c",)], 3)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        restore_source_order(requests, [("a", "b"), ("c",)], 0)

"""The vLLM worker's request table and step planner (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.vllm_plugin.batch import RequestTable


def table() -> RequestTable:
    return RequestTable(max_slots=4, block_size=4, decode_width=8)


def test_new_prefill_rows_are_whole_prompts_from_zero_with_engine_blocks() -> None:
    t = table()
    t.add("a", [5, 6, 7, 8, 9, 10], [3, 7], 0)
    t.add("b", [1, 2, 3], [4], 0)
    plan = t.plan({"a": 6, "b": 3})
    assert plan.decode is None and plan.prefill is not None
    batch = plan.prefill
    assert batch.req_ids == ("a", "b")
    assert batch.tokens.dtype == torch.int32
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9, 10], [1, 2, 3, 0, 0, 0]]
    assert batch.page_table.tolist() == [[3, 7, 0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.prompt_lens.dtype == np.int64 and batch.prompt_lens.tolist() == [6, 3]
    assert batch.start_pos.dtype == np.int32 and batch.start_pos.tolist() == [0, 0]
    assert batch.sample == (True, True)
    assert len(set(batch.empty_slots)) == 2


def test_chunks_start_at_the_block_boundary_and_sample_only_at_the_end() -> None:
    t = table()
    t.add("a", list(range(1, 11)), [1, 2, 3], 0)
    first = t.plan({"a": 5}).prefill
    assert first is not None and first.prompt_lens.tolist() == [5] and first.sample == (False,)
    t.update("a", num_computed=5, new_block_ids=None, resumed=False)
    second = t.plan({"a": 5}).prefill
    assert second is not None
    assert second.start_pos.tolist() == [4]  # 5 rounded down to the block start
    assert second.prompt_lens.tolist() == [10] and second.sample == (True,)
    assert second.page_table[0, :4].tolist() == [1, 2, 3, 0]


def test_prefix_hit_starts_at_the_cached_offset() -> None:
    t = table()
    t.add("a", list(range(1, 11)), [9, 8, 7], 8)
    batch = t.plan({"a": 2}).prefill
    assert batch is not None and batch.start_pos.tolist() == [8] and batch.sample == (True,)


def test_decode_rows_sit_at_their_slot_with_padding() -> None:
    t = table()
    t.add("a", [1, 2, 3], [5], 0)
    t.add("b", [4, 5, 6, 7], [6], 0)
    t.plan({"a": 3, "b": 4})
    t.append_token("a", 11)
    t.append_token("b", 12)
    t.update("a", num_computed=3, new_block_ids=None, resumed=False)
    t.update("b", num_computed=4, new_block_ids=[9], resumed=False)
    plan = t.plan({"a": 1, "b": 1})
    assert plan.prefill is None and plan.decode is not None
    decode = plan.decode
    slot_a, slot_b = t["a"].slot, t["b"].slot
    assert decode.tokens.shape == (4, 1) and decode.page_table.shape == (4, 8)
    assert decode.tokens[slot_a, 0] == 11 and decode.tokens[slot_b, 0] == 12
    assert decode.start_pos[slot_a] == 3 and decode.start_pos[slot_b] == 4
    assert decode.page_table[slot_b, :2].tolist() == [6, 9]
    idle = [s for s in range(4) if s not in (slot_a, slot_b)]
    assert all(decode.start_pos[s] == -1 for s in idle)
    assert all(decode.page_table[s].eq(0).all() for s in idle)


def test_resumed_request_replaces_its_blocks_and_recomputes_prompt_and_output() -> None:
    t = table()
    t.add("a", [1, 2, 3], [5], 0)
    t.plan({"a": 3})
    t.append_token("a", 40)
    t.release_slot("a")
    assert t["a"].slot is None
    t.update("a", num_computed=0, new_block_ids=[8], resumed=True, num_output_tokens=1)
    batch = t.plan({"a": 4}).prefill
    assert batch is not None
    assert batch.tokens.tolist() == [[1, 2, 3, 40]] and batch.page_table[0, :2].tolist() == [8, 0]
    assert batch.sample == (True,)


def test_finished_requests_free_their_slots() -> None:
    t = table()
    for name in "abcd":
        t.add(name, [1], [1], 0)
    t.plan(dict.fromkeys("abcd", 1))
    t.finish("a")
    t.add("e", [1], [2], 0)
    t.plan({"b": 1, "c": 1, "d": 1, "e": 1})
    assert sorted(t[r].slot for r in "bcde") == [0, 1, 2, 3]  # type: ignore[type-var]


def test_bad_steps_are_refused_with_their_numbers() -> None:
    t = table()
    t.add("a", [1, 2], [1], 0)
    with pytest.raises(RuntimeError, match=r"3 scheduled tokens after 0 computed exceed its 2"):
        t.plan({"a": 3})
    with pytest.raises(RuntimeError, match=r"request 'z' was scheduled but never added"):
        t.plan({"z": 1})
    t.add("b", [1] * 9, [1], 0)
    with pytest.raises(
        RuntimeError, match=r"needs 3 KV blocks for 9 tokens but the engine gave it 1"
    ):
        t.plan({"b": 9})

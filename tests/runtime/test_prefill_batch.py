"""The prefill boundary: caller input becomes one checked, frozen `PrefillBatch`."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from runtime.config import RuntimePolicy
from runtime.prefill.batch import (
    PREFILL_KEYWORDS,
    PlanLimits,
    PrefillArguments,
    check_batch,
    check_prefill_keywords,
)
from runtime.sampling import SamplingParams
from tests.runtime.prefill_setup import BLOCK, LANES, PrefillHarness, make_harness, prompt
from tests.runtime.prefill_setup import token_matrix as tokens_of


def _limits(**overrides: Any) -> PlanLimits:
    values: dict[str, Any] = {
        "block_size": BLOCK,
        "max_batch_size": LANES,
        "max_prefill_chunk_size": 2048,
        "max_prefill_batch_size": 8,
        "supports_batched_prefill": True,
        "disable_batched_prefill": False,
        "max_actual_width": None,
        "canonical_width": None,
        "policy": RuntimePolicy.torch_default(),
    }
    values.update(overrides)
    return PlanLimits.checked(**values)


def _arguments(rows: int = 2, width: int = 16, **extra: Any) -> PrefillArguments:
    arguments = PrefillArguments(
        tokens=torch.ones(rows, width, dtype=torch.long),
        page_table=torch.zeros(rows, -(-width // BLOCK), dtype=torch.int32),
    )
    arguments.update(extra)  # type: ignore[typeddict-item]
    return arguments


def test_the_batch_fills_defaults_and_is_frozen() -> None:
    batch = check_batch(_arguments(rows=3, width=16), _limits())
    assert batch.batch_size == 3
    assert batch.prompt_lens == (16, 16, 16)
    assert batch.cached_tokens == (0, 0, 0)
    assert batch.slots == (0, 1, 2)
    assert batch.sampling_params is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        batch.slots = (2, 1, 0)  # type: ignore[misc]


def test_tensor_and_list_vectors_become_the_same_tuples() -> None:
    from_lists = check_batch(
        _arguments(prompt_lens=[16, 9], start_pos=[8, 0], empty_slots=[5, 2]), _limits()
    )
    from_tensors = check_batch(
        _arguments(
            prompt_lens=torch.tensor([16, 9]),
            start_pos=torch.tensor([8, 0]),
            empty_slots=torch.tensor([5, 2]),
        ),
        _limits(),
    )
    for batch in (from_lists, from_tensors):
        assert (batch.prompt_lens, batch.cached_tokens, batch.slots) == ((16, 9), (8, 0), (5, 2))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prompt_lens": [16]}, "prompt_lens has 1 entries, the batch has 2 rows"),
        ({"start_pos": [3, 0]}, "must be block aligned"),
        ({"empty_slots": [0, LANES]}, "unique lane-local slots"),
        ({"prompt_lens": [17, 4]}, "row 0 must satisfy 0 <= start_pos <= prompt_len"),
    ],
)
def test_row_errors_name_the_argument(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_batch(_arguments(**extra), _limits())


def test_a_fully_cached_row_is_not_held_to_the_table_width() -> None:
    arguments = _arguments(rows=2, width=32, prompt_lens=[32, 8], start_pos=[32, 0])
    arguments["page_table"] = torch.zeros(2, 1, dtype=torch.int32)
    batch = check_batch(arguments, _limits())
    assert batch.cached_tokens == (32, 0)
    arguments["start_pos"] = [0, 0]
    with pytest.raises(ValueError, match="page table is too narrow for row 0"):
        check_batch(arguments, _limits())


def test_sampling_history_is_checked_only_with_sampling_params() -> None:
    history = torch.zeros(3, 4, dtype=torch.int64)  # neither 1, the batch (2) nor the lane
    unsampled = check_batch(_arguments(prompt_tokens=history), _limits(), _arguments())
    assert unsampled.prompt_tokens is None
    sampled = _arguments(sampling_params=SamplingParams(), prompt_tokens=history)
    with pytest.raises(ValueError, match="prefill sampling state prompt_tokens has 3 rows"):
        check_batch(sampled, _limits(), sampled)
    sampled["prompt_tokens"] = history.float()[:1]
    with pytest.raises(TypeError, match="prompt_tokens must be an integer tensor"):
        check_batch(sampled, _limits(), sampled)


def test_keyword_names_are_checked_like_a_keyword_list() -> None:
    assert {"tokens", "page_table", "slot_remap", "sampling_params"} <= PREFILL_KEYWORDS
    with pytest.raises(TypeError, match=r"^prefill_forward\(\) got an unexpected .* 'mystery'"):
        check_prefill_keywords("prefill_forward", {**_arguments(), "mystery": 1})
    with pytest.raises(TypeError, match="'kv_cache': executors use the manager-owned cache"):
        check_prefill_keywords("compile_prefill", {**_arguments(), "kv_cache": []})
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'page_table'"):
        check_prefill_keywords("prepare", {"tokens": torch.ones(1, 4, dtype=torch.long)})


def test_plan_limits_refuse_bad_planner_arguments() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        _limits(block_size=0)
    with pytest.raises(TypeError, match="disable_batched_prefill must be bool"):
        _limits(disable_batched_prefill=1)
    with pytest.raises(ValueError, match="must be given together"):
        _limits(max_actual_width=4)


def test_runtime_prepare_refuses_an_unknown_keyword_before_planning() -> None:
    harness: PrefillHarness = make_harness()
    prompts = [prompt(12, seed=3)]
    arguments: dict[str, Any] = {
        "tokens": tokens_of(prompts),
        "page_table": harness.page_table(prompts),
        "start_pos": [4],  # not block aligned: a later check would fail differently
        "stray": True,
    }
    with pytest.raises(TypeError, match=r"prepare\(\) got an unexpected keyword argument 'stray'"):
        harness.runtime.prepare(**arguments)
    arguments.pop("stray")
    with pytest.raises(ValueError, match="must be block aligned"):
        harness.runtime.prepare(**arguments)
    assert harness.runtime.transient_orphan_count == 0

"""SamplingParams validation and the device normalisation of reference §2.7 / §3."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    merge_log_probs,
    place_prepared_sampling_params,
    prepare_sampling_params,
    sampled_log_probs_for_rows,
    slice_prepared_sampling_params,
    slice_sampling_params,
)


def prep(sp: SamplingParams, batch_size: int = 4, **kwargs: Any) -> PreparedSamplingParams:
    kwargs.setdefault("max_device_top_k", 32)
    kwargs.setdefault("allow_force_argmax", True)
    return prepare_sampling_params(sp, batch_size, **kwargs)


# ---- SamplingParams construction --------------------------------------------------------


def test_defaults_are_greedy_and_neutral() -> None:
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.0, 0, 1.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.seed is None and sp.enable_log_probs is False and sp.num_logprobs == 0
    assert sp.num_rows == 1


def test_tensors_become_scalars_or_tuples() -> None:
    sp = SamplingParams(
        temperature=torch.tensor([0.5, 1.0]),
        top_k=torch.tensor(7),
        top_p=torch.tensor([[0.25], [0.5]]),
        seed=torch.tensor([3, -1]),
        enable_log_probs=torch.tensor([True, False]),
    )
    assert sp.temperature == (0.5, 1.0)
    assert sp.top_k == 7 and isinstance(sp.top_k, int)
    assert sp.top_p == (0.25, 0.5)
    assert sp.seed == (3, None)
    assert sp.enable_log_probs == (True, False)
    assert sp.num_rows == 2


def test_scalar_minus_one_seed_is_none_and_values_are_hashable() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert hash(SamplingParams(top_k=[1, 2])) == hash(SamplingParams(top_k=(1, 2)))


@pytest.mark.parametrize(
    ("kwargs", "error", "fragments"),
    [
        ({"temperature": -0.5}, ValueError, ["temperature", "all rows", "-0.5", ">= 0"]),
        ({"temperature": [0.5, -1.0]}, ValueError, ["temperature", "row 1", "-1.0", ">= 0"]),
        ({"temperature": math.nan}, ValueError, ["temperature", "all rows", "finite"]),
        ({"temperature": "hot"}, TypeError, ["temperature"]),
        ({"temperature": [0.5, "x"]}, TypeError, ["temperature", "row 1", "real number"]),
        ({"temperature": []}, ValueError, ["temperature", "empty"]),
        ({"top_p": 0.0}, ValueError, ["top_p", "all rows", "(0, 1]"]),
        ({"top_p": [1.0, 1.0, 1.5]}, ValueError, ["top_p", "row 2", "1.5", "(0, 1]"]),
        ({"top_p": [0.5, -0.1]}, ValueError, ["top_p", "row 1", "(0, 1]"]),
        ({"top_k": -1}, ValueError, ["top_k", "all rows", "-1", ">= 0"]),
        ({"top_k": [4, -2]}, ValueError, ["top_k", "row 1", "-2", ">= 0"]),
        ({"top_k": 2.5}, TypeError, ["top_k", "all rows", "int"]),
        ({"top_k": [1, True]}, TypeError, ["top_k", "row 1", "int"]),
        ({"top_k": torch.tensor([4.0])}, TypeError, ["top_k", "row 0", "int"]),
        ({"repetition_penalty": 0.0}, ValueError, ["repetition_penalty", "all rows", "> 0"]),
        ({"repetition_penalty": [1.0, -1.2]}, ValueError, ["repetition_penalty", "row 1", "> 0"]),
        (
            {"presence_penalty": [0.0, math.inf]},
            ValueError,
            ["presence_penalty", "row 1", "finite"],
        ),
        ({"frequency_penalty": math.nan}, ValueError, ["frequency_penalty", "all rows", "finite"]),
        ({"seed": -2}, ValueError, ["seed", "all rows", "-2", "2**64"]),
        ({"seed": [1, 2**64]}, ValueError, ["seed", "row 1", "2**64"]),
        ({"seed": 1.5}, TypeError, ["seed", "all rows", "int"]),
        ({"enable_log_probs": 1}, TypeError, ["enable_log_probs", "all rows", "bool"]),
        ({"enable_log_probs": [True, 0]}, TypeError, ["enable_log_probs", "row 1", "bool"]),
        ({"num_logprobs": [0, -1]}, ValueError, ["num_logprobs", "row 1", ">= 0"]),
    ],
)
def test_invalid_parameters_name_row_and_field(
    kwargs: dict[str, Any], error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_negative_presence_and_frequency_penalties_are_allowed() -> None:
    sp = SamplingParams(presence_penalty=-0.5, frequency_penalty=[-1.0, 0.5])
    assert sp.presence_penalty == -0.5 and sp.frequency_penalty == (-1.0, 0.5)


# ---- prepare: policy and shape rules ----------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: prep(object(), 2), TypeError, "sp must be SamplingParams"),  # type: ignore[arg-type]
        (lambda: prep(SamplingParams(), 0), ValueError, "batch_size"),
        (lambda: prep(SamplingParams(), True), ValueError, "batch_size"),
        (lambda: prep(SamplingParams(), 2, max_device_top_k=0), ValueError, "max_device_top_k"),
        (lambda: prep(SamplingParams(), 2, allow_force_argmax=1), TypeError, "allow_force_argmax"),
        (lambda: prep(SamplingParams(temperature=[0.0] * 3), 2), ValueError, "3 rows"),
    ],
)
def test_policy_validation(call: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        call()


def test_active_rows_follow_temperature_and_the_rest_is_neutral() -> None:
    sp = SamplingParams(
        temperature=[0.5, 0.25],
        top_k=8,
        top_p=0.9,
        presence_penalty=0.5,
        repetition_penalty=1.5,
        enable_log_probs=True,
    )
    p = prep(sp, 4)
    assert p.active_rows == 2 and p.active_mask == (True, True, False, False)
    assert p.top_k == (8, 8, 1, 1)
    assert p.top_p == (0.9, 0.9, 0.0, 0.0)
    assert p.inverse_temperature == (2.0, 4.0, 1.0, 1.0)
    assert p.presence_penalty == (0.5, 0.5, 0.0, 0.0)
    assert p.repetition_penalty == (1.5, 1.5, 1.0, 1.0)
    assert p.enable_log_probs == (True, True, False, False)
    assert p.logprob_modes == ("sampled_token", "sampled_token", "none", "none")
    assert p.row_paths == ("topk", "topk", "inactive", "inactive")
    assert p.greedy_mask == (False, False, False, False)


def test_per_row_sequences_and_length_one_broadcast() -> None:
    sp = SamplingParams(temperature=[1.0, 1.0, 1.0], top_k=[2, 3, 4], top_p=[0.5])
    p = prep(sp, 4)
    assert p.top_k == (2, 3, 4, 1)
    assert p.top_p == (0.5, 0.5, 0.5, 0.0)


def test_sequence_shorter_than_active_rows_is_rejected() -> None:
    sp = SamplingParams(temperature=[1.0, 1.0, 1.0], top_k=[2, 3])
    with pytest.raises(ValueError, match=r"top_k has 2 values but active row 2"):
        prep(sp, 4)


def test_sequence_longer_than_batch_is_rejected() -> None:
    sp = SamplingParams(temperature=1.0, top_k=[2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match=r"top_k has 5 values but the sampling batch has 4"):
        prep(sp, 4)


def test_scalar_seed_applies_to_row_zero_only() -> None:
    p = prep(SamplingParams(temperature=[0.0, 0.0, 0.0], seed=11), 4)
    assert p.seeds == (11, None, None, None)
    assert p.seeded


def test_vector_seeds_are_per_row_and_minus_one_means_none() -> None:
    p = prep(SamplingParams(temperature=[0.0, 0.0, 0.0], seed=[5, -1, 7]), 4)
    assert p.seeds == (5, None, 7, None)
    with pytest.raises(ValueError, match="seed has 5 values"):
        prep(SamplingParams(temperature=0.0, seed=[1, 2, 3, 4, 5]), 4)


def test_greedy_rows_use_the_device_representation_and_skip_the_top_k_check() -> None:
    sp = SamplingParams(temperature=[0.0, 0.0], top_k=[50_000, 0], top_p=0.3)
    p = prep(sp, 2, max_device_top_k=32)
    assert p.greedy_mask == (True, True)
    assert p.top_k == (1, 1) and p.top_p == (0.0, 0.0)
    assert p.inverse_temperature == (1.0, 1.0)
    assert p.all_active_rows_greedy


@pytest.mark.parametrize("top_k", [33, 0])
def test_stochastic_top_k_outside_device_range_is_rejected_not_clamped(top_k: int) -> None:
    sp = SamplingParams(temperature=[0.0, 0.8], top_k=[1, top_k])
    with pytest.raises(ValueError) as info:
        prep(sp, 2, max_device_top_k=32)
    message = str(info.value)
    for fragment in (
        "row 1",
        f"top_k={top_k}",
        "outside the device-supported range",
        "[1, 32]",
        "route this request to host sampling",
    ):
        assert fragment in message


def test_stochastic_top_k_at_the_bounds_is_accepted() -> None:
    p = prep(SamplingParams(temperature=[1.0, 1.0], top_k=[1, 32]), 2, max_device_top_k=32)
    assert p.top_k == (1, 32)


def test_tiny_temperature_whose_inverse_overflows_is_rejected() -> None:
    with pytest.raises(ValueError, match="row 0: temperature=1e-300 is too small"):
        prep(SamplingParams(temperature=1e-300, top_k=4), 1)


def test_log_prob_modes() -> None:
    sp = SamplingParams(
        temperature=[0.0, 0.0, 0.0], enable_log_probs=[False, True, True], num_logprobs=[5, 0, 3]
    )
    p = prep(sp, 3)
    assert p.logprob_modes == ("none", "sampled_token", "top_n")
    assert p.num_logprobs == (0, 0, 3)  # forced to 0 when disabled
    assert p.log_probs_enabled and p.max_num_logprobs == 3


def test_single_log_prob_flag_broadcasts_to_every_active_row() -> None:
    p = prep(SamplingParams(temperature=[0.0, 0.0], enable_log_probs=[True]), 3)
    assert p.enable_log_probs == (True, True, False)


def test_row_and_batch_paths() -> None:
    greedy = SamplingParams(temperature=[0.0, 0.0])
    assert prep(greedy, 4).row_paths == ("argmax", "argmax", "inactive", "inactive")
    assert prep(greedy, 4).sampling_path == "argmax"
    assert prep(greedy, 4).all_active_rows_argmax
    no_force = prep(greedy, 4, allow_force_argmax=False)
    assert no_force.row_paths[:2] == ("topk", "topk") and no_force.sampling_path == "topk"
    with_logprobs = prep(SamplingParams(temperature=[0.0, 0.0], enable_log_probs=[False, True]), 2)
    assert with_logprobs.row_paths == ("argmax", "topk")
    assert with_logprobs.sampling_path == "topk"
    assert with_logprobs.all_active_rows_greedy and not with_logprobs.all_active_rows_argmax
    mixed = prep(SamplingParams(temperature=[0.0, 1.0], top_k=4), 2)
    assert mixed.row_paths == ("argmax", "topk") and mixed.sampling_path == "topk"


def test_penalties_enabled_only_counts_active_rows() -> None:
    assert not prep(SamplingParams(temperature=[0.0, 0.0]), 2).penalties_enabled
    assert prep(SamplingParams(temperature=0.0, frequency_penalty=0.1), 2).penalties_enabled
    assert prep(SamplingParams(temperature=0.0, repetition_penalty=1.1), 2).penalties_enabled
    masked = prep(
        SamplingParams(temperature=0.0, presence_penalty=[0.0, 0.7]),
        2,
        active_mask=[True, False],
    )
    assert not masked.penalties_enabled


# ---- active_mask (slot-indexed decode form) ---------------------------------------------


def test_active_mask_makes_sequences_slot_indexed_and_neutralises_inactive_slots() -> None:
    sp = SamplingParams(
        temperature=[0.5, 0.7, 1.0, 0.0],
        top_k=[2, 3, 4, 5],
        seed=[1, 2, 3, 4],
        enable_log_probs=True,
        repetition_penalty=[1.1, 1.2, 1.3, 1.4],
    )
    p = prep(sp, 4, active_mask=[False, True, False, True])
    assert p.active_rows == 2
    assert p.row_paths == ("inactive", "topk", "inactive", "topk")
    assert p.top_k == (1, 3, 1, 1)
    assert p.inverse_temperature == (1.0, 1.0 / 0.7, 1.0, 1.0)
    assert p.seeds == (None, 2, None, 4)
    assert p.enable_log_probs == (False, True, False, True)
    assert p.repetition_penalty == (1.0, 1.2, 1.0, 1.4)
    assert p.greedy_mask == (False, False, False, True)


def test_active_mask_scalar_seed_belongs_to_slot_zero() -> None:
    sp = SamplingParams(temperature=0.0, seed=9)
    assert prep(sp, 3, active_mask=[True, True, False]).seeds == (9, None, None)
    assert prep(sp, 3, active_mask=[False, True, True]).seeds == (None, None, None)


def test_active_mask_accepts_tensors_and_needs_coverage() -> None:
    p = prep(SamplingParams(temperature=1.0, top_k=2), 3, active_mask=torch.tensor([1, 0, 1]) > 0)
    assert p.active_mask == (True, False, True) and p.top_k == (2, 1, 2)
    with pytest.raises(ValueError, match="active row 2"):
        prep(SamplingParams(temperature=[1.0, 1.0], top_k=2), 3, active_mask=[True, False, True])


@pytest.mark.parametrize(
    ("mask", "error", "fragment"),
    [
        ([True, False], ValueError, "expected batch_size 3"),
        ([False, False, False], ValueError, "no active row"),
        ([1, 0, 1], TypeError, "row 0 must be a bool"),
        ("yes", TypeError, "sequence of bool"),
    ],
)
def test_active_mask_validation(mask: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        prep(SamplingParams(), 3, active_mask=mask)


# ---- history and slot_remap ---------------------------------------------------------------


def test_history_is_copied_broadcast_and_blanked_for_inactive_rows() -> None:
    prompt = torch.tensor([[4, 5, 6]], dtype=torch.int32)
    output = torch.tensor([[1, -1], [2, 3], [7, 8]])
    p = prep(
        SamplingParams(temperature=[0.0, 0.0]),
        3,
        prompt_tokens=prompt,
        output_tokens=output,
    )
    assert p.prompt_tokens is not None and p.output_tokens is not None
    assert p.prompt_tokens.dtype == torch.int64
    assert p.prompt_tokens.tolist() == [[4, 5, 6], [4, 5, 6], [-1, -1, -1]]
    assert p.output_tokens.tolist() == [[1, -1], [2, 3], [-1, -1]]
    assert output.tolist() == [[1, -1], [2, 3], [7, 8]]  # caller tensor untouched


@pytest.mark.parametrize(
    ("history", "error", "fragment"),
    [
        (torch.zeros(2, 3, dtype=torch.int64), ValueError, "2 rows"),
        (torch.zeros(3, dtype=torch.int64), ValueError, "rows, length"),
        (torch.zeros(3, 2), TypeError, "integer tensor"),
        ([[1, 2]], TypeError, "torch.Tensor"),
        (torch.tensor([[0], [-3], [0]]), ValueError, "row 1 holds a token id < -1"),
    ],
)
def test_history_validation(history: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        prep(SamplingParams(temperature=[0.0, 0.0, 0.0]), 3, output_tokens=history)


def test_slot_remap_is_validated_and_carried() -> None:
    p = prep(SamplingParams(), 3, slot_remap=torch.tensor([2, -1, 0]))
    assert p.slot_remap == (2, -1, 0)
    with pytest.raises(ValueError, match="expected batch_size 3"):
        prep(SamplingParams(), 3, slot_remap=[0, 1])
    with pytest.raises(ValueError, match="slot 1 is 3"):
        prep(SamplingParams(), 3, slot_remap=[0, 3, 1])


# ---- invariants -------------------------------------------------------------------------


def test_prepared_invariants_reject_inconsistent_values() -> None:
    good = prep(SamplingParams(temperature=[0.0, 1.0], top_k=4), 3)
    with pytest.raises(ValueError, match="top_k has 2 entries; expected batch_size 3"):
        attrs.evolve(good, top_k=(1, 4))
    with pytest.raises(ValueError, match="active_mask marks 2 rows but active_rows is 1"):
        attrs.evolve(good, active_rows=1)
    with pytest.raises(ValueError, match="active_rows must be in"):
        attrs.evolve(good, active_rows=0, active_mask=(False, False, False))
    with pytest.raises(ValueError, match="sampling_path 'argmax' disagrees"):
        attrs.evolve(good, sampling_path="argmax")
    with pytest.raises(ValueError, match="greedy row must be k=1"):
        attrs.evolve(good, top_k=(2, 4, 1))
    with pytest.raises(ValueError, match="outside the device-supported range"):
        attrs.evolve(good, top_k=(1, 40, 1))
    with pytest.raises(ValueError, match="disagrees with active"):
        attrs.evolve(good, row_paths=("argmax", "topk", "topk"))


# ---- slicing and placing ----------------------------------------------------------------


def test_slice_sampling_params_selects_rows_and_keeps_broadcasts() -> None:
    sp = SamplingParams(temperature=[0.1, 0.2, 0.3], top_k=[1, 2, 3], top_p=[0.5], seed=[4, 5, 6])
    out = slice_sampling_params(sp, [2, 0])
    assert out.temperature == (0.3, 0.1)
    assert out.top_k == (3, 1)
    assert out.top_p == (0.5,)
    assert out.seed == (6, 4)
    assert out.presence_penalty == 0.0


def test_slice_sampling_params_scalar_seed_follows_row_zero() -> None:
    sp = SamplingParams(temperature=[1.0, 1.0, 1.0], seed=8)
    assert slice_sampling_params(sp, [0]).seed == 8
    assert slice_sampling_params(sp, [1, 2]).seed is None
    assert slice_sampling_params(sp, [2, 0]).seed == (None, 8)
    short = SamplingParams(temperature=[1.0, 1.0, 1.0], seed=[3, 4])
    assert slice_sampling_params(short, [1, 2]).seed == (4, None)


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [([], "at least one row"), ([0, 5], "does not cover row 5"), ([1, 1], "must not repeat")],
)
def test_slice_sampling_params_errors(rows: list[int], fragment: str) -> None:
    sp = SamplingParams(temperature=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=fragment):
        slice_sampling_params(sp, rows)


def test_slice_prepared_sampling_params() -> None:
    sp = SamplingParams(temperature=[0.0, 1.0, 0.5], top_k=[1, 4, 6], seed=[1, 2, 3])
    p = prep(sp, 4, output_tokens=torch.tensor([[10], [11], [12], [13]]), slot_remap=[0, 1, 2, 3])
    out = slice_prepared_sampling_params(p, [2, 3])
    assert out.batch_size == 2 and out.active_rows == 1
    assert out.top_k == (6, 1) and out.seeds == (3, None)
    assert out.row_paths == ("topk", "inactive")
    assert out.output_tokens is not None and out.output_tokens.tolist() == [[12], [-1]]
    assert out.slot_remap is None
    greedy = slice_prepared_sampling_params(p, [0])
    assert greedy.sampling_path == "argmax"
    with pytest.raises(ValueError, match="no active row"):
        slice_prepared_sampling_params(p, [3])
    with pytest.raises(ValueError, match="outside the prepared batch"):
        slice_prepared_sampling_params(p, [4])


def test_place_prepared_sampling_params_moves_active_rows_into_slots() -> None:
    sp = SamplingParams(temperature=[0.5, 1.0], top_k=[3, 5], seed=[7, 8], enable_log_probs=True)
    prompt = torch.tensor([[1, 2], [3, 4]])
    p = prep(sp, 2, prompt_tokens=prompt)
    out = place_prepared_sampling_params(p, [3, 1], batch_size=4)
    assert out.batch_size == 4 and out.active_mask == (False, True, False, True)
    assert out.top_k == (1, 5, 1, 3)
    assert out.seeds == (None, 8, None, 7)
    assert out.inverse_temperature == (1.0, 1.0, 1.0, 2.0)
    assert out.logprob_modes == ("none", "sampled_token", "none", "sampled_token")
    assert out.prompt_tokens is not None
    assert out.prompt_tokens.tolist() == [[-1, -1], [3, 4], [-1, -1], [1, 2]]
    with pytest.raises(ValueError, match="2 active rows"):
        place_prepared_sampling_params(p, [0], batch_size=4)
    with pytest.raises(ValueError, match="outside the target batch"):
        place_prepared_sampling_params(p, [0, 4], batch_size=4)
    with pytest.raises(ValueError, match="must not repeat"):
        place_prepared_sampling_params(p, [1, 1], batch_size=4)


# ---- log-prob payloads ------------------------------------------------------------------


def test_merge_log_probs_none_without_payloads() -> None:
    assert merge_log_probs([], 4) is None
    assert merge_log_probs([([0, 1], None)], 4) is None


def test_merge_log_probs_fills_one_and_broadcasts_single_values() -> None:
    merged = merge_log_probs(
        [([2, 0], torch.tensor([[-0.5], [-1.5]])), ([3], -2.0), ([1], None)], 5
    )
    assert merged is not None and merged.dtype == torch.float32
    assert merged.tolist() == [-1.5, 1.0, -0.5, -2.0, 1.0]
    single = merge_log_probs([([1, 3], [-0.25])], 4)
    assert single is not None and single.tolist() == [1.0, -0.25, 1.0, -0.25]


def test_merge_log_probs_errors() -> None:
    with pytest.raises(ValueError, match="2 values but 3 rows"):
        merge_log_probs([([0, 1, 2], [-1.0, -2.0])], 4)
    with pytest.raises(ValueError, match="outside the batch"):
        merge_log_probs([([4], -1.0)], 4)
    with pytest.raises(ValueError, match="at least one source row"):
        merge_log_probs([([], -1.0)], 4)
    with pytest.raises(TypeError, match="log-prob payload"):
        merge_log_probs([([0], "x")], 4)


def test_sampled_log_probs_for_rows() -> None:
    assert sampled_log_probs_for_rows(torch.tensor([[-1.0, -2.0, -3.0]]), 2).tolist() == [
        -1.0,
        -2.0,
    ]
    assert sampled_log_probs_for_rows(-0.5, 3).tolist() == [-0.5, -0.5, -0.5]
    assert sampled_log_probs_for_rows((-1.0, -2.0), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="1 rows need one"):
        sampled_log_probs_for_rows([], 1)
    with pytest.raises(TypeError, match="bool"):
        sampled_log_probs_for_rows(True, 1)
    with pytest.raises(TypeError, match="numbers"):
        sampled_log_probs_for_rows([None], 1)


# ---- property: every prepared row obeys the normalisation rules -------------------------

_row = st.tuples(
    st.sampled_from([0.0, 0.0, 0.25, 1.0, 1.7]),  # temperature
    st.integers(min_value=1, max_value=16),  # top_k
    st.floats(min_value=0.01, max_value=1.0),  # top_p
    st.booleans(),  # enable_log_probs
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**40)),  # seed
)


@given(
    rows=st.lists(_row, min_size=1, max_size=6),
    extra=st.integers(min_value=0, max_value=3),
    allow_argmax=st.booleans(),
)
def test_prepared_rows_obey_the_normalisation(
    rows: list[tuple[float, int, float, bool, int | None]], extra: int, allow_argmax: bool
) -> None:
    sp = SamplingParams(
        temperature=[r[0] for r in rows],
        top_k=[r[1] for r in rows],
        top_p=[r[2] for r in rows],
        enable_log_probs=[r[3] for r in rows],
        seed=[r[4] for r in rows],
    )
    batch = len(rows) + extra
    p = prepare_sampling_params(sp, batch, max_device_top_k=16, allow_force_argmax=allow_argmax)
    assert p.active_rows == len(rows)
    for i in range(batch):
        if i >= len(rows):
            assert (p.top_k[i], p.top_p[i], p.inverse_temperature[i]) == (1, 0.0, 1.0)
            assert p.row_paths[i] == "inactive" and p.seeds[i] is None
            continue
        temperature, top_k, top_p, logprobs, seed = rows[i]
        assert p.seeds[i] == seed
        assert p.greedy_mask[i] == (temperature == 0.0)
        if temperature == 0.0:
            assert (p.top_k[i], p.top_p[i], p.inverse_temperature[i]) == (1, 0.0, 1.0)
            expected = "argmax" if allow_argmax and not logprobs else "topk"
            assert p.row_paths[i] == expected
        else:
            assert (p.top_k[i], p.top_p[i]) == (top_k, top_p)
            assert p.inverse_temperature[i] == 1.0 / temperature
            assert p.row_paths[i] == "topk"
    assert (p.sampling_path == "argmax") == all(
        path == "argmax" for path in p.row_paths[: len(rows)]
    )

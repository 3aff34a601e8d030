"""The vLLM worker's device-sampling mapping (no vLLM needed).

`VLLMParams` carries the attributes of vLLM's `SamplingParams` the mapping reads, with
vLLM's defaults; the runtime's own `prepare_sampling_params` and `DeviceSampler` check that
the mapped rows sample like the requests at their rows and slots.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import pytest
import torch

from models.vllm_plugin.device_sampling import (
    DeviceSamplingPolicy,
    FacadeSampling,
    HistoryRow,
    HostRow,
    facade_sampling,
    host_runtime_sampler,
    runtime_sampling_params,
    sample_rows_on_host,
)
from models.vllm_plugin.step_samples import StepSamples
from runtime.sampling import (
    DeviceSampler,
    PreparedSamplingParams,
    SamplerConfig,
    apply_penalties,
    prepare_sampling_params,
)

VOCAB = 256


@dataclasses.dataclass
class VLLMParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None


GREEDY = VLLMParams(temperature=0.0)
POLICY = DeviceSamplingPolicy(vocab_size=VOCAB, max_top_k=64, penalties=True)


def _prepared(
    sampling: FacadeSampling, lane: Sequence[VLLMParams | None]
) -> PreparedSamplingParams:
    """The runtime's prepared parameters for a 4-slot lane (None: an empty slot)."""
    return prepare_sampling_params(
        sampling.sampling_params,
        4,
        max_device_top_k=64,
        allow_force_argmax=True,
        prompt_tokens=sampling.prompt_tokens,
        output_tokens=sampling.output_tokens,
        active_mask=[row is not None for row in lane],
    )


@pytest.mark.parametrize(
    ("params", "policy", "reason"),
    [
        (GREEDY, POLICY, None),
        (VLLMParams(temperature=1e-6, top_k=0), POLICY, None),  # below vLLM's epsilon: greedy
        (VLLMParams(temperature=0.7, top_k=20, top_p=0.9, seed=3), POLICY, None),
        (VLLMParams(temperature=0.7, top_k=64), POLICY, None),
        (VLLMParams(temperature=0.7, top_k=0), POLICY, "no top_k limit"),
        (VLLMParams(temperature=0.7, top_k=-1), POLICY, "no top_k limit"),
        (VLLMParams(temperature=0.7, top_k=VOCAB), POLICY, "no top_k limit"),
        (VLLMParams(temperature=0.7, top_k=65), POLICY, r"top_k=65 \(the device samples"),
        (VLLMParams(temperature=0.0, logprobs=0), POLICY, "logprobs=0"),
        (VLLMParams(temperature=0.0, repetition_penalty=1.2), POLICY, None),
        (
            VLLMParams(temperature=0.0, presence_penalty=0.5),
            DeviceSamplingPolicy(vocab_size=VOCAB, max_top_k=64, penalties=False),
            "penalties on a traced lane",
        ),
        (
            VLLMParams(temperature=0.7, top_k=5),
            DeviceSamplingPolicy(vocab_size=VOCAB, max_top_k=None, penalties=True),
            "names no device top-k limit",
        ),
        # A vocabulary within the device top-k: "no limit" is the whole vocabulary, on device.
        (VLLMParams(temperature=0.7), DeviceSamplingPolicy(32, 64, True), None),
    ],
)
def test_host_reason_names_what_the_device_cannot_honour(
    params: VLLMParams, policy: DeviceSamplingPolicy, reason: str | None
) -> None:
    found = policy.host_reason(params)
    if reason is None:
        assert found is None
    else:
        assert found is not None
        assert re.search(reason, found), found


def test_first_host_reason_sends_a_call_to_the_host_for_one_row() -> None:
    rows = [GREEDY, VLLMParams(temperature=0.5, top_k=8), VLLMParams(logprobs=2, top_k=4)]
    assert POLICY.first_host_reason(rows[:2]) is None
    assert POLICY.first_host_reason(rows) == "logprobs=2 (vLLM's sampler returns them)"


def test_rows_map_field_by_field_and_none_rows_are_neutral() -> None:
    rows = [
        None,
        VLLMParams(temperature=0.0, top_k=7, seed=9, repetition_penalty=1.3),
        VLLMParams(temperature=0.8, top_k=0, top_p=0.5, seed=-5, frequency_penalty=0.25),
        VLLMParams(temperature=0.6, top_k=12, presence_penalty=-0.5),
    ]
    sp = runtime_sampling_params(rows, vocab_size=VOCAB)
    assert sp.temperature == (0.0, 0.0, 0.8, 0.6)
    assert sp.top_k == (0, 0, VOCAB, 12)  # greedy rows need none; "no limit" is the vocabulary
    assert sp.top_p == (1.0, 1.0, 0.5, 1.0)
    assert sp.repetition_penalty == (1.0, 1.3, 1.0, 1.0)  # a greedy row keeps its penalty
    assert sp.frequency_penalty == (0.0, 0.0, 0.25, 0.0)
    assert sp.presence_penalty == (0.0, 0.0, 0.0, -0.5)
    # Seeds are per row, never a scalar (that would be row 0's); greedy rows draw no noise;
    # a negative vLLM seed is taken modulo 2**64, so it stays a seed.
    assert sp.seed == (None, None, 2**64 - 5, None)
    unseeded = runtime_sampling_params([GREEDY, VLLMParams(top_k=3)], vocab_size=VOCAB)
    assert unseeded.seed is None


def test_decode_rows_by_slot_prepare_with_inactive_slots_neutral() -> None:
    lane: list[VLLMParams | None] = [None, VLLMParams(temperature=0.9, top_k=5, seed=11)]
    lane += [None, VLLMParams(temperature=0.0, repetition_penalty=2.0)]
    sp = runtime_sampling_params(lane, vocab_size=VOCAB)
    prepared = prepare_sampling_params(
        sp,
        4,
        max_device_top_k=64,
        allow_force_argmax=True,
        active_mask=[row is not None for row in lane],
    )
    assert prepared.seeds[1] == 11 and prepared.seeds[3] is None
    assert prepared.top_k[1] == 5 and prepared.top_k[3] == 1  # greedy: the device's k=1
    assert prepared.repetition_penalty[3] == 2.0
    assert prepared.repetition_penalty[0] == prepared.repetition_penalty[2] == 1.0
    assert prepared.penalties_enabled


def test_histories_are_slot_rows_and_only_built_for_penalties() -> None:
    plain = facade_sampling([GREEDY], [None, HistoryRow([1, 2], [3]), None], vocab_size=VOCAB)
    assert set(plain.keywords()) == {"sampling_params"}
    penalised = facade_sampling(
        [VLLMParams(temperature=0.0, frequency_penalty=1.0)],
        [None, HistoryRow([1, 2, 3], [4]), None],
        vocab_size=VOCAB,
    )
    keywords = penalised.keywords()
    assert set(keywords) == {"sampling_params", "prompt_tokens", "output_tokens"}
    assert keywords["prompt_tokens"].tolist() == [[-1, -1, -1], [1, 2, 3], [-1, -1, -1]]
    assert keywords["output_tokens"].tolist() == [[-1], [4], [-1]]
    assert keywords["prompt_tokens"].dtype == torch.int64


def test_mapped_lane_samples_like_the_requests_on_the_runtime_sampler() -> None:
    """Greedy slots give the argmax (penalised where asked); a seeded slot repeats itself."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    lane: list[VLLMParams | None] = [
        GREEDY,
        None,
        VLLMParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=0.5),
        VLLMParams(temperature=0.8, top_k=10, seed=1234),
    ]
    history: list[HistoryRow | None] = [
        HistoryRow([5], []),
        None,
        HistoryRow([int(logits[2].argmax())], [int(logits[2].argmax()), 7]),
        HistoryRow([1], [2]),
    ]
    sampling = facade_sampling(lane, history, vocab_size=VOCAB)
    sampler = DeviceSampler(SamplerConfig(max_batch_size=4, max_top_k=64, vocab_size=VOCAB))
    sampler.materialize("cpu")
    prepared = _prepared(sampling, lane)
    positions = torch.tensor([3, 0, 8, 6])

    def run() -> list[int]:
        out = sampler.sample(logits.clone(), prepared, positions=positions)
        return [int(t) for t in out.tokens.tolist()]

    first, second = run(), run()
    assert first[0] == int(logits[0].argmax())
    penalised = apply_penalties(
        logits[2:3],
        prompt_tokens=sampling.prompt_tokens[2:3] if sampling.prompt_tokens is not None else None,
        output_tokens=sampling.output_tokens[2:3] if sampling.output_tokens is not None else None,
        repetition_penalty=3.0,
        frequency_penalty=0.5,
    )
    assert first[2] == int(penalised.argmax()) != int(logits[2].argmax())
    top10 = set(torch.topk(logits[3] / 0.8, 10).indices.tolist())
    assert first[3] in top10 and first[3] == second[3]  # seeded: same position, same draw


def test_host_rows_draw_what_the_lane_draws_at_any_slot() -> None:
    """A call that fell back to logits samples its device-samplable rows on the host with the
    runtime's sampler: a seeded row alone on the host draws what it drew at slot 3 of a lane."""
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    seeded = VLLMParams(temperature=1.5, top_k=40, top_p=0.95, seed=77)
    penalised = VLLMParams(temperature=0.0, presence_penalty=5.0)
    lane: list[VLLMParams | None] = [None, penalised, None, seeded]
    histories: list[HistoryRow | None] = [None, HistoryRow([1], [2, 3]), None, HistoryRow([4], [])]
    positions = torch.tensor([0, 9, 0, 21])
    sampler = host_runtime_sampler(POLICY, 4)
    sampling = facade_sampling(lane, histories, vocab_size=VOCAB)
    prepared = _prepared(sampling, lane)
    in_lane = sampler.sample(logits, prepared, positions=positions).tokens.tolist()
    alone = sample_rows_on_host(sampler, logits[3:4], [HostRow(seeded, HistoryRow([4], []), 21)])
    both = sample_rows_on_host(
        sampler,
        logits[[3, 1]],
        [HostRow(seeded, HistoryRow([4], []), 21), HostRow(penalised, HistoryRow([1], [2, 3]), 9)],
    )
    assert alone == [in_lane[3]] and both == [in_lane[3], in_lane[1]]
    forced = logits[1].clone()
    forced[[2, 3]] -= 5.0
    assert in_lane[1] == int(forced.argmax())
    draws = {
        sample_rows_on_host(sampler, logits[3:4], [HostRow(seeded, HistoryRow([], []), p)])[0]
        for p in range(20, 40)
    }
    assert len(draws) > 1  # the seeded noise is keyed by the position


def test_runtime_sampling_params_needs_a_row() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        runtime_sampling_params([], vocab_size=VOCAB)


def test_step_samples_sort_rows_by_sampler() -> None:
    sampled = facade_sampling([GREEDY, GREEDY], [None, None], vocab_size=VOCAB)
    step = StepSamples()
    # A sampled prefill returns (tokens [B], log_probs); rows are the call's rows.
    step.collect((torch.tensor([7, 9, 4]), None), sampled, [("a", 0), ("c", 2)], {"a", "c"})
    # A decode that returned logits [lane, 1, V]: slot rows, split by sampler.
    logits = torch.arange(4 * 1 * 5, dtype=torch.float32).reshape(4, 1, 5)
    step.collect(logits, None, [("d", 3), ("e", 1)], {"e"})
    assert step.device_tokens == {"a": 7, "c": 4}
    assert step.runtime_ids == ["e"] and step.runtime_logits[0].tolist() == logits[1, 0].tolist()
    assert step.vllm_ids == ["d"] and step.vllm_logits[0].tolist() == logits[3, 0].tolist()
    step.collect(logits, None, [], set())  # a call that samples nothing (a chunk) adds nothing
    assert len(step.vllm_ids) == 1


def test_step_samples_name_an_output_of_the_wrong_kind() -> None:
    sampled = facade_sampling([GREEDY], [None], vocab_size=VOCAB)
    with pytest.raises(RuntimeError, match=r"expected sampled token ids \[>= 2\]"):
        StepSamples().collect(torch.zeros(2, 1, 5), sampled, [("a", 1)], {"a"})
    with pytest.raises(RuntimeError, match=r"expected logits \[>= 3, vocab\]"):
        StepSamples().collect(torch.tensor([1, 2, 3]), None, [("a", 2)], set())

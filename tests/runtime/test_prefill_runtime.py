"""PrefillRuntime end to end on the tiny model, and every validation rule of its parts."""

from __future__ import annotations

import types
from typing import Any

import attrs
import pytest
import torch

from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.config import PageTableLayout
from runtime.output_reader import OutputReader
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.inputs import (
    PrefillInputStager,
    allocate_device_tensors,
    copy_into_device_tensors,
    host_inputs,
)
from runtime.prefill.plan import PrefillChunk
from runtime.prefill.postprocess import PrefillPostprocessor
from runtime.prefill.result_collector import InvocationResult
from runtime.prefill.runtime import PrefillRuntime
from runtime.prefill.sampling_helpers import (
    default_prompt_history,
    fit_sampling_logits,
    select_history_rows,
)
from runtime.prefill.sequence_runner import PrefillSequenceRunner
from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    broadcast_active_row,
    prepare_sampling_params,
)
from tests.runtime.prefill_setup import (
    BLOCK,
    CHUNK,
    LANES,
    POLICY,
    FailingPrefillModel,
    PrefillHarness,
    make_harness,
    prompt,
    token_matrix,
)

ATOL = 1e-4

# A mixed batch: rows 0, 1 and 5 form one padded-4 wave; row 2 (70 tokens) is chunked into
# 3 chunks; row 3 has a 16-token cached prefix and runs 2 chunks; row 4 is fully cached.
MIXED_LENGTHS = (20, 30, 70, 50, 24, 10)
MIXED_STARTS = (0, 0, 0, 16, 24, 0)
MIXED_SLOTS = (3, 1, 0, 5, 2, 7)


@pytest.fixture(scope="module")
def harness() -> PrefillHarness:
    return make_harness()


@pytest.fixture(scope="module")
def sampling_harness() -> PrefillHarness:
    return make_harness(sampling=True)


def mixed_batch(h: PrefillHarness) -> tuple[list[list[int]], torch.Tensor]:
    prompts = [prompt(n, seed=100 + row) for row, n in enumerate(MIXED_LENGTHS)]
    table = h.page_table(prompts)
    for row, (tokens, cached) in enumerate(zip(prompts, MIXED_STARTS, strict=True)):
        h.write_prefix(tokens, table[row], cached)
    return prompts, table


def prepare_mixed(
    h: PrefillHarness, prompts: list[list[int]], table: torch.Tensor, **extra: Any
) -> Any:
    """`h.runtime.prepare` of the mixed batch (its lengths, cached starts and slots)."""
    return h.runtime.prepare(
        tokens=token_matrix(prompts),
        page_table=table,
        prompt_lens=list(MIXED_LENGTHS),
        start_pos=list(MIXED_STARTS),
        empty_slots=list(MIXED_SLOTS),
        **extra,
    )


# -- configuration ---------------------------------------------------------------------------


def resolve_args(h: PrefillHarness, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": h.model,
        "device": h.device,
        "output_reader": h.reader,
        "page_table_layout": h.config.page_table_layout,
        "max_batch_size": LANES,
        "max_prefill_chunk_size": CHUNK,
        "policy": POLICY,
        "device_sampling_enabled": False,
        "can_enable_trace": lambda length, cached: False,
    }
    args.update(overrides)
    return args


class _NoPrefill:
    vocab_size = 256


class _ElsewhereModel:
    vocab_size = 256
    device = torch.device("meta")

    def prefill(self, tokens: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never called")


CONFIG_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"policy": "torch"}, TypeError, "policy must be a RuntimePolicy"),
    ({"max_batch_size": 0}, ValueError, "max_batch_size must be a positive integer"),
    ({"max_batch_size": True}, ValueError, "max_batch_size must be a positive integer"),
    ({"max_prefill_chunk_size": -32}, ValueError, "max_prefill_chunk_size must be a positive"),
    ({"max_prefill_batch_size": 0}, ValueError, "max_prefill_batch_size must be a positive"),
    ({"max_batch_size": 1000}, ValueError, "lane capacity limit"),
    ({"max_prefill_chunk_size": 40}, ValueError, "multiple of the policy's chunk_size_multiple"),
    ({"max_prefill_batch_size": 3}, ValueError, "max_prefill_batch_size must be one of"),
    ({"supports_batched_prefill": "yes"}, TypeError, "supports_batched_prefill must be bool"),
    ({"disable_batched_prefill": 1}, TypeError, "disable_batched_prefill must be bool"),
    (
        {"batched_prefill_batched_extract": None},
        TypeError,
        "batched_prefill_batched_extract must be bool",
    ),
    ({"device_sampling_enabled": "no"}, TypeError, "device_sampling_enabled must be bool"),
    ({"can_enable_trace": True}, TypeError, "can_enable_trace must be callable"),
    ({"trace_capture_prime_sequence_lengths": [32]}, TypeError, "must be a tuple"),
    ({"trace_capture_prime_sequence_lengths": (0,)}, ValueError, "positive integers"),
    ({"trace_capture_prime_sequence_lengths": (64,)}, ValueError, "<= max_prefill_chunk_size"),
    ({"trace_capture_prime_sequence_lengths": (16, 16)}, ValueError, "must be unique"),
    ({"page_table_layout": (8, 64)}, TypeError, "page_table_layout must be a PageTableLayout"),
    ({"device": "cpu"}, TypeError, "device must implement the Device protocol"),
    ({"output_reader": object()}, TypeError, "output_reader must be an OutputReader"),
    ({"model": _NoPrefill()}, TypeError, "model must implement prefill"),
    ({"model": _ElsewhereModel()}, ValueError, "model and prefill runtime must use the same"),
    ({"device_sampling_enabled": True}, TypeError, "device sampling requires model.sampling"),
]


@pytest.mark.parametrize(("overrides", "error", "fragment"), CONFIG_ERRORS)
def test_config_resolve_rejects(
    harness: PrefillHarness, overrides: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        PrefillRuntimeConfig.resolve(**resolve_args(harness, **overrides))


def test_config_rejects_an_output_reader_of_another_device(harness: PrefillHarness) -> None:
    reader = OutputReader(TorchDevice("cpu"))
    with pytest.raises(ValueError, match="output_reader and prefill runtime must use the same"):
        PrefillRuntimeConfig.resolve(**resolve_args(harness, output_reader=reader))


def _sampling_model(config: object) -> Any:
    sampler = types.SimpleNamespace(config=config, stage=lambda p: p, run=lambda *a, **k: None)
    return types.SimpleNamespace(
        vocab_size=256, prefill=lambda *a, **k: None, sampling=sampler, device=torch.device("cpu")
    )


@pytest.mark.parametrize(
    ("sampler_config", "error", "fragment"),
    [
        (
            types.SimpleNamespace(allow_force_argmax="x", max_top_k=8, max_batch_size=8),
            TypeError,
            "allow_force_argmax must be bool",
        ),
        (
            types.SimpleNamespace(allow_force_argmax=True, max_top_k=0, max_batch_size=8),
            ValueError,
            "max_top_k must be a positive integer",
        ),
        (
            types.SimpleNamespace(allow_force_argmax=True, max_top_k=8, max_batch_size=4),
            ValueError,
            "widest prefill wave",
        ),
        (
            types.SimpleNamespace(
                allow_force_argmax=True, max_top_k=8, max_batch_size=8, vocab_size=100
            ),
            ValueError,
            "must equal model.vocab_size",
        ),
    ],
)
def test_config_rejects_bad_samplers(
    harness: PrefillHarness, sampler_config: object, error: type[Exception], fragment: str
) -> None:
    args = resolve_args(
        harness, model=_sampling_model(sampler_config), device_sampling_enabled=True
    )
    with pytest.raises(error, match=fragment):
        PrefillRuntimeConfig.resolve(**args)


def test_config_derives_sampler_capabilities(sampling_harness: PrefillHarness) -> None:
    config = sampling_harness.config
    assert (config.allow_force_argmax, config.max_device_top_k, config.sampling_batch_size) == (
        True,
        8,
        LANES,
    )
    with pytest.raises(ValueError, match="must match the resolved sampler"):
        attrs.evolve(config, max_device_top_k=4)
    plain = make_harness().config
    assert (plain.allow_force_argmax, plain.max_device_top_k, plain.sampling_batch_size) == (
        False,
        0,
        LANES,
    )


def test_with_page_table_layout_may_only_shrink(harness: PrefillHarness) -> None:
    config = harness.config
    ceiling = config.page_table_layout
    smaller = PageTableLayout.resolve(
        block_size=BLOCK,
        model_max_sequence_length=256,
        physical_num_blocks=32,
        max_prefill_chunk_size=CHUNK,
    )
    shrunk = config.with_page_table_layout(smaller)
    assert shrunk.page_table_layout == smaller and config.page_table_layout == ceiling
    assert shrunk.page_table_layout_ceiling == ceiling
    cases: list[tuple[Any, type[Exception], str]] = [
        ("layout", TypeError, "must be a PageTableLayout"),
        (attrs.evolve(ceiling, block_size=16), ValueError, "cannot change block_size"),
        (
            PageTableLayout(BLOCK, ceiling.raw_capacity_width + 1, 80, 72),
            ValueError,
            "capacity ceiling",
        ),
        (
            attrs.evolve(ceiling, prefill_width=ceiling.prefill_width + 8),
            ValueError,
            "cannot expand canonical geometry",
        ),
    ]
    for layout, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            config.with_page_table_layout(layout)


def test_runtime_needs_a_config() -> None:
    with pytest.raises(TypeError, match="config must be a PrefillRuntimeConfig"):
        PrefillRuntime(object())  # type: ignore[arg-type]


# -- staging ---------------------------------------------------------------------------------


def test_copy_rejects_structure_changes_before_any_copy() -> None:
    device = TorchDevice("cpu")
    first = device.allocate((2,), torch.int64)
    second = device.allocate((3,), torch.int64)
    new_first = torch.tensor([7, 7])
    structures: list[tuple[list[torch.Tensor | None], list[Any]]] = [
        ([new_first, None], [first, second]),
        ([new_first, torch.ones(3, dtype=torch.int64)], [first, None]),
        ([new_first], [first, second]),
    ]
    for hosts, devices in structures:
        with pytest.raises(ValueError, match="host/device optional tensor structure changed"):
            copy_into_device_tensors(device, hosts, devices)
        assert first.tolist() == [0, 0]
    with pytest.raises(ValueError, match="changed geometry"):
        copy_into_device_tensors(
            device, [new_first, torch.ones(4, dtype=torch.int64)], [first, second]
        )
    assert first.tolist() == [0, 0]
    copy_into_device_tensors(device, [new_first, None], [first, None])
    assert first.tolist() == [7, 7]


def test_allocation_failure_releases_what_was_staged() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.nth("from_host", 3))
    released: list[Any] = []

    def release(value: Any) -> list[BaseException]:
        released.append(value)
        for tensor in value:
            if tensor is not None:
                inner.deallocate(tensor)
        return []

    hosts = [torch.ones(2), None, torch.ones(3), torch.ones(4)]
    with pytest.raises(InjectedFault):
        allocate_device_tensors(device, hosts, release)
    assert inner.live_allocations == 0
    assert len(released) == 1 and len(released[0]) == 3
    made = allocate_device_tensors(inner, [torch.ones(2), None], release)
    assert made[1] is None and inner.is_owned(made[0])


def test_host_inputs_of_waves_and_chunks(harness: PrefillHarness) -> None:
    prompts, table = mixed_batch(harness)
    prepared = prepare_mixed(harness, prompts, table)
    wave, long_row, cached_row = (item.request for item in prepared)
    regular = host_inputs(wave)
    assert regular.prompt_lens.tolist() == [20, 30, 10, 0]
    assert regular.chunk_start.tolist() == [0, 0, 0, 0]
    assert regular.page_table.dtype == torch.int32
    assert (regular.page_table[3] == -1).all()
    assert (regular.page_table[0, 3:] == -1).all(), "stale tails must not reach the device"
    starts = [host_inputs(cached_row, chunk).chunk_start.tolist() for chunk in cached_row.chunks]
    assert starts == [[16], [48]]
    assert int(host_inputs(cached_row).page_table[0, -1]) == 0, "chunked tables keep 0 filler"
    foreign = PrefillChunk(slice(0, 32), 0, 32, long_row.chunks[0].chunk_page_table, False)
    with pytest.raises(ValueError, match="is not one of the"):
        host_inputs(cached_row, foreign)


# -- end to end ------------------------------------------------------------------------------


def test_mixed_batch_matches_single_row_full_prefill(harness: PrefillHarness) -> None:
    prompts, table = mixed_batch(harness)
    prepared = prepare_mixed(harness, prompts, table)
    shapes = [
        (p.request.kind, p.request.source_rows, p.request.padded_batch_size, len(p.request.chunks))
        for p in prepared
    ]
    assert shapes == [("batched", (0, 1, 5), 4, 1), ("single", (2,), 1, 3), ("single", (3,), 1, 2)]
    assert prepared[0].request.slots == (3, 1, 7)
    before = harness.device.live_allocations
    results = [(item, harness.runtime.invoke(item)) for item in prepared]
    assert harness.device.live_allocations > before
    logits = harness.runtime.assemble(results, batch_size=len(prompts))
    assert harness.device.live_allocations == before
    assert isinstance(logits, torch.Tensor)
    assert logits.shape == (6, 1, harness.vocab) and logits.dtype == torch.float32
    for row, tokens in enumerate(prompts):
        if row == 4:
            assert torch.count_nonzero(logits[row]) == 0, "a fully cached row stays zero"
            continue
        torch.testing.assert_close(
            logits[row, 0], harness.reference_logits(tokens), atol=ATOL, rtol=0
        )
    assert harness.runtime.transient_orphan_count == 0


def test_fully_cached_batch_plans_nothing(harness: PrefillHarness) -> None:
    prompts = [prompt(16, seed=1), prompt(8, seed=2)]
    table = harness.page_table(prompts)
    prepared = harness.runtime.prepare(
        tokens=token_matrix(prompts), page_table=table, prompt_lens=[16, 8], start_pos=[16, 8]
    )
    assert prepared == ()
    logits = harness.runtime.assemble([], batch_size=2)
    assert isinstance(logits, torch.Tensor) and torch.count_nonzero(logits) == 0
    tokens, log_probs = harness.runtime.assemble([], batch_size=2, sampling_params=SamplingParams())
    assert tokens.tolist() == [0, 0] and tokens.dtype == torch.int64 and log_probs is None


def test_prepare_builds_signatures(harness: PrefillHarness) -> None:
    prompts = [prompt(20, seed=3), prompt(70, seed=4)]
    table = harness.page_table(prompts)
    seen: list[tuple[int, int]] = []

    def trace_32_only(length: int, cached: int) -> bool:
        seen.append((length, cached))
        return length == 32

    traced = make_harness(can_enable_trace=trace_32_only)
    prepared = traced.runtime.prepare(
        tokens=token_matrix(prompts), page_table=table, prompt_lens=[20, 70]
    )
    assert seen == [(32, 0), (32, 0)]
    assert all(p.trace_signature is not None for p in prepared)
    assert prepared[0].program_signatures[0].operation_variant == "regular-single"
    chunked = prepared[1]
    assert len(chunked.program_signatures) == 1
    assert chunked.program_signatures[0].operation_variant == "chunked"
    untraced = harness.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    assert all(p.trace_signature is None for p in untraced)
    bad = make_harness(can_enable_trace=lambda length, cached: 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must return bool"):
        bad.runtime.prepare(tokens=token_matrix(prompts), page_table=table)


def test_configure_page_table_layout_changes_planned_width(harness: PrefillHarness) -> None:
    h = make_harness()
    smaller = PageTableLayout.resolve(
        block_size=BLOCK,
        model_max_sequence_length=256,
        physical_num_blocks=32,
        max_prefill_chunk_size=CHUNK,
    )
    h.runtime.configure_page_table_layout(smaller)
    assert h.runtime.config.page_table_layout == smaller
    prompts = [prompt(20, seed=5)]
    table = h.page_table(prompts, width=smaller.raw_capacity_width)
    (prepared,) = h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    assert prepared.request.page_table_width == smaller.prefill_width
    logits = h.runtime.assemble([(prepared, h.runtime.invoke(prepared))], batch_size=1)
    assert isinstance(logits, torch.Tensor)
    torch.testing.assert_close(logits[0, 0], h.reference_logits(prompts[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("tokens", "prompt_lens", "start_pos", "expected"),
    [
        (torch.zeros((2, 80), dtype=torch.int64), None, [0, 32], True),
        (torch.zeros((2, 80), dtype=torch.int64), None, [0, 1], False),
        (torch.zeros((1, 80), dtype=torch.int64), [80], [80], False),
        (torch.zeros((1, 80), dtype=torch.int64), [81], None, False),
        (torch.zeros((1, 80), dtype=torch.int64), [10, 20], None, False),
        (torch.zeros((0, 80), dtype=torch.int64), None, None, False),
        (torch.zeros(80, dtype=torch.int64), None, None, False),
        (torch.zeros((1, 8), dtype=torch.int64), None, [-8], False),
    ],
)
def test_can_trace_is_a_geometry_query(
    tokens: torch.Tensor, prompt_lens: Any, start_pos: Any, expected: bool
) -> None:
    asked: list[tuple[int, int]] = []

    def only_32(length: int, cached: int) -> bool:
        asked.append((length, cached))
        return length == 32

    h = make_harness(can_enable_trace=only_32)
    before = h.device.live_allocations
    assert h.runtime.can_trace(tokens=tokens, prompt_lens=prompt_lens, start_pos=start_pos) is (
        expected
    )
    assert h.device.live_allocations == before
    assert all(cached == 0 for _, cached in asked)


def test_can_trace_refuses_lengths_without_a_family() -> None:
    h = make_harness(can_enable_trace=lambda length, cached: length == 64)
    assert h.runtime.can_trace(tokens=torch.zeros((1, 40), dtype=torch.int64)) is False
    assert h.runtime.can_trace(tokens=torch.zeros((1, 20), dtype=torch.int64)) is False
    h = make_harness(can_enable_trace=lambda length, cached: length == 32)
    assert h.runtime.can_trace(tokens=torch.zeros((1, 40), dtype=torch.int64)) is True


# -- sampling --------------------------------------------------------------------------------


def test_greedy_device_sampling_equals_argmax_of_logits(sampling_harness: PrefillHarness) -> None:
    h = sampling_harness
    prompts, table = mixed_batch(h)
    logits = h.run(prompts, table, start_pos=list(MIXED_STARTS), empty_slots=list(MIXED_SLOTS))
    prepared = prepare_mixed(h, prompts, table, sampling_params=SamplingParams(temperature=0.0))
    assert [p.sampling_path for p in prepared] == ["topk", "argmax", "argmax"]
    assert [p.program_signatures[0].sampling_path for p in prepared] == ["topk", "argmax", "argmax"]
    before = h.device.live_allocations
    results = [(item, h.runtime.invoke(item)) for item in prepared]
    tokens, log_probs = h.runtime.assemble(
        results, batch_size=6, sampling_params=SamplingParams(temperature=0.0)
    )
    assert h.device.live_allocations == before
    expected = logits[:, 0].argmax(dim=-1)
    expected[4] = 0
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == expected.tolist()
    assert log_probs is None


def test_log_probs_merge_with_one_filler(sampling_harness: PrefillHarness) -> None:
    h = sampling_harness
    prompts, table = mixed_batch(h)
    logits = h.run(prompts, table, start_pos=list(MIXED_STARTS), empty_slots=list(MIXED_SLOTS))
    params = SamplingParams(
        temperature=0.0, enable_log_probs=[True, False, True, False, True, True]
    )
    tokens, log_probs = h.run(
        prompts,
        table,
        start_pos=list(MIXED_STARTS),
        empty_slots=list(MIXED_SLOTS),
        sampling_params=params,
    )
    assert log_probs is not None and log_probs.dtype == torch.float32
    reference = torch.log_softmax(logits[:, 0], dim=-1)
    for row in range(6):
        if row in (1, 3, 4):
            assert log_probs[row].item() == 1.0, f"row {row} asked for none (or is cached)"
        else:
            expected = reference[row, int(tokens[row])].item()
            assert log_probs[row].item() == pytest.approx(expected, abs=ATOL)
            assert expected < 0.0


def test_sampling_requests_are_validated(harness: PrefillHarness) -> None:
    prompts = [prompt(20, seed=7)]
    table = harness.page_table(prompts)
    with pytest.raises(ValueError, match="device sampling is disabled"):
        harness.runtime.prepare(
            tokens=token_matrix(prompts), page_table=table, sampling_params=SamplingParams()
        )
    sampler = make_harness(sampling=True)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        sampler.runtime.prepare(
            tokens=token_matrix(prompts),
            page_table=table,
            sampling_params={"temperature": 0},  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="prefill sampling state prompt_tokens has 3 rows"):
        sampler.runtime.prepare(
            tokens=token_matrix(prompts),
            page_table=table,
            sampling_params=SamplingParams(),
            prompt_tokens=torch.zeros((3, 4), dtype=torch.int64),
        )


def test_sampling_history_defaults_to_the_prompt(sampling_harness: PrefillHarness) -> None:
    prompts = [prompt(12, seed=8), prompt(5, seed=9)]
    table = sampling_harness.page_table(prompts)
    prepared = sampling_harness.runtime.prepare(
        tokens=token_matrix(prompts),
        page_table=table,
        prompt_lens=[12, 5],
        sampling_params=SamplingParams(temperature=0.0, repetition_penalty=1.5),
    )
    (wave,) = prepared
    assert isinstance(wave.prepared_sampling, PreparedSamplingParams)
    history = wave.prepared_sampling.prompt_tokens
    assert history is not None and history.shape == (LANES, 12)
    assert history[0].tolist() == prompts[0]
    assert history[1].tolist() == prompts[1] + [-1] * 7
    assert (history[2:] == -1).all()
    assert wave.program_signatures[0].penalties_enabled


def test_sampling_helpers() -> None:
    logits = torch.arange(6.0).reshape(2, 3)
    assert fit_sampling_logits(logits, 2) is logits
    assert fit_sampling_logits(logits, 1).tolist() == [[0.0, 1.0, 2.0]]
    assert fit_sampling_logits(logits, 3)[2].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="sampling rows must be a positive integer"):
        fit_sampling_logits(logits, 0)
    history = default_prompt_history(torch.tensor([[5, 6, 7]]), [2])
    assert history.tolist() == [[5, 6, -1]]
    with pytest.raises(ValueError, match="prompt_lens\\[0\\] is 4"):
        default_prompt_history(torch.tensor([[5, 6, 7]]), [4])
    lane = torch.arange(8).reshape(8, 1)
    picked = select_history_rows(
        "output_tokens", lane, source_rows=(0,), slots=(5,), request_batch=2, lane_capacity=8
    )
    assert picked.tolist() == [[5]]
    single = prepare_sampling_params(
        SamplingParams(temperature=0.5, top_k=4),
        4,
        max_device_top_k=8,
        allow_force_argmax=True,
        active_mask=[True, False, False, False],
    )
    wide = broadcast_active_row(single)
    assert wide.active_rows == 4 and wide.top_k == (4, 4, 4, 4)
    assert wide.inverse_temperature == (2.0,) * 4


# -- result collector ------------------------------------------------------------------------


def _one_request(h: PrefillHarness, length: int = 20) -> Any:
    prompts = [prompt(length, seed=11)]
    table = h.page_table(prompts)
    (prepared,) = h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    return prepared


def test_collector_validations(harness: PrefillHarness) -> None:
    prepared = _one_request(harness)
    logits = torch.zeros((1, harness.vocab))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        harness.runtime.assemble([], batch_size=0)
    with pytest.raises(ValueError, match="sampling path disagrees with the public request"):
        harness.runtime.assemble(
            [(prepared, InvocationResult(logits))],
            batch_size=1,
            sampling_params=SamplingParams(),
        )
    bad = InvocationResult((logits, logits, logits))
    with pytest.raises(TypeError, match="must be \\(tokens, log_probs\\)"):
        harness.runtime.assemble([(prepared, bad)], batch_size=1)
    with pytest.raises(TypeError, match="must yield \\(PreparedPrefill, InvocationResult\\)"):
        harness.runtime.assemble([(prepared, logits)], batch_size=1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="source row 3 is outside"):
        other = attrs.evolve(prepared, request=attrs.evolve(prepared.request, source_rows=(3,)))
        harness.runtime.assemble([(other, InvocationResult(logits))], batch_size=2)
    with pytest.raises(ValueError, match="expected at least 1 leading rows"):
        harness.runtime.assemble([(prepared, InvocationResult(logits[:0]))], batch_size=1)


def test_collector_reads_lazily_in_source_order(harness: PrefillHarness) -> None:
    prompts = [prompt(40, seed=12), prompt(20, seed=13), prompt(10, seed=14)]
    table = harness.page_table(prompts)
    prepared = harness.runtime.prepare(
        tokens=token_matrix(prompts), page_table=table, prompt_lens=[40, 20, 10]
    )
    assert [item.request.source_rows for item in prepared] == [(1, 2), (0,)]
    shared = torch.zeros((4, harness.vocab))
    produced: list[int] = []

    def stream() -> Any:
        for index, item in enumerate(prepared):
            shared.fill_(float(index + 1))  # one persistent output, overwritten per request
            produced.append(index)
            yield item, InvocationResult(shared)

    logits = harness.runtime.assemble(stream(), batch_size=3)
    assert isinstance(logits, torch.Tensor)
    order = {
        row: index + 1 for index, item in enumerate(prepared) for row in item.request.source_rows
    }
    for row in range(3):
        assert (logits[row, 0] == order[row]).all()
    assert produced == list(range(len(prepared)))


def test_collector_releases_owned_values_on_success_and_failure(harness: PrefillHarness) -> None:
    prepared = _one_request(harness)
    device = harness.device
    before = device.live_allocations
    owned = device.allocate((2,), torch.float32)
    result = InvocationResult(torch.zeros((1, harness.vocab)), (owned,))
    leftover = device.allocate((2,), torch.float32)
    bad = InvocationResult((torch.zeros(1),) * 3, (device.allocate((1,), torch.float32),))
    with pytest.raises(TypeError):
        harness.runtime.assemble(
            [(prepared, result), (prepared, bad), (prepared, InvocationResult(owned, (leftover,)))],
            batch_size=1,
        )
    assert device.live_allocations == before, "read, failed and unread results are released"


# -- failure safety --------------------------------------------------------------------------


def test_failing_second_chunk_releases_everything() -> None:
    h = make_harness(wrap_model=lambda model: FailingPrefillModel(model, fail_on=2))
    prompts = [prompt(70, seed=21)]
    table = h.page_table(prompts)
    (prepared,) = h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    assert len(prepared.request.chunks) == 3
    before = h.device.live_allocations
    with pytest.raises(RuntimeError, match="injected prefill failure on call 2"):
        h.runtime.invoke(prepared)
    assert h.device.live_allocations == before
    assert h.runtime.transient_orphan_count == 0


def test_failing_releases_are_attached_and_retried() -> None:
    h = make_harness(
        wrap_model=lambda model: FailingPrefillModel(model, fail_on=2),
        wrap_device=lambda device: FaultInjectingDevice(device, FaultPlan.every("deallocate")),
    )
    device = h.device
    assert isinstance(device, FaultInjectingDevice)
    prompts = [prompt(70, seed=22)]
    table = h.page_table(prompts)
    (prepared,) = h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    before = device.live_allocations
    with pytest.raises(RuntimeError, match="injected prefill failure") as caught:
        h.runtime.invoke(prepared)
    failures = caught.value.cleanup_failures  # type: ignore[attr-defined]
    assert len(failures) == 8, "two chunks x four staged inputs could not be released"
    assert all(isinstance(failure, InjectedFault) for failure in failures)
    assert h.runtime.transient_orphan_count == 1
    assert device.live_allocations == before + 8
    with pytest.raises(RuntimeError, match="unreleased transient resources; cleanup is required"):
        h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    with pytest.raises(RuntimeError, match="cleanup is required"):
        h.runtime.invoke(prepared)
    with pytest.raises(InjectedFault) as again:
        h.runtime.cleanup()
    assert len(again.value.cleanup_failures) == 7  # type: ignore[attr-defined]
    device.plan = FaultPlan()
    h.runtime.cleanup()
    assert device.live_allocations == before
    assert h.runtime.transient_orphan_count == 0
    h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)


def test_staging_failure_releases_the_partial_step() -> None:
    h = make_harness(
        wrap_device=lambda device: FaultInjectingDevice(device, FaultPlan.nth("from_host", 7))
    )
    prompts = [prompt(70, seed=23)]
    table = h.page_table(prompts)
    (prepared,) = h.runtime.prepare(tokens=token_matrix(prompts), page_table=table)
    before = h.device.live_allocations
    with pytest.raises(InjectedFault):
        h.runtime.invoke(prepared)
    assert h.device.live_allocations == before


def test_non_final_chunk_outputs_are_released_at_once(harness: PrefillHarness) -> None:
    events: list[str] = []

    class Recording:
        vocab_size = harness.vocab

        def prefill(self, tokens: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            events.append(f"prefill@{int(kwargs['chunk_start'][0])}")
            return harness.model.prefill(tokens, **kwargs)

    outputs: list[torch.Tensor] = []  # kept alive, so no later tensor can reuse their ids

    def release(value: Any) -> list[BaseException]:
        if isinstance(value, torch.Tensor):
            events.append("release-step-output")
            outputs.append(value)
        else:
            events.append("release-owned")
        return []

    stager = PrefillInputStager(device=harness.device, release_transient=release)
    runner = PrefillSequenceRunner(
        model=Recording(),
        input_stager=stager,
        postprocessor=PrefillPostprocessor(harness.config),
        release_transient=release,
    )
    prepared = _one_request(harness, length=70)
    result = runner.run(prepared)
    assert events == [
        "prefill@0",
        "release-step-output",
        "prefill@32",
        "release-step-output",
        "prefill@64",
    ]
    assert len(result.owned) == 4 and result.owned[-1] is result.value
    assert all(result.value is not output for output in outputs)
    harness.runtime.assemble([(prepared, result)], batch_size=1)


def test_batching_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [prompt(10, seed=31), prompt(12, seed=32)]

    def kinds(h: PrefillHarness, params: SamplingParams | None = None) -> list[str]:
        prepared = h.runtime.prepare(
            tokens=token_matrix(prompts),
            page_table=h.page_table(prompts),
            prompt_lens=[10, 12],
            sampling_params=params,
        )
        return [item.request.kind for item in prepared]

    assert kinds(make_harness()) == ["batched"]
    assert kinds(make_harness(disable_batched_prefill=True)) == ["single", "single"]
    assert kinds(make_harness(supports_batched_prefill=False)) == ["single", "single"]
    monkeypatch.setenv("DISABLE_BATCHED_PREFILL", "true")
    assert kinds(make_harness()) == ["single", "single"]
    monkeypatch.delenv("DISABLE_BATCHED_PREFILL")
    no_extract = make_harness(sampling=True, batched_prefill_batched_extract=False)
    assert kinds(no_extract) == ["batched"]
    assert kinds(no_extract, SamplingParams()) == ["single", "single"]

"""DecodeRuntime: configuration rules, prepare validation, page-table normalisation, sampling
path classification, eager decode against the model, device sampling, asynchronous reads and
cleanup, on the tiny-random Llama model on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from models.decoder.model import DecoderModel
from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.config import PageTableLayout, RuntimePolicy
from runtime.decode import (
    DecodeInvocationResult,
    DecodeRuntime,
    DecodeRuntimeConfig,
    PreparedDecode,
)
from runtime.output_reader import OutputReader, ReadState
from runtime.sampling import SamplingParams
from tests.runtime.tiny_setup import (
    TinySetup,
    block_page_table,
    build_tiny_setup,
    prefill_prompts,
    tiny_sampler,
)

LANE = 4
BLOCKS_PER_ROW = 8  # 32 tokens per row with block size 4


@pytest.fixture
def setup() -> Iterator[TinySetup]:
    built = build_tiny_setup()
    yield built
    built.close()


def resolve(setup: TinySetup, **overrides: Any) -> DecodeRuntimeConfig:
    return setup.decode_config(**{"lane_capacity": LANE, **overrides})


def runtime(setup: TinySetup, *, sampling: bool = False, **overrides: Any) -> DecodeRuntime:
    if sampling and getattr(setup.model, "sampling", None) is None:
        setup.model.sampling = tiny_sampler(setup.model, max_batch_size=LANE)
    return DecodeRuntime(resolve(setup, device_sampling_enabled=sampling, **overrides))


def attach_feedback(model: DecoderModel) -> None:
    """Give the model device position feedback: active positions advance by one in place."""

    def increment_positions(positions: torch.Tensor) -> None:
        positions.add_((positions >= 0).to(positions.dtype))

    model.increment_positions = increment_positions


PROMPTS: list[list[int] | None] = [[1, 5, 9, 13, 17], None, [3, 4, 200], None]
NEXT_TOKENS = torch.tensor([21, 0, 42, 0])
START = torch.tensor([5, -1, 3, -1])


def prefilled(setup: TinySetup) -> torch.Tensor:
    """Prefill rows 0 and 2 (rows 1 and 3 stay inactive); returns the caller page table."""
    table = block_page_table(LANE, BLOCKS_PER_ROW)
    prefill_prompts(setup, PROMPTS, table)
    return table


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_resolve_derives_static_facts(setup: TinySetup) -> None:
    config = resolve(setup)
    assert config.vocab_size == setup.model.vocab_size
    assert config.lane_capacity == LANE
    assert not config.allow_force_argmax and config.max_device_top_k is None
    assert not config.position_feedback_capable
    assert config.max_raw_capacity_width == setup.layout.raw_capacity_width
    assert config.max_decode_page_table_width == setup.layout.decode_width
    setup.model.sampling = tiny_sampler(setup.model, max_batch_size=8, allow_force_argmax=False)
    attach_feedback(setup.model)
    sampled = resolve(setup, device_sampling_enabled=True)
    assert sampled.allow_force_argmax is False
    assert sampled.max_device_top_k == 32 and sampled.sampling_batch_size == 8
    assert sampled.position_feedback_capable is True


def test_resolve_rejects_a_foreign_reader(setup: TinySetup) -> None:
    with pytest.raises(TypeError, match="output_reader must be an OutputReader"):
        resolve(setup, output_reader=object())
    other = OutputReader(TorchDevice("cpu"))
    with pytest.raises(ValueError, match="same device as the output reader"):
        resolve(setup, output_reader=other)


@pytest.mark.parametrize("lane", [0, -1, True, 2.0])
def test_lane_capacity_must_be_a_positive_int(setup: TinySetup, lane: object) -> None:
    with pytest.raises(ValueError, match="lane_capacity must be a positive integer"):
        resolve(setup, lane_capacity=lane)


def test_lane_capacity_limit_names_its_source(setup: TinySetup) -> None:
    policy = RuntimePolicy.torch_default(decode_lane_capacity_limit=3)
    with pytest.raises(ValueError, match=r"limit 3 \(RuntimePolicy.decode_lane_capacity_limit\)"):
        resolve(setup, policy=policy)
    assert resolve(setup, policy=policy, lane_capacity=3).lane_capacity == 3


@pytest.mark.parametrize("flag", ["device_sampling_enabled", "force_greedy_top_k"])
def test_flags_must_be_bool(setup: TinySetup, flag: str) -> None:
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        resolve(setup, **{flag: 1})


def test_layout_and_policy_types(setup: TinySetup) -> None:
    with pytest.raises(TypeError, match="must be a PageTableLayout"):
        resolve(setup, page_table_layout=(4, 32))
    with pytest.raises(TypeError, match="policy must be a RuntimePolicy"):
        resolve(setup, policy="torch")


def test_vocab_size_must_be_positive(setup: TinySetup) -> None:
    @attrs.define
    class Stub:
        vocab_size: int

        def decode(self, *args: Any, **kwargs: Any) -> None:
            return None

    with pytest.raises(ValueError, match=r"model\.vocab_size must be a positive integer"):
        resolve(setup, model=Stub(0))


def test_device_sampling_requires_a_sampler(setup: TinySetup) -> None:
    with pytest.raises(TypeError, match=r"model.sampling with callable stage\(\) and run\(\)"):
        resolve(setup, device_sampling_enabled=True)
    setup.model.sampling = tiny_sampler(setup.model, max_batch_size=LANE - 1)
    with pytest.raises(ValueError, match="smaller than lane_capacity 4"):
        resolve(setup, device_sampling_enabled=True)


def test_direct_construction_revalidates_derived_values(setup: TinySetup) -> None:
    config = resolve(setup)
    with pytest.raises(ValueError, match=r"does not match model\.vocab_size"):
        attrs.evolve(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(ValueError, match="position_feedback_capable=True does not match"):
        attrs.evolve(config, position_feedback_capable=True)
    with pytest.raises(TypeError, match="DecodeRuntimeConfig"):
        DecodeRuntime(attrs.asdict(config, recurse=False))  # type: ignore[arg-type]


def test_late_layout_may_only_shrink(setup: TinySetup) -> None:
    def layout_for(blocks: int) -> PageTableLayout:
        return PageTableLayout.resolve(
            block_size=setup.block_size,
            model_max_sequence_length=setup.model.max_seq_len,
            physical_num_blocks=blocks,
            max_prefill_chunk_size=32,
        )

    config = resolve(setup, page_table_layout=layout_for(30))  # raw 30, decode width 32
    shrunk = config.with_page_table_layout(layout_for(16))
    assert shrunk.page_table_layout == layout_for(16)
    assert (shrunk.max_raw_capacity_width, shrunk.max_decode_page_table_width) == (30, 32)
    with pytest.raises(ValueError, match="block_size"):
        config.with_page_table_layout(attrs.evolve(layout_for(16), block_size=8))
    with pytest.raises(ValueError, match=r"raw_capacity_width 31 exceeds .* ceiling 30"):
        config.with_page_table_layout(layout_for(31))
    wider_decode = attrs.evolve(layout_for(30), decode_width=40)
    with pytest.raises(ValueError, match="decode width 40 exceeds"):
        config.with_page_table_layout(wider_decode)
    with pytest.raises(TypeError, match="PageTableLayout"):
        config.with_page_table_layout("wide")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# prepare validation
# --------------------------------------------------------------------------------------------


def test_prepare_validates_ranks_types_and_batches(setup: TinySetup) -> None:
    rt = runtime(setup)
    table = block_page_table(LANE, 2)
    with pytest.raises(TypeError, match=r"tokens must be a torch\.Tensor"):
        rt.prepare([1, 2, 3, 4], START, table)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens must be a rank-1 tensor"):
        rt.prepare(NEXT_TOKENS.view(2, 2), START, table)
    with pytest.raises(ValueError, match="page_table must be a rank-2 tensor"):
        rt.prepare(NEXT_TOKENS, START, table[0])
    with pytest.raises(ValueError, match="start_pos must be an integer tensor"):
        rt.prepare(NEXT_TOKENS, START.float(), table)
    with pytest.raises(ValueError, match="decode batch 3 must equal lane capacity 4"):
        rt.prepare(NEXT_TOKENS[:3], START[:3], table[:3])
    with pytest.raises(ValueError, match="batches must match"):
        rt.prepare(NEXT_TOKENS, START[:3], table)
    with pytest.raises(ValueError, match="batches must match"):
        rt.prepare(NEXT_TOKENS, START, table[:2])
    with pytest.raises(ValueError, match=r"tokens row 2 is 256; allowed .* \[0, 256\)"):
        rt.prepare(torch.tensor([1, 0, 256, 0]), START, table)
    # Inactive rows may carry any token value.
    rt.prepare(torch.tensor([1, -7, 2, 999]), START, table)
    with pytest.raises(TypeError, match="reset_batch must be a bool"):
        rt.prepare(NEXT_TOKENS, START, table, reset_batch=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        rt.prepare(NEXT_TOKENS, START, table, None)  # type: ignore[misc]
    with pytest.raises(TypeError):
        rt.prepare(NEXT_TOKENS, START, table, seeds=[1])  # type: ignore[call-arg]


def test_prepare_refuses_sampling_while_disabled(setup: TinySetup) -> None:
    rt = runtime(setup)
    table = block_page_table(LANE, 2)
    with pytest.raises(ValueError, match="device sampling is disabled"):
        rt.prepare(NEXT_TOKENS, START, table, sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="output_tokens is request-owned sampling state"):
        rt.prepare(NEXT_TOKENS, START, table, output_tokens=torch.zeros(LANE, 2, dtype=torch.int64))


def test_prepare_with_sampling_needs_an_active_row(setup: TinySetup) -> None:
    rt = runtime(setup, sampling=True)
    table = block_page_table(LANE, 2)
    inactive = torch.full((LANE,), -1)
    rt.prepare(NEXT_TOKENS, inactive, table)  # logits path: fine
    with pytest.raises(ValueError, match="at least one active decode row"):
        rt.prepare(NEXT_TOKENS, inactive, table, sampling_params=SamplingParams())
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        rt.prepare(NEXT_TOKENS, START, table, sampling_params={"temperature": 0.0})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Page-table normalisation (rule 20)
# --------------------------------------------------------------------------------------------


def test_page_table_is_zero_filled_int32_with_only_used_blocks(setup: TinySetup) -> None:
    rt = runtime(setup)
    caller = torch.arange(100, 100 + LANE * 10, dtype=torch.int64).view(LANE, 10)
    positions = torch.tensor([5, -1, 3, 8])  # used blocks: 2, 0, 1, 3
    prepared = rt.prepare(NEXT_TOKENS, positions, caller)
    table = prepared.page_table
    assert table.dtype == torch.int32
    assert tuple(table.shape) == (LANE, setup.layout.decode_width)
    expected = torch.zeros((LANE, setup.layout.decode_width), dtype=torch.int32)
    expected[0, :2] = torch.tensor([100, 101])
    expected[2, :1] = torch.tensor([120])
    expected[3, :3] = torch.tensor([130, 131, 132])
    assert torch.equal(table, expected)


def test_negative_positions_copy_nothing(setup: TinySetup) -> None:
    rt = runtime(setup)
    caller = torch.full((LANE, 4), 7, dtype=torch.int32)
    prepared = rt.prepare(NEXT_TOKENS, torch.tensor([-1, -5, -1, -1]), caller)
    assert not prepared.page_table.any()


def test_capacity_and_width_errors(setup: TinySetup) -> None:
    rt = runtime(setup)
    raw = setup.layout.raw_capacity_width
    block = setup.layout.block_size
    wide = block_page_table(LANE, raw)
    beyond = torch.tensor([0, raw * block, -1, -1])
    with pytest.raises(ValueError, match="exceeds the configured paged-KV capacity"):
        rt.prepare(NEXT_TOKENS, beyond, wide)
    last = torch.tensor([0, raw * block - 1, -1, -1])
    assert rt.prepare(NEXT_TOKENS, last, wide).page_table[1, raw - 1] == wide[1, raw - 1]
    narrow = block_page_table(LANE, 1)
    with pytest.raises(ValueError, match="page table is too narrow for decode row 2"):
        rt.prepare(NEXT_TOKENS, torch.tensor([3, -1, 4, -1]), narrow)


def test_look_ahead_block_only_with_feedback_at_a_boundary(setup: TinySetup) -> None:
    caller = block_page_table(LANE, 4, first_block=1)  # no block id 0: zero means "not copied"
    plain = runtime(setup, sampling=True)
    at_boundary = torch.tensor([3, 7, 2, -1])  # (pos+1) % 4 == 0 for rows 0 and 1
    without = plain.prepare(NEXT_TOKENS, at_boundary, caller, sampling_params=SamplingParams())
    assert not without.device_feedback
    assert [int((row != 0).sum()) for row in without.page_table] == [1, 2, 1, 0]

    attach_feedback(setup.model)
    feedback = runtime(setup, sampling=True)
    logits_only = feedback.prepare(NEXT_TOKENS, at_boundary, caller)
    assert not logits_only.device_feedback  # feedback needs sampling params
    assert [int((row != 0).sum()) for row in logits_only.page_table] == [1, 2, 1, 0]
    sampled = feedback.prepare(NEXT_TOKENS, at_boundary, caller, sampling_params=SamplingParams())
    assert sampled.device_feedback
    assert [int((row != 0).sum()) for row in sampled.page_table] == [2, 3, 1, 0]
    assert torch.equal(sampled.page_table[1, :3], caller[1, :3])
    # The look-ahead is capped by the caller width.
    capped = feedback.prepare(
        NEXT_TOKENS, torch.tensor([3, -1, -1, -1]), caller[:, :1], sampling_params=SamplingParams()
    )
    assert torch.equal(capped.page_table[0, :1], caller[0, :1])
    assert not capped.page_table[0, 1:].any()


def test_identity_caching_and_mutation_detection(setup: TinySetup) -> None:
    rt = runtime(setup)
    caller = block_page_table(LANE, 4, first_block=1)
    first = rt.prepare(NEXT_TOKENS, torch.tensor([5, -1, 3, -1]), caller)
    same = rt.prepare(NEXT_TOKENS, torch.tensor([5, -1, 3, -1]), caller.clone())
    assert same.page_table is first.page_table
    same_counts = rt.prepare(NEXT_TOKENS, torch.tensor([6, -1, 2, -1]), caller)
    assert same_counts.page_table is first.page_table
    assert rt.page_table_cache_hits == 2
    more_blocks = rt.prepare(NEXT_TOKENS, torch.tensor([8, -1, 3, -1]), caller)
    assert more_blocks.page_table is not first.page_table
    caller[0, 0] = 30  # in-place mutation of the caller's table
    mutated = rt.prepare(NEXT_TOKENS, torch.tensor([8, -1, 3, -1]), caller)
    assert mutated.page_table is not more_blocks.page_table
    assert mutated.page_table[0, 0] == 30


def test_page_table_changed_tracks_the_last_submitted_table(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup)
    first = rt.prepare(NEXT_TOKENS, START, table)
    assert first.page_table_changed
    rt.consume(rt.invoke(first))
    second = rt.prepare(NEXT_TOKENS, START, table)
    assert not second.page_table_changed
    table[2, 0] = 20
    changed = rt.prepare(NEXT_TOKENS, START, table)
    assert changed.page_table_changed
    rt.note_submitted(changed)
    assert not rt.prepare(NEXT_TOKENS, START, table).page_table_changed


# --------------------------------------------------------------------------------------------
# Sampling path classification (rule 21) and signatures
# --------------------------------------------------------------------------------------------


def test_sampling_path_examples(setup: TinySetup) -> None:
    table = block_page_table(LANE, 2)
    greedy = SamplingParams(temperature=0.0, top_k=32)
    rt = runtime(setup, sampling=True)
    assert rt.prepare(NEXT_TOKENS, START, table).sampling_path == "logits"
    assert rt.prepare(NEXT_TOKENS, START, table, sampling_params=greedy).sampling_path == "argmax"
    stochastic = SamplingParams(temperature=0.7, top_k=8)
    assert rt.prepare(NEXT_TOKENS, START, table, sampling_params=stochastic).sampling_path == "topk"
    logprobs = SamplingParams(temperature=0.0, enable_log_probs=True)
    prepared = rt.prepare(NEXT_TOKENS, START, table, sampling_params=logprobs)
    assert prepared.sampling_path == "topk" and prepared.logprobs_enabled
    forced = runtime(setup, sampling=True, force_greedy_top_k=True)
    assert forced.prepare(NEXT_TOKENS, START, table, sampling_params=greedy).sampling_path == "topk"
    setup.model.sampling = tiny_sampler(setup.model, max_batch_size=LANE, allow_force_argmax=False)
    no_argmax = runtime(setup, sampling=True)
    path = no_argmax.prepare(NEXT_TOKENS, START, table, sampling_params=greedy).sampling_path
    assert path == "topk"


def test_sampling_is_slot_indexed_with_neutral_inactive_rows(setup: TinySetup) -> None:
    rt = runtime(setup, sampling=True)
    table = block_page_table(LANE, 2)
    # Row 1 is inactive: its stochastic temperature is ignored, so the lane stays argmax.
    params = SamplingParams(temperature=[0.0, 0.9, 0.0, 0.5], top_k=[1, 5, 1, 7], seed=[3, 4, 5, 6])
    prepared = rt.prepare(NEXT_TOKENS, torch.tensor([5, -1, 3, 2]), table, sampling_params=params)
    sampling = prepared.prepared_sampling
    assert sampling is not None
    assert sampling.batch_size == LANE
    assert sampling.active_mask == (True, False, True, True)
    assert sampling.top_k[1] == 1 and sampling.seeds[1] is None
    assert sampling.top_k[3] == 7 and sampling.seeds == (3, None, 5, 6)
    assert prepared.sampling_path == "topk"
    again = rt.prepare(NEXT_TOKENS, torch.tensor([6, -1, 4, 3]), table, sampling_params=params)
    assert again.prepared_sampling is sampling  # same parameters, same active rows: kept
    equal = SamplingParams(temperature=[0.0, 0.9, 0.0, 0.5], top_k=[1, 5, 1, 7], seed=[3, 4, 5, 6])
    kept = rt.prepare(NEXT_TOKENS, torch.tensor([6, -1, 4, 3]), table, sampling_params=equal)
    assert kept.prepared_sampling is sampling  # an equal object (a serving engine's) too
    other = SamplingParams(temperature=[0.0, 0.9, 0.0, 0.5], top_k=[1, 5, 1, 8], seed=[3, 4, 5, 6])
    fresh = rt.prepare(NEXT_TOKENS, torch.tensor([6, -1, 4, 3]), table, sampling_params=other)
    assert fresh.prepared_sampling is not None and fresh.prepared_sampling.top_k[3] == 8
    lane_greedy = rt.prepare(
        NEXT_TOKENS, torch.tensor([5, -1, 3, -1]), table, sampling_params=params
    )
    assert lane_greedy.sampling_path == "argmax"  # other active rows: prepared afresh


def test_sampling_is_prepared_over_the_sampler_batch(setup: TinySetup) -> None:
    # Reference 2.15: slot-indexed values may cover the sampler batch (8 rows, lane of 4);
    # rows past the lane are inactive, so their stochastic values never change the path.
    table = prefilled(setup)
    setup.model.sampling = tiny_sampler(setup.model, max_batch_size=2 * LANE)
    rt = runtime(setup, sampling=True)
    assert rt.config.sampling_batch_size == 2 * LANE
    params = SamplingParams(temperature=[0.0] * LANE + [0.9] * LANE, top_k=[1] * LANE + [5] * LANE)
    prepared = rt.prepare(NEXT_TOKENS, START, table, sampling_params=params)
    sampling = prepared.prepared_sampling
    assert sampling is not None and sampling.batch_size == LANE
    assert prepared.sampling_path == "argmax"
    tokens = rt.consume(rt.invoke(prepared))
    logits = rt.consume(rt.invoke(rt.prepare(NEXT_TOKENS, START, table)))
    active = START >= 0
    assert torch.equal(tokens[active], logits[:, 0].argmax(-1)[active])
    history = torch.tensor([[5, 9, -1]] * LANE)
    with_history = rt.prepare(
        NEXT_TOKENS, START, table, sampling_params=params, prompt_tokens=history
    )
    assert with_history.prepared_sampling is not None
    assert with_history.prepared_sampling.prompt_tokens is not None
    assert tuple(with_history.prepared_sampling.prompt_tokens.shape) == (LANE, 3)
    with pytest.raises(ValueError, match="sampling batch has 8 rows"):
        rt.prepare(NEXT_TOKENS, START, table, sampling_params=SamplingParams(temperature=[0.0] * 9))


def test_signatures_use_lane_capacity_and_decode_width(setup: TinySetup) -> None:
    rt = runtime(setup, sampling=True)
    table = block_page_table(LANE, 2)
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    signature = rt.program_signature(prepared)
    assert signature.batch_size == LANE
    assert signature.page_table_width == setup.layout.decode_width
    assert signature.sampling_path == "logits" and signature.device_feedback is False
    one_active = rt.prepare(NEXT_TOKENS, torch.tensor([1, -1, -1, -1]), table)
    assert rt.program_signature(one_active) == signature
    trace = rt.trace_signature(prepared)
    assert trace.key_material() == signature.key_material()
    greedy = rt.prepare(NEXT_TOKENS, START, table, sampling_params=SamplingParams())
    assert rt.program_signature(greedy).sampling_path == "argmax"
    with pytest.raises(TypeError, match="PreparedDecode"):
        rt.program_signature(signature)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Eager decode and device sampling
# --------------------------------------------------------------------------------------------


def test_eager_logits_equal_the_model_with_inactive_rows(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup)
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    result = rt.invoke(prepared)
    assert isinstance(result, DecodeInvocationResult) and not result.is_tokens
    assert tuple(result.value.shape) == (LANE, setup.model.vocab_size)
    logits = rt.consume(result)
    direct = setup.model.decode(NEXT_TOKENS, positions=START, page_table=table)
    assert logits.dtype == torch.float32
    assert tuple(logits.shape) == (LANE, 1, setup.model.vocab_size)
    assert torch.equal(logits[:, 0], direct)
    assert logits[0].abs().sum() > 0 and not logits[1].any() and not logits[3].any()
    assert setup.device.live_allocations == setup.resident_allocations


def test_greedy_device_sampling_equals_argmax(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup, sampling=True)
    logits = rt.consume(rt.invoke(rt.prepare(NEXT_TOKENS, START, table)))
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=32)):
        prepared = rt.prepare(NEXT_TOKENS, START, table, sampling_params=params)
        result = rt.invoke(prepared)
        assert result.is_tokens
        tokens = rt.consume(result)
        assert tokens.dtype == torch.int64 and tuple(tokens.shape) == (LANE,)
        active = START >= 0
        assert torch.equal(tokens[active], logits[:, 0].argmax(-1)[active])
    forced = runtime(setup, sampling=True, force_greedy_top_k=True)
    prepared = forced.prepare(NEXT_TOKENS, START, table, sampling_params=SamplingParams())
    assert prepared.sampling_path == "topk"
    tokens = forced.consume(forced.invoke(prepared))
    assert torch.equal(tokens[START >= 0], logits[:, 0].argmax(-1)[START >= 0])


def test_seeded_sampling_is_reproducible_and_log_probs_are_float32(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup, sampling=True)
    params = SamplingParams(temperature=1.5, top_k=32, top_p=1.0, seed=[11, -1, 12, -1])
    runs = [
        rt.consume(rt.invoke(rt.prepare(NEXT_TOKENS, START, table, sampling_params=params)))
        for _ in range(3)
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    logged = SamplingParams(
        temperature=1.5, top_k=32, seed=[11, -1, 12, -1], enable_log_probs=[True, False, False]
    )
    prepared = rt.prepare(NEXT_TOKENS, START, table, sampling_params=logged)
    tokens, log_probs = rt.consume(rt.invoke(prepared))
    assert torch.equal(tokens, runs[0])
    assert log_probs.dtype == torch.float32 and tuple(log_probs.shape) == (LANE,)
    assert log_probs[0] < 0 and torch.equal(log_probs[1:], torch.ones(3))


def test_invoke_with_device_feedback_advances_inputs_on_device(setup: TinySetup) -> None:
    table = prefilled(setup)
    attach_feedback(setup.model)
    rt = runtime(setup, sampling=True)
    prepared = rt.prepare(NEXT_TOKENS, START, table, sampling_params=SamplingParams())
    assert prepared.device_feedback
    with pytest.raises(ValueError, match="device_feedback=True needs a request prepared"):
        rt.invoke(rt.prepare(NEXT_TOKENS, START, table), device_feedback=True)
    result = rt.invoke(prepared, device_feedback=True)
    tokens, _ = result.value
    staged = result.owned[1]
    assert torch.equal(staged.tokens, tokens)
    assert torch.equal(staged.positions, torch.tensor([6, -1, 4, -1]))
    rt.consume(result)
    assert setup.device.live_allocations == setup.resident_allocations


# --------------------------------------------------------------------------------------------
# Reads, leases and cleanup
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True])
def test_async_read_matches_blocking_read(setup: TinySetup, sampled: bool) -> None:
    table = prefilled(setup)
    rt = runtime(setup, sampling=True)
    params = SamplingParams(temperature=0.0) if sampled else None
    blocking = rt.consume(rt.invoke(rt.prepare(NEXT_TOKENS, START, table, sampling_params=params)))
    raw = rt.consume(
        rt.invoke(rt.prepare(NEXT_TOKENS, START, table, sampling_params=params)),
        read_from_device=False,
    )
    assert rt.outstanding_lease_count == 1
    assert setup.device.live_allocations > setup.resident_allocations  # staged inputs still owned
    host, events = rt.read_decode_output(raw, async_read=True)
    assert len(events) == 1 and setup.reader.pending_count == 1
    with pytest.raises(RuntimeError, match="already read"):
        rt.read_decode_output(raw, async_read=True)
    out = rt.process_decode_output_host(host)  # the lease knows the output kind
    assert torch.equal(out, blocking)
    assert rt.outstanding_lease_count == 0 and setup.reader.pending_count == 0
    assert setup.device.live_allocations == setup.resident_allocations


def test_sync_read_of_a_leased_output(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup)
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    expected = rt.consume(rt.invoke(prepared))
    raw = rt.consume(rt.invoke(prepared), read_from_device=False)
    host = rt.read_decode_output(raw)
    assert rt.outstanding_lease_count == 0
    assert setup.device.live_allocations == setup.resident_allocations
    assert torch.equal(rt.process_decode_output_host(host), expected)


def test_drain_releases_outstanding_leases(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup)
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    idle = rt.consume(rt.invoke(prepared), read_from_device=False)
    pending = rt.consume(rt.invoke(prepared), read_from_device=False)
    host, _ = rt.read_decode_output(pending, async_read=True)
    leases = rt.outstanding_leases
    assert {lease.state for lease in leases} == {ReadState.IDLE, ReadState.PENDING}
    rt.drain_external_outputs()
    assert all(lease.released for lease in leases)
    assert rt.outstanding_lease_count == 0 and setup.reader.pending_count == 0
    assert setup.device.live_allocations == setup.resident_allocations
    rt.drain_external_outputs()  # idempotent
    # A drained output can still be normalised by whoever holds its host value.
    assert tuple(rt.process_decode_output_host(host).shape) == (LANE, 1, setup.model.vocab_size)
    with pytest.raises(RuntimeError, match="cannot release from released"):
        leases[0].move("release")
    del idle


def test_consume_validates_its_argument(setup: TinySetup) -> None:
    rt = runtime(setup)
    with pytest.raises(TypeError, match="DecodeInvocationResult"):
        rt.consume(torch.zeros(LANE, 3))
    table = prefilled(setup)
    result = rt.invoke(rt.prepare(NEXT_TOKENS, START, table))
    rt.consume(result, read_from_device=False)
    with pytest.raises(RuntimeError, match="already leased"):
        rt.consume(result, read_from_device=False)
    rt.drain_external_outputs()


def test_failed_invoke_releases_staged_inputs(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = runtime(setup)
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    bad = rt.prepare(NEXT_TOKENS, START, torch.full((LANE, 8), 99, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table has entries"):
        rt.invoke(bad)
    assert setup.device.live_allocations == setup.resident_allocations
    assert rt.transient_orphan_count == 0
    rt.consume(rt.invoke(prepared))


def test_release_failures_become_orphans_that_block_prepare(setup: TinySetup) -> None:
    table = prefilled(setup)
    faulty = FaultInjectingDevice(setup.device, FaultPlan.nth("deallocate", 1))
    rt = runtime(setup, device=faulty, output_reader=OutputReader(faulty))
    prepared = rt.prepare(NEXT_TOKENS, START, table)
    with pytest.raises(RuntimeError, match="consume: failed to release 1") as info:
        rt.consume(rt.invoke(prepared))
    assert isinstance(info.value.__cause__, InjectedFault)
    assert rt.transient_orphan_count == 1
    with pytest.raises(RuntimeError, match="DecodeRuntime has unreleased transient resources"):
        rt.prepare(NEXT_TOKENS, START, table)
    with pytest.raises(RuntimeError, match="unreleased transient resources"):
        rt.invoke(prepared)
    rt.cleanup_transients()
    assert rt.transient_orphan_count == 0
    assert setup.device.live_allocations == setup.resident_allocations
    rt.cleanup_transients()  # idempotent
    rt.consume(rt.invoke(rt.prepare(NEXT_TOKENS, START, table)))


def test_prepared_decode_is_a_private_copy(setup: TinySetup) -> None:
    rt = runtime(setup)
    tokens = NEXT_TOKENS.clone().to(torch.int32)
    positions = START.clone()
    prepared = rt.prepare(tokens, positions, block_page_table(LANE, 2))
    assert isinstance(prepared, PreparedDecode)
    tokens[0] = 99
    positions[0] = 0
    assert prepared.tokens.dtype == torch.int64 and prepared.tokens[0] == NEXT_TOKENS[0]
    assert prepared.start_pos[0] == START[0]
    assert prepared.active_mask.tolist() == [True, False, True, False]

"""Reference 2.20 with fake lanes: routing, broadcast, preflight, barrier, guarded cleanup."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from lifecycle import Phase, PhaseError
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, LaneFailure
from runtime.lanes.fanout import OUTPUT_THREAD_PREFIX
from runtime.sampling import SamplingParams
from tests.runtime.lane_fakes import FakeLane, fake_group, serving_group


def _prefill(group: LaneGroupExecutor, slots: list[int], **extra: object) -> object:
    rows = len(slots)
    return group.prefill_forward(
        tokens=torch.arange(rows * 3).reshape(rows, 3),
        page_table=torch.arange(rows).reshape(rows, 1),
        prompt_lens=torch.tensor([3] * rows),
        empty_slots=slots,
        **extra,
    )


def _decode_inputs(group: LaneGroupExecutor) -> dict[str, torch.Tensor]:
    batch = group.max_batch_size
    return {
        "tokens": torch.arange(batch),
        "start_pos": torch.arange(batch),
        "page_table": torch.zeros((batch, 2), dtype=torch.int32),
    }


# -- construction ---------------------------------------------------------------------------------


def test_needs_a_lane() -> None:
    with pytest.raises(ValueError, match="at least one lane"):
        LaneGroupExecutor([])


def test_unequal_capacities_clean_every_supplied_lane() -> None:
    fakes = [FakeLane(0, capacity=2), FakeLane(1, capacity=3)]
    with pytest.raises(ValueError, match="same fixed capacity"):
        LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)])
    assert [f.closed for f in fakes] == [1, 1]


def test_shape_attributes() -> None:
    group, _ = fake_group(3, capacity=4, trace_mode="all")
    assert group.tt_data_parallel == 3
    assert group.per_lane_max_batch_size == 4
    assert group.max_batch_size == 12
    assert group.traced_prefill_execution == ("traced",) * 3
    assert group.eager_execution == ("eager",) * 3
    assert group.requires_prefill_trace_warmup is True
    assert group.phase is Phase.CONSTRUCTED
    mesh = object()
    explicit = LaneGroupExecutor([InProcessLane(FakeLane(0), index=0)], mesh_device=mesh)
    assert explicit.mesh_device is mesh
    group.close()
    explicit.close()


# -- phases fan out --------------------------------------------------------------------------------


def test_phases_fan_out_and_journal_each_lane() -> None:
    group, fakes = fake_group(2)
    group.start()
    assert group.phase is Phase.SERVING
    for fake in fakes:
        assert fake.names() == ["resolve_capacity", "seal", "allocate_kv_cache", "compile", "serve"]
    machines = {entry.machine for entry in group.journal.entries}
    assert "LaneGroupExecutor" in machines
    group.close()


def test_configure_clones_a_single_config_per_lane() -> None:
    group, fakes = fake_group(2)
    config = torch.nn.Identity()  # any object: copied, never shared
    group.configure_paged_kv_cache(config)
    given = [f.calls[0][1]["config"] for f in fakes]
    assert given[0] is not given[1] and given[0] is not config
    assert group.phase is Phase.CAPACITY_RESOLVED
    group.close()


def test_configure_per_lane_sequence_must_match_lanes() -> None:
    group, fakes = fake_group(2)
    with pytest.raises(ValueError, match="2 DP lanes"):
        group.configure_paged_kv_cache([object()])
    assert group.phase is Phase.CONSTRUCTED
    assert all(not f.calls for f in fakes)
    group.close()


def test_allocate_kv_cache_returns_per_lane_handles_and_forwards_arguments() -> None:
    group, fakes = fake_group(2)
    handles = group.allocate_kv_cache((8, 1, 4, 2), torch.float32, 2)
    assert handles == ["kv0", "kv1"]
    assert fakes[1].calls[0] == (
        "allocate_kv_cache",
        {"kv_cache_shape": (8, 1, 4, 2), "dtype": torch.float32, "num_layers": 2},
    )
    assert group.phase is Phase.ALLOCATED
    group.close()


def test_side_effect_calls_return_none_and_warm_each_lane_with_its_cache() -> None:
    group, fakes = fake_group(2)
    group.allocate_kv_cache()
    assert group.warmup_prefill(kv_cache=["a", "b"]) is None
    assert group.warmup_model_decode(kv_cache=["a", "b"], max_batch_size=999) is None
    assert [f.calls[-1][1]["kv_cache"] for f in fakes] == ["a", "b"]
    assert "max_batch_size" not in fakes[0].calls[-1][1]
    assert group.phase is Phase.COMPILED
    group.close()


# -- prefill routing ------------------------------------------------------------------------------


def test_prefill_routes_by_global_slot_and_restores_source_order() -> None:
    group, fakes = serving_group(2, capacity=2)
    out = _prefill(group, [3, 0, 2])
    # lane = slot // 2, local = slot % 2, value = 100 * lane + local
    assert out.tolist() == [101, 0, 100]
    assert out.dtype == torch.int64
    lane1 = fakes[1].calls[0][1]
    assert lane1["empty_slots"] == [1, 0]  # rows 0 and 2 keep their relative order
    assert lane1["tokens"].tolist() == [[0, 1, 2], [6, 7, 8]]
    assert lane1["page_table"].tolist() == [[0], [2]]
    assert fakes[0].calls[0][1]["empty_slots"] == [0]
    group.close()


def test_only_lanes_with_rows_participate() -> None:
    group, fakes = serving_group(2)
    _prefill(group, [2, 3])
    assert fakes[0].calls == []
    assert fakes[1].names() == ["prefill_forward"]
    group.close()


@pytest.mark.parametrize("slot", [-1, 4])
def test_invalid_slot_is_refused_before_any_lane(slot: int) -> None:
    group, fakes = serving_group(2)
    with pytest.raises(ValueError, match=f"empty slot {slot} maps to an invalid DP lane"):
        _prefill(group, [0, slot])
    assert all(not f.calls for f in fakes)
    assert group.phase is Phase.SERVING
    group.close()


def test_empty_slots_length_must_match() -> None:
    group, _ = serving_group(2)
    with pytest.raises(ValueError, match="empty_slots has 1 entries"):
        group.prefill_forward(
            tokens=torch.zeros((2, 3), dtype=torch.long),
            page_table=torch.zeros((2, 1)),
            empty_slots=[0],
        )
    group.close()


def test_sampling_params_follow_rows_and_singletons_broadcast() -> None:
    group, fakes = serving_group(2)
    sampling = SamplingParams(temperature=[0.1, 0.2, 0.3], top_k=[5], top_p=0.9, seed=[7, 8, 9])
    _prefill(group, [3, 0, 2], sampling_params=sampling)
    lane1 = fakes[1].calls[0][1]["sampling_params"]
    assert lane1.temperature == (0.1, 0.3)
    assert lane1.top_k == (5,)  # a length-1 field broadcasts within the lane
    assert lane1.top_p == 0.9
    assert lane1.seed == (7, 9)
    assert fakes[0].calls[0][1]["sampling_params"].temperature == (0.2,)
    group.close()


def test_kv_cache_and_execution_must_be_per_lane_sequences() -> None:
    group, _ = serving_group(2)
    with pytest.raises(TypeError, match="kv_cache must be a sequence"):
        _prefill(group, [0], kv_cache=object())
    with pytest.raises(ValueError, match="execution has 1 entries for 2 DP lanes"):
        _prefill(group, [0], execution=["eager"])
    with pytest.raises(TypeError, match="execution must be a sequence"):
        _prefill(group, [0], execution="eager")
    assert group.phase is Phase.SERVING
    group.close()


def test_history_tokens_land_at_local_slots() -> None:
    group, fakes = serving_group(2)
    prompt_tokens = torch.tensor([[1, 1], [2, 2]])
    _prefill(group, [3, 0], prompt_tokens=prompt_tokens)
    assert fakes[1].calls[0][1]["prompt_tokens"].tolist() == [[-1, -1], [1, 1]]
    assert fakes[0].calls[0][1]["prompt_tokens"].tolist() == [[2, 2], [-1, -1]]
    group.close()


def test_global_slot_remap_must_stay_in_its_lane() -> None:
    group, fakes = serving_group(2)
    _prefill(group, [2], slot_remap=[1, 0, 3, 2])
    assert fakes[1].calls[0][1]["slot_remap"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="across DP lanes"):
        _prefill(group, [2], slot_remap=[2, 1, 0, 3])
    group.close()


# -- preflight ------------------------------------------------------------------------------------


def test_every_traced_lane_is_preflighted_before_any_runs() -> None:
    group, fakes = serving_group(2, trace_mode="all")
    out = _prefill(group, [3, 0])
    assert out.tolist() == [101, 0]
    order = [(f.index, name) for f in fakes for name in f.names()]
    assert sorted(order) == sorted(
        [
            (0, "preflight_prefill"),
            (1, "preflight_prefill"),
            (0, "execute_preflighted_prefill"),
            (1, "execute_preflighted_prefill"),
        ]
    )
    group.close()


def test_a_failed_preflight_executes_no_lane_and_cleans_every_lane() -> None:
    group, fakes = serving_group(2, trace_mode="all")
    fakes[1].fail["preflight_prefill"] = RuntimeError("no trace for this shape")
    with pytest.raises(
        RuntimeError,
        match="Required traced prefill is unavailable for DP lane 1; no DP lane executed: "
        "RuntimeError: no trace",
    ):
        _prefill(group, [0, 3])
    assert all("execute_preflighted_prefill" not in f.names() for f in fakes)
    assert all(f.closed == 1 for f in fakes)
    assert group.phase is Phase.TERMINAL
    with pytest.raises(PhaseError, match="LaneGroupExecutor is terminal; construct a new group"):
        _prefill(group, [0])


def test_a_lane_fault_in_preflight_is_a_lane_failure_naming_the_lane() -> None:
    """Hypothesis found it: a preflight error was a bare RuntimeError, unlike every other call."""
    group, fakes = serving_group(2, trace_mode="all")
    fakes[1].fail["preflight_prefill"] = RuntimeError("injected lane fault")
    with pytest.raises(LaneFailure, match="DP lane 1: Required traced prefill") as failure:
        _prefill(group, [0, 3])
    assert failure.value.lane == 1
    assert group.phase is Phase.TERMINAL


def test_can_trace_prefill_asks_each_participating_lane_with_its_rows() -> None:
    group, fakes = serving_group(2, trace_mode="all")
    tokens = torch.zeros((2, 3), dtype=torch.long)
    assert group.can_trace_prefill(tokens=tokens, prompt_lens=[3, 2], empty_slots=[3, 1])
    assert sorted(fakes[1].calls[0][1]) == ["prompt_lens", "start_pos", "tokens"]
    assert fakes[1].calls[0][1]["prompt_lens"] == [3]
    fakes[0].can_trace = False
    assert not group.can_trace_prefill(tokens=tokens, empty_slots=[0, 3])
    with pytest.raises(TypeError):
        group.can_trace_prefill(tokens=tokens, unrelated=1)  # type: ignore[call-arg]
    group.close()


# -- decode ---------------------------------------------------------------------------------------


def test_decode_needs_the_fixed_global_batch() -> None:
    group, fakes = serving_group(2)
    inputs = _decode_inputs(group)
    inputs["tokens"] = inputs["tokens"][:3]
    with pytest.raises(ValueError, match="DP decode expects fixed global batch 4"):
        group.decode_forward(**inputs)
    assert all(not f.calls for f in fakes) and group.phase is Phase.SERVING
    group.close()


def test_decode_splits_contiguously_and_concatenates() -> None:
    group, fakes = serving_group(2)
    sampling = SamplingParams(temperature=[0.1, 0.2, 0.3, 0.4], top_k=[3])
    out = group.decode_forward(**_decode_inputs(group), sampling_params=sampling, reset_batch=True)
    assert out.tolist() == [0, 1, 100, 101] and out.dtype == torch.int64
    lane1 = fakes[1].calls[0][1]
    assert lane1["tokens"].tolist() == [2, 3]
    assert lane1["sampling_params"].temperature == (0.3, 0.4)
    assert lane1["sampling_params"].top_k == (3,)
    assert all(f.calls[0][1]["reset_batch"] is True for f in fakes)
    group.close()


def test_raw_decode_reads_concurrently_with_flattened_events() -> None:
    group, fakes = serving_group(2)
    raws = group.decode_forward(**_decode_inputs(group), read_from_device=False)
    assert isinstance(raws, list) and len(raws) == 2
    seen: list[str] = []
    original = fakes[0].read_decode_output

    def spy(raw: object, *, async_read: bool = False) -> object:
        seen.append(threading.current_thread().name)
        return original(raw, async_read=async_read)

    fakes[0].read_decode_output = spy  # type: ignore[method-assign]
    hosts, events = group.read_decode_output(raws, async_read=True)
    assert events == ["event", "event"]
    assert seen[0].startswith(OUTPUT_THREAD_PREFIX)
    assert group.process_decode_output_host(hosts, is_tokens=True).tolist() == [0, 1, 100, 101]
    with pytest.raises(ValueError, match="one value per DP lane"):
        group.process_decode_output_host(hosts[:1])
    group.close()


def test_async_read_must_return_pairs() -> None:
    group, fakes = serving_group(2)
    raws = group.decode_forward(**_decode_inputs(group), read_from_device=False)
    fakes[1].read_decode_output = lambda raw, async_read=False: raw[1]  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="DP lane 1 async read"):
        group.read_decode_output(raws, async_read=True)
    assert group.phase is Phase.TERMINAL


def test_concurrent_read_failures_attach_lane_failures() -> None:
    group, fakes = serving_group(2)
    raws = group.decode_forward(**_decode_inputs(group), read_from_device=False)
    for fake in fakes:
        fake.fail["read_decode_output"] = RuntimeError(f"read failed on {fake.index}")
    with pytest.raises(LaneFailure, match="DP lane 0") as caught:
        group.read_decode_output(raws)
    others = caught.value.lane_failures  # type: ignore[attr-defined]
    assert [f.lane for f in others] == [1]
    assert all(f.closed == 1 for f in fakes)


def test_log_probabilities_aggregate_with_missing_rows_at_one() -> None:
    group, fakes = serving_group(2, logprobs=True)
    fakes[0].logprobs = False
    tokens, logprobs = group.decode_forward(**_decode_inputs(group))
    assert tokens.tolist() == [0, 1, 100, 101]
    assert logprobs.tolist() == [1.0, 1.0, 1.5, 1.5]
    tokens, logprobs = _prefill(group, [3, 0])  # type: ignore[misc]
    assert tokens.tolist() == [101, 0]
    assert logprobs.tolist() == [1.5, 1.0]
    group.close()


# -- guarded cleanup ------------------------------------------------------------------------------


def test_a_lane_failure_cleans_every_lane_and_names_the_lane() -> None:
    group, fakes = serving_group(3)
    fakes[1].fail["decode_forward"] = RuntimeError("device lost")
    with pytest.raises(
        LaneFailure, match=r"DP lane 1: decode_forward\(\) failed: RuntimeError: device lost"
    ) as caught:
        group.decode_forward(**_decode_inputs(group))
    assert caught.value.lane == 1
    assert [f.closed for f in fakes] == [1, 1, 1]
    assert group.phase is Phase.TERMINAL
    triggers = [e.trigger for e in group.journal.entries if e.machine == "LaneGroupExecutor"]
    assert triggers[-2:] == ["fault", "close"]
    group.close()  # a no-op
    assert [f.closed for f in fakes] == [1, 1, 1]


def test_cleanup_failures_are_attached_and_only_failed_lanes_retry() -> None:
    group, fakes = serving_group(3)
    fakes[0].fail["decode_forward"] = RuntimeError("primary")
    fakes[2].fail["close"] = RuntimeError("lane 2 close failed")
    with pytest.raises(LaneFailure, match="primary") as caught:
        group.decode_forward(**_decode_inputs(group))
    failures = caught.value.cleanup_failures  # type: ignore[attr-defined]
    assert len(failures) == 1 and "lane 2 close failed" in str(failures[0])
    assert group.phase is Phase.CLOSING
    assert [f.closed for f in fakes] == [1, 1, 0]
    group.close()  # retries lane 2 only
    assert [f.closed for f in fakes] == [1, 1, 1]
    assert group.phase is Phase.TERMINAL
    group.close()
    assert [f.closed for f in fakes] == [1, 1, 1]


# -- the capture barrier --------------------------------------------------------------------------


def _warm(group: LaneGroupExecutor) -> None:
    group.allocate_kv_cache()
    group.warmup_prefill(enable_trace=True)
    group.warmup_decode(enable_trace=True)


def test_capture_is_one_barrier_over_pending_lanes() -> None:
    group, fakes = fake_group(2, trace_mode="all")
    _warm(group)
    assert group.phase is Phase.COMPILED
    group.capture()
    assert all(f.warmup is not None and f.warmup.trace_activated for f in fakes)
    detail = [e.detail for e in group.journal.entries if e.trigger == "capture"][-1]
    assert "barrier: 2 lanes pending" in detail
    group.serve()
    assert group.phase is Phase.SERVING
    group.close()


def test_mixed_readiness_raises_and_captures_nothing() -> None:
    group, fakes = fake_group(2, trace_mode="all")
    group.allocate_kv_cache()
    original = fakes[1]._warm

    def stays_not_ready(name: str, kwargs: dict[str, object]) -> str:
        result = original(name, kwargs)
        assert fakes[1].warmup is not None
        fakes[1].warmup.capture_pending = False
        return result

    fakes[1]._warm = stays_not_ready  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="mixed trace activation readiness"):
        group.warmup_prefill(enable_trace=True)
    assert all("capture" not in f.names() for f in fakes)
    assert group.phase is Phase.TERMINAL


def test_trace_warmup_needs_every_lane_to_expose_the_barrier() -> None:
    fakes = [FakeLane(0, trace_mode="all"), FakeLane(1, trace_mode="all", barrier=False)]
    group = LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)])
    group.allocate_kv_cache()
    with pytest.raises(RuntimeError, match="Every DP lane must expose the trace activation"):
        group.warmup_prefill(enable_trace=True)


def test_eager_group_cannot_capture() -> None:
    group, fakes = fake_group(2)
    group.allocate_kv_cache()
    group.warmup_prefill()
    group.warmup_decode()
    with pytest.raises(PhaseError, match="nothing to capture"):
        group.capture()
    assert group.phase is Phase.COMPILED  # the group's own refusal cleans nothing
    assert all(f.closed == 0 for f in fakes)
    group.close()


def test_illegal_phase_call_is_refused_before_any_lane() -> None:
    group, fakes = fake_group(2)
    with pytest.raises(PhaseError, match=r"decode_forward\(\) is not legal in CONSTRUCTED"):
        group.decode_forward(**_decode_inputs(group))
    assert all(not f.calls for f in fakes)
    group.close()


class OrderedLane(InProcessLane):
    """Records when the group issues a call and when it waits on it."""

    log: ClassVar[list[str]] = []

    def submit(self, method: str, /, **kwargs: object) -> object:  # type: ignore[override]
        call = super().submit(method, **kwargs)
        lane, log = self.index, self.log

        class Recorded:
            def wait(self, timeout_s: float | None = None) -> object:
                log.append(f"wait {method} {lane}")
                return call.wait(timeout_s)

        log.append(f"issue {method} {lane}")
        return Recorded()


def test_every_lane_is_issued_before_any_is_waited() -> None:
    fakes = [FakeLane(i) for i in range(2)]
    group = LaneGroupExecutor([OrderedLane(f, index=i) for i, f in enumerate(fakes)])
    group.start()
    OrderedLane.log.clear()
    group.decode_forward(**_decode_inputs(group))
    assert OrderedLane.log == [
        "issue decode_forward 0",
        "issue decode_forward 1",
        "wait decode_forward 0",
        "wait decode_forward 1",
    ]
    group.close()


def test_the_tokenizer_survives_fact_refreshes() -> None:
    fakes = [FakeLane(i) for i in range(2)]
    marker = object()
    for fake in fakes:
        fake.tokenizer = marker  # type: ignore[attr-defined]
    group = LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)])
    group.start()  # every phase refreshes the lanes' facts
    assert group.tokenizer is marker
    group.close()

"""Drain, sleep, staged wake and reload on one lane (`models.executor_sleep`).

Greedy output after every sleep/wake form equals the output before, for eager and both
traced modes; while asleep the device holds no allocation and no weight byte; each vLLM sleep
bug has a regression test here (forward in the weights-only stage, level 2 losing the rotary
tables, a second sleep, a failed wake leaking).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch

from lifecycle import Phase, PhaseError
from models.decoder.executor import DecoderExecutor
from models.decoder.sources import load_model
from models.generation import GenerationParams, Generator
from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.weight_reload import WeightMismatchError
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.executor_setup import tiny_executor

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
MODES = ("none", "decode_only", "all")


def greedy(executor: DecoderExecutor) -> list[tuple[int, ...]]:
    """Greedy tokens of PROMPTS on a fresh generator (no prefix cache carried over)."""
    params = GenerationParams(max_new_tokens=6)
    return [c.token_ids for c in Generator(executor).generate(PROMPTS, params)]


@pytest.fixture(params=MODES)
def served(request: pytest.FixtureRequest) -> Iterator[DecoderExecutor]:
    executor = tiny_executor(trace_mode=request.param, max_batch_size=2, faults="allocate:999999")
    executor.start()
    yield executor
    executor.close()
    assert executor.device.live_allocations == 0


def faulty(executor: DecoderExecutor) -> FaultInjectingDevice:
    device = executor.device
    assert isinstance(device, FaultInjectingDevice)
    return device


def asleep_holds_nothing(executor: DecoderExecutor) -> None:
    assert executor.phase is Phase.SLEEPING
    assert executor.device.live_allocations == 0
    assert executor.device.live_traces == 0
    assert executor.residency is not None and executor.residency.device_bytes() == 0


def test_sleep_1_then_wake_gives_the_same_output(served: DecoderExecutor) -> None:
    before = greedy(served)
    served.drain()
    assert served.phase is Phase.DRAINED
    served.sleep(1)
    asleep_holds_nothing(served)
    served.wake()
    assert served.phase is Phase.SERVING
    assert greedy(served) == before


def test_staged_wake_gives_the_same_output(served: DecoderExecutor) -> None:
    before = greedy(served)
    served.drain()
    served.sleep(1)
    served.wake(tags=("weights",))
    assert served.phase is Phase.WEIGHTS_AWAKE
    assert served.device.live_allocations == 0
    served.wake(tags=("kv_cache",))
    assert served.phase is Phase.SERVING
    assert greedy(served) == before


def test_sleep_2_wake_reload_gives_the_same_output(served: DecoderExecutor) -> None:
    before = greedy(served)
    served.drain()
    served.sleep(2)
    asleep_holds_nothing(served)
    served.wake(tags=("weights",))
    served.reload_weights("tiny-random")
    served.wake(tags=("kv_cache",))
    assert greedy(served) == before


def test_sleep_2_full_wake_waits_for_reload_before_serving(served: DecoderExecutor) -> None:
    before = greedy(served)
    served.drain()
    served.sleep(2)
    served.wake()
    assert served.phase is Phase.DRAINED  # zeros are never served
    with pytest.raises(PhaseError, match="reload_weights"):
        served.serve()
    served.reload_weights(load_model("tiny-random", with_tokenizer=False))
    served.serve()
    assert greedy(served) == before


def test_reload_other_weights_equals_a_fresh_executor(served: DecoderExecutor) -> None:
    other = load_model("tiny-random", seed=1, with_tokenizer=False).model
    served.drain()
    served.reload_weights(other.canonical_state_dict())
    served.serve()
    fresh = tiny_executor(trace_mode=served.trace_mode, max_batch_size=2, seed=1)
    fresh.start()
    try:
        assert greedy(served) == greedy(fresh)
    finally:
        fresh.close()
    entry = [e for e in served.journal if e.trigger == "reload_weights"][-1]
    if served.trace_mode != "none":
        assert "captured traces stay valid" in entry.detail


def test_forward_in_weights_only_stage_is_refused_before_device_work(
    served: DecoderExecutor,
) -> None:
    served.drain()
    served.sleep(1)
    served.wake(tags=("weights",))
    attempts = dict(faulty(served).attempts)
    for call in (
        lambda: served.decode_forward(
            tokens=torch.zeros(2, dtype=torch.long),
            start_pos=torch.zeros(2, dtype=torch.long),
            page_table=torch.zeros(2, 4, dtype=torch.int32),
        ),
        lambda: served.prefill_forward(tokens=torch.ones(1, 4, dtype=torch.long)),
        lambda: served.warmup_decode(),
    ):
        with pytest.raises(PhaseError, match=r"wake\(tags=\('kv_cache',\)\)"):
            call()
        assert served.phase is Phase.WEIGHTS_AWAKE
    assert faulty(served).attempts == attempts


def test_level_2_restores_rotary_tables_bit_equal_to_a_fresh_load(
    served: DecoderExecutor,
) -> None:
    served.drain()
    served.sleep(2)
    cos, sin = served.loaded.model.rope
    assert cos.numel() == 0 and sin.numel() == 0
    served.wake(tags=("weights",))
    served.reload_weights("tiny-random")
    fresh_cos, fresh_sin = load_model("tiny-random", with_tokenizer=False).model.rope
    cos, sin = served.loaded.model.rope
    assert torch.equal(cos, fresh_cos) and torch.equal(sin, fresh_sin)


def test_second_sleep_and_wake_while_awake_are_journaled_no_ops(
    served: DecoderExecutor,
) -> None:
    served.wake()
    served.drain()
    served.drain()
    served.sleep(1)
    held = served.device.live_allocations, served.residency and served.residency.level
    served.sleep(2)
    assert served.phase is Phase.SLEEPING
    assert (served.device.live_allocations, served.residency and served.residency.level) == held
    noops = [e.detail for e in served.journal if e.detail.startswith("no-op")]
    assert any("already awake" in d for d in noops)
    assert any("nothing in flight" in d for d in noops)
    assert any("already SLEEPING" in d for d in noops)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e.sleep(3), ValueError, "level must be 1"),
        (lambda e: e.sleep(True), ValueError, "level must be 1"),
        (lambda e: e.wake(tags=("weights", "kv")), ValueError, "tags must name"),
        (lambda e: e.wake(tags="weights"), TypeError, "tags must be a sequence"),
        (lambda e: e.wake(tags=()), ValueError, "tags must name"),
    ],
)
def test_bad_arguments_are_refused_naming_them(call: object, error: type, match: str) -> None:
    executor = tiny_executor(max_batch_size=2)
    executor.start()
    executor.drain()
    with pytest.raises(error, match=match):
        call(executor)  # type: ignore[operator]
    assert executor.phase is Phase.DRAINED
    executor.close()


def test_sleep_needs_a_drain_first() -> None:
    executor = tiny_executor(max_batch_size=2)
    executor.start()
    with pytest.raises(PhaseError, match=r"drain\(\) first"):
        executor.sleep()
    with pytest.raises(PhaseError, match=r"drain\(\) first"):
        executor.reload_weights("tiny-random")
    assert executor.phase is Phase.SERVING
    executor.drain()
    executor.sleep()
    with pytest.raises(PhaseError, match=r"wake\(tags=\('weights',\)\)"):
        executor.wake(tags=("kv_cache",))
    with pytest.raises(PhaseError, match=r"wake\(tags=\('weights',\)\) first"):
        executor.reload_weights("tiny-random")
    assert executor.phase is Phase.SLEEPING
    executor.close()
    assert executor.device.live_allocations == 0


def test_mismatching_reload_is_refused_naming_the_tensor_and_changes_nothing() -> None:
    executor = tiny_executor(max_batch_size=2)
    executor.start()
    executor.drain()
    model = executor.loaded.model
    snapshot = {k: v.clone() for k, v in model.resident_weights().items()}
    state = load_model("tiny-random", seed=1, with_tokenizer=False).model.canonical_state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(state, **{name: state[name][:-1]})
    with pytest.raises(ValueError, match="up_proj"):
        executor.reload_weights(bad)
    half = {k: v.half() if k.endswith("norm.weight") else v for k, v in state.items()}
    with pytest.raises(WeightMismatchError, match=r"norm\.weight"):
        executor.reload_weights(half)
    with pytest.raises(WeightMismatchError, match=r"'embed_tokens\.weight' is missing"):
        executor.reload_weights(load_model("tiny-random-mha-tied", with_tokenizer=False))
    assert executor.phase is Phase.DRAINED
    for key, value in model.resident_weights().items():
        assert torch.equal(value, snapshot[key]), key
    executor.close()


@pytest.mark.parametrize("mode", ["none", "decode_only"])
def test_failed_kv_wake_leaves_weights_awake_with_nothing_leaked(mode: str) -> None:
    executor = tiny_executor(trace_mode=mode, max_batch_size=2, faults="allocate:999999")
    executor.start()
    before = greedy(executor)
    executor.drain()
    executor.sleep(1)
    device = faulty(executor)
    for step in (1, 3):  # the KV cache's own allocation, then one during warmup
        device.plan = FaultPlan.nth("allocate", device.attempts["allocate"] + step)
        with pytest.raises(InjectedFault):
            executor.wake()
        assert executor.phase is Phase.WEIGHTS_AWAKE
        assert device.live_allocations == 0
    device.plan = FaultPlan()
    executor.wake()
    assert greedy(executor) == before
    executor.close()
    assert device.live_allocations == 0


def test_failed_release_during_sleep_faults_and_close_retries() -> None:
    executor = tiny_executor(max_batch_size=2, faults="allocate:999999")
    executor.start()
    executor.drain()
    device = faulty(executor)
    device.plan = FaultPlan.nth("deallocate", device.attempts["deallocate"] + 1)
    with pytest.raises(InjectedFault):
        executor.sleep(1)
    assert executor.phase is Phase.FAULTED
    executor.close()
    assert executor.phase is Phase.TERMINAL
    assert device.live_allocations == 0


def test_close_while_asleep_gives_the_model_back_its_kept_weights() -> None:
    executor = tiny_executor(max_batch_size=2)
    model = executor.loaded.model
    executor.start()
    kept = {k: v.clone() for k, v in model.resident_weights().items()}
    executor.drain()
    executor.sleep(1)
    executor.close()
    assert all(torch.equal(v, kept[k]) for k, v in model.resident_weights().items())
    dropped = tiny_executor(max_batch_size=2)
    dropped.start()
    dropped.drain()
    dropped.sleep(2)
    dropped.close()  # dropped weights stay empty: zeros would compute gibberish silently
    assert all(v.numel() == 0 for v in dropped.loaded.model.resident_weights().values())
    assert dropped.device.live_allocations == 0


def test_a_reload_that_moved_addresses_recaptures_the_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor = tiny_executor(trace_mode="decode_only", max_batch_size=2)
    executor.start()
    before = greedy(executor)
    executor.drain()
    residency = executor.residency
    assert residency is not None
    real = residency.reload

    def moved(pairs: object) -> object:
        return attrs.evolve(real(pairs), addresses_kept=False)  # type: ignore[arg-type]

    monkeypatch.setattr(residency, "reload", moved)
    captured = executor.device.traces_captured_total  # type: ignore[attr-defined]
    executor.reload_weights("tiny-random")
    entry = [e for e in executor.journal if e.trigger == "reload_weights"][-1]
    assert "addresses moved, traces recaptured" in entry.detail
    assert executor.device.traces_captured_total > captured  # type: ignore[attr-defined]
    assert executor.phase is Phase.DRAINED
    executor.serve()
    assert greedy(executor) == before
    executor.close()
    assert executor.device.live_allocations == 0

"""TraceCompiler: registration, capture ordering, replay refresh decisions, rollback, cleanup."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lifecycle import PhaseError
from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.program_compiler import CompilerState, ProgramCompiler
from runtime.trace_compiler import RefreshDecision, TraceArtifact, TraceCompiler, TraceState
from tests.runtime.trace_fixtures import ToySignature, compile_toy, toy_plan


def build(device: Any = None) -> tuple[TraceCompiler, ProgramCompiler, Any]:
    device = device or TorchDevice("cpu")
    compiler = ProgramCompiler(device, lambda: object())
    return TraceCompiler(compiler), compiler, device


def refresh_x(values: torch.Tensor) -> Any:
    def refresh(artifact: TraceArtifact, decision: RefreshDecision) -> None:
        artifact.persistent_inputs.values["x"].copy_(values)

    return refresh


def test_capture_prepares_everything_first_then_decode_before_prefill() -> None:
    traces, compiler, device = build()
    events: list[str] = []
    prefill_key, prefill_sig = compile_toy(compiler, "prefill", 4)
    decode_key, decode_sig = compile_toy(compiler, "decode", 2)
    traces.register_capture_plan(toy_plan(device, prefill_key, prefill_sig, events=events))
    traces.register_capture_plan(toy_plan(device, decode_key, decode_sig, events=events))
    traces.capture_all()
    assert events == ["prepare:prefill", "prepare:decode", "capture:decode", "capture:prefill"]
    assert traces.state is TraceState.ACTIVE and compiler.state is CompilerState.ACTIVE
    assert traces.capture_count == 2 and device.live_traces == 2
    traces.capture_all()  # idempotent
    assert traces.capture_count == 2


def test_replay_refreshes_in_place_and_reuses_outputs() -> None:
    traces, compiler, device = build()
    key, sig = compile_toy(compiler, "decode", 3)
    traces.register_capture_plan(toy_plan(device, key, sig))
    traces.capture_all()
    first = traces.replay(key, refresh_x(torch.tensor([1.0, 2.0, 3.0])))
    assert torch.equal(first, torch.tensor([3.0, 5.0, 7.0]))
    second = traces.replay(key, refresh_x(torch.tensor([0.0, 1.0, 0.5])))
    assert second is first
    assert torch.equal(second, torch.tensor([1.0, 3.0, 2.0]))
    assert traces.replay_counts == {"prefill": 0, "decode": 2}


def test_aliases_share_one_trace() -> None:
    traces, compiler, device = build()
    key_a, sig = compile_toy(compiler, "decode", 2)
    other = compiler.compile(_AliasSig("decode", 2, "argmax"), lambda ctx: torch.zeros(2)).key
    traces.register_capture_plan(toy_plan(device, key_a, sig))
    traces.register_capture_plan(toy_plan(device, other, sig))
    assert traces.trace_count == 1 and traces.trace_association_count == 2
    assert traces.trace_key_for_program(key_a) == traces.trace_key_for_program(other)
    traces.capture_all()
    assert device.live_traces == 1


class _AliasSig(ToySignature):
    def __init__(self, operation: str, batch: int, path: str) -> None:
        super().__init__(operation, batch)
        object.__setattr__(self, "path", path)

    def key_material(self) -> tuple[Any, ...]:
        return (*super().key_material(), ("path", self.path))  # type: ignore[attr-defined]


def test_registration_rules() -> None:
    traces, compiler, device = build()
    key, sig = compile_toy(compiler, "decode", 2)
    with pytest.raises(RuntimeError, match="was not compiled"):
        traces.register_capture_plan(
            toy_plan(device, compiler.key_for(ToySignature("decode", 9)), sig)
        )
    traces.register_capture_plan(toy_plan(device, key, sig))
    with pytest.raises(ValueError, match="already associated with trace"):
        traces.register_capture_plan(toy_plan(device, key, ToySignature("decode", 3)))
    traces.capture_all()
    with pytest.raises(PhaseError, match="during capture or after trace activation"):
        traces.register_capture_plan(toy_plan(device, key, sig))
    with pytest.raises(RuntimeError, match="after trace activation"):
        compile_toy(compiler, "decode", 5)
    assert compiler.post_activation_compile_rejections == 1


def test_replay_requires_association_and_activation() -> None:
    traces, compiler, device = build()
    key, _ = compile_toy(compiler, "decode", 2)
    with pytest.raises(PhaseError, match=r"replay\(\) is not legal in REGISTERING"):
        traces.replay(key, refresh_x(torch.zeros(2)))
    other, other_sig = compile_toy(compiler, "prefill", 2)
    traces.register_capture_plan(toy_plan(device, other, other_sig))
    traces.capture_all()
    with pytest.raises(RuntimeError, match="has no trace association"):
        traces.replay(key, refresh_x(torch.zeros(2)))


def test_no_plans_means_no_activation() -> None:
    traces, compiler, _ = build()
    traces.capture_all()
    assert traces.state is TraceState.REGISTERING
    assert compiler.state is CompilerState.OPEN


def test_refresh_decision_sequence() -> None:
    traces, compiler, device = build()
    key_a, sig_a = compile_toy(compiler, "decode", 2)
    key_b, sig_b = compile_toy(compiler, "decode", 4)
    traces.register_capture_plan(toy_plan(device, key_a, sig_a))
    traces.register_capture_plan(toy_plan(device, key_b, sig_b))
    traces.capture_all()
    seen: list[RefreshDecision] = []

    def record(artifact: TraceArtifact, decision: RefreshDecision) -> None:
        seen.append(decision)

    feedback = {"device_feedback_enabled": True, "feedback_compatible": True}
    traces.replay(key_a, record, **feedback)
    traces.replay(key_a, record, page_table_changed=True, **feedback)
    traces.replay(key_b, record, **feedback)
    traces.replay(key_b, record, device_feedback_enabled=False)
    traces.replay(key_b, record, reset_batch=True, **feedback)
    assert [(d.full, d.page_table) for d in seen] == [
        (True, False),
        (False, True),
        (True, False),
        (True, False),
        (True, False),
    ]


def test_capture_failure_rolls_back_and_reopens_gate() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.nth("capture", 2))
    traces, compiler, _ = build(device)
    for operation, batch in (("decode", 2), ("prefill", 3)):
        key, sig = compile_toy(compiler, operation, batch)
        traces.register_capture_plan(toy_plan(device, key, sig))
    with pytest.raises(InjectedFault):
        traces.capture_all()
    assert inner.live_allocations == 0 and inner.live_traces == 0
    assert traces.state is TraceState.REGISTERING
    assert compiler.state is CompilerState.OPEN
    traces.capture_all()  # a retry captures both
    assert inner.live_traces == 2


def test_dirty_rollback_keeps_gate_closed_until_cleanup() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(
        inner, FaultPlan.nth("capture", 2) + FaultPlan.every("deallocate")
    )
    traces, compiler, _ = build(device)
    for operation, batch in (("decode", 2), ("prefill", 3)):
        key, sig = compile_toy(compiler, operation, batch)
        traces.register_capture_plan(toy_plan(device, key, sig))
    with pytest.raises(InjectedFault) as caught:
        traces.capture_all()
    assert caught.value.cleanup_failures  # type: ignore[attr-defined]
    assert compiler.gate_closed and traces.unreleased_resource_count == 2
    with pytest.raises(RuntimeError, match="call cleanup"):
        traces.replay(key, refresh_x(torch.zeros(3)))
    with pytest.raises(RuntimeError, match="Failed to release 4 trace resource"):
        traces.cleanup()
    assert compiler.gate_closed
    device.plan = FaultPlan()
    traces.cleanup()
    assert inner.live_allocations == 0 and inner.live_traces == 0
    assert compiler.state is CompilerState.OPEN
    assert device.deallocated_twice == 0


def test_live_traces_are_not_unreleased_resources() -> None:
    """Captured, replayable traces are owned, not left behind: a clean capture holds none."""
    inner = TorchDevice("cpu")
    traces, compiler, _ = build(inner)
    for operation, batch in (("decode", 2), ("prefill", 3)):
        key, sig = compile_toy(compiler, operation, batch)
        traces.register_capture_plan(toy_plan(inner, key, sig))
    traces.capture_all()
    assert inner.live_traces == 2
    assert traces.unreleased_resource_count == 0
    traces.cleanup()
    assert traces.unreleased_resource_count == 0


def test_cleanup_retries_failed_trace_release_without_freeing_inputs() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.nth("release_trace", 1))
    traces, compiler, _ = build(device)
    key, sig = compile_toy(compiler, "decode", 2)
    traces.register_capture_plan(toy_plan(device, key, sig))
    traces.capture_all()
    with pytest.raises(RuntimeError, match="Failed to release 1 trace resource"):
        traces.cleanup()
    assert inner.live_allocations == 2  # inputs kept while the trace is alive
    assert traces.unreleased_resource_count == 1
    assert compiler.gate_closed
    traces.cleanup()
    traces.cleanup()
    assert inner.live_allocations == 0 and inner.live_traces == 0
    assert traces.state is TraceState.RELEASED
    assert compiler.state is CompilerState.OPEN


@given(
    capture_failure=st.integers(1, 3),
    release_failures=st.lists(st.integers(1, 8), max_size=3, unique=True),
)
def test_random_capture_failures_leave_nothing_after_cleanup(
    capture_failure: int, release_failures: list[int]
) -> None:
    inner = TorchDevice("cpu")
    plan = FaultPlan.nth("capture", capture_failure)
    for n in release_failures:
        plan = plan + FaultPlan.nth("deallocate", n)
    device = FaultInjectingDevice(inner, plan)
    traces, compiler, _ = build(device)
    for operation, batch in (("decode", 2), ("prefill", 3), ("prefill", 5)):
        key, sig = compile_toy(compiler, operation, batch)
        traces.register_capture_plan(toy_plan(device, key, sig))
    with pytest.raises(InjectedFault):
        traces.capture_all()
    if traces.unreleased_resource_count:
        assert compiler.gate_closed
    else:
        assert not compiler.gate_closed
    for _ in range(4):
        try:
            traces.cleanup()
            break
        except RuntimeError:
            assert compiler.gate_closed
    assert traces.state is TraceState.RELEASED
    assert inner.live_allocations == 0 and inner.live_traces == 0
    assert device.deallocated_twice == 0
    assert not compiler.gate_closed

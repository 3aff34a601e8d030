"""Fault injection: plan parsing, injected failures that leave state retryable, and a model
check that accounting stays exact under random operation sequences."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from runtime.backends import (
    FAULT_OPERATIONS,
    Device,
    DeviceError,
    DoubleDeallocationError,
    FaultCall,
    FaultInjectingDevice,
    FaultPlan,
    FaultRule,
    InjectedFault,
    TorchDevice,
)

# --- parsing --------------------------------------------------------------------------------


def test_parse_single_and_multiple_rules() -> None:
    assert FaultPlan.parse("deallocate:3") == FaultPlan((FaultRule("deallocate", nth=3),))
    plan = FaultPlan.parse(" allocate:2 , release_trace:every,capture:1")
    assert plan.rules == (
        FaultRule("allocate", nth=2),
        FaultRule("release_trace", every=True),
        FaultRule("capture", nth=1),
    )
    assert plan.describe() == "allocate:2,release_trace:every,capture:1"
    assert FaultPlan().describe() == "<no faults>"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty fault spec"),
        ("deallocate", "has no ':<N>|every'"),
        ("deallocate:", "has no ':<N>|every'"),
        ("dealloc:3", "unknown fault operation 'dealloc'"),
        ("deallocate:0", "must be a 1-based call number"),
        ("deallocate:-1", "must be a 1-based call number"),
        ("deallocate:often", "must be a 1-based call number"),
        ("deallocate:3,", "has no ':<N>|every'"),
    ],
)
def test_parse_rejects_bad_specs_listing_valid_kinds(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        FaultPlan.parse(spec)
    assert "allocate, from_host, to_host, deallocate" in str(info.value)


def test_rule_needs_exactly_one_selector() -> None:
    with pytest.raises(ValueError, match="exactly one of nth=N, every=True or predicate"):
        FaultRule("allocate")
    with pytest.raises(ValueError, match="exactly one of"):
        FaultRule("allocate", nth=1, every=True)
    with pytest.raises(ValueError, match="operation must be one of"):
        FaultRule("free", nth=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nth must be a 1-based positive int"):
        FaultRule("allocate", nth=True)


def test_device_accepts_spec_string() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), "allocate:every")
    assert device.plan == FaultPlan.every("allocate")
    with pytest.raises(TypeError, match="plan must be a FaultPlan"):
        FaultInjectingDevice(TorchDevice("cpu"), 3)  # type: ignore[arg-type]


# --- injected failures ----------------------------------------------------------------------


def test_nth_allocate_fails_and_allocates_nothing() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.nth("allocate", 2))
    assert isinstance(device, Device)
    device.allocate((1,), torch.float32)
    with pytest.raises(InjectedFault, match=r"allocate call #2 failed on purpose \(allocate:2\)"):
        device.allocate((1,), torch.float32)
    assert device.live_allocations == 1
    device.allocate((1,), torch.float32)
    assert device.live_allocations == 2
    assert device.attempts["allocate"] == 3 and device.failures["allocate"] == 1


def test_failed_deallocate_keeps_the_tensor_owned_and_retry_succeeds() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.parse("deallocate:1"))
    t = device.allocate((4,), torch.float32)
    with pytest.raises(InjectedFault) as info:
        device.deallocate(t)
    assert info.value.operation == "deallocate" and info.value.call_index == 1
    assert isinstance(info.value, RuntimeError)
    assert device.is_owned(t) and device.live_allocations == 1
    device.deallocate(t)
    assert device.live_allocations == 0
    assert device.deallocated_twice == 0


def test_double_free_is_counted() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan())
    t = device.allocate((4,), torch.float32)
    device.deallocate(t)
    with pytest.raises(DoubleDeallocationError):
        device.deallocate(t)
    with pytest.raises(DeviceError):
        device.deallocate(torch.zeros(1))  # foreign: not a double free
    assert device.deallocated_twice == 1


def test_every_release_trace_fails_until_plan_changes() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.parse("release_trace:every"))
    trace = device.capture(lambda: torch.ones(2))
    for _ in range(3):
        with pytest.raises(InjectedFault):
            device.release_trace(trace)
    assert device.live_traces == 1 and not trace.released
    inner.release_trace(trace)  # the retry on a healthy path succeeds
    assert device.live_traces == 0
    assert device.failures["release_trace"] == 3


def test_failed_capture_captures_nothing() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.parse("capture:1"))
    calls: list[int] = []

    def fn() -> torch.Tensor:
        calls.append(1)
        return torch.ones(1)

    with pytest.raises(InjectedFault):
        device.capture(fn)
    assert calls == [] and device.live_traces == 0
    device.capture(fn)
    assert device.live_traces == 1


@pytest.mark.parametrize("operation", ["synchronize", "record_event", "from_host", "to_host"])
def test_other_operations_fail_on_request(operation: Any) -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.nth(operation, 1))
    t = device.allocate((2,), torch.float32)
    calls: dict[str, Callable[[], object]] = {
        "synchronize": lambda: device.synchronize(),
        "record_event": lambda: device.record_event(),
        "from_host": lambda: device.from_host(torch.ones(2), into=t),
        "to_host": lambda: device.to_host(t),
    }
    with pytest.raises(InjectedFault):
        calls[operation]()
    assert t.tolist() == [0.0, 0.0], "a failed from_host copies nothing"
    calls[operation]()
    assert device.failures[operation] == 1 and device.injected_total == 1


def test_event_synchronize_and_replay_faults() -> None:
    device = FaultInjectingDevice(
        TorchDevice("cpu"), FaultPlan.parse("event_synchronize:1,replay:2")
    )
    event = device.record_event()
    with pytest.raises(InjectedFault):
        device.event_synchronize(event)
    device.event_synchronize(event)
    trace = device.capture(lambda: torch.ones(1))
    device.replay(trace)
    with pytest.raises(InjectedFault):
        device.replay(trace)
    assert device.replay(trace) is trace.outputs


def test_predicate_rules_see_call_arguments() -> None:
    def large(call: FaultCall) -> bool:
        shape = call.args[0]
        return int(torch.tensor(shape).prod()) > 100

    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.matching("allocate", large))
    device.allocate((10, 10), torch.float32)
    with pytest.raises(InjectedFault, match="allocate:<predicate>"):
        device.allocate((11, 10), torch.float32)
    assert device.live_allocations == 1


def test_plans_combine() -> None:
    plan = FaultPlan.nth("allocate", 1) + FaultPlan.every("synchronize")
    assert plan.describe() == "allocate:1,synchronize:every"


def test_all_operations_are_counted() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan())
    assert set(device.attempts) == set(FAULT_OPERATIONS)
    t = device.allocate((1,), torch.float32)
    device.is_owned(t)
    assert sum(device.attempts.values()) == 1, "is_owned is not a device operation"


# --- model-based check ----------------------------------------------------------------------


class FaultDeviceMachine(RuleBasedStateMachine):
    """Random allocate/deallocate/capture/release under random faults; accounting must match
    a model, and every failed operation must leave state retryable."""

    tensors = Bundle("tensors")
    traces = Bundle("traces")

    def __init__(self) -> None:
        super().__init__()
        self.inner = TorchDevice("cpu")
        self.device: FaultInjectingDevice | None = None
        self.live: dict[int, Any] = {}
        self.released: list[Any] = []
        self.live_traces: set[int] = set()
        self.double_frees = 0

    @rule(
        allocate_faults=st.sets(st.integers(1, 12), max_size=4),
        deallocate_faults=st.sets(st.integers(1, 12), max_size=4),
        capture_fault=st.sampled_from(["", "capture:2", "capture:every"]),
        release_fault=st.sampled_from(["", "release_trace:1", "release_trace:3"]),
    )
    def choose_plan(
        self,
        allocate_faults: set[int],
        deallocate_faults: set[int],
        capture_fault: str,
        release_fault: str,
    ) -> None:
        if self.device is not None:
            return
        parts = [f"allocate:{n}" for n in sorted(allocate_faults)]
        parts += [f"deallocate:{n}" for n in sorted(deallocate_faults)]
        parts += [part for part in (capture_fault, release_fault) if part]
        plan = FaultPlan.parse(",".join(parts)) if parts else FaultPlan()
        self.device = FaultInjectingDevice(self.inner, plan)

    def _device(self) -> FaultInjectingDevice:
        if self.device is None:
            self.device = FaultInjectingDevice(self.inner, FaultPlan())
        return self.device

    @rule(target=tensors, size=st.integers(0, 4))
    def allocate(self, size: int) -> Any:
        device = self._device()
        try:
            tensor = device.allocate((size,), torch.float32)
        except InjectedFault:
            return None
        self.live[id(tensor)] = tensor
        return tensor

    @rule(tensor=consumes(tensors))
    def deallocate(self, tensor: Any) -> None:
        if tensor is None:
            return
        device = self._device()
        if id(tensor) in self.live:
            while True:  # retry until the injected faults are exhausted
                try:
                    device.deallocate(tensor)
                    break
                except InjectedFault:
                    assert device.is_owned(tensor), "a failed deallocate must keep ownership"
            del self.live[id(tensor)]
            self.released.append(tensor)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        if not self.released:
            return
        tensor = data.draw(st.sampled_from(self.released))
        device = self._device()
        try:
            device.deallocate(tensor)
        except InjectedFault:
            return
        except DoubleDeallocationError:
            self.double_frees += 1
            return
        raise AssertionError("a double free must raise")

    @rule(target=traces)
    def capture(self) -> Any:
        device = self._device()
        try:
            trace = device.capture(lambda: torch.ones(2))
        except InjectedFault:
            return None
        self.live_traces.add(trace.trace_id)
        return trace

    @rule(trace=consumes(traces))
    def release(self, trace: Any) -> None:
        if trace is None:
            return
        device = self._device()
        try:
            device.release_trace(trace)
        except InjectedFault:
            assert not trace.released
            self.inner.release_trace(trace)
        assert trace.released
        self.live_traces.discard(trace.trace_id)
        with pytest.raises(DeviceError, match="already released"):
            self.inner.release_trace(trace)

    @invariant()
    def accounting_matches_model(self) -> None:
        device = self._device()
        assert device.live_allocations == len(self.live)
        assert device.live_traces == len(self.live_traces)
        assert all(device.is_owned(t) for t in self.live.values())
        assert not any(device.is_owned(t) for t in self.released)
        assert device.deallocated_twice == self.double_frees
        assert self.inner.allocations_total - self.inner.deallocations_total == len(self.live)


TestFaultDeviceMachine = FaultDeviceMachine.TestCase


def test_allocates_torch_tensors_sees_through_fault_injection() -> None:
    from runtime.backends import allocates_torch_tensors

    assert allocates_torch_tensors(TorchDevice("cpu"))
    assert allocates_torch_tensors(FaultInjectingDevice(TorchDevice("cpu"), "allocate:1"))

"""OutputReader: blocking reads, retained asynchronous reads, completion, drain."""

from __future__ import annotations

import pytest
import torch

from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.output_reader import OutputReader, PendingRead, ReadState


def test_blocking_read_copies_nested_payload_and_retains_nothing() -> None:
    reader = OutputReader(TorchDevice("cpu"))
    tokens = torch.arange(4)
    logits = torch.ones(2, 3)
    host = reader.read({"out": (tokens, [logits, None]), "n": 3})
    assert torch.equal(host["out"][0], tokens) and host["out"][0] is not tokens
    assert isinstance(host["out"], tuple) and isinstance(host["out"][1], list)
    assert host["out"][1][1] is None and host["n"] == 3
    assert reader.pending_count == 0


def test_submit_then_complete_by_pending_or_value() -> None:
    reader = OutputReader(TorchDevice("cpu"))
    source = torch.arange(6)
    pending = reader.submit((source, source * 2))
    assert isinstance(pending, PendingRead)
    assert pending.state is ReadState.PENDING and not pending.completed
    assert len(pending.events) == 1
    assert reader.pending_count == 1
    source.add_(100)  # the destination is a copy, not a view
    host = reader.complete(pending.value)
    assert host is pending.value and pending.completed
    assert torch.equal(host[0], torch.arange(6))
    assert reader.pending_count == 0
    assert reader.complete(pending) is host  # idempotent


def test_host_only_payload_completes_immediately() -> None:
    reader = OutputReader(TorchDevice("cpu"))
    pending = reader.submit({"count": 3, "none": None})
    assert pending.completed and pending.events == ()
    assert reader.pending_count == 0


def test_foreign_pending_and_unknown_values() -> None:
    device = TorchDevice("cpu")
    first, second = OutputReader(device), OutputReader(device)
    pending = first.submit(torch.zeros(2))
    with pytest.raises(ValueError, match="not owned by this OutputReader"):
        second.complete(pending)
    raw = torch.ones(1)
    assert second.complete(raw) is raw
    first.drain()
    assert first.pending_count == 0
    first.drain()  # repeated drains are no-ops


def test_read_synchronized_synchronizes_once() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan())
    reader = OutputReader(device)
    host = reader.read_synchronized([torch.zeros(2), torch.ones(2)])
    assert torch.equal(host[1], torch.ones(2))
    assert device.attempts["synchronize"] == 1
    assert reader.read_synchronized({"x": 1}) == {"x": 1}
    assert device.attempts["synchronize"] == 1


def test_failed_submission_synchronizes_and_retains_nothing() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.nth("to_host", 2))
    reader = OutputReader(device)
    with pytest.raises(InjectedFault):
        reader.submit((torch.zeros(2), torch.zeros(3)))
    assert reader.pending_count == 0
    assert device.attempts["synchronize"] == 1


def test_drain_collects_failures() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.every("event_synchronize"))
    reader = OutputReader(device)
    reader.submit(torch.zeros(1))
    reader.submit(torch.zeros(1))
    with pytest.raises(RuntimeError, match="Failed to drain 2 pending output read") as caught:
        reader.drain()
    assert len(caught.value.cleanup_failures) == 2  # type: ignore[attr-defined]
    assert reader.pending_count == 2
    device.plan = FaultPlan()
    reader.drain()
    assert reader.pending_count == 0


def test_donated_values_are_handed_over_on_host_memory_devices() -> None:
    reader = OutputReader(TorchDevice("cpu"))
    fresh = torch.arange(3)
    assert reader.read(fresh, donate=True) is fresh
    assert reader.read(fresh) is not fresh  # without donation the reader copies
    assert reader.pending_count == 0

"""Ownership helpers: walk semantics, failure collection, orphan retry, failure reporting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from runtime.backends import FaultInjectingDevice, FaultPlan, InjectedFault, TorchDevice
from runtime.backends.base import DoubleDeallocationError
from runtime.tensor_resources import (
    TensorResourceOrphan,
    attach_cleanup_failures,
    best_effort_deallocate_owned_tensors,
    deallocate_owned_tensors,
    raise_cleanup_failures,
    release_or_orphan,
    release_orphans,
    trim_host_allocator,
)


class RecordingDevice(TorchDevice):
    """A CPU device that records the order of deallocations."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.released: list[int] = []

    def deallocate(self, tensor: Any) -> None:
        super().deallocate(tensor)
        self.released.append(id(tensor))


class Owner:
    """An object that declares what it owns."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)
        self.calls = 0

    def owned_tensor_values(self) -> Any:
        self.calls += 1
        return self.values


@dataclasses.dataclass
class Borrowed:
    """A plain dataclass holding tensors: borrowed, never walked."""

    tensor: Any


def _alloc(device: TorchDevice | FaultInjectingDevice, n: int = 1) -> list[Any]:
    return [device.allocate((2, 3), torch.float32) for _ in range(n)]


def test_walks_dict_list_tuple_set_and_owner_objects() -> None:
    device = RecordingDevice()
    a, b, c, d, e = _alloc(device, 5)
    tree = {"x": [a, (b, {c})], "y": Owner(d, [e])}
    assert best_effort_deallocate_owned_tensors(tree, device) == []
    assert device.live_allocations == 0
    assert device.released == [id(a), id(b), id(c), id(d), id(e)], "depth-first, in order"


def test_borrowed_dataclass_and_foreign_tensors_are_skipped() -> None:
    device = RecordingDevice()
    (owned,) = _alloc(device)
    (borrowed_owned,) = _alloc(device)
    foreign = torch.zeros(3)
    tree = [owned, Borrowed(borrowed_owned), foreign, "text", 3, None]
    assert best_effort_deallocate_owned_tensors(tree, device) == []
    assert device.released == [id(owned)]
    assert device.is_owned(borrowed_owned), "a dataclass without owned_tensor_values is borrowed"
    assert foreign.numel() == 3


def test_never_deallocates_twice_and_guards_cycles() -> None:
    device = RecordingDevice()
    (t,) = _alloc(device)
    cyclic: list[Any] = [t, t]
    cyclic.append(cyclic)
    owner = Owner(t)
    owner.values.append(owner)
    completed: set[int] = set()
    assert best_effort_deallocate_owned_tensors([cyclic, owner, {"t": t}], device, completed) == []
    assert device.released == [id(t)]
    assert completed == {id(t)}
    assert owner.calls == 1
    # A second walk with the same record does nothing (no DoubleDeallocationError).
    assert best_effort_deallocate_owned_tensors([cyclic], device, completed) == []
    assert device.released == [id(t)]


def test_failures_are_collected_and_the_walk_continues() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.parse("deallocate:2"))
    a, b, c = _alloc(device, 3)
    failures = best_effort_deallocate_owned_tensors([a, b, c], device)
    assert [type(f) for f in failures] == [InjectedFault]
    assert device.is_owned(b) and not device.is_owned(a) and not device.is_owned(c)
    assert device.live_allocations == 1


def test_failing_owned_tensor_values_is_collected() -> None:
    device = TorchDevice("cpu")
    (t,) = _alloc(device)

    class Broken:
        def owned_tensor_values(self) -> Any:
            raise RuntimeError("cannot enumerate")

    failures = best_effort_deallocate_owned_tensors([Broken(), t], device)
    assert [str(f) for f in failures] == ["cannot enumerate"]
    assert device.live_allocations == 0


def test_strict_variant_raises_on_first_failure() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.parse("deallocate:2"))
    a, b, c = _alloc(device, 3)
    completed: set[int] = set()
    with pytest.raises(InjectedFault):
        deallocate_owned_tensors([a, b, c], device, completed)
    assert completed == {id(a)}
    assert device.is_owned(b) and device.is_owned(c)
    deallocate_owned_tensors([a, b, c], device, completed)
    assert device.live_allocations == 0
    assert device.deallocated_twice == 0


def test_orphan_retry_never_double_deallocates() -> None:
    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan.parse("deallocate:2,deallocate:4"))
    a, b, c = _alloc(device, 3)
    orphan, failures = release_or_orphan({"kv": [a, b, c]}, device)
    assert orphan is not None and len(failures) == 1
    assert orphan.deallocated_tensor_ids == {id(a), id(c)}

    orphans = [orphan]
    retry_failures = release_orphans(orphans)  # 4th deallocate (b again) fails
    assert len(retry_failures) == 1 and orphans == [orphan]
    assert release_orphans(orphans) == []
    assert orphans == []
    assert device.live_allocations == 0
    assert device.deallocated_twice == 0
    assert device.attempts["deallocate"] == 5


def test_release_or_orphan_without_failures_returns_no_orphan() -> None:
    device = TorchDevice("cpu")
    orphan, failures = release_or_orphan(_alloc(device, 2), device)
    assert orphan is None and failures == []
    assert device.live_allocations == 0


def test_orphan_is_mutable_record() -> None:
    device = TorchDevice("cpu")
    orphan = TensorResourceOrphan(values=_alloc(device), device=device)
    assert orphan.deallocated_tensor_ids == set()
    assert orphan.release() == []
    assert len(orphan.deallocated_tensor_ids) == 1


def test_double_free_outside_helpers_is_detected() -> None:
    device = TorchDevice("cpu")
    (t,) = _alloc(device)
    device.deallocate(t)
    with pytest.raises(DoubleDeallocationError):
        device.deallocate(t)


# --- failure reporting ----------------------------------------------------------------------


def test_attach_cleanup_failures_accumulates_and_notes() -> None:
    primary = RuntimeError("primary")
    first, second, third = ValueError("a"), KeyError("b"), OSError("c")
    assert attach_cleanup_failures(primary, [first, second], note="closing the KV cache") is (
        primary
    )
    attach_cleanup_failures(primary, [third, first, primary])
    assert primary.cleanup_failures == (first, second, third)  # type: ignore[attr-defined]
    notes = primary.__notes__
    assert len(notes) == 2
    assert notes[0].startswith("Cleanup also encountered 2 failure(s) while closing the KV cache")
    assert notes[1].startswith("Cleanup also encountered 1 failure(s)")


def test_attach_cleanup_failures_empty_is_a_no_op() -> None:
    primary = RuntimeError("primary")
    attach_cleanup_failures(primary, [])
    assert not hasattr(primary, "cleanup_failures")
    assert not hasattr(primary, "__notes__")


def test_raise_cleanup_failures_raises_first_with_rest_attached() -> None:
    first, second, third = RuntimeError("1"), RuntimeError("2"), RuntimeError("3")
    with pytest.raises(RuntimeError) as info:
        raise_cleanup_failures([first, second, third])
    assert info.value is first
    assert first.__notes__ == [
        "Cleanup also encountered 2 failure(s): RuntimeError: 2; RuntimeError: 3"
    ]
    assert first.cleanup_failures == (second, third)  # type: ignore[attr-defined]


def test_raise_cleanup_failures_single_failure_has_no_attachment() -> None:
    only = RuntimeError("only")
    with pytest.raises(RuntimeError) as info:
        raise_cleanup_failures([only])
    assert info.value is only
    assert not hasattr(only, "cleanup_failures")


def test_raise_cleanup_failures_empty_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        raise_cleanup_failures([])


def test_trim_host_allocator_is_safe_to_call() -> None:
    import ctypes.util
    import sys

    result = trim_host_allocator()
    assert isinstance(result, bool)
    if sys.platform.startswith("linux") and ctypes.util.find_library("c"):
        try:
            has_trim = hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim")
        except OSError:
            has_trim = False
        assert result is has_trim
    assert trim_host_allocator() is result

"""Exact ownership accounting every backend shares: which tensors a device allocated.

`AllocationRegistry` tracks live allocations by identity and remembers recent releases, so a
double free is told apart from a foreign tensor; `AccountedDevice` gives a device class the
bookkeeping (lock, registry, traces, events) and the counters the `Device` protocol reports.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeGuard, TypeVar

import attrs

from runtime.backends.base import (
    DeviceError,
    DeviceTensor,
    DoubleDeallocationError,
    Event,
    TraceHandle,
    TraceOutputs,
)

TensorT = TypeVar("TensorT", bound=DeviceTensor)
"""The tensor type a backend allocates (`torch.Tensor` on torch)."""

_MAX_TOMBSTONES = 4096
_MISSING = object()


def describe_tensor(tensor: object) -> str:
    """A short description naming shape and dtype, for error messages."""
    shape = getattr(tensor, "shape", None)
    dtype = getattr(tensor, "dtype", None)
    shape_text = tuple(shape) if shape is not None else "?"
    return f"{type(tensor).__name__}(shape={shape_text}, dtype={dtype})"


class AllocationRegistry(Generic[TensorT]):
    """Live allocations by identity, plus recent releases to tell a double free from a foreign
    tensor.

    Releases are remembered by weak reference where the tensor type allows it (otherwise a
    bounded number are kept strongly), so an id reused by a new object is never mistaken for a
    released tensor.
    """

    def __init__(self, device_name: str) -> None:
        self.device_name = device_name
        self._live: dict[int, TensorT] = {}
        self._released: collections.OrderedDict[int, Callable[[], object]] = (
            collections.OrderedDict()
        )
        self.allocations_total = 0
        self.deallocations_total = 0

    def __len__(self) -> int:
        return len(self._live)

    def live_values(self) -> list[TensorT]:
        """The live allocations, oldest first."""
        return list(self._live.values())

    def add(self, tensor: TensorT) -> None:
        """Register a fresh allocation."""
        self._live[id(tensor)] = tensor
        self._released.pop(id(tensor), None)
        self.allocations_total += 1

    def is_live(self, tensor: object) -> bool:
        """Whether `tensor` (this exact object) is a live allocation."""
        return self._live.get(id(tensor), _MISSING) is tensor

    def check_releasable(self, tensor: object, operation: str = "deallocate") -> None:
        """Raise unless `tensor` is live: `DoubleDeallocationError` if it was released here
        before, `DeviceError` if it never belonged to this device."""
        if self.is_live(tensor):
            return
        reference = self._released.get(id(tensor))
        if reference is not None and reference() is tensor and tensor is not None:
            raise DoubleDeallocationError(
                f"{operation}: {describe_tensor(tensor)} was already deallocated on "
                f"{self.device_name}; an owner must release a tensor exactly once"
            )
        raise DeviceError(
            f"{operation}: {describe_tensor(tensor)} is not an allocation of "
            f"{self.device_name}; only tensors returned by allocate()/from_host() on this "
            "device may be passed (borrowed tensors are released by their owner)"
        )

    def remove(self, tensor: object) -> None:
        """Forget a live allocation after the backend released it."""
        del self._live[id(tensor)]
        try:
            reference: Callable[[], object] = weakref.ref(tensor)
        except TypeError:
            reference = _StrongReference(tensor)
        self._released[id(tensor)] = reference
        self._released.move_to_end(id(tensor))
        while len(self._released) > _MAX_TOMBSTONES:
            self._released.popitem(last=False)
        self.deallocations_total += 1


@attrs.define(eq=False)
class _StrongReference:
    value: object

    def __call__(self) -> object:
        return self.value


class AccountedDevice(Generic[TensorT]):
    """The bookkeeping every backend's device keeps: its name, one lock, the registry of its
    allocations, its live traces and its event sequence, with the counters the `Device`
    protocol reports from them."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.RLock()
        self._registry: AllocationRegistry[TensorT] = AllocationRegistry(name)
        self._traces: dict[int, TraceHandle] = {}
        self._next_trace_id = 0
        self._event_sequence = 0

    @property
    def live_allocations(self) -> int:
        """Allocated and not yet deallocated tensors."""
        return len(self._registry)

    @property
    def live_traces(self) -> int:
        """Captured and not yet released traces."""
        return len(self._traces)

    @property
    def allocations_total(self) -> int:
        """Allocations ever registered (allocate and new from_host tensors)."""
        return self._registry.allocations_total

    @property
    def deallocations_total(self) -> int:
        """Successful deallocations."""
        return self._registry.deallocations_total

    def describe_live_allocations(self) -> list[str]:
        """Shape/dtype of every live allocation, oldest first, for leak reports."""
        with self._lock:
            return [describe_tensor(t) for t in self._registry.live_values()]

    def is_owned(self, tensor: object) -> TypeGuard[DeviceTensor]:
        """Whether `tensor` is a live allocation of this device (identity, not equality)."""
        return self._registry.is_live(tensor)

    def _register_trace(self, outputs: TraceOutputs, handle: object) -> TraceHandle:
        """A new live trace of this device holding `outputs` and the backend's `handle`."""
        with self._lock:
            self._next_trace_id += 1
            trace = TraceHandle(
                device_name=self._name, trace_id=self._next_trace_id, outputs=outputs, handle=handle
            )
            self._traces[trace.trace_id] = trace
        return trace

    def _check_event_origin(self, event: Event) -> None:
        """`event` is an `Event` recorded on this device."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be an Event, got {type(event).__name__}")
        if event.device_name != self._name:
            raise DeviceError(
                f"event {event.sequence} was recorded on {event.device_name!r}, not on "
                f"{self._name!r}; synchronize it on the device that recorded it"
            )

"""The device protocol: the only way runtime modules touch a device API.

Every backend (torch CPU, torch CUDA, ttnn, and the fault-injecting wrapper) implements
`Device`. Runtime modules allocate, copy, synchronize and trace through it, so ownership and
leak accounting (`live_allocations`) are uniform across backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias, TypeGuard, runtime_checkable

import attrs
import torch


@runtime_checkable
class DeviceTensor(Protocol):
    """A tensor a `Device` hands out: a `torch.Tensor` on torch, a ``ttnn.Tensor`` on ttnn.

    Backend-neutral runtime code reads only its shape; code that computes on it with torch
    narrows it with `as_torch`, which names the backend when the tensor is not torch's.
    """

    @property
    def shape(self) -> Sequence[int]:
        """The tensor's dimensions."""
        ...


TraceOutputs: TypeAlias = DeviceTensor | tuple["TraceOutputs", ...] | list["TraceOutputs"]
"""What a traced function returns and a replay rewrites: a device tensor or nested tuples/lists."""


def as_torch(tensor: DeviceTensor, what: str = "device tensor") -> torch.Tensor:
    """`tensor` as the `torch.Tensor` a torch backend handed out.

    TypeError when it came from another backend (ttnn), so torch-only code fails with the
    backend named instead of deep inside a torch call.
    """
    if isinstance(tensor, torch.Tensor):
        return tensor
    kind = type(tensor)
    raise TypeError(
        f"{what} must be a torch.Tensor from a torch backend ('cpu' or 'cuda'), got "
        f"{kind.__module__}.{kind.__qualname__}; this path computes with torch, so it needs a "
        "torch backend, not ttnn"
    )


class DeviceError(RuntimeError):
    """A backend refused an operation (double free, foreign tensor, released trace)."""


class DoubleDeallocationError(DeviceError):
    """A tensor this device already released was released again (a double free)."""


@attrs.define(eq=False)
class Event:
    """A point in a device's stream; `Device.event_synchronize` waits for it."""

    device_name: str
    sequence: int
    handle: object = None
    """The backend's event (a ``torch.cuda.Event``, a ttnn event), or None where none is needed."""


@attrs.define(eq=False)
class TraceHandle:
    """A captured trace: replaying it rewrites `outputs` in place from the persistent inputs."""

    device_name: str
    trace_id: int
    outputs: TraceOutputs
    handle: object = None
    """The backend's trace state; each backend checks it is its own before using it."""
    released: bool = False


@runtime_checkable
class Device(Protocol):
    """What every runtime module may ask of a device."""

    @property
    def name(self) -> str:
        """A stable identifier such as ``cpu``, ``cuda:0`` or ``ttnn:0``."""
        ...

    @property
    def torch_device(self) -> torch.device:
        """Where tensors returned by `allocate` live (host surrogate for ttnn)."""
        ...

    @property
    def live_allocations(self) -> int:
        """Tensors allocated through this device and not yet deallocated."""
        ...

    @property
    def live_traces(self) -> int:
        """Traces captured on this device and not yet released."""
        ...

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, *, fill: float = 0.0
    ) -> DeviceTensor:
        """Allocate an owned device tensor filled with `fill`."""
        ...

    def from_host(self, host: torch.Tensor, *, into: DeviceTensor | None = None) -> DeviceTensor:
        """Copy a host tensor to the device: a new owned tensor, or in place into `into`."""
        ...

    def to_host(
        self, tensor: DeviceTensor, *, blocking: bool = True
    ) -> tuple[torch.Tensor, Event | None]:
        """Copy to host. Non-blocking copies return an event to wait on before reading."""
        ...

    def is_owned(self, tensor: object) -> TypeGuard[DeviceTensor]:
        """Whether `tensor` is a live allocation of this device."""
        ...

    def deallocate(self, tensor: DeviceTensor) -> None:
        """Release an owned tensor; a second release raises `DeviceError`."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work."""
        ...

    def record_event(self) -> Event:
        """Record an event after the work queued so far."""
        ...

    def event_synchronize(self, event: Event) -> None:
        """Wait until `event` completed."""
        ...

    def capture(self, fn: Callable[[], TraceOutputs]) -> TraceHandle:
        """Capture `fn` (reading persistent inputs) as a replayable trace."""
        ...

    def replay(self, trace: TraceHandle, *, blocking: bool = False) -> TraceOutputs:
        """Replay a captured trace; returns its (trace-owned) outputs."""
        ...

    def release_trace(self, trace: TraceHandle) -> None:
        """Release a captured trace; a second release raises `DeviceError`."""
        ...

"""The ttnn backend: the `Device` protocol on Tenstorrent devices.

ttnn is imported lazily, so the runtime imports and type-checks without it. The ttnn wheel
exists only for Python 3.10 and 3.12 and opening a device needs Tenstorrent hardware; where it
is missing, constructing `TtnnDevice` raises `RuntimeError` with the install hint. A
`ttnn_module` may be injected (tests use a fake to check the mapping on any machine).

Mapping: allocate/from_host -> ``ttnn.from_torch(..., device=...)``; in-place from_host ->
``ttnn.copy_host_to_device_tensor``; to_host -> ``ttnn.to_torch``; deallocate ->
``ttnn.deallocate``; traces -> ``begin_trace_capture``/``end_trace_capture``/
``execute_trace``/``release_trace``; events -> ``record_event``/``event_synchronize``;
synchronize -> ``synchronize_device``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol, runtime_checkable

import attrs
import torch

from runtime.backends.accounting import AccountedDevice
from runtime.backends.base import DeviceError, DeviceTensor, Event, TraceHandle, TraceOutputs
from runtime.validation import is_int, non_negative_int

logger = logging.getLogger(__name__)

TTNN_INSTALL_HINT = (
    "install it with `pip install ttnn` (wheels exist only for Python 3.10 and 3.12, and "
    "opening a device needs Tenstorrent hardware); otherwise use the 'cpu' or 'cuda' backend"
)

_TORCH_TO_TTNN_DTYPE: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.uint32: "uint32",
    torch.uint16: "uint16",
    torch.uint8: "uint8",
}
_MEMORY_CONFIGS: dict[str, str] = {"dram": "DRAM_MEMORY_CONFIG", "l1": "L1_MEMORY_CONFIG"}


def import_ttnn() -> ModuleType:
    """Import ttnn, or raise `RuntimeError` saying how to get it.

    ttnn ships no type information, so its attributes are untyped (`ModuleType` says so);
    this backend annotates what it keeps of their results.
    """
    try:
        return importlib.import_module("ttnn")
    except ImportError as exc:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise RuntimeError(
            f"the ttnn backend needs the ttnn package, which is not importable on this Python "
            f"{version} ({exc}); {TTNN_INSTALL_HINT}"
        ) from exc


@runtime_checkable
class _TtnnTensor(Protocol):
    """What this backend reads of its own tensors besides the shape: ttnn's dtype and layout."""

    @property
    def shape(self) -> Sequence[int]:
        """The tensor's dimensions."""
        ...

    @property
    def dtype(self) -> object:
        """A ttnn dtype, passed back to ttnn only."""
        ...

    @property
    def layout(self) -> object:
        """A ttnn layout, passed back to ttnn only."""
        ...


@attrs.define(eq=False)
class _TtnnTraceState:
    """ttnn trace id plus which trace outputs were already freed (release is retryable)."""

    trace_id: object
    """ttnn's id for the trace, opaque here: only passed back to ttnn."""
    freed_output_ids: set[int] = attrs.field(factory=set)


def _trace_leaves(value: object, path: str = "outputs") -> list[DeviceTensor]:
    """Leaves of a traced function's result: a tensor or nested tuple/list of tensors."""
    if isinstance(value, tuple | list):
        return [
            leaf
            for index, item in enumerate(value)
            for leaf in _trace_leaves(item, f"{path}[{index}]")
        ]
    if not isinstance(value, DeviceTensor) or isinstance(value, str | bytes):
        raise TypeError(
            f"a traced function must return a ttnn tensor or a (nested) tuple/list of tensors; "
            f"{path} is {type(value).__name__}"
        )
    return [value]


class TtnnDevice(AccountedDevice[DeviceTensor]):
    """The `Device` protocol over one ttnn device (command queue `cq_id`).

    `device`, when given, is an already opened ttnn device that this object borrows and never
    closes; otherwise `close()` closes the device it opened. `capture` first runs `fn` once
    eagerly (program compilation must not happen inside a trace) and frees that run's outputs.
    """

    programs_hold_device_memory = True
    """ttnn compiles programs into the device's program cache."""

    def __init__(
        self,
        device_id: int = 0,
        *,
        device: object | None = None,
        ttnn_module: ModuleType | None = None,
        l1_small_size: int = 32768,
        trace_region_size: int = 64 * 1024 * 1024,
        cq_id: int = 0,
        memory_config: str = "dram",
    ) -> None:
        non_negative_int("device_id", device_id)
        if memory_config not in _MEMORY_CONFIGS:
            raise ValueError(
                f"memory_config must be one of {', '.join(_MEMORY_CONFIGS)}, got {memory_config!r}"
            )
        self._ttnn = ttnn_module if ttnn_module is not None else import_ttnn()
        self._owns_device = device is None
        if device is None:
            device = self._ttnn.open_device(
                device_id=device_id,
                l1_small_size=l1_small_size,
                trace_region_size=trace_region_size,
            )
        super().__init__(f"ttnn:{device_id}")
        self._device: object = device
        self._cq_id = cq_id
        self._memory_config: object = getattr(self._ttnn, _MEMORY_CONFIGS[memory_config])
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"TtnnDevice({self._name!r}, live_allocations={self.live_allocations}, "
            f"live_traces={self.live_traces})"
        )

    @property
    def ttnn_device(self) -> object:
        """The underlying ttnn device object."""
        return self._device

    @property
    def name(self) -> str:
        """``ttnn:N``."""
        return self._name

    @property
    def torch_device(self) -> torch.device:
        """ttnn tensors are converted through host torch tensors."""
        return torch.device("cpu")

    def ttnn_dtype(self, dtype: torch.dtype) -> object:
        """The ttnn dtype used for a torch dtype."""
        if dtype not in _TORCH_TO_TTNN_DTYPE:
            allowed = ", ".join(str(d) for d in _TORCH_TO_TTNN_DTYPE)
            raise ValueError(f"dtype {dtype} has no ttnn equivalent here; allowed: {allowed}")
        ttnn_dtype: object = getattr(self._ttnn, _TORCH_TO_TTNN_DTYPE[dtype])
        return ttnn_dtype

    def ttnn_layout(self, dtype: torch.dtype) -> object:
        """Tile layout for floating point (compute) tensors, row-major for integer tensors."""
        name = "TILE_LAYOUT" if dtype.is_floating_point else "ROW_MAJOR_LAYOUT"
        layout: object = getattr(self._ttnn, name)
        return layout

    def _to_device(self, host: torch.Tensor) -> DeviceTensor:
        tensor: DeviceTensor = self._ttnn.from_torch(
            host,
            dtype=self.ttnn_dtype(host.dtype),
            layout=self.ttnn_layout(host.dtype),
            device=self._device,
            memory_config=self._memory_config,
        )
        return tensor

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, *, fill: float = 0.0
    ) -> DeviceTensor:
        """A new owned device tensor, filled on the host and uploaded."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        dims = tuple(shape)
        if any(not is_int(d) or d < 0 for d in dims):
            raise ValueError(f"shape must be a sequence of non-negative ints, got {dims!r}")
        tensor = self._to_device(torch.full(dims, fill, dtype=dtype))
        with self._lock:
            self._registry.add(tensor)
        return tensor

    def from_host(self, host: torch.Tensor, *, into: DeviceTensor | None = None) -> DeviceTensor:
        """Upload `host` as a new owned tensor, or copy it into the owned tensor `into`."""
        if not isinstance(host, torch.Tensor):
            raise TypeError(f"host must be a torch.Tensor, got {type(host).__name__}")
        if into is None:
            tensor = self._to_device(host)
            with self._lock:
                self._registry.add(tensor)
            return tensor
        with self._lock:
            self._registry.check_releasable(into, "from_host(into=...)")
        if tuple(into.shape) != tuple(host.shape):
            raise ValueError(
                f"from_host(into=...) needs matching shapes: host is {tuple(host.shape)}, "
                f"into is {tuple(into.shape)}"
            )
        assert isinstance(into, _TtnnTensor), "an allocation of this device is a ttnn tensor"
        staged = self._ttnn.from_torch(host, dtype=into.dtype, layout=into.layout)
        self._ttnn.copy_host_to_device_tensor(staged, into, cq_id=self._cq_id)
        return into

    def to_host(
        self, tensor: DeviceTensor, *, blocking: bool = True
    ) -> tuple[torch.Tensor, Event | None]:
        """Read to a torch tensor.

        ``ttnn.to_torch`` needs the data, so a non-blocking read completes here and returns an
        event recorded after it (already complete); callers keep one code path for all backends.
        """
        host: object = self._ttnn.to_torch(tensor)
        if not isinstance(host, torch.Tensor):
            raise DeviceError(f"ttnn.to_torch returned {type(host).__name__}, not a torch.Tensor")
        return host, (None if blocking else self.record_event())

    def deallocate(self, tensor: DeviceTensor) -> None:
        """``ttnn.deallocate``; the tensor stays owned (retryable) if that fails."""
        with self._lock:
            self._registry.check_releasable(tensor, "deallocate")
            self._ttnn.deallocate(tensor)
            self._registry.remove(tensor)

    def synchronize(self) -> None:
        """``ttnn.synchronize_device``."""
        self._ttnn.synchronize_device(self._device)

    def record_event(self) -> Event:
        """``ttnn.record_event`` on this device's command queue."""
        handle: object = self._ttnn.record_event(self._device, self._cq_id)
        with self._lock:
            self._event_sequence += 1
            return Event(device_name=self._name, sequence=self._event_sequence, handle=handle)

    def event_synchronize(self, event: Event) -> None:
        """``ttnn.event_synchronize``."""
        self._check_event_origin(event)
        self._ttnn.event_synchronize(event.handle)

    def _free_unowned(self, value: TraceOutputs) -> None:
        """Free the outputs of an eager compile run (never a registered allocation)."""
        for leaf in _trace_leaves(value):
            if not self._registry.is_live(leaf):
                self._ttnn.deallocate(leaf)

    def capture(self, fn: Callable[[], TraceOutputs]) -> TraceHandle:
        """Compile-run `fn`, then capture it between begin/end_trace_capture."""
        if not callable(fn):
            raise TypeError(f"capture expects a callable, got {type(fn).__name__}")
        self._free_unowned(fn())
        trace_id: object = self._ttnn.begin_trace_capture(self._device, cq_id=self._cq_id)
        try:
            outputs = fn()
        except BaseException:
            self._abort_capture(trace_id)
            raise
        self._ttnn.end_trace_capture(self._device, trace_id, cq_id=self._cq_id)
        self._ttnn.synchronize_device(self._device)
        try:
            _trace_leaves(outputs)
        except TypeError:
            self._ttnn.release_trace(self._device, trace_id)
            raise
        trace = self._register_trace(outputs, _TtnnTraceState(trace_id=trace_id))
        logger.debug("captured ttnn trace %r as %d on %s", trace_id, trace.trace_id, self._name)
        return trace

    def _abort_capture(self, trace_id: object) -> None:
        try:
            self._ttnn.end_trace_capture(self._device, trace_id, cq_id=self._cq_id)
            self._ttnn.release_trace(self._device, trace_id)
        except Exception as exc:  # the capture error is the one to report
            logger.warning("could not abort failed ttnn trace capture %r: %r", trace_id, exc)

    def _live_trace(self, trace: TraceHandle, operation: str) -> _TtnnTraceState:
        if not isinstance(trace, TraceHandle):
            raise TypeError(f"{operation} expects a TraceHandle, got {type(trace).__name__}")
        with self._lock:
            if trace.device_name != self._name or self._traces.get(trace.trace_id) is not trace:
                state = "was already released" if trace.released else "is not a live trace here"
                raise DeviceError(
                    f"{operation}: trace {trace.trace_id} of {trace.device_name!r} {state} "
                    f"(device {self._name!r}); capture a new trace"
                )
        state_obj = trace.handle
        if not isinstance(state_obj, _TtnnTraceState):
            raise DeviceError(f"{operation}: trace {trace.trace_id} has no ttnn trace state")
        return state_obj

    def replay(self, trace: TraceHandle, *, blocking: bool = False) -> TraceOutputs:
        """``ttnn.execute_trace``; returns the trace-owned outputs."""
        state = self._live_trace(trace, "replay")
        self._ttnn.execute_trace(self._device, state.trace_id, cq_id=self._cq_id, blocking=blocking)
        return trace.outputs

    def release_trace(self, trace: TraceHandle) -> None:
        """Free the trace's outputs, then ``ttnn.release_trace``; retryable on failure."""
        state = self._live_trace(trace, "release_trace")
        for leaf in _trace_leaves(trace.outputs):
            if id(leaf) not in state.freed_output_ids and not self._registry.is_live(leaf):
                self._ttnn.deallocate(leaf)
                state.freed_output_ids.add(id(leaf))
        self._ttnn.release_trace(self._device, state.trace_id)
        with self._lock:
            del self._traces[trace.trace_id]
            trace.released = True

    def close(self) -> None:
        """Close the device if this object opened it; idempotent. Owners release first."""
        if self._closed:
            return
        if self.live_allocations or self.live_traces:
            logger.warning(
                "closing %s with %d live allocation(s) and %d live trace(s): %s",
                self._name,
                self.live_allocations,
                self.live_traces,
                self.describe_live_allocations()[:8],
            )
        if self._owns_device:
            self._ttnn.close_device(self._device)
        self._closed = True

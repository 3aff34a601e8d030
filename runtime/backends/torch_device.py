"""The torch backend: CPU tensors with re-run traces, CUDA tensors with real CUDA graphs.

`TorchDevice` keeps a registry of the tensors it allocated (by identity), so ownership checks,
double-free detection and leak accounting (`live_allocations`) are exact. Deallocation drops
the device's reference; the memory returns to torch's allocator once the owner drops its own.
(Emptying the storage in place was rejected: torch kernels do not bounds-check storage, so a
use after free would crash the process instead of raising.)

Traces keep one semantics on both device types: the caller refreshes persistent input tensors in
place, `replay` rewrites the trace-owned output tensors in place (same objects every time), and
the output signature never changes after capture. On CPU a trace re-runs `fn` and copies its
results into the captured outputs; on CUDA it is a `torch.cuda.CUDAGraph` with a private memory
pool, replayed with `graph.replay()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeAlias, cast

import attrs
import torch

from runtime.backends import huge_pages
from runtime.backends.accounting import AccountedDevice
from runtime.backends.base import DeviceError, DeviceTensor, Event, TraceHandle, TraceOutputs
from runtime.validation import is_int, non_negative_int

logger = logging.getLogger(__name__)

# torch's stubs leave these constructors untyped; give them the types they have.
_new_cuda_event = cast(Callable[[], torch.cuda.Event], torch.cuda.Event)
_new_cuda_stream = cast(Callable[[torch.device], torch.cuda.Stream], torch.cuda.Stream)


_TensorSignature: TypeAlias = tuple[str, tuple[int, ...], torch.dtype, torch.device]
_Signature: TypeAlias = _TensorSignature | tuple[str, tuple["_Signature", ...]]
"""A trace result's structure: per tensor its shape, dtype and device; per tuple/list its items."""


@attrs.define(eq=False)
class _TraceState:
    """Backend state behind a `TraceHandle`: the function and, on CUDA, its graph and pool."""

    fn: Callable[[], TraceOutputs]
    signature: _Signature
    graph: torch.cuda.CUDAGraph | None = None
    pool: tuple[int, int] | None = None


def _signature(value: object, path: str = "outputs") -> _Signature:
    """Nested structure of a trace result; raises TypeError on anything but tensors/tuples/lists."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, tuple | list):
        return (
            type(value).__name__,
            tuple(_signature(item, f"{path}[{index}]") for index, item in enumerate(value)),
        )
    raise TypeError(
        f"a traced function must return a torch.Tensor or a (nested) tuple/list of tensors; "
        f"{path} is {type(value).__name__}"
    )


def _flatten(value: TraceOutputs) -> list[torch.Tensor]:
    """The tensors of a result `_signature` accepted, depth first."""
    if isinstance(value, tuple | list):
        return [tensor for item in value for tensor in _flatten(item)]
    assert isinstance(value, torch.Tensor), "_signature admits only torch tensors as leaves"
    return [value]


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    for dim in shape:
        if not is_int(dim) or dim < 0:
            raise ValueError(
                f"shape must be a sequence of non-negative ints (bool not accepted), "
                f"got {tuple(shape)!r}"
            )
    return tuple(shape)


class TorchDevice(AccountedDevice[torch.Tensor]):
    """The `Device` protocol over torch, for ``cpu`` and ``cuda[:N]``.

    `graph_warmup_runs` eager runs of a traced function precede CUDA graph capture (on a side
    stream, as CUDA graphs require), so lazy initialisation never happens inside a capture.
    """

    programs_hold_device_memory = False
    """A compiled program is a key and an output contract over eager torch calls; what a
    captured CUDA graph holds is a trace's, released with the traces."""

    def __init__(self, device: str | torch.device = "cpu", *, graph_warmup_runs: int = 2) -> None:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}: {exc}"
            ) from exc
        if resolved.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} (type {resolved.type!r})"
            )
        non_negative_int("graph_warmup_runs", graph_warmup_runs)
        if resolved.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"TorchDevice({str(device)!r}) needs a CUDA GPU but "
                    "torch.cuda.is_available() is False; install a CUDA build of torch on a "
                    "machine with an NVIDIA driver, or use 'cpu'"
                )
            index = resolved.index if resolved.index is not None else torch.cuda.current_device()
            count = torch.cuda.device_count()
            if not 0 <= index < count:
                raise ValueError(
                    f"device {str(device)!r}: CUDA index {index} is out of range; "
                    f"allowed: 0..{count - 1}"
                )
            resolved = torch.device("cuda", index)
        else:
            resolved = torch.device("cpu")
        super().__init__(str(resolved))
        self._device = resolved
        self._is_cuda = resolved.type == "cuda"
        self._graph_warmup_runs = graph_warmup_runs
        self.traces_captured_total = 0
        self.traces_released_total = 0

    def __repr__(self) -> str:
        return (
            f"TorchDevice({self._name!r}, live_allocations={self.live_allocations}, "
            f"live_traces={self.live_traces})"
        )

    # --- identity and accounting --------------------------------------------------------------

    @property
    def name(self) -> str:
        """``cpu`` or ``cuda:N``."""
        return self._name

    @property
    def torch_device(self) -> torch.device:
        """Where allocations live."""
        return self._device

    @property
    def live_bytes(self) -> int:
        """Bytes held by live allocations."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._registry.live_values())

    # --- allocation and copies ----------------------------------------------------------------

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, *, fill: float = 0.0
    ) -> torch.Tensor:
        """A new owned tensor of `shape`/`dtype` filled with `fill`."""
        dims = _check_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        tensor = huge_pages.full(dims, fill, dtype, self._device)
        with self._lock:
            self._registry.add(tensor)
        return tensor

    def from_host(self, host: torch.Tensor, *, into: DeviceTensor | None = None) -> torch.Tensor:
        """Copy `host` to the device: a new owned tensor, or in place into an owned `into`.

        The copy is complete when this returns, so the caller may reuse `host` at once.
        """
        if not isinstance(host, torch.Tensor):
            raise TypeError(f"host must be a torch.Tensor, got {type(host).__name__}")
        if into is None:
            tensor = torch.empty(host.shape, dtype=host.dtype, device=self._device)
            with torch.inference_mode():
                tensor.copy_(host)
            with self._lock:
                self._registry.add(tensor)
            return tensor
        into = self._check_writable(into, "from_host(into=...)")
        if tuple(into.shape) != tuple(host.shape) or into.dtype != host.dtype:
            raise ValueError(
                f"from_host(into=...) needs matching shape and dtype: host is "
                f"{tuple(host.shape)} {host.dtype}, into is {tuple(into.shape)} {into.dtype}"
            )
        with torch.inference_mode():
            into.copy_(host)
        return into

    def _check_writable(self, into: DeviceTensor, operation: str) -> torch.Tensor:
        """`into`, which must be a live allocation or a view of one."""
        if not isinstance(into, torch.Tensor):
            raise TypeError(f"{operation}: into must be a torch.Tensor, got {type(into).__name__}")
        with self._lock:
            if self._registry.is_live(into):
                return into
            base = into._base
            if base is not None and self._registry.is_live(base):
                return into
            self._registry.check_releasable(into, operation)
        return into

    def to_host(
        self, tensor: DeviceTensor, *, blocking: bool = True
    ) -> tuple[torch.Tensor, Event | None]:
        """Copy to host memory; never returns a view of device-owned memory.

        Blocking: returns ``(host, None)``. Non-blocking on CUDA: the copy goes into a pinned
        host tensor on the current stream and the returned event completes with it; read the
        host tensor only after `event_synchronize`. Non-blocking on CPU: the copy is done and
        the event is already complete.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"to_host expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type == "cuda" and self._is_cuda and not blocking:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            with torch.cuda.device(self._device), torch.inference_mode():
                host.copy_(tensor, non_blocking=True)
            return host, self.record_event()
        host = tensor.detach().to("cpu", copy=True)
        return host, (None if blocking else self.record_event())

    def deallocate(self, tensor: DeviceTensor) -> None:
        """Release an owned tensor; a double free or a foreign tensor raises `DeviceError`."""
        with self._lock:
            self._registry.check_releasable(tensor, "deallocate")
            self._registry.remove(tensor)

    # --- synchronisation ----------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for all queued work on this device."""
        if self._is_cuda:
            torch.cuda.synchronize(self._device)

    def record_event(self) -> Event:
        """An event after the work queued so far (a CUDA event on CUDA, a marker on CPU)."""
        with self._lock:
            self._event_sequence += 1
            sequence = self._event_sequence
        handle: torch.cuda.Event | None = None
        if self._is_cuda:
            handle = _new_cuda_event()
            handle.record(torch.cuda.current_stream(self._device))
        return Event(device_name=self._name, sequence=sequence, handle=handle)

    def _check_event(self, event: Event) -> None:
        self._check_event_origin(event)
        if not 0 < event.sequence <= self._event_sequence:
            raise DeviceError(
                f"event sequence {event.sequence} was never recorded on {self._name!r} "
                f"(recorded so far: 1..{self._event_sequence})"
            )

    def event_synchronize(self, event: Event) -> None:
        """Block until `event` completed."""
        self._check_event(event)
        if isinstance(event.handle, torch.cuda.Event):
            event.handle.synchronize()

    def event_completed(self, event: Event) -> bool:
        """Whether `event` completed, without blocking (always True on CPU)."""
        self._check_event(event)
        if isinstance(event.handle, torch.cuda.Event):
            query = cast(Callable[[], bool], event.handle.query)
            return bool(query())
        return True

    # --- traces -------------------------------------------------------------------------------

    def capture(self, fn: Callable[[], TraceOutputs]) -> TraceHandle:
        """Capture `fn` as a trace whose outputs are owned by the trace.

        `fn` must read persistent inputs (refreshed in place by the caller before each replay)
        and return a tensor or a nested tuple/list of tensors.
        """
        if not callable(fn):
            raise TypeError(f"capture expects a callable, got {type(fn).__name__}")
        if self._is_cuda:
            outputs, state = self._capture_cuda(fn)
        else:
            with torch.no_grad():
                outputs = fn()
            state = _TraceState(fn=fn, signature=_signature(outputs))
        with self._lock:
            trace = self._register_trace(outputs, state)
            self.traces_captured_total += 1
        logger.debug("captured trace %d on %s", trace.trace_id, self._name)
        return trace

    def _capture_cuda(self, fn: Callable[[], TraceOutputs]) -> tuple[TraceOutputs, _TraceState]:
        current = torch.cuda.current_stream(self._device)
        side = _new_cuda_stream(self._device)
        with torch.cuda.device(self._device), torch.no_grad():
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self._graph_warmup_runs):
                    _signature(fn())
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    outputs = fn()
                signature = _signature(outputs)
            except BaseException:
                graph.reset()
                raise
        return outputs, _TraceState(fn=fn, signature=signature, graph=graph, pool=pool)

    def _live_trace(self, trace: TraceHandle, operation: str) -> _TraceState:
        if not isinstance(trace, TraceHandle):
            raise TypeError(f"{operation} expects a TraceHandle, got {type(trace).__name__}")
        with self._lock:
            if trace.device_name != self._name or self._traces.get(trace.trace_id) is not trace:
                if trace.released and trace.device_name == self._name:
                    raise DeviceError(
                        f"{operation}: trace {trace.trace_id} on {self._name} was already "
                        "released; capture a new trace"
                    )
                raise DeviceError(
                    f"{operation}: trace {trace.trace_id} of {trace.device_name!r} is not a "
                    f"live trace of {self._name!r}"
                )
        state = trace.handle
        if not isinstance(state, _TraceState):
            raise DeviceError(f"{operation}: trace {trace.trace_id} has no torch trace state")
        return state

    def replay(self, trace: TraceHandle, *, blocking: bool = False) -> TraceOutputs:
        """Replay `trace`, rewriting its outputs in place; returns those same output objects."""
        state = self._live_trace(trace, "replay")
        if state.graph is not None:
            with torch.cuda.device(self._device):
                state.graph.replay()
                if blocking:
                    torch.cuda.current_stream(self._device).synchronize()
            return trace.outputs
        with torch.no_grad():
            fresh = state.fn()
        signature = _signature(fresh)
        if signature != state.signature:
            raise DeviceError(
                f"replay: trace {trace.trace_id} produced outputs {signature!r} but was "
                f"captured with {state.signature!r}; a trace's signature cannot change"
            )
        with torch.inference_mode():
            for target, source in zip(_flatten(trace.outputs), _flatten(fresh), strict=True):
                if target is not source:
                    target.copy_(source)
        return trace.outputs

    def release_trace(self, trace: TraceHandle) -> None:
        """Release `trace` (and its CUDA graph and pool); a second release raises."""
        state = self._live_trace(trace, "release_trace")
        if state.graph is not None:
            state.graph.reset()
        with self._lock:
            del self._traces[trace.trace_id]
            trace.released = True
            trace.handle = None  # drop fn (and its captured inputs) and the graph
            self.traces_released_total += 1
        logger.debug("released trace %d on %s", trace.trace_id, self._name)

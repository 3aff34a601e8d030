"""Device-to-host reads: blocking, or submitted now and completed later with events.

A tensor counts as device memory when it lives on the device's `torch_device`; on the CPU
backend that is every CPU tensor, so reads copy (trace outputs are overwritten by the next
replay) and asynchronous reads follow the same submit/complete path as on CUDA.

`OutputReader` owns every pending destination and event until the caller completes it, so
an external scheduler can overlap host work with device work without leaking reads. Each
pending read follows the declared `OUTPUT_READ_TABLE` (idle -> pending -> completed); the
read validates its moves against that table with a dictionary lookup rather than building a
`transitions` machine per read, which would cost more than the decode step it serves.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from enum import StrEnum

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from lifecycle.machine import MachineTable, StateSpec, TransitionSpec
from runtime.backends.base import Device, Event

logger = logging.getLogger(__name__)


class ReadState(StrEnum):
    """One asynchronous output read or decode lease."""

    IDLE = "idle"
    PENDING = "pending"
    COMPLETED = "completed"
    RELEASED = "released"


OUTPUT_READ_TABLE = MachineTable(
    name="output-read",
    states=(
        StateSpec(ReadState.IDLE, "raw device output held", ("submit",)),
        StateSpec(ReadState.PENDING, "non-blocking copy submitted with an event", ("complete",)),
        StateSpec(ReadState.COMPLETED, "event synchronized; host value readable", ()),
        StateSpec(ReadState.RELEASED, "terminal: device output released", ()),
    ),
    transitions=(
        TransitionSpec("submit", (ReadState.IDLE,), ReadState.PENDING),
        TransitionSpec("complete", (ReadState.IDLE, ReadState.PENDING), ReadState.COMPLETED),
        TransitionSpec(
            "release",
            (ReadState.IDLE, ReadState.PENDING, ReadState.COMPLETED),
            ReadState.RELEASED,
        ),
    ),
    initial=ReadState.IDLE,
    terminal=frozenset({ReadState.RELEASED}),
)


@attrs.define(eq=False)
class _ReadRecord:
    """The mutable half of a pending read: where it is in the read table."""

    state: ReadState = ReadState.IDLE

    def move(self, trigger: str) -> None:
        dest = OUTPUT_READ_TABLE.dest(trigger, self.state)
        if dest is None:
            raise RuntimeError(f"output read cannot {trigger} from {self.state.value}")
        assert isinstance(dest, ReadState)
        self.state = dest


@attrs.frozen(eq=False)
class PendingRead:
    """A submitted read: the host destination, the events to wait on, its order."""

    value: object
    """The host payload: the device value's structure with host tensor leaves."""
    events: tuple[Event, ...]
    sequence: int
    _owner: object = attrs.field(repr=False)
    _record: _ReadRecord = attrs.field(repr=False, factory=_ReadRecord)

    @property
    def completed(self) -> bool:
        """Whether the read's events were synchronized (host value safe to use)."""
        return self._record.state is ReadState.COMPLETED

    @property
    def state(self) -> ReadState:
        """Where the read is: pending or completed."""
        return self._record.state


class OutputReader:
    """Reads nested device outputs to host; retains non-blocking reads until completed."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._pending: dict[int, PendingRead] = {}
        self._by_value: dict[int, int] = {}
        self._sequence = itertools.count(1)
        self._token = object()

    @property
    def device(self) -> Device:
        """The device every read synchronizes against."""
        return self._device

    @property
    def pending_count(self) -> int:
        """Reads submitted and not yet completed."""
        with self._lock:
            return len(self._pending)

    @property
    def pending_reads(self) -> tuple[PendingRead, ...]:
        """A snapshot of the pending reads, in submission order."""
        with self._lock:
            return tuple(self._pending.values())

    # -- reads ------------------------------------------------------------------------------

    def read(self, value: object, *, blocking: bool = True, donate: bool = False) -> object:
        """Blocking: the host payload, nothing retained. Non-blocking: a `PendingRead`.

        `donate=True` says the caller gives the device value up (a fresh, invocation-owned
        output it releases right after): where device memory is host memory (the CPU backend)
        it is handed over without a copy.
        """
        if blocking:
            if donate and self._device.torch_device.type == "cpu":
                return value
            return _walk(value, lambda t: self._copy(t, blocking=True)[0])
        return self.submit(value)

    def submit(self, value: object) -> PendingRead:
        """Start non-blocking copies of every device leaf and record one event after them.

        A host-only payload needs no event: it comes back already completed and is not
        retained. If any copy or the event fails, the device is synchronized while the
        partial destinations are still referenced, and the error is re-raised.
        """
        submitted: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host, submitted_now = self._copy(tensor, blocking=False)
            if submitted_now:
                submitted.append(host)
            return host

        try:
            host_value = _walk(value, copy)
            events = (self._device.record_event(),) if submitted else ()
        except BaseException as error:
            self._synchronize_after_failure(error)
            raise
        sequence = next(self._sequence)
        record = _ReadRecord()
        pending = PendingRead(host_value, events, sequence, self._token, record)
        if not submitted:
            record.move("complete")
            return pending
        record.move("submit")
        with self._lock:
            self._pending[sequence] = pending
            self._by_value[id(host_value)] = sequence
        return pending

    def read_synchronized(self, value: object) -> object:
        """Submit every copy, then synchronize the device once (only if anything was sent)."""
        submitted = False

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal submitted
            host, submitted_now = self._copy(tensor, blocking=False)
            submitted = submitted or submitted_now
            return host

        try:
            host_value = _walk(value, copy)
            if submitted:
                self._device.synchronize()
        except BaseException as error:
            self._synchronize_after_failure(error)
            raise
        return host_value

    def complete(self, pending_or_value: object) -> object:
        """Wait for a read's events and hand over its host value. Idempotent.

        Accepts the `PendingRead` or the exact host value it carries; an unknown raw value is
        returned unchanged. A `PendingRead` from another reader is refused.
        """
        if isinstance(pending_or_value, PendingRead):
            if pending_or_value._owner is not self._token:
                raise ValueError(
                    "PendingRead is not owned by this OutputReader; complete it on the reader "
                    "that submitted it"
                )
            pending = pending_or_value
        else:
            with self._lock:
                sequence = self._by_value.get(id(pending_or_value))
                found = self._pending.get(sequence) if sequence is not None else None
            if found is None or found.value is not pending_or_value:
                return pending_or_value
            pending = found
        if pending.completed:
            return pending.value
        for event in pending.events:
            self._device.event_synchronize(event)
        with self._lock:
            self._pending.pop(pending.sequence, None)
            self._by_value.pop(id(pending.value), None)
        pending._record.move("complete")
        return pending.value

    def drain(self) -> None:
        """Complete every pending read; raise the first failure with the rest attached."""
        failures: list[BaseException] = []
        for pending in self.pending_reads:
            try:
                self.complete(pending)
            except BaseException as failure:
                failures.append(failure)
        if failures:
            error = RuntimeError(f"Failed to drain {len(failures)} pending output read(s)")
            error.__cause__ = failures[0]
            attach_cleanup_failures(error, failures)
            raise error

    # -- helpers ------------------------------------------------------------------------------

    def _copy(self, tensor: torch.Tensor, *, blocking: bool) -> tuple[torch.Tensor, bool]:
        if tensor.device != self._device.torch_device:
            return tensor, False  # already host memory of a separate device
        host, _event = self._device.to_host(tensor, blocking=blocking)
        return host, not blocking

    def _synchronize_after_failure(self, error: BaseException) -> None:
        try:
            self._device.synchronize()
        except BaseException as sync_error:
            attach_cleanup_failures(error, [sync_error])


def _walk(value: object, leaf: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """Rebuild tuples, lists and dicts with every tensor leaf replaced by `leaf(tensor)`."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return leaf(value)
    if isinstance(value, tuple):
        return tuple(_walk(item, leaf) for item in value)
    if isinstance(value, list):
        return [_walk(item, leaf) for item in value]
    if isinstance(value, dict):
        return {key: _walk(item, leaf) for key, item in value.items()}
    return value

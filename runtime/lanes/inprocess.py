"""In-process lanes: one lane executor per device in this process.

`submit` runs the call at once: on CUDA the launches and replays it makes are asynchronous,
so the group issuing a call to every lane before waiting on any overlaps the lane's device
work. A blocking decode is split into launch, asynchronous read and completion, so only
`wait` synchronizes with the lane's device (its events). On a torch CPU device every call has
finished when it returns, so there is nothing to overlap and the lane reads at once (the split
would only add host work to every step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs

from runtime.backends.torch_device import TorchDevice
from runtime.lanes.protocol import (
    CompletedCall,
    JournalRow,
    LaneBase,
    LaneFacts,
    LaneTarget,
    keep_tokenizer,
)
from runtime.steps import DecodeStep

logger = logging.getLogger(__name__)


class InProcessLane(LaneBase):
    """A lane executor living in this process (it owns its device, KV cache and traces)."""

    def __init__(self, executor: object, *, index: int) -> None:
        super().__init__(index)
        self.executor = executor
        self._target = LaneTarget(executor)
        self._split_reads = not _synchronous(executor)
        self._last: CompletedCall | None = None
        self._facts = self._describe({"with_tokenizer": True}, None)

    def __repr__(self) -> str:
        return f"InProcessLane({self.index}, {self._facts.device_name})"

    @property
    def facts(self) -> LaneFacts:
        return self._facts

    @property
    def live_allocations(self) -> int:
        return self._target.live_allocations

    @property
    def last_call_seconds(self) -> float:
        return self._last.seconds if self._last is not None else 0.0

    def _describe(self, kwargs: dict[str, object], previous: LaneFacts | None) -> LaneFacts:
        facts = self._target.run("describe", kwargs)
        assert isinstance(facts, LaneFacts)
        return keep_tokenizer(facts, previous)

    def submit(self, method: str, /, **kwargs: object) -> CompletedCall:
        clock = time.perf_counter()
        try:
            step = kwargs.get("step")
            if (
                method == "decode_forward"
                and isinstance(step, DecodeStep)
                and step.read_from_device
                and self._split_reads
            ):
                call = self._launch_decode(step)
            elif method == "describe":
                self._facts = self._describe(kwargs, self._facts)
                call = CompletedCall(self._facts)
            else:
                call = CompletedCall(self._target.run(method, kwargs))
        except BaseException as error:
            call = CompletedCall(error=error)
        call.seconds = time.perf_counter() - clock
        self._last = call
        return call

    def _launch_decode(self, step: DecodeStep) -> CompletedCall:
        """Launch and start the read now; `wait` completes it (on the lane's events)."""
        target = self.executor
        read: Callable[..., object] | None = getattr(target, "read_decode_output", None)
        if not callable(read):
            return CompletedCall(self._target.run("decode_forward", {"step": step}))
        raw = self._target.run(
            "decode_forward", {"step": attrs.evolve(step, read_from_device=False)}
        )
        started = read(raw, async_read=True)
        assert isinstance(started, tuple)
        host = started[0]
        # A traced output has no lease to remember its kind: sampling params mean tokens.
        tokens = step.sampling_params is not None and self._facts.device_sampling_enabled
        complete: Callable[..., object] | None = getattr(target, "process_decode_output_host", None)
        assert callable(complete)
        return CompletedCall(finish=lambda: complete(host, is_tokens=tokens))

    def drain_journal(self) -> list[JournalRow]:
        return self._target.new_journal_rows()

    def close(self) -> None:
        if self._closed:
            return
        self._target.close()
        self._closed = True


def _synchronous(executor: object) -> bool:
    """Whether the lane's device finishes its work before a call returns (torch on CPU)."""
    device = getattr(executor, "device", None)
    return isinstance(device, TorchDevice) and device.torch_device.type == "cpu"

"""In-process lanes: one lane executor per device in this process.

`submit` runs the call at once: on CUDA the launches and replays it makes are asynchronous,
so the group issuing a call to every lane before waiting on any overlaps the lanes' device
work. A blocking decode is split into launch, asynchronous read and completion, so only
`wait` synchronizes with the lane's device (its events).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime.lanes.protocol import CompletedCall, LaneBase, LaneFacts, LaneTarget, keep_tokenizer

logger = logging.getLogger(__name__)


class InProcessLane(LaneBase):
    """A lane executor living in this process (it owns its device, KV cache and traces)."""

    def __init__(self, executor: Any, *, index: int) -> None:
        super().__init__(index)
        self.executor = executor
        self._target = LaneTarget(executor)
        self._last: CompletedCall | None = None
        self._facts: LaneFacts = self._target.run("describe", {"with_tokenizer": True})

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

    def submit(self, method: str, /, **kwargs: Any) -> CompletedCall:
        clock = time.perf_counter()
        try:
            if method == "decode_forward" and kwargs.get("read_from_device", True):
                call = self._launch_decode(kwargs)
            else:
                value = self._target.run(method, kwargs)
                if method == "describe":
                    value = keep_tokenizer(value, self._facts)
                    self._facts = value
                call = CompletedCall(value)
        except BaseException as error:
            call = CompletedCall(error=error)
        call.seconds = time.perf_counter() - clock
        self._last = call
        return call

    def _launch_decode(self, kwargs: dict[str, Any]) -> CompletedCall:
        """Launch and start the read now; `wait` completes it (on the lane's events)."""
        target = self.executor
        if not callable(getattr(target, "read_decode_output", None)):
            return CompletedCall(self._target.run("decode_forward", kwargs))
        raw = target.decode_forward(**{**kwargs, "read_from_device": False})
        host, _events = target.read_decode_output(raw, async_read=True)
        # A traced output has no lease to remember its kind: sampling params mean tokens.
        tokens = kwargs.get("sampling_params") is not None and self._facts.device_sampling_enabled
        return CompletedCall(
            finish=lambda: target.process_decode_output_host(host, is_tokens=tokens)
        )

    def drain_journal(self) -> list[dict[str, Any]]:
        return self._target.new_journal_rows()

    def close(self) -> None:
        if self._closed:
            return
        self._target.close()
        self._closed = True

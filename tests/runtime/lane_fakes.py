"""Fake lane executors for the lane-group rules: they record every call and answer simply."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane


@attrs.define
class FakeTrace:
    mode: str = "none"

    @property
    def prefill_enabled(self) -> bool:
        return self.mode == "all"

    @property
    def decode_enabled(self) -> bool:
        return self.mode != "none"


@attrs.define
class FakeConfig:
    trace: FakeTrace
    device_sampling_enabled: bool = True
    max_seq_len: int = 64


class FakeWarmup:
    """The trace-activation barrier of a lane."""

    def __init__(self) -> None:
        self.capture_pending = False
        self.trace_activated = False

    @contextlib.contextmanager
    def defer_capture(self) -> Iterator[None]:
        yield

    def operation_complete(self, operation: str) -> bool:
        return self.capture_pending or self.trace_activated


class FakeLane:
    """A lane executor: row values are `100 * lane + local slot` so routing is visible."""

    def __init__(
        self,
        index: int,
        *,
        capacity: int = 2,
        trace_mode: str = "none",
        barrier: bool = True,
        fail: dict[str, BaseException] | None = None,
        can_trace: bool = True,
        logprobs: bool = False,
    ) -> None:
        self.index = index
        self.max_batch_size = capacity
        self.phase = "CONSTRUCTED"
        self.config = FakeConfig(FakeTrace(trace_mode))
        self.warmup: FakeWarmup | None = FakeWarmup() if barrier else None
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = dict(fail or {})
        self.can_trace = can_trace
        self.logprobs = logprobs
        self.closed = 0
        self.fail_next_call = False
        self.num_blocks = 8
        self.block_size = 4

    def _record(self, name: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((name, kwargs))
        if self.fail_next_call and name != "close":
            self.fail_next_call = False
            raise RuntimeError(f"injected lane fault in {name}")
        error = self.fail.pop(name, None)
        if error is not None:
            raise error

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def configure_paged_kv_cache(self, config: Any) -> None:
        self._record("configure_paged_kv_cache", {"config": config})
        self.phase = "CAPACITY_RESOLVED"

    def resolve_capacity(self, num_blocks: Any = None) -> None:
        self._record("resolve_capacity", {"num_blocks": num_blocks})
        self.phase = "CAPACITY_RESOLVED"

    def seal(self) -> None:
        self._record("seal", {})
        self.phase = "SEALED"

    def allocate(self) -> None:
        self._record("allocate", {})
        self.phase = "ALLOCATED"

    def allocate_kv_cache(self, **kwargs: Any) -> str:
        self._record("allocate_kv_cache", kwargs)
        self.phase = "ALLOCATED"
        return f"kv{self.index}"

    def _warm(self, name: str, kwargs: dict[str, Any]) -> str:
        self._record(name, kwargs)
        if self.config.trace.mode != "none" and self.warmup is not None:
            self.warmup.capture_pending = True
        self.phase = "COMPILED"
        return "ignored"

    def warmup_prefill(self, **kwargs: Any) -> str:
        return self._warm("warmup_prefill", kwargs)

    def warmup_decode(self, **kwargs: Any) -> str:
        return self._warm("warmup_decode", kwargs)

    def compile(self) -> None:
        self._warm("compile", {})

    def compile_prefill(self, **kwargs: Any) -> str:
        self._record("compile_prefill", kwargs)
        return "ignored"

    def compile_decode(self, **kwargs: Any) -> str:
        self._record("compile_decode", kwargs)
        return "ignored"

    def capture(self) -> None:
        self._record("capture", {})
        assert self.warmup is not None
        self.warmup.capture_pending = False
        self.warmup.trace_activated = True
        self.phase = "CAPTURED"

    def serve(self) -> None:
        self._record("serve", {})
        self.phase = "SERVING"

    def _rows(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor([100 * self.index + s for s in slots], dtype=torch.int32)

    def _maybe_logprobs(self, values: torch.Tensor) -> Any:
        if self.logprobs:
            return values, torch.full((values.shape[0],), 0.5 + self.index)
        return values

    def prefill_forward(self, **kwargs: Any) -> Any:
        self._record("prefill_forward", kwargs)
        return self._maybe_logprobs(self._rows(list(kwargs["empty_slots"])))

    def preflight_prefill(self, **kwargs: Any) -> Any:
        self._record("preflight_prefill", kwargs)
        return {"slots": list(kwargs["empty_slots"])}

    def execute_preflighted_prefill(self, *, preflighted: Any) -> Any:
        self._record("execute_preflighted_prefill", {"preflighted": preflighted})
        return self._maybe_logprobs(self._rows(preflighted["slots"]))

    def can_trace_prefill(self, **kwargs: Any) -> bool:
        self._record("can_trace_prefill", kwargs)
        return self.can_trace

    def decode_forward(self, **kwargs: Any) -> Any:
        self._record("decode_forward", kwargs)
        values = self._rows(list(range(self.max_batch_size)))
        if not kwargs.get("read_from_device", True):
            return ("raw", self._maybe_logprobs(values))
        return self._maybe_logprobs(values)

    def read_decode_output(self, raw: Any, *, async_read: bool = False) -> Any:
        self._record("read_decode_output", {"raw": raw, "async_read": async_read})
        return (raw[1], ["event"]) if async_read else raw[1]

    def process_decode_output_host(self, host_value: Any, *, is_tokens: bool = False) -> Any:
        self._record("process_decode_output_host", {"host_value": host_value})
        return host_value

    def close(self) -> None:
        self._record("close", {})
        self.closed += 1
        self.phase = "TERMINAL"


def fake_group(count: int = 2, **lane_options: Any) -> tuple[LaneGroupExecutor, list[FakeLane]]:
    fakes = [FakeLane(i, **lane_options) for i in range(count)]
    return LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)]), fakes


def serving_group(count: int = 2, **lane_options: Any) -> tuple[LaneGroupExecutor, list[FakeLane]]:
    group, fakes = fake_group(count, **lane_options)
    group.start()
    for fake in fakes:
        fake.calls.clear()
    return group, fakes


class StuckLane(FakeLane):
    """A lane whose decode never answers in time (for the process transport's bound)."""

    def decode_forward(self, **kwargs: Any) -> Any:
        import time

        time.sleep(60)
        return super().decode_forward(**kwargs)


def stuck_lane() -> StuckLane:
    """A picklable factory for a process lane."""
    return StuckLane(0)

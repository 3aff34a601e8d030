"""Fault injection: a `Device` wrapper that fails chosen operations on purpose.

Tests and bring-up use it to prove that cleanup retries, rollback and leak accounting work:
"the 3rd deallocate fails", "every trace release fails", "allocations of more than 1 MiB fail".
A fault is raised *before* the call reaches the wrapped device, so a failed deallocate leaves
the tensor owned (a retry can release it) and a failed allocate allocates nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeGuard, get_args

import attrs
import torch

from runtime.backends.base import (
    Device,
    DeviceTensor,
    DoubleDeallocationError,
    Event,
    TraceHandle,
    TraceOutputs,
)
from runtime.validation import is_int

logger = logging.getLogger(__name__)

FaultOperation = Literal[
    "allocate",
    "from_host",
    "to_host",
    "deallocate",
    "synchronize",
    "record_event",
    "event_synchronize",
    "capture",
    "replay",
    "release_trace",
]
FAULT_OPERATIONS: tuple[FaultOperation, ...] = get_args(FaultOperation)


class InjectedFault(RuntimeError):
    """A failure raised on purpose by `FaultInjectingDevice`."""

    def __init__(self, operation: str, call_index: int, rule: FaultRule) -> None:
        super().__init__(
            f"injected fault: {operation} call #{call_index} failed on purpose ({rule.describe()})"
        )
        self.operation = operation
        self.call_index = call_index
        self.rule = rule


@attrs.frozen
class FaultCall:
    """One call a predicate may inspect: operation, 1-based index per operation, arguments.

    The arguments are the operation's own (a shape, a tensor, a trace, ...); a predicate
    narrows the ones it reads.
    """

    operation: FaultOperation
    index: int
    args: tuple[object, ...]
    kwargs: Mapping[str, object]


def _check_operation(
    instance: object, attribute: attrs.Attribute[FaultOperation], value: FaultOperation
) -> None:
    if value not in FAULT_OPERATIONS:
        raise ValueError(f"operation must be one of {', '.join(FAULT_OPERATIONS)}; got {value!r}")


def _check_nth(instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is None:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"nth must be a 1-based positive int or None, got {value!r}")


@attrs.frozen
class FaultRule:
    """Fail `operation` on its `nth` call, on every call, or when `predicate` says so.

    Exactly one of `nth`, `every=True` and `predicate` selects the failing calls.
    """

    operation: FaultOperation = attrs.field(validator=_check_operation)
    nth: int | None = attrs.field(default=None, validator=_check_nth)
    every: bool = False
    predicate: Callable[[FaultCall], bool] | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        chosen = (self.nth is not None) + bool(self.every) + (self.predicate is not None)
        if chosen != 1:
            raise ValueError(
                f"a FaultRule for {self.operation!r} needs exactly one of nth=N, every=True or "
                f"predicate=...; got nth={self.nth!r}, every={self.every!r}, "
                f"predicate={self.predicate!r}"
            )

    def matches(self, call: FaultCall) -> bool:
        """Whether this rule fails `call`."""
        if call.operation != self.operation:
            return False
        if self.every:
            return True
        if self.nth is not None:
            return call.index == self.nth
        return self.predicate is not None and bool(self.predicate(call))

    def describe(self) -> str:
        """The rule in `FaultPlan.parse` syntax where it has one."""
        if self.every:
            return f"{self.operation}:every"
        if self.nth is not None:
            return f"{self.operation}:{self.nth}"
        return f"{self.operation}:<predicate>"


_SPEC_HELP = (
    "a fault spec is a comma-separated list of '<operation>:<N>' (fail the Nth call, N >= 1) "
    "or '<operation>:every'; operations: " + ", ".join(FAULT_OPERATIONS)
)


@attrs.frozen
class FaultPlan:
    """Which calls fail: a tuple of rules; a call fails when any rule matches it."""

    rules: tuple[FaultRule, ...] = ()

    @classmethod
    def nth(cls, operation: FaultOperation, n: int) -> FaultPlan:
        """Fail only the `n`-th (1-based) call of `operation`."""
        return cls((FaultRule(operation, nth=n),))

    @classmethod
    def every(cls, operation: FaultOperation) -> FaultPlan:
        """Fail every call of `operation`."""
        return cls((FaultRule(operation, every=True),))

    @classmethod
    def matching(
        cls, operation: FaultOperation, predicate: Callable[[FaultCall], bool]
    ) -> FaultPlan:
        """Fail calls of `operation` for which `predicate(call)` is true."""
        return cls((FaultRule(operation, predicate=predicate),))

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse a CLI spec such as ``"deallocate:3"`` or ``"allocate:2,release_trace:every"``."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"empty fault spec {spec!r}; {_SPEC_HELP}")
        rules: list[FaultRule] = []
        for part in spec.split(","):
            item = part.strip()
            operation, sep, selector = item.partition(":")
            operation, selector = operation.strip(), selector.strip()
            if not sep or not selector:
                raise ValueError(f"fault spec item {item!r} has no ':<N>|every'; {_SPEC_HELP}")
            if operation not in FAULT_OPERATIONS:
                raise ValueError(
                    f"unknown fault operation {operation!r} in {spec!r}; valid operations: "
                    f"{', '.join(FAULT_OPERATIONS)}"
                )
            if selector == "every":
                rules.append(FaultRule(operation, every=True))
            elif selector.isdigit() and int(selector) >= 1:
                rules.append(FaultRule(operation, nth=int(selector)))
            else:
                raise ValueError(
                    f"fault spec item {item!r}: selector {selector!r} must be a 1-based call "
                    f"number (N >= 1) or 'every'; {_SPEC_HELP}"
                )
        return cls(tuple(rules))

    def __add__(self, other: FaultPlan) -> FaultPlan:
        return FaultPlan(self.rules + other.rules)

    def match(self, call: FaultCall) -> FaultRule | None:
        """The first rule that fails `call`, or None."""
        for rule in self.rules:
            if rule.matches(call):
                return rule
        return None

    def describe(self) -> str:
        """The plan in spec syntax."""
        return ",".join(rule.describe() for rule in self.rules) or "<no faults>"


class FaultInjectingDevice:
    """A `Device` that delegates to `inner` and fails the calls `plan` selects.

    Counters: `attempts[op]` (calls made), `failures[op]` (injected faults) and
    `deallocated_twice` (deallocations the inner device refused as double frees). Its `name`
    is the inner device's, so events and trace handles pass through unchanged.
    """

    def __init__(self, inner: Device, plan: FaultPlan | str) -> None:
        self.inner = inner
        self.plan = FaultPlan.parse(plan) if isinstance(plan, str) else plan
        if not isinstance(self.plan, FaultPlan):
            raise TypeError(f"plan must be a FaultPlan or a spec string, got {plan!r}")
        self.attempts: dict[str, int] = dict.fromkeys(FAULT_OPERATIONS, 0)
        self.failures: dict[str, int] = dict.fromkeys(FAULT_OPERATIONS, 0)
        self.deallocated_twice = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultInjectingDevice({self.inner!r}, plan={self.plan.describe()!r})"

    def _enter(self, operation: FaultOperation, *args: object, **kwargs: object) -> None:
        """Count the call and raise `InjectedFault` when the plan selects it."""
        with self._lock:
            self.attempts[operation] += 1
            call = FaultCall(operation, self.attempts[operation], args, kwargs)
        rule = self.plan.match(call)
        if rule is None:
            return
        with self._lock:
            self.failures[operation] += 1
        logger.info("injecting fault into %s call #%d (%s)", operation, call.index, rule.describe())
        raise InjectedFault(operation, call.index, rule)

    @property
    def injected_total(self) -> int:
        """Faults injected so far, all operations together."""
        return sum(self.failures.values())

    # --- protocol, by delegation --------------------------------------------------------------

    @property
    def name(self) -> str:
        """The inner device's name."""
        return self.inner.name

    @property
    def torch_device(self) -> torch.device:
        """The inner device's torch device."""
        return self.inner.torch_device

    @property
    def live_allocations(self) -> int:
        """The inner device's live allocations."""
        return self.inner.live_allocations

    @property
    def live_traces(self) -> int:
        """The inner device's live traces."""
        return self.inner.live_traces

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, *, fill: float = 0.0
    ) -> DeviceTensor:
        """Delegate unless the plan fails this call (then nothing is allocated)."""
        self._enter("allocate", shape, dtype, fill=fill)
        return self.inner.allocate(shape, dtype, fill=fill)

    def from_host(self, host: torch.Tensor, *, into: DeviceTensor | None = None) -> DeviceTensor:
        """Delegate unless the plan fails this call (then nothing is copied)."""
        self._enter("from_host", host, into=into)
        return self.inner.from_host(host, into=into)

    def to_host(
        self, tensor: DeviceTensor, *, blocking: bool = True
    ) -> tuple[torch.Tensor, Event | None]:
        """Delegate unless the plan fails this call."""
        self._enter("to_host", tensor, blocking=blocking)
        return self.inner.to_host(tensor, blocking=blocking)

    def is_owned(self, tensor: object) -> TypeGuard[DeviceTensor]:
        """Never fails: ownership queries are not device work."""
        return self.inner.is_owned(tensor)

    def deallocate(self, tensor: DeviceTensor) -> None:
        """Delegate unless the plan fails this call (then the tensor stays owned)."""
        self._enter("deallocate", tensor)
        try:
            self.inner.deallocate(tensor)
        except DoubleDeallocationError:
            with self._lock:
                self.deallocated_twice += 1
            raise

    def synchronize(self) -> None:
        """Delegate unless the plan fails this call."""
        self._enter("synchronize")
        self.inner.synchronize()

    def record_event(self) -> Event:
        """Delegate unless the plan fails this call."""
        self._enter("record_event")
        return self.inner.record_event()

    def event_synchronize(self, event: Event) -> None:
        """Delegate unless the plan fails this call."""
        self._enter("event_synchronize", event)
        self.inner.event_synchronize(event)

    def capture(self, fn: Callable[[], TraceOutputs]) -> TraceHandle:
        """Delegate unless the plan fails this call (then nothing is captured)."""
        self._enter("capture", fn)
        return self.inner.capture(fn)

    def replay(self, trace: TraceHandle, *, blocking: bool = False) -> TraceOutputs:
        """Delegate unless the plan fails this call."""
        self._enter("replay", trace, blocking=blocking)
        return self.inner.replay(trace, blocking=blocking)

    def release_trace(self, trace: TraceHandle) -> None:
        """Delegate unless the plan fails this call (then the trace stays live)."""
        self._enter("release_trace", trace)
        self.inner.release_trace(trace)

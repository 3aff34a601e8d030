"""Hypothesis: serve / generate / drain / sleep(1|2) / wake(tags) / reload / close in random
orders, with device faults injected at random steps.

Checked after every call: a refused call raised `PhaseError` before any device work and left
the phase unchanged; a call that failed did so because of an injected fault and left a legal
phase with nothing held outside FAULTED/CLOSING; while asleep the device holds no allocation,
trace or weight byte; a drain finishes or hands back every request of the running stream
(none lost); every completed greedy request equals a fresh executor's; after `close()` no
allocation is live.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lifecycle import Phase, PhaseError
from models.generation import GenerationParams, Generator
from models.generation.stream import GenerationStream
from runtime.backends.faults import FaultInjectingDevice, FaultPlan
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.executor_setup import tiny_executor

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
PARAMS = GenerationParams(max_new_tokens=4)
FAULT_OPERATIONS = ("allocate", "deallocate", "capture", "release_trace", "synchronize")


def faults(reach: int) -> st.SearchStrategy[tuple[str, int] | None]:
    """A fault for the next call: its operation and which of its next `reach` calls fails."""
    return st.none() | st.tuples(st.sampled_from(FAULT_OPERATIONS), st.integers(1, reach))


FAULTS = faults(4)
ASLEEP_OR_DRAINED = (Phase.DRAINED, Phase.WEIGHTS_AWAKE, Phase.SLEEPING)
ANY_CALLS: dict[str, Callable[[Any], object]] = {
    "drain": lambda e: e.drain(),
    "sleep(1)": lambda e: e.sleep(1),
    "sleep(2)": lambda e: e.sleep(2),
    "wake()": lambda e: e.wake(),
    "wake(weights)": lambda e: e.wake(tags=("weights",)),
    "wake(kv_cache)": lambda e: e.wake(tags=("kv_cache",)),
    "reload": lambda e: e.reload_weights("tiny-random"),
    "serve": lambda e: e.serve(),
    "start": lambda e: e.start(),
    "warmup_decode": lambda e: e.warmup_decode(),
}
_REFERENCE: dict[str, list[tuple[int, ...]]] = {}


def reference(mode: str) -> list[tuple[int, ...]]:
    """Greedy tokens of PROMPTS from a fresh executor that never slept."""
    if mode not in _REFERENCE:
        executor = tiny_executor(trace_mode=mode, max_batch_size=2)
        executor.start()
        _REFERENCE[mode] = [c.token_ids for c in Generator(executor).generate(PROMPTS, PARAMS)]
        executor.close()
    return _REFERENCE[mode]


class SleepWakeMachine(RuleBasedStateMachine):
    """One executor on a fault-injecting device, driven through its sleep lifecycle."""

    @initialize(mode=st.sampled_from(["none", "decode_only", "all"]))
    def start(self, mode: str) -> None:
        self.expected = reference(mode)
        self.executor = tiny_executor(trace_mode=mode, max_batch_size=2, faults="allocate:999999")
        device = self.executor.device
        assert isinstance(device, FaultInjectingDevice)
        self.device = device
        self.device.plan = FaultPlan()
        self.executor.start()
        self.generator = Generator(self.executor)
        self.stream: GenerationStream | None = None
        self.sleeps = 0

    # -- the check every call goes through -------------------------------------------------------

    def attempt(self, name: str, call: Callable[[], Any]) -> Any:
        executor, device = self.executor, self.device
        phase, attempts, injected = executor.phase, dict(device.attempts), device.injected_total
        try:
            value = call()
        except PhaseError as error:
            if error.owner != executor.owner_name:
                raise
            assert executor.phase is phase, f"refusal moved {phase} -> {executor.phase}"
            assert device.attempts == attempts, "a refused call reached the device"
            event(f"{name} refused")
        except Exception:
            if device.injected_total == injected:
                raise  # a failure no injected fault explains: a real bug
            if executor.phase not in (Phase.FAULTED, Phase.CLOSING):
                assert not executor._held_resources(), executor._held_resources()
            event(f"{name} failed by a fault: {phase.name} -> {executor.phase.name}")
        else:
            event(f"{name} ok")
            return value
        return None

    def check_completions(self, completions: Any) -> None:
        for completion in completions:
            assert completion.token_ids == self.expected[completion.index]

    # -- rules ------------------------------------------------------------------------------------

    def arm(self, fault: tuple[str, int] | None) -> None:
        """Fail the `offset`-th next call of `operation` (None: no fault)."""
        if fault is None:
            self.device.plan = FaultPlan()
            return
        operation, offset = fault
        self.device.plan = FaultPlan.nth(operation, self.device.attempts[operation] + offset)  # type: ignore[arg-type]

    @precondition(lambda self: self.stream is None or self.stream.done)
    @rule(fault=FAULTS)
    def generate_one_step(self, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        if self.executor.phase is not Phase.SERVING:
            return  # the generator refuses before any work (tested with the generator)
        stream = self.attempt("stream", lambda: self.generator.stream(PROMPTS, PARAMS))
        if stream is None:
            return
        self.stream = stream
        self.attempt("step", lambda: next(stream, None))

    @precondition(
        lambda self: (
            self.executor.phase is Phase.SERVING and (self.stream is None or self.stream.done)
        )
    )
    @rule()
    def generate(self) -> None:
        """A whole greedy generation; its tokens must equal a fresh executor's."""
        completions = self.attempt("generate", lambda: self.generator.generate(PROMPTS, PARAMS))
        if completions is not None:
            self.check_completions(completions)
            event(f"generate checked after {self.sleeps} sleep(s)")

    @precondition(
        lambda self: (
            self.executor.phase is Phase.SERVING and (self.stream is None or self.stream.done)
        )
    )
    @rule(level=st.sampled_from([1, 2]), staged=st.booleans(), fault=faults(60))
    def cycle(self, level: int, staged: bool, fault: tuple[str, int] | None) -> None:
        """drain, sleep, wake (staged or whole, with a reload after level 2), then a checked
        generation: the sequence an RL loop runs, a fault anywhere in it."""
        executor = self.executor
        steps: list[tuple[str, Callable[[], object]]] = [
            ("drain", executor.drain),
            (f"sleep({level})", lambda: executor.sleep(level)),
        ]
        reload = ("reload", lambda: executor.reload_weights("tiny-random"))
        if staged:
            steps.append(("wake(weights)", lambda: executor.wake(tags=("weights",))))
            steps += [reload] if level == 2 else []
            steps.append(("wake(kv_cache)", lambda: executor.wake(tags=("kv_cache",))))
        else:
            steps.append(("wake()", executor.wake))
            steps += [reload, ("serve", executor.serve)] if level == 2 else []
        self.arm(fault)
        for name, call in steps:
            injected = self.device.injected_total
            self.attempt(f"cycle {name}", call)
            if self.device.injected_total != injected:
                return
        self.device.plan = FaultPlan()
        assert executor.phase is Phase.SERVING
        self.sleeps += 1
        self.generate()

    @precondition(
        lambda self: (
            self.executor.phase is Phase.SERVING and (self.stream is None or self.stream.done)
        )
    )
    @rule(level=st.sampled_from([1, 2]), staged=st.booleans())
    def clean_cycle(self, level: int, staged: bool) -> None:
        """A cycle without a fault (drawn as often as one with): the output check runs."""
        self.cycle(level, staged, None)

    @precondition(lambda self: self.stream is not None and not self.stream.done)
    @rule(fault=FAULTS)
    def finish_stream(self, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        stream = self.stream
        assert stream is not None
        if self.attempt("finish", lambda: [*stream] or True) is not None:
            self.check_completions(stream.completions)

    @precondition(lambda self: self.executor.phase in (Phase.SERVING, Phase.DRAINING))
    @rule(finish=st.booleans(), fault=FAULTS)
    def drain(self, finish: bool, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        stream = self.stream
        running = stream is not None and not stream.done
        result = self.attempt("drain", lambda: self.generator.drain(finish=finish))
        if result is None or not running:
            return
        assert stream is not None
        assert len(result.completions) + len(result.handed_back) == len(PROMPTS), "lost request"
        self.check_completions(result.completions)
        for handed in result.handed_back:
            want = self.expected[handed.index]
            assert handed.output_token_ids == want[: len(handed.output_token_ids)]

    @precondition(
        lambda self: self.executor.phase in (Phase.DRAINED, Phase.WEIGHTS_AWAKE, Phase.SLEEPING)
    )
    @rule(level=st.sampled_from([1, 2]), fault=FAULTS)
    def sleep(self, level: int, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        self.attempt(f"sleep({level})", lambda: self.executor.sleep(level))
        self.sleeps += self.executor.phase is Phase.SLEEPING

    @precondition(lambda self: self.executor.phase in (Phase.SLEEPING, Phase.WEIGHTS_AWAKE))
    @rule(
        tags=st.sampled_from([None, ("weights",), ("kv_cache",), ("weights", "kv_cache")]),
        fault=faults(40),
    )
    def wake(self, tags: tuple[str, ...] | None, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        self.attempt(f"wake({tags})", lambda: self.executor.wake(tags=tags))

    @precondition(lambda self: self.executor.phase in (Phase.DRAINED, Phase.WEIGHTS_AWAKE))
    @rule()
    def reload(self) -> None:
        self.attempt("reload", lambda: self.executor.reload_weights("tiny-random"))

    @precondition(lambda self: self.executor.phase in (Phase.DRAINED,))
    @rule()
    def serve(self) -> None:
        self.attempt("serve", self.executor.serve)

    @rule(call=st.sampled_from(sorted(ANY_CALLS)), fault=FAULTS)
    def any_call(self, call: str, fault: tuple[str, int] | None) -> None:
        """Any call in any phase: refusals and journaled no-ops (the rules above progress)."""
        self.arm(fault)
        self.attempt(call, lambda: ANY_CALLS[call](self.executor))

    @rule(roll=st.integers(0, 7), fault=FAULTS)
    def close(self, roll: int, fault: tuple[str, int] | None) -> None:
        self.arm(fault)
        if roll == 0:  # rarely: everything after a close is a refusal
            self.attempt("close", self.executor.close)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def asleep_holds_nothing(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is None or executor.phase not in (Phase.SLEEPING, Phase.WEIGHTS_AWAKE):
            return
        assert self.device.live_allocations == 0
        assert self.device.live_traces == 0
        residency = executor.residency
        assert residency is not None
        if executor.phase is Phase.SLEEPING:
            assert residency.device_bytes() == 0

    def teardown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is None:
            return
        self.device.plan = FaultPlan()
        for _ in range(3):
            if executor.is_terminal:
                break
            try:
                executor.close()
            except Exception:
                continue
        assert executor.is_terminal
        assert self.device.live_allocations == 0


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SleepWakeMachine.TestCase.settings = settings(
    settings.default,
    max_examples=500 if THOROUGH else 60,
    stateful_step_count=40 if THOROUGH else 16,
)
TestSleepWakeMachine = SleepWakeMachine.TestCase

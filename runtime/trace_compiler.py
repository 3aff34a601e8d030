"""The trace registry: capture plans, program-to-trace aliases, capture, replay, cleanup.

Traces are separate from compiled programs: a trace is keyed by its own signature
(`runtime.identity.TraceKey`) and several compiled programs may alias one trace. All plans
register first; `capture_all` then prepares every persistent input and workspace before the
first capture, captures decode traces before prefill traces, and closes the program
compiler's gate for good. A capture failure rolls everything back; while anything could not
be released the gate stays closed until `cleanup()` succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Literal

import attrs

from lifecycle.errors import attach_cleanup_failures
from lifecycle.journal import Journal
from lifecycle.machine import MachineTable, StateMachine, StateSpec, TransitionSpec
from runtime.backends.base import TraceHandle, TraceOutputs
from runtime.identity import ProgramKey, TraceKey, key_material_of
from runtime.program_compiler import ProgramCompiler
from runtime.tensor_resources import (
    TensorResourceOrphan,
    release_or_orphan,
    release_orphans,
    trim_host_allocator,
)

logger = logging.getLogger(__name__)


class TraceState(StrEnum):
    """`TraceCompiler`: register capture plans, capture them all once, replay, release."""

    REGISTERING = "registering"
    CAPTURING = "capturing"
    ACTIVE = "active"
    RELEASED = "released"


TRACE_COMPILER_TABLE = MachineTable(
    name="trace-compiler",
    states=(
        StateSpec(TraceState.REGISTERING, "collecting capture plans", ("capture_all",)),
        StateSpec(TraceState.CAPTURING, "capturing every registered plan", ()),
        StateSpec(TraceState.ACTIVE, "traces replayable", ("replay", "cleanup")),
        StateSpec(
            TraceState.RELEASED,
            "terminal: traces and persistent inputs released",
            (),
            refusal="{owner} has been released",
        ),
    ),
    transitions=(
        TransitionSpec("begin_capture", (TraceState.REGISTERING,), TraceState.CAPTURING),
        TransitionSpec("activate", (TraceState.CAPTURING,), TraceState.ACTIVE),
        TransitionSpec("rollback", (TraceState.CAPTURING,), TraceState.REGISTERING),
        TransitionSpec(
            "release",
            (TraceState.REGISTERING, TraceState.CAPTURING, TraceState.ACTIVE),
            TraceState.RELEASED,
        ),
    ),
    initial=TraceState.REGISTERING,
    terminal=frozenset({TraceState.RELEASED}),
)

TraceOperation = Literal["prefill", "decode"]
_OPERATIONS: tuple[TraceOperation, ...] = ("prefill", "decode")


@attrs.frozen(eq=False)
class PersistentInputs:
    """Trace-owned input buffers, refreshed in place before every replay."""

    values: object
    """The operation's own inputs (`DecodePersistentInputs`, `PrefillPersistentInputs`)."""

    def owned_tensor_values(self) -> object:
        """What a release walks."""
        return self.values


@attrs.frozen
class InputRefreshPolicy:
    """When a replay must refresh all inputs, only the page table, or replay-varying fields."""

    every_replay: tuple[str, ...] = ()
    full_on_batch_reset: bool = True
    full_on_graph_switch: bool = True
    full_without_device_feedback: bool = True
    refresh_page_table_on_change: bool = True


@attrs.frozen
class RefreshDecision:
    """What `refresh_inputs` must copy before this replay."""

    full: bool
    page_table: bool
    fields: tuple[str, ...]


def _check_operation(
    instance: object, attribute: attrs.Attribute[TraceOperation], value: object
) -> None:
    if value not in _OPERATIONS:
        raise ValueError(f"operation must be 'prefill' or 'decode', got {value!r}")


@attrs.frozen(eq=False)
class TraceCapturePlan:
    """How to capture one trace for one compiled program.

    `prepare_inputs()` allocates the persistent inputs; `capture(persistent)` runs the model
    body reading them (it is what the device records); `prepare_workspace()` makes the
    alias-local post-processing workspace; `prime(persistent)` optionally runs the body once
    before capture, and `release_prime_output(output)` releases what it returned.
    """

    program_key: ProgramKey
    trace_signature: object
    operation: TraceOperation = attrs.field(validator=_check_operation)
    prepare_inputs: Callable[[], object]
    capture: Callable[[PersistentInputs], TraceOutputs]
    refresh_policy: InputRefreshPolicy = InputRefreshPolicy()
    schema_fingerprint: object = None
    prepare_workspace: Callable[[], object] | None = None
    workspace_fingerprint: object = None
    prime: Callable[[PersistentInputs], object] | None = None
    release_prime_output: Callable[[object], list[BaseException]] | None = None

    def __attrs_post_init__(self) -> None:
        if (self.prime is None) != (self.release_prime_output is None):
            raise ValueError("prime and release_prime_output must be supplied together")


@attrs.define(eq=False)
class TraceArtifact:
    """A captured trace: its device handle, persistent inputs and trace-owned outputs."""

    handle: TraceHandle
    persistent_inputs: PersistentInputs
    outputs: TraceOutputs
    refresh_policy: InputRefreshPolicy
    trace_released: bool = False
    deallocated_tensor_ids: set[int] = attrs.field(factory=set)


@attrs.define(eq=False)
class TraceRecord:
    """One trace key: the plan that captures it and, once captured, its artifact."""

    key: TraceKey
    signature: object
    operation: TraceOperation
    plan: TraceCapturePlan
    persistent: PersistentInputs | None = None
    artifact: TraceArtifact | None = None
    shares: TraceKey | None = None
    """The trace whose capture this key replays (equal capture schema), or None."""


@attrs.define(eq=False)
class TraceAliasRecord:
    """One program's association with a trace, and its own post-processing workspace."""

    trace_key: TraceKey
    workspace_fingerprint: object
    prepare_workspace: Callable[[], object] | None
    workspace: object = None


class TraceCompiler:
    """Owns trace artifacts and replay; composes the eager `ProgramCompiler`."""

    def __init__(
        self,
        program_compiler: ProgramCompiler,
        *,
        journal: Journal | None = None,
        owner_name: str = "TraceCompiler",
    ) -> None:
        if not isinstance(program_compiler, ProgramCompiler):
            raise TypeError(
                f"program_compiler must be a ProgramCompiler, got {type(program_compiler).__name__}"
            )
        self.program_compiler = program_compiler
        self._device = program_compiler.device
        self._lifecycle: StateMachine = TRACE_COMPILER_TABLE.build(
            owner=owner_name, journal=journal
        )
        self._records: dict[TraceKey, TraceRecord] = {}
        self._aliases: dict[ProgramKey, TraceAliasRecord] = {}
        self._orphans: list[TensorResourceOrphan] = []
        self._unreleased_traces: set[TraceKey] = set()
        self._replay_counts: dict[str, int] = dict.fromkeys(_OPERATIONS, 0)
        self._last_replayed: TraceKey | None = None
        self._captures = 0
        self._capture_failed = False

    # -- introspection ------------------------------------------------------------------------

    @property
    def state(self) -> TraceState:
        """registering, capturing, active or released."""
        state = self._lifecycle.state
        assert isinstance(state, TraceState)
        return state

    @property
    def trace_active(self) -> bool:
        """Whether traces are captured and replayable (or a rollback left resources)."""
        return self.state is TraceState.ACTIVE

    @property
    def replay_count(self) -> int:
        """Replays so far, all operations."""
        return sum(self._replay_counts.values())

    @property
    def replay_counts(self) -> dict[str, int]:
        """Replays per operation (a snapshot)."""
        return dict(self._replay_counts)

    @property
    def capture_count(self) -> int:
        """Captures `capture_all` ran: one per capture schema (each key at most once)."""
        return self._captures

    @property
    def shared_capture_count(self) -> int:
        """Trace keys that replay another key's capture (same capture schema)."""
        return sum(1 for record in self._records.values() if record.shares is not None)

    @property
    def trace_count(self) -> int:
        """Distinct registered traces."""
        return len(self._records)

    @property
    def trace_association_count(self) -> int:
        """Programs associated with a trace (aliases included)."""
        return len(self._aliases)

    @property
    def unreleased_resource_count(self) -> int:
        """Resources a failed capture rollback or cleanup tried and failed to release.

        Live captured traces and their inputs are not counted: they are owned and replayable
        until `cleanup()`. Only traces whose release failed and tensors whose deallocation
        failed are; while any remain the gate stays closed and replay is refused.
        """
        return len(self._orphans) + len(self._unreleased_traces)

    def registered_coverage(self, operation: str) -> tuple[tuple[TraceKey, object], ...]:
        """(trace key, signature) of every registered trace of `operation`."""
        if operation not in _OPERATIONS:
            raise ValueError(f"operation must be 'prefill' or 'decode', got {operation!r}")
        return tuple(
            (r.key, r.signature) for r in self._records.values() if r.operation == operation
        )

    def get(self, trace_key: TraceKey) -> TraceRecord | None:
        """The record of `trace_key`, if registered."""
        return self._records.get(trace_key)

    def trace_key_for_program(self, program_key: ProgramKey) -> TraceKey | None:
        """The trace a program is associated with, if any."""
        alias = self._aliases.get(program_key)
        return None if alias is None else alias.trace_key

    def alias_for_program(self, program_key: ProgramKey) -> TraceAliasRecord | None:
        """The association record of a program (trace key and workspace fingerprint)."""
        return self._aliases.get(program_key)

    def is_captured(self, program_key: ProgramKey) -> bool:
        """Whether `program_key` has an association whose trace is captured."""
        alias = self._aliases.get(program_key)
        if alias is None:
            return False
        record = self._records.get(alias.trace_key)
        return record is not None and record.artifact is not None

    def workspace_for_program(self, program_key: ProgramKey) -> object:
        """The alias-local workspace of a program."""
        alias = self._aliases.get(program_key)
        if alias is None:
            raise RuntimeError(f"program {program_key.digest} has no trace association")
        return alias.workspace

    # -- registration -------------------------------------------------------------------------

    def register_capture_plan(self, plan: TraceCapturePlan) -> TraceKey:
        """Associate a compiled program with a trace; the first plan of a key is captured."""
        self._lifecycle.require(
            "register_capture_plan",
            frozenset({TraceState.REGISTERING}),
            reason="Cannot register trace capture plans during capture or after trace activation",
        )
        if not isinstance(plan, TraceCapturePlan):
            raise TypeError(f"plan must be a TraceCapturePlan, got {type(plan).__name__}")
        self.program_compiler.require_compiled(plan.program_key)
        key = TraceKey.from_signature(plan.trace_signature)
        alias = self._aliases.get(plan.program_key)
        if alias is not None and alias.trace_key != key:
            raise ValueError(
                f"program {plan.program_key.digest} is already associated with trace "
                f"{alias.trace_key.digest}, not {key.digest}"
            )
        if alias is not None and alias.workspace_fingerprint != plan.workspace_fingerprint:
            raise ValueError(
                f"program {plan.program_key.digest} re-registered with a different workspace "
                f"fingerprint: {alias.workspace_fingerprint!r} != {plan.workspace_fingerprint!r}"
            )
        record = self._records.get(key)
        if record is not None:
            if key_material_of(record.signature) != key_material_of(plan.trace_signature):
                raise RuntimeError(f"Trace key collision for {key.digest}")
            if record.operation != plan.operation:
                raise RuntimeError(
                    f"trace {key.digest} is a {record.operation} trace, not {plan.operation}"
                )
            if record.plan.refresh_policy != plan.refresh_policy:
                raise ValueError(f"trace {key.digest} registered with another refresh policy")
            if record.plan.schema_fingerprint != plan.schema_fingerprint:
                raise ValueError(f"trace {key.digest} registered with another capture schema")
        else:
            self._records[key] = TraceRecord(key, plan.trace_signature, plan.operation, plan)
        if alias is None:
            self._aliases[plan.program_key] = TraceAliasRecord(
                key, plan.workspace_fingerprint, plan.prepare_workspace
            )
        return key

    # -- capture --------------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Prepare every input and workspace, then capture decode and prefill traces once."""
        if self.state is TraceState.ACTIVE:
            return
        self._lifecycle.require("capture_all", frozenset({TraceState.REGISTERING}))
        if not self._records:
            logger.info("capture_all: no registered plans; traces stay inactive")
            return
        if self.program_compiler.compile_orphan_count:
            raise RuntimeError(
                "Cannot capture traces while compile outputs remain unreleased; clean up the "
                "program compiler"
            )
        for alias_key in self._aliases:
            self.program_compiler.require_compiled(alias_key)
        self._lifecycle.fire("begin_capture", detail=f"{len(self._records)} trace(s)")
        self.program_compiler.begin_capture()
        leaders = self._assign_shared_captures()
        try:
            for record in leaders:
                record.persistent = PersistentInputs(record.plan.prepare_inputs())
            for alias in self._aliases.values():
                if alias.prepare_workspace is not None:
                    alias.workspace = alias.prepare_workspace()
            ordered = sorted(leaders, key=lambda r: r.operation != "decode")
            for record in ordered:
                self._capture_one(record)
            for record in self._records.values():
                if record.shares is not None:
                    record.artifact = self._records[record.shares].artifact
            self._device.synchronize()
        except BaseException as error:
            self._rollback(error)
            raise
        self._captures += len(leaders)
        self._lifecycle.fire("activate", detail=f"{len(self._records)} trace(s) captured")
        self.program_compiler.activate()
        trim_host_allocator()

    def _assign_shared_captures(self) -> list[TraceRecord]:
        """The records to capture; the others replay a leader with the same capture schema.

        Prefill traces whose keys differ only in sampling material capture the same
        hidden-state computation (equal schema fingerprint and refresh policy): one capture
        serves them all, each program keeping its own post-processing workspace.
        """
        leaders: list[TraceRecord] = []
        by_schema: dict[tuple[object, ...], TraceRecord] = {}
        for record in self._records.values():
            plan = record.plan
            record.shares = None
            if record.operation == "prefill" and plan.schema_fingerprint is not None:
                group = (plan.schema_fingerprint, plan.refresh_policy)
                leader = by_schema.setdefault(group, record)
                if leader is not record:
                    record.shares = leader.key
                    continue
            leaders.append(record)
        return leaders

    def _capture_one(self, record: TraceRecord) -> None:
        plan = record.plan
        persistent = record.persistent
        assert persistent is not None
        if plan.prime is not None and plan.release_prime_output is not None:
            output = plan.prime(persistent)
            self._device.synchronize()
            failures = plan.release_prime_output(output)
            if failures:
                error = RuntimeError(f"Failed to release the prime output of {record.key.digest}")
                attach_cleanup_failures(error, failures)
                raise error
            self._device.synchronize()
        handle = self._device.capture(lambda: plan.capture(persistent))
        record.artifact = TraceArtifact(
            handle=handle,
            persistent_inputs=persistent,
            outputs=handle.outputs,
            refresh_policy=plan.refresh_policy,
        )
        self._device.synchronize()

    def _rollback(self, primary: BaseException) -> None:
        failures = self._release_everything()
        attach_cleanup_failures(primary, failures, note="rolling back trace capture")
        if self.unreleased_resource_count:
            self._capture_failed = True
            self._lifecycle.fire("activate", detail="rollback left resources; gate stays closed")
            self.program_compiler.activate()
        else:
            self._lifecycle.fire("rollback", detail="capture failed; everything released")
            self.program_compiler.rollback()

    def _release_everything(self) -> list[BaseException]:
        """Release every trace, then its inputs; a trace that fails to release keeps them."""
        failures: list[BaseException] = []
        for record in self._records.values():
            if record.shares is not None:
                record.artifact = None  # its leader owns and releases the capture
                continue
            artifact = record.artifact
            if artifact is not None and not artifact.trace_released:
                try:
                    self._device.release_trace(artifact.handle)
                except BaseException as failure:
                    failures.append(failure)
                    self._unreleased_traces.add(record.key)
                    continue  # nothing of this artifact is freed until its trace is
                artifact.trace_released = True
            self._unreleased_traces.discard(record.key)
            record.artifact = None
            if record.persistent is not None:
                orphan, orphan_failures = release_or_orphan(record.persistent, self._device)
                if orphan is not None:
                    self._orphans.append(orphan)
                failures.extend(orphan_failures)
                record.persistent = None
        for alias in self._aliases.values():
            if alias.workspace is not None:
                orphan, orphan_failures = release_or_orphan(alias.workspace, self._device)
                if orphan is not None:
                    self._orphans.append(orphan)
                failures.extend(orphan_failures)
                alias.workspace = None
        failures.extend(release_orphans(self._orphans))
        return failures

    # -- replay ---------------------------------------------------------------------------------

    def replay(
        self,
        program_key: ProgramKey,
        refresh_inputs: Callable[[TraceArtifact, RefreshDecision], None],
        *,
        reset_batch: bool = False,
        device_feedback_enabled: bool = False,
        feedback_compatible: bool = False,
        page_table_changed: bool = False,
    ) -> TraceOutputs:
        """Refresh what the decision says, replay without blocking, return trace outputs."""
        self._lifecycle.require("replay", frozenset({TraceState.ACTIVE}))
        if self._capture_failed:
            raise RuntimeError(
                "trace capture failed and its rollback left resources; call cleanup() and "
                "construct a new executor"
            )
        self.program_compiler.require_compiled(program_key)
        alias = self._aliases.get(program_key)
        if alias is None:
            raise RuntimeError(f"program {program_key.digest} has no trace association")
        record = self._records[alias.trace_key]
        artifact = record.artifact
        if artifact is None:
            raise RuntimeError(f"trace {alias.trace_key.digest} has not been captured")
        policy = artifact.refresh_policy
        switched = self._last_replayed != alias.trace_key
        full = (
            (reset_batch and policy.full_on_batch_reset)
            or (switched and policy.full_on_graph_switch)
            or (
                policy.full_without_device_feedback
                and not (device_feedback_enabled and feedback_compatible)
            )
        )
        decision = RefreshDecision(
            full=full,
            page_table=policy.refresh_page_table_on_change and page_table_changed,
            fields=policy.every_replay,
        )
        refresh_inputs(artifact, decision)
        outputs = self._device.replay(artifact.handle, blocking=False)
        self._replay_counts[record.operation] += 1
        self._last_replayed = alias.trace_key
        return outputs

    # -- cleanup --------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Release traces, persistent inputs, workspaces and orphans; reopen the gate."""
        if self.state is TraceState.RELEASED:
            return

        def release() -> str:
            failures = self._release_everything()
            if failures:
                error = RuntimeError(
                    f"Failed to release {len(failures)} trace resource(s); call cleanup() again"
                )
                attach_cleanup_failures(error, failures)
                raise error
            count = len(self._records)
            if self.program_compiler.trace_active:
                self.program_compiler.deactivate()
            return f"{count} trace(s) released"

        self._lifecycle.transact("release", release, detail=lambda text: text)

"""The eager program registry: identity, compile-once, output contracts, the compile gate.

A program is identified by the SHA-256 of its signature's canonical key material
(`runtime.identity`). Compiling runs the program once against the bound KV cache, records its
output contract and releases the output. The compile gate (`PROGRAM_COMPILER_TABLE`) closes
when trace capture begins: after that, only already-compiled signatures may run, and every
attempt to compile a new one is refused and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import TypeVar

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from lifecycle.journal import Journal
from lifecycle.machine import MachineTable, StateMachine, StateSpec, TransitionSpec
from runtime.backends.base import Device
from runtime.identity import (
    KEY_SCHEMA_VERSION,
    PROGRAM_KEY_DOMAIN,
    ProgramKey,
    canonical_key_json,
    key_material_of,
)
from runtime.tensor_resources import TensorResourceOrphan, release_or_orphan, release_orphans

logger = logging.getLogger(__name__)


class CompilerState(StrEnum):
    """`ProgramCompiler`: the compile gate is open until trace capture begins."""

    OPEN = "open"
    CAPTURING = "capturing"
    ACTIVE = "active"
    RELEASED = "released"


PROGRAM_COMPILER_TABLE = MachineTable(
    name="program-compiler",
    states=(
        StateSpec(CompilerState.OPEN, "gate open: new signatures compile", ("compile",)),
        StateSpec(CompilerState.CAPTURING, "trace capture in progress: gate closed", ()),
        StateSpec(CompilerState.ACTIVE, "traces active: gate closed", ("cleanup",)),
        StateSpec(
            CompilerState.RELEASED,
            "terminal: registry released",
            (),
            refusal="{owner} has been released",
        ),
    ),
    transitions=(
        TransitionSpec("begin_capture", (CompilerState.OPEN,), CompilerState.CAPTURING),
        TransitionSpec("activate", (CompilerState.CAPTURING,), CompilerState.ACTIVE),
        TransitionSpec("rollback", (CompilerState.CAPTURING,), CompilerState.OPEN),
        TransitionSpec("deactivate", (CompilerState.ACTIVE,), CompilerState.OPEN),
        TransitionSpec(
            "release",
            (CompilerState.OPEN, CompilerState.CAPTURING, CompilerState.ACTIVE),
            CompilerState.RELEASED,
        ),
    ),
    initial=CompilerState.OPEN,
    terminal=frozenset({CompilerState.RELEASED}),
)


@attrs.frozen
class OutputSpec:
    """The output contract of a compiled program: what every later run must return."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str | None = None
    memory_config: str | None = None

    @classmethod
    def from_value(cls, value: object) -> OutputSpec:
        """The contract of an output value; a tuple is described by its first element."""
        if isinstance(value, tuple):
            if not value:
                raise ValueError("cannot derive an output contract from an empty tuple")
            value = value[0]
        if isinstance(value, torch.Tensor):
            return cls(shape=tuple(value.shape), dtype=value.dtype)
        raise TypeError(
            f"cannot derive an output contract from {type(value).__name__}; expected a "
            "torch.Tensor or a tuple starting with one"
        )


@attrs.frozen
class CompiledProgram:
    """One registered program: its key, the signature it came from, its output contract."""

    key: ProgramKey
    signature: object
    output_spec: OutputSpec


_Output = TypeVar("_Output")
"""What a compile run's `invoke` returns."""


def _no_owned(output: object) -> object:
    return output


class ProgramCompiler:
    """Owns eager program identity and readiness; the compile gate closes at capture."""

    def __init__(
        self,
        device: Device,
        bound_cache_context: Callable[[], object],
        *,
        journal: Journal | None = None,
        owner_name: str = "ProgramCompiler",
    ) -> None:
        if not callable(bound_cache_context):
            raise TypeError(
                f"bound_cache_context must be a callable returning the bound KV context, got "
                f"{type(bound_cache_context).__name__}"
            )
        self._device = device
        self._bound_cache_context = bound_cache_context
        self._lifecycle: StateMachine = PROGRAM_COMPILER_TABLE.build(
            owner=owner_name, journal=journal
        )
        self._programs: dict[ProgramKey, CompiledProgram] = {}
        self._keys: dict[str, ProgramKey] = {}
        self._orphans: list[TensorResourceOrphan] = []
        self._post_activation_rejections = 0

    # -- introspection ------------------------------------------------------------------------

    @property
    def device(self) -> Device:
        """The device programs run on (trace compilers must share it)."""
        return self._device

    @property
    def state(self) -> CompilerState:
        """open, capturing, active (gate closed) or released."""
        state = self._lifecycle.state
        assert isinstance(state, CompilerState)
        return state

    @property
    def trace_capture_in_progress(self) -> bool:
        """Whether trace capture is running (the gate is closed)."""
        return self.state is CompilerState.CAPTURING

    @property
    def trace_active(self) -> bool:
        """Whether traces are active (the gate is closed)."""
        return self.state is CompilerState.ACTIVE

    @property
    def gate_closed(self) -> bool:
        """Whether new signatures are refused (capture in progress or traces active)."""
        return self.state in (CompilerState.CAPTURING, CompilerState.ACTIVE)

    @property
    def compile_orphan_count(self) -> int:
        """Compile outputs whose release failed; compiling is blocked until `cleanup()`."""
        return len(self._orphans)

    @property
    def compiled_programs(self) -> tuple[CompiledProgram, ...]:
        """A snapshot, in compile order."""
        return tuple(self._programs.values())

    @property
    def post_activation_compile_rejections(self) -> int:
        """Attempts to compile an unseen signature after trace activation."""
        return self._post_activation_rejections

    # -- identity -------------------------------------------------------------------------------

    def key_for(self, signature: object) -> ProgramKey:
        """The program key of `signature`, memoised by canonical material (not identity)."""
        material = key_material_of(signature)
        text = canonical_key_json(PROGRAM_KEY_DOMAIN, KEY_SCHEMA_VERSION, material)
        key = self._keys.get(text)
        if key is None:
            key = ProgramKey.from_signature(signature)
            self._keys[text] = key
        return key

    def is_compiled(self, signature: object) -> bool:
        """Whether `signature` has a compiled program; a digest collision raises (2.16)."""
        return self.program_for(signature) is not None

    def program_for(self, signature: object) -> CompiledProgram | None:
        """The compiled program of `signature`, or None; a digest collision raises (2.16)."""
        key = self.key_for(signature)
        program = self._programs.get(key)
        if program is not None:
            self._check_collision(key, signature, program)
        return program

    @staticmethod
    def _check_collision(key: ProgramKey, signature: object, program: CompiledProgram) -> None:
        """Equal digests with different key material are a collision, never the same program."""
        if key_material_of(signature) != key_material_of(program.signature):
            raise RuntimeError(
                f"Program key collision for {key.digest}: {signature!r} differs from the "
                f"compiled {program.signature!r}"
            )

    def require_compiled(self, key: ProgramKey, signature: object | None = None) -> CompiledProgram:
        """The compiled program for `key`, or a `RuntimeError` naming what is missing."""
        if self.state is CompilerState.RELEASED:
            raise RuntimeError("ProgramCompiler has been released; construct a new executor")
        program = self._programs.get(key)
        if program is None:
            when = " after trace activation" if self.gate_closed else ""
            raise RuntimeError(
                f"Program key {key.digest} was not compiled{when}; warm up this signature "
                "before serving"
            )
        if signature is not None:
            self._check_collision(key, signature, program)
        return program

    def adopt(self, programs: Iterable[CompiledProgram]) -> int:
        """Register programs a released compiler of the same lane compiled, without running
        them again (a wake's warmup then finds them compiled). Only for backends whose
        programs are host metadata (`programs_hold_device_memory` false): a program is its
        key, signature and output contract. Legal while the gate is open; returns the count."""
        self._check_usable()
        if self.gate_closed:
            raise self._lifecycle.refusal("adopt", frozenset({CompilerState.OPEN}))
        count = 0
        for program in programs:
            if self._programs.setdefault(program.key, program) is program:
                count += 1
        return count

    # -- compilation ----------------------------------------------------------------------------

    def compile(
        self,
        signature: object,
        invoke: Callable[[object], _Output],
        *,
        output_spec: Callable[[_Output], OutputSpec] = OutputSpec.from_value,
        release_output: Callable[[_Output], object] = _no_owned,
        expected_output_spec: OutputSpec | None = None,
    ) -> CompiledProgram:
        """Compile `signature` once: run `invoke(context)`, keep its contract, free its output.

        Idempotent per key (the registered program comes back and `invoke` is not called).
        Refused after the gate closed, while compile outputs are orphaned, and before the KV
        cache is bound.
        """
        self._check_usable()
        key = self.key_for(signature)
        existing = self._programs.get(key)
        if existing is not None:
            return self._registered(key, signature, existing, expected_output_spec)
        self._check_gate_open(signature)
        context = self._bound_cache_context()
        if context is None:
            raise RuntimeError(
                "Paged KV cache must be allocated and bound before compilation; call "
                "allocate_kv_cache() first"
            )
        output = invoke(context)
        spec = self._contract_of(key, output, output_spec, release_output, expected_output_spec)
        program = CompiledProgram(key=key, signature=signature, output_spec=spec)
        self._programs[key] = program
        logger.debug("compiled program %s for %r", key.digest[:12], signature)
        return program

    def _check_usable(self) -> None:
        """Refuse every compile once released or while compile outputs are orphaned."""
        if self.state is CompilerState.RELEASED:
            raise self._lifecycle.refusal("compile", frozenset({CompilerState.OPEN}))
        if self._orphans:
            raise RuntimeError(
                "Cannot compile while unreleased compile outputs remain; clean up this "
                f"compiler ({len(self._orphans)} orphan(s))"
            )

    def _registered(
        self,
        key: ProgramKey,
        signature: object,
        program: CompiledProgram,
        expected_output_spec: OutputSpec | None,
    ) -> CompiledProgram:
        """The program already compiled under `key` (a collision or contract change raises)."""
        self._check_collision(key, signature, program)
        if expected_output_spec is not None and expected_output_spec != program.output_spec:
            raise ValueError(
                f"program {key.digest} is already compiled with a different output "
                f"contract: {program.output_spec} != {expected_output_spec}"
            )
        return program

    def _check_gate_open(self, signature: object) -> None:
        """A new signature compiles only while the gate is open (counted when refused)."""
        if self.state is CompilerState.CAPTURING:
            raise RuntimeError(f"Cannot compile {signature!r} while trace capture is in progress")
        if self.state is CompilerState.ACTIVE:
            self._post_activation_rejections += 1
            raise RuntimeError(
                f"Cannot compile {signature!r} after trace activation: the compile gate closed "
                "at capture. Add the signature to warmup coverage, or rerun with trace mode "
                "'none' for debugging."
            )

    def _contract_of(
        self,
        key: ProgramKey,
        output: _Output,
        output_spec: Callable[[_Output], OutputSpec],
        release_output: Callable[[_Output], object],
        expected_output_spec: OutputSpec | None,
    ) -> OutputSpec:
        """Read (and check) the contract of a compile run's `output`, then release what it owns.

        A failed release keeps the resources as orphans (retried by `cleanup()`) and blocks
        further compiles, whether or not reading the contract failed first.
        """
        owned = release_output(output)
        try:
            self._device.synchronize()
            spec = output_spec(output)
            if expected_output_spec is not None and spec != expected_output_spec:
                raise ValueError(
                    f"program {key.digest} produced {spec}, expected {expected_output_spec}"
                )
        except BaseException as error:
            attach_cleanup_failures(error, self._release(owned))
            raise
        failures = self._release(owned)
        if failures:
            release_error = RuntimeError(
                f"Failed to deallocate {len(failures)} compile output resource(s); nothing "
                "compiles until they are released: the owning executor's close() retries them"
            )
            attach_cleanup_failures(release_error, failures)
            raise release_error
        self._device.synchronize()
        return spec

    def _release(self, owned: object) -> list[BaseException]:
        """Release `owned`; what fails to release is kept as an orphan."""
        orphan, failures = release_or_orphan(owned, self._device)
        if orphan is not None:
            self._orphans.append(orphan)
        return failures

    # -- gate -----------------------------------------------------------------------------------

    def begin_capture(self) -> None:
        """Close the gate: trace capture starts."""
        self._lifecycle.fire("begin_capture")

    def activate(self) -> None:
        """Keep the gate closed: traces are active (or a failed capture left resources)."""
        self._lifecycle.fire("activate")

    def rollback(self) -> None:
        """Reopen the gate after a capture that failed and released everything."""
        self._lifecycle.fire("rollback")

    def deactivate(self) -> None:
        """Reopen the gate after every trace was released."""
        self._lifecycle.fire("deactivate")

    # -- cleanup --------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Retry orphaned compile outputs, then release the registry. Idempotent."""
        if self.state is CompilerState.RELEASED:
            return

        def release() -> str:
            failures = release_orphans(self._orphans)
            if failures:
                error = RuntimeError(
                    f"Failed to release {len(failures)} compile output resource(s); call "
                    "cleanup() again"
                )
                attach_cleanup_failures(error, failures)
                raise error
            count = len(self._programs)
            self._keys.clear()
            return f"{count} program(s) released"

        self._lifecycle.transact("release", release, detail=lambda text: text)

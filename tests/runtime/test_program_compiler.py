"""ProgramCompiler: identity, idempotent compile, output contracts, the compile gate."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from lifecycle import TerminalError
from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.program_compiler import CompilerState, OutputSpec, ProgramCompiler


@attrs.frozen
class Sig:
    mode: str
    batch: Any
    note: str = attrs.field(default="", eq=False)

    def key_material(self) -> tuple[Any, ...]:
        return (("mode", self.mode), ("batch", self.batch))


CONTEXT = object()


def make(device: Any = None, context: Any = CONTEXT) -> tuple[ProgramCompiler, Any]:
    device = device or TorchDevice("cpu")
    return ProgramCompiler(device, lambda: context), device


def test_key_for_uses_canonical_material_not_identity() -> None:
    compiler, _ = make()
    a = compiler.key_for(Sig("decode", 32, note="a"))
    b = compiler.key_for(Sig("decode", 32, note="b"))
    assert a is b
    keys = {compiler.key_for(Sig("decode", value)) for value in (True, 1, 1.0, "1")}
    assert len(keys) == 4


def test_compile_is_idempotent_and_records_contract() -> None:
    compiler, device = make()
    calls: list[Any] = []

    def invoke(context: Any) -> Any:
        calls.append(context)
        out = device.allocate((2, 3), torch.float32)
        return out

    first = compiler.compile(Sig("decode", 32), invoke)
    assert calls == [CONTEXT]
    assert first.output_spec == OutputSpec(shape=(2, 3), dtype=torch.float32)
    assert device.live_allocations == 0  # compile output released
    again = compiler.compile(Sig("decode", 32, note="other"), invoke)
    assert again is first and calls == [CONTEXT]
    assert compiler.compiled_programs == (first,)
    assert compiler.require_compiled(first.key) is first


def test_expected_output_contract_mismatch() -> None:
    compiler, _ = make()
    compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(2))
    with pytest.raises(ValueError, match="different output contract"):
        compiler.compile(
            Sig("decode", 1),
            lambda ctx: torch.zeros(2),
            expected_output_spec=OutputSpec(shape=(3,), dtype=torch.float32),
        )


def test_compile_requires_bound_cache() -> None:
    compiler, _ = make(context=None)
    with pytest.raises(RuntimeError, match="Paged KV cache must be allocated and bound"):
        compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))


def test_gate_closes_at_capture_and_counts_rejections() -> None:
    compiler, _ = make()
    known = compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))
    compiler.begin_capture()
    assert compiler.trace_capture_in_progress and compiler.gate_closed
    with pytest.raises(RuntimeError, match="while trace capture is in progress"):
        compiler.compile(Sig("decode", 2), lambda ctx: torch.zeros(1))
    assert compiler.post_activation_compile_rejections == 0
    compiler.activate()
    with pytest.raises(RuntimeError, match="after trace activation"):
        compiler.compile(Sig("decode", 2), lambda ctx: torch.zeros(1))
    assert compiler.post_activation_compile_rejections == 1
    # An already-compiled signature still resolves (intentional eager call).
    assert compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1)) is known
    with pytest.raises(RuntimeError, match="was not compiled after trace activation"):
        compiler.require_compiled(compiler.key_for(Sig("decode", 3)))
    compiler.deactivate()
    assert compiler.state is CompilerState.OPEN


def test_signature_collision_is_detected() -> None:
    compiler, _ = make()
    program = compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))
    with pytest.raises(RuntimeError, match="collision"):
        compiler.require_compiled(program.key, Sig("decode", 2))


def test_failed_release_orphans_block_compile_until_cleanup() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.nth("deallocate", 1))
    compiler, _ = make(device=device)
    with pytest.raises(RuntimeError, match="Failed to deallocate 1 compile output") as caught:
        compiler.compile(Sig("decode", 1), lambda ctx: device.allocate((1,), torch.float32))
    assert isinstance(caught.value.cleanup_failures[0], InjectedFault)  # type: ignore[attr-defined]
    assert compiler.compile_orphan_count == 1
    with pytest.raises(RuntimeError, match="unreleased compile outputs remain"):
        compiler.compile(Sig("decode", 2), lambda ctx: torch.zeros(1))
    compiler.cleanup()
    assert inner.live_allocations == 0
    assert compiler.state is CompilerState.RELEASED
    assert device.deallocated_twice == 0


def test_cleanup_is_idempotent_and_terminal() -> None:
    compiler, _ = make()
    program = compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))
    compiler.cleanup()
    compiler.cleanup()
    with pytest.raises(TerminalError, match="has been released"):
        compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))
    with pytest.raises(RuntimeError, match="has been released"):
        compiler.require_compiled(program.key)


def test_output_spec_from_value() -> None:
    assert OutputSpec.from_value((torch.zeros(2, 2, dtype=torch.int64), None)).shape == (2, 2)
    with pytest.raises(ValueError, match="empty tuple"):
        OutputSpec.from_value(())
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        OutputSpec.from_value("text")


def test_equal_digest_with_different_material_is_a_key_collision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reference 2.16: a digest collision is an error, never the already-compiled program.
    from runtime import program_compiler as module
    from runtime.identity import ProgramKey

    compiler, _ = make()
    monkeypatch.setattr(
        module.ProgramKey, "from_signature", classmethod(lambda cls, sig: ProgramKey("0" * 64))
    )
    calls: list[int] = []
    first = compiler.compile(Sig("decode", 1), lambda ctx: torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"Program key collision for 0{64}"):
        compiler.compile(Sig("decode", 2), lambda ctx: calls.append(1) or torch.zeros(1))
    assert calls == []  # refused before running anything
    with pytest.raises(RuntimeError, match="Program key collision"):
        compiler.is_compiled(Sig("decode", 2))
    assert compiler.is_compiled(Sig("decode", 1))
    assert compiler.compiled_programs == (first,)

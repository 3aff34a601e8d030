"""A toy traced program over a real CPU device: y = x * w + step."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from runtime.backends.base import Device
from runtime.program_compiler import ProgramCompiler
from runtime.trace_compiler import InputRefreshPolicy, PersistentInputs, TraceCapturePlan

DEFAULT_POLICY = InputRefreshPolicy()


@attrs.frozen
class ToySignature:
    operation: str
    batch: int

    def key_material(self) -> tuple[Any, ...]:
        return (("operation", self.operation), ("batch", self.batch))


def compile_toy(compiler: ProgramCompiler, operation: str, batch: int) -> Any:
    signature = ToySignature(operation, batch)
    return compiler.compile(signature, lambda ctx: torch.zeros(batch)).key, signature


def toy_plan(
    device: Device,
    program_key: Any,
    signature: ToySignature,
    *,
    events: list[str] | None = None,
    policy: InputRefreshPolicy = DEFAULT_POLICY,
) -> TraceCapturePlan:
    log = events if events is not None else []

    def prepare_inputs() -> dict[str, torch.Tensor]:
        log.append(f"prepare:{signature.operation}")
        return {
            "x": device.allocate((signature.batch,), torch.float32),
            "w": device.allocate((signature.batch,), torch.float32, fill=2.0),
        }

    def capture(persistent: PersistentInputs) -> torch.Tensor:
        log.append(f"capture:{signature.operation}")
        return persistent.values["x"] * persistent.values["w"] + 1.0

    return TraceCapturePlan(
        program_key=program_key,
        trace_signature=signature,
        operation=signature.operation,  # type: ignore[arg-type]
        prepare_inputs=prepare_inputs,
        capture=capture,
        refresh_policy=policy,
    )

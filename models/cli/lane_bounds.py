"""`--lanes` no larger than host memory holds, checked before any lane starts.

A process lane is a worker process that imports torch and loads its own copy of the weights;
an in-process lane loads its own copy of the weights here. On the CPU both come out of host
memory, so a lane count the host cannot hold is refused with the arithmetic instead of
spawning workers for minutes until the kernel kills them. A worker's base cost is this
process's own resident memory at the check (the same interpreter with torch and the runtime
imported, before any weights load); the weights are the model's parameter count at `--dtype`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from models.cli.errors import UsageError

if TYPE_CHECKING:  # only named in annotations: `models.cli` must import without torch
    from models.decoder.config import DecoderArgs

WEIGHT_ITEM_BYTES = {"float32": 4, "bfloat16": 2}


def weight_bytes(model: DecoderArgs, dtype: str) -> int:
    """The model's parameters at `dtype` (its family's count: `DecoderArgs.parameter_count`)."""
    return model.parameter_count() * WEIGHT_ITEM_BYTES.get(dtype, 4)


def process_base_bytes() -> int:
    """This process's peak resident memory (what a fresh worker costs before its weights)."""
    from runtime.backends.memory import peak_resident_bytes

    return peak_resident_bytes()


def check_lane_memory(args: argparse.Namespace, model: DecoderArgs) -> None:
    """Refuse `--lanes` whose workers and weights exceed the host's available memory."""
    lanes = int(getattr(args, "lanes", 1))
    if lanes == 1 or args.device != "cpu":
        return
    from runtime.backends.memory import available_memory_bytes, format_bytes

    available = available_memory_bytes("cpu")
    if available is None:
        return
    weights = weight_bytes(model, args.dtype)
    process = args.lane_transport == "process"
    per_lane = weights + (process_base_bytes() if process else 0)
    if lanes * per_lane <= available:
        return
    what = (
        f"a worker process of about {format_bytes(per_lane)} (this interpreter with torch, "
        f"{format_bytes(per_lane - weights)}, plus the weights, {format_bytes(weights)})"
        if process
        else f"its own copy of the weights ({format_bytes(weights)})"
    )
    most = max(available // per_lane, 1)
    raise UsageError(
        f"--lanes {lanes} is invalid: each {args.lane_transport} lane of {args.model} is {what}, "
        f"so {lanes} lanes need {format_bytes(lanes * per_lane)} and this host has "
        f"{format_bytes(available)} available; allowed is --lanes 1..{most} (with --max-batch "
        f"a multiple of it)"
    )

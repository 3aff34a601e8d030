"""The decode outputs `DecoderVLLMModel` hands an engine between its read calls.

Why a type of their own: an engine that skips a step of the read sequence still hands the
object back, and the facade knows which step it is at (and releases the step's device
resources) from the object alone.
"""

from __future__ import annotations

import attrs


@attrs.define(eq=False)
class DecodeOutput:
    """A decode step's raw output, not yet read (`decode_forward(read_from_device=False)`).

    It is deliberately not a tensor: an engine hands it back to `read_decode_output` or
    `process_decode_output_host`, which release the step's device resources.
    """

    raw: object
    is_tokens: bool
    read: bool = False


@attrs.define(eq=False)
class HostDecodeOutput:
    """A decode step's host copy; valid once the events `read_decode_output` returned completed."""

    host: object
    is_tokens: bool
    processed: bool = False

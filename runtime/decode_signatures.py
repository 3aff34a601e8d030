"""The decode signature: one frozen value names both the decode program and its trace.

Decode always runs the full lane (`batch_size` is the lane capacity, never the active row
count) over the normalized page-table width, so the signature changes only with the sampling
path, device position feedback and the sampling features that change the compiled program.
A trace replays exactly one program, so one `DecodeSignature` serves both registries: its
`ProgramKey` and `TraceKey` are digests of the same key material in two domains (as one
batch descriptor keys every graph table of a dispatcher).
"""

from __future__ import annotations

import attrs

from runtime.identity import KeyMaterial, KeyPairs
from runtime.sampling import SamplingPath
from runtime.signature_fields import (
    bool_field,
    check_sampling_flags,
    positive_field,
    sampling_path_field,
)


@attrs.frozen(cache_hash=True)
class DecodeSignature:
    """What a decode program and its trace depend on: lane shape, widths, sampling path.

    Frozen and hashable (the hash is computed once): the key a `DecodeDispatcher` looks a
    step's program and trace up by, in one dict lookup.
    """

    batch_size: int = attrs.field(validator=positive_field)
    page_table_width: int = attrs.field(validator=positive_field)
    sampling_path: SamplingPath = attrs.field(validator=sampling_path_field)
    device_feedback: bool = attrs.field(validator=bool_field)
    penalties_enabled: bool = attrs.field(default=False, validator=bool_field)
    logprobs_enabled: bool = attrs.field(default=False, validator=bool_field)

    def __attrs_post_init__(self) -> None:
        check_sampling_flags(self.sampling_path, self.penalties_enabled, self.logprobs_enabled)
        if self.device_feedback and self.sampling_path == "logits":
            raise ValueError(
                "device_feedback=True feeds sampled tokens back on device and needs a sampled "
                "path (argmax or topk), got sampling_path 'logits'"
            )

    @classmethod
    def for_program(cls, program: DecodeSignature) -> DecodeSignature:
        """The signature of the trace that replays `program`: the program's own."""
        return program

    def key_material(self) -> KeyPairs:
        pairs: list[tuple[str, KeyMaterial]] = [
            ("operation", "decode"),
            ("batch_size", self.batch_size),
            ("page_table_width", self.page_table_width),
            ("sampling_path", self.sampling_path),
            ("device_feedback", self.device_feedback),
        ]
        if self.penalties_enabled:
            pairs.append(("penalties_enabled", True))
        if self.logprobs_enabled:
            pairs.append(("logprobs_enabled", True))
        return tuple(pairs)

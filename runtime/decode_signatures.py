"""Decode identities: program and trace signatures of one decode step.

Decode always runs the full lane (`batch_size` is the lane capacity, never the active row
count) over the normalized page-table width, so the identity changes only with the sampling
path, device position feedback and the sampling features that change the compiled program.
"""

from __future__ import annotations

from typing import TypeGuard

import attrs

from runtime.identity import KeyMaterial
from runtime.prefill.signatures import KeyPairs, check_sampling_flags, check_sampling_path
from runtime.sampling import SamplingPath


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be bool, got {type(value).__name__} {value!r}")


def _decode_key_material(
    batch_size: int,
    page_table_width: int,
    sampling_path: SamplingPath,
    device_feedback: bool,
    penalties_enabled: bool,
    logprobs_enabled: bool,
) -> KeyPairs:
    pairs: list[tuple[str, KeyMaterial]] = [
        ("operation", "decode"),
        ("batch_size", batch_size),
        ("page_table_width", page_table_width),
        ("sampling_path", sampling_path),
        ("device_feedback", device_feedback),
    ]
    if penalties_enabled:
        pairs.append(("penalties_enabled", True))
    if logprobs_enabled:
        pairs.append(("logprobs_enabled", True))
    return tuple(pairs)


def _check_decode(
    sampling_path: SamplingPath,
    device_feedback: bool,
    penalties_enabled: bool,
    logprobs_enabled: bool,
) -> None:
    check_sampling_flags(sampling_path, penalties_enabled, logprobs_enabled)
    if device_feedback and sampling_path == "logits":
        raise ValueError(
            "device_feedback=True feeds sampled tokens back on device and needs a sampled path "
            "(argmax or topk), got sampling_path 'logits'"
        )


@attrs.frozen
class DecodeProgramSignature:
    """Identity of the eager decode program of one lane."""

    batch_size: int = attrs.field(validator=_positive)
    page_table_width: int = attrs.field(validator=_positive)
    sampling_path: SamplingPath = attrs.field(validator=check_sampling_path)
    device_feedback: bool = attrs.field(validator=_flag)
    penalties_enabled: bool = attrs.field(default=False, validator=_flag)
    logprobs_enabled: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self) -> None:
        _check_decode(
            self.sampling_path, self.device_feedback, self.penalties_enabled, self.logprobs_enabled
        )

    def key_material(self) -> KeyPairs:
        return _decode_key_material(
            self.batch_size,
            self.page_table_width,
            self.sampling_path,
            self.device_feedback,
            self.penalties_enabled,
            self.logprobs_enabled,
        )


@attrs.frozen
class DecodeTraceSignature:
    """Identity of the decode trace of one lane; same key material as its program."""

    batch_size: int = attrs.field(validator=_positive)
    page_table_width: int = attrs.field(validator=_positive)
    sampling_path: SamplingPath = attrs.field(validator=check_sampling_path)
    device_feedback: bool = attrs.field(validator=_flag)
    penalties_enabled: bool = attrs.field(default=False, validator=_flag)
    logprobs_enabled: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self) -> None:
        _check_decode(
            self.sampling_path, self.device_feedback, self.penalties_enabled, self.logprobs_enabled
        )

    @classmethod
    def for_program(cls, program: DecodeProgramSignature) -> DecodeTraceSignature:
        """The trace that replays `program`."""
        return cls(**attrs.asdict(program, recurse=False))

    def key_material(self) -> KeyPairs:
        return _decode_key_material(
            self.batch_size,
            self.page_table_width,
            self.sampling_path,
            self.device_feedback,
            self.penalties_enabled,
            self.logprobs_enabled,
        )

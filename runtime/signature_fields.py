"""attrs field validators shared by the frozen signatures of every operation.

A signature is built at a public boundary from caller-derived geometry, so its fields check
themselves once, here, with the texts tests and users match (`X must be bool`, `X must be a
positive integer`).
"""

from __future__ import annotations

from typing import get_args

import attrs

from runtime.identity import KeyPairs
from runtime.sampling import SamplingPath
from runtime.validation import is_int, plain_bool, positive_int

SAMPLING_PATHS: tuple[SamplingPath, ...] = get_args(SamplingPath)


def positive_field(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """attrs validator: an int >= 1."""
    positive_int(attribute.name, value)


def optional_positive_field(
    instance: object, attribute: attrs.Attribute[int | None], value: object
) -> None:
    """attrs validator: None or an int >= 1."""
    if value is not None and (not is_int(value) or value <= 0):
        raise ValueError(f"{attribute.name} must be None or a positive integer, got {value!r}")


def bool_field(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    """attrs validator: exactly True or False (1 and "yes" are refused)."""
    plain_bool(attribute.name, value)


def sampling_path_field(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    """attrs validator: `value` is a `SamplingPath`."""
    if value not in SAMPLING_PATHS:
        raise ValueError(f"{attribute.name} must be one of {SAMPLING_PATHS}, got {value!r}")


def check_sampling_flags(
    sampling_path: str, penalties_enabled: bool, logprobs_enabled: bool
) -> None:
    """Penalties and log probabilities exist only on a sampled path, never on `logits`."""
    if sampling_path == "logits" and (penalties_enabled or logprobs_enabled):
        raise ValueError(
            f"penalties_enabled={penalties_enabled} and logprobs_enabled={logprobs_enabled} "
            f"need a sampled path (argmax or topk), got sampling_path 'logits'"
        )


def sampling_flag_pairs(penalties_enabled: bool, logprobs_enabled: bool) -> KeyPairs:
    """Key material of the optional sampling features: present only when enabled."""
    pairs: KeyPairs = ()
    if penalties_enabled:
        pairs += (("penalties_enabled", True),)
    if logprobs_enabled:
        pairs += (("logprobs_enabled", True),)
    return pairs

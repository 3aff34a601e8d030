"""How compiled programs and traces are identified: signatures, key material, keys.

The vocabulary, used the same way everywhere:

- a *signature* is a frozen value naming what a compiled artifact depends on (one type per
  operation: `DecodeSignature`, `PrefillSignature` and its trace grain
  `PrefillTraceSignature`); it exposes its *key material*, `(name, value)` pairs;
- a *key* is the SHA-256 digest of that material in one domain: `ProgramKey` in the program
  registry, `TraceKey` in the trace registry. The same signature gives both;
- a *fingerprint* identifies nothing compiled: it is the coarser tuple that decides when
  several traces share one capture or one post-processing workspace (the coverage
  manifest's `schema_fingerprint` and `workspace_fingerprint`).

Registries key their entries by digest, not by object identity, so equal geometry always maps
to the same compiled program or trace. The encoding is type tagged (`True`, `1`, `1.0` and
`"1"` give four different keys) and accepts only immutable, unambiguous values, so a key can
never depend on a mutable or device object. The digests reproduce the reference runtime's
digests byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from enum import Enum
from typing import TypeAlias

import attrs

PROGRAM_KEY_DOMAIN = "tttv2.llm-runtime.program"
TRACE_KEY_DOMAIN = "tttv2.llm-runtime.trace"
KEY_SCHEMA_VERSION = 1

KeyMaterial: TypeAlias = bool | int | float | str | Enum | tuple["KeyMaterial", ...] | None
"""Values allowed in a signature's key material (str-valued Enums only; floats finite)."""

KeyPairs: TypeAlias = tuple[tuple[str, KeyMaterial], ...]
"""A signature's key material: named values, in the order the digest hashes them."""

TaggedMaterial: TypeAlias = tuple["str | bool | list[TaggedMaterial]", ...]
"""The type-tagged form of key material, as it is JSON-encoded."""

_MISSING = object()
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
_ALLOWED = "None, bool, int, finite float, str, a str-valued Enum or a tuple of those"


def tag_key_material(value: object) -> TaggedMaterial:
    """Return the type-tagged form of `value`, so values of different types never collide.

    Raises `TypeError` for anything outside `KeyMaterial` and `ValueError` for non-finite
    floats.
    """
    if value is None:
        return ("null",)
    if isinstance(value, Enum):
        if not isinstance(value.value, str):
            raise TypeError(
                f"key material may only contain {_ALLOWED}; got enum {value!r} whose value "
                f"is {type(value.value).__name__}"
            )
        return ("enum", value.value)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", str(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"key material floats must be finite, got {value!r}")
        return ("float", value.hex())
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, tuple):
        return ("tuple", [tag_key_material(item) for item in value])
    raise TypeError(
        f"key material may only contain {_ALLOWED}; got {type(value).__name__} {value!r:.80}"
    )


def key_material_of(signature: object) -> tuple[KeyMaterial, ...]:
    """Read `signature.key_material`: an attribute or a zero-argument method giving a tuple."""
    material: object = getattr(signature, "key_material", _MISSING)
    if material is _MISSING:
        raise TypeError(
            f"signature must expose key_material (an attribute or a zero-argument method); "
            f"got {type(signature).__name__}"
        )
    if callable(material):
        material = material()
    if not isinstance(material, tuple):
        raise TypeError(
            f"{type(signature).__name__}.key_material must be a tuple, "
            f"got {type(material).__name__}"
        )
    return material


def key_pairs_of(signature: object) -> tuple[tuple[str, KeyMaterial], ...]:
    """A signature's key material as `(field name, value)` pairs (for messages and counts).

    Raises `TypeError` when the material is not a tuple of named pairs.
    """
    pairs: list[tuple[str, KeyMaterial]] = []
    for item in key_material_of(signature):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"{type(signature).__name__}.key_material is not a tuple of (name, value) "
                f"pairs: {item!r}"
            )
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def canonical_key_json(domain: str, schema_version: int, material: tuple[KeyMaterial, ...]) -> str:
    """The canonical ASCII JSON text that a digest hashes: domain, schema version, material."""
    if not isinstance(domain, str) or not domain:
        raise ValueError(f"domain must be a non-empty string, got {domain!r}")
    if isinstance(schema_version, bool) or not isinstance(schema_version, int):
        raise ValueError(f"schema_version must be an int, got {schema_version!r}")
    payload = (("domain", domain), ("schema_version", schema_version), ("signature", material))
    return json.dumps(tag_key_material(payload), ensure_ascii=True, separators=(",", ":"))


def signature_digest(domain: str, schema_version: int, signature: object) -> str:
    """Lowercase SHA-256 hex digest of a signature's canonical key material in `domain`."""
    text = canonical_key_json(domain, schema_version, key_material_of(signature))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_digest(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or _DIGEST_PATTERN.fullmatch(value) is None:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a full lowercase SHA-256 "
            f"hexadecimal digest (64 characters 0-9a-f), got {value!r}"
        )


@attrs.frozen
class ProgramKey:
    """Identity of one eager program: the digest of its signature in the program domain."""

    digest: str = attrs.field(validator=_check_digest)

    @classmethod
    def from_signature(cls, signature: object) -> ProgramKey:
        return cls(signature_digest(PROGRAM_KEY_DOMAIN, KEY_SCHEMA_VERSION, signature))


@attrs.frozen
class TraceKey:
    """Identity of one captured trace: the digest of its signature in the trace domain."""

    digest: str = attrs.field(validator=_check_digest)

    @classmethod
    def from_signature(cls, signature: object) -> TraceKey:
        return cls(signature_digest(TRACE_KEY_DOMAIN, KEY_SCHEMA_VERSION, signature))

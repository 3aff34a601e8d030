"""Canonical key material and digests: type tagging, allowed types, golden reference digests."""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.identity import (
    KEY_SCHEMA_VERSION,
    PROGRAM_KEY_DOMAIN,
    TRACE_KEY_DOMAIN,
    ProgramKey,
    TraceKey,
    canonical_key_json,
    key_material_of,
    signature_digest,
    tag_key_material,
)

GOLDEN_MATERIAL = (("mode", "decode"), ("batch", 32), ("optional", None))
GOLDEN_PROGRAM = "c807e5574b34f3f83d386fc441580d1ae499aa534c8a426541dbeafdefa2ffdb"
GOLDEN_TRACE = "27bea60de6b500f448e680d3423ad62efbd01294c254524e37c114ff8b5dff35"


class Mode(Enum):
    DECODE = "decode"
    ONE = "1"


class Level(Enum):
    LOW = 1


@attrs.frozen
class MethodSignature:
    material: Any

    def key_material(self) -> Any:
        return self.material


@attrs.frozen
class AttributeSignature:
    key_material: Any


def program_digest(material: Any) -> str:
    return signature_digest(PROGRAM_KEY_DOMAIN, KEY_SCHEMA_VERSION, MethodSignature(material))


def test_golden_program_and_trace_digests_reproduce() -> None:
    signature = MethodSignature(GOLDEN_MATERIAL)
    assert signature_digest(PROGRAM_KEY_DOMAIN, 1, signature) == GOLDEN_PROGRAM
    assert signature_digest(TRACE_KEY_DOMAIN, 1, signature) == GOLDEN_TRACE
    assert ProgramKey.from_signature(signature) == ProgramKey(GOLDEN_PROGRAM)
    assert TraceKey.from_signature(signature) == TraceKey(GOLDEN_TRACE)


def test_canonical_json_is_compact_tagged_ascii() -> None:
    text = canonical_key_json(PROGRAM_KEY_DOMAIN, 1, (("n", 1), ("x", "é")))
    assert text.startswith('["tuple",[["tuple",[["str","domain"],["str","tttv2.llm-runtime')
    assert '["int","1"]' in text
    assert " " not in text
    assert text.isascii() and "\\u00e9" in text


def test_key_material_may_be_an_attribute_or_a_method() -> None:
    by_method = signature_digest(PROGRAM_KEY_DOMAIN, 1, MethodSignature(GOLDEN_MATERIAL))
    by_attribute = signature_digest(PROGRAM_KEY_DOMAIN, 1, AttributeSignature(GOLDEN_MATERIAL))
    assert by_method == by_attribute == GOLDEN_PROGRAM


def test_true_one_float_one_and_string_one_give_four_keys() -> None:
    values = (True, 1, 1.0, "1", Mode.ONE, None, "null", 0.0, -0.0, False, 0)
    digests = {program_digest((("value", value),)) for value in values}
    assert len(digests) == len(values)


def test_schema_version_and_domain_separate_keys() -> None:
    signature = MethodSignature(GOLDEN_MATERIAL)
    assert signature_digest(PROGRAM_KEY_DOMAIN, 2, signature) != GOLDEN_PROGRAM
    assert signature_digest("other", 1, signature) not in (GOLDEN_PROGRAM, GOLDEN_TRACE)


def test_str_enum_tags_as_enum_value() -> None:
    assert tag_key_material(Mode.DECODE) == ("enum", "decode")
    assert tag_key_material(1.5) == ("float", (1.5).hex())
    assert tag_key_material(-7) == ("int", "-7")
    assert tag_key_material(("a", None)) == ("tuple", [("str", "a"), ("null",)])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, ("ok", (1, math.nan))])
def test_non_finite_floats_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="finite"):
        tag_key_material(value)
    with pytest.raises(ValueError, match="finite"):
        program_digest((("value", value),))


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1},
        [1, 2],
        torch.tensor([1]),
        {1},
        b"1",
        object(),
        Level.LOW,
        (1, [2]),
        ((("nested", {"x": 1}),),),
    ],
    ids=["dict", "list", "tensor", "set", "bytes", "object", "int-enum", "nested-list", "deep"],
)
def test_other_types_are_rejected_as_key_material(value: object) -> None:
    with pytest.raises(TypeError, match="key material"):
        tag_key_material(value)
    with pytest.raises(TypeError, match="key material"):
        program_digest((("value", value),))


def test_signature_without_tuple_key_material_is_rejected() -> None:
    with pytest.raises(TypeError, match="must expose key_material"):
        signature_digest(PROGRAM_KEY_DOMAIN, 1, object())
    with pytest.raises(TypeError, match="must be a tuple"):
        signature_digest(PROGRAM_KEY_DOMAIN, 1, MethodSignature([("a", 1)]))
    assert key_material_of(AttributeSignature(())) == ()


@pytest.mark.parametrize(
    ("domain", "version", "fragment"),
    [("", 1, "domain must be"), (3, 1, "domain must be"), ("d", True, "schema_version")],
)
def test_domain_and_schema_version_are_validated(
    domain: object, version: object, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        canonical_key_json(domain, version, ())  # type: ignore[arg-type]


@pytest.mark.parametrize("key_type", [ProgramKey, TraceKey])
@pytest.mark.parametrize(
    "digest",
    [GOLDEN_PROGRAM.upper(), GOLDEN_PROGRAM[:-1], GOLDEN_PROGRAM + "0", "g" * 64, 12, None],
)
def test_key_digest_must_be_full_lowercase_sha256(key_type: type, digest: object) -> None:
    with pytest.raises(ValueError, match="full lowercase SHA-256 hexadecimal digest"):
        key_type(digest)


def test_keys_compare_by_digest_and_are_frozen() -> None:
    key = ProgramKey(GOLDEN_PROGRAM)
    assert key == ProgramKey(GOLDEN_PROGRAM) and hash(key) == hash(ProgramKey(GOLDEN_PROGRAM))
    assert key != ProgramKey(GOLDEN_TRACE)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        key.digest = GOLDEN_TRACE  # type: ignore[misc]


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(Mode),
)
allowed_material = st.recursive(_leaves, lambda inner: st.tuples(inner, inner), max_leaves=12)
_forbidden = st.one_of(
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.just(Level.LOW),
    st.binary(max_size=2),
    st.builds(torch.zeros, st.integers(0, 2)),
)


def _untag(value: object) -> object:
    """Tuples become lists, as JSON decoding gives them back."""
    if isinstance(value, tuple | list):
        return [_untag(item) for item in value]
    return value


@given(allowed_material)
def test_allowed_material_encodes_injectively_and_deterministically(material: Any) -> None:
    text = canonical_key_json(PROGRAM_KEY_DOMAIN, 1, (material,))
    # The JSON decodes back to the tagged tree: equal text means equal typed material.
    assert json.loads(text)[1][2][1][1][1][0] == _untag(tag_key_material(material))
    digest = program_digest((material,))
    assert digest == program_digest((material,))
    assert ProgramKey(digest).digest == digest


@given(allowed_material, allowed_material)
def test_distinct_typed_material_gives_distinct_digests(left: object, right: object) -> None:
    if tag_key_material(left) != tag_key_material(right):
        assert program_digest((left,)) != program_digest((right,))
    else:
        assert program_digest((left,)) == program_digest((right,))


@given(allowed_material, _forbidden, st.booleans())
def test_a_forbidden_leaf_anywhere_is_rejected(
    material: object, forbidden: object, left: bool
) -> None:
    tree = (forbidden, material) if left else (material, (material, forbidden))
    with pytest.raises(TypeError, match="key material"):
        program_digest(tree)

"""One signature type per operation: a decode signature keys its program and its trace."""

from __future__ import annotations

from runtime.decode_signatures import DecodeSignature
from runtime.identity import (
    KEY_SCHEMA_VERSION,
    PROGRAM_KEY_DOMAIN,
    TRACE_KEY_DOMAIN,
    ProgramKey,
    TraceKey,
    signature_digest,
)


def test_one_decode_signature_gives_the_program_key_and_the_trace_key() -> None:
    signature = DecodeSignature(32, 104, "topk", False, penalties_enabled=True)
    assert DecodeSignature.for_program(signature) is signature
    program = ProgramKey.from_signature(signature)
    trace = TraceKey.from_signature(signature)
    assert program.digest == signature_digest(PROGRAM_KEY_DOMAIN, KEY_SCHEMA_VERSION, signature)
    assert trace.digest == signature_digest(TRACE_KEY_DOMAIN, KEY_SCHEMA_VERSION, signature)
    assert program.digest != trace.digest  # one material, two domains


def test_equal_decode_signatures_share_both_keys() -> None:
    a = DecodeSignature(8, 16, "argmax", True)
    b = DecodeSignature(8, 16, "argmax", True)
    assert a == b and hash(a) == hash(b)
    assert ProgramKey.from_signature(a) == ProgramKey.from_signature(b)
    assert TraceKey.from_signature(a) == TraceKey.from_signature(b)
    assert ProgramKey.from_signature(a) != ProgramKey.from_signature(
        DecodeSignature(8, 16, "argmax", False)
    )

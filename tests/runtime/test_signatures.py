"""Prefill and decode identities: key material, golden digests, padded-geometry sharing."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from runtime.decode_signatures import DecodeSignature
from runtime.identity import ProgramKey, TraceKey
from runtime.prefill.request import PrefillRequest
from runtime.prefill.signatures import (
    PrefillSignature,
    PrefillTraceSignature,
    PreparedPrefill,
    build_program_signatures,
    build_trace_signature,
    capture_schema_fingerprint,
    prefill_variant,
    workspace_fingerprint,
)
from runtime.sampling import SamplingPath
from tests.runtime.test_prefill_plan import plan

GOLDEN_PREFILL_PROGRAM = "1fb47a00a66b522391f24ce966d44cbfe133b2623f5e2f7ae03cf2c31f6a42c5"
GOLDEN_PREFILL_TRACE = "4b71c7b3d465fe51a661a621c45b7952f7cc7028adb171d7e9b17161b07113b0"


@pytest.fixture(autouse=True)
def _batching_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISABLE_BATCHED_PREFILL", raising=False)


def only(requests: tuple[PrefillRequest, ...]) -> PrefillRequest:
    (request,) = requests
    return request


def prepared(
    request: PrefillRequest,
    path: SamplingPath = "logits",
    *,
    trace: bool = True,
    **flags: bool,
) -> PreparedPrefill:
    return PreparedPrefill(
        request=request,
        sampling_params=None if path == "logits" else {"temperature": 0.0},
        sampling_path=path,
        program_signatures=build_program_signatures(
            request, path, static_q128_topk_supported=False, **flags
        ),
        trace_signature=build_trace_signature(
            request, trace_enabled=trace, sampling_path=path, **flags
        ),
    )


def test_golden_prefill_program_digest() -> None:
    signature = PrefillSignature("regular-batched", 16, 128, 32, None, "topk")
    assert signature.key_material() == (
        ("operation_variant", "regular-batched"),
        ("padded_batch_size", 16),
        ("invocation_sequence_length", 128),
        ("page_table_width", 32),
        ("chunk_page_table_width", None),
        ("sampling_path", "topk"),
        ("last_token_tile_start", None),
    )
    assert ProgramKey.from_signature(signature).digest == GOLDEN_PREFILL_PROGRAM


def test_golden_prefill_trace_digest() -> None:
    signature = PrefillTraceSignature("chunked", 1, 512, 32, 4)
    assert signature.key_material() == (
        ("operation_variant", "chunked"),
        ("padded_batch_size", 1),
        ("padded_sequence_length", 512),
        ("page_table_width", 32),
        ("chunk_page_table_width", 4),
    )
    assert TraceKey.from_signature(signature).digest == GOLDEN_PREFILL_TRACE


def test_optional_flags_enter_key_material_only_when_set() -> None:
    program = PrefillSignature(
        "regular-single", 1, 128, 8, None, "topk", True, True, last_token_tile_start=64
    )
    assert [name for name, _ in program.key_material()][-3:] == [
        "penalties_enabled",
        "logprobs_enabled",
        "last_token_tile_start",
    ]
    assert program.key_material()[-1] == ("last_token_tile_start", 64)
    trace = PrefillTraceSignature("regular-single", 1, 128, 8, None, "argmax", False, True)
    assert trace.key_material()[5:] == (("sampling_path", "argmax"), ("logprobs_enabled", True))


def test_15_and_16_active_rows_share_program_trace_and_capture_schema() -> None:
    fifteen = only(plan([100] * 15, max_prefill_batch_size=16))
    sixteen = only(plan([90] * 16, max_prefill_batch_size=16))
    for path in ("logits", "topk"):
        a, b = prepared(fifteen, path), prepared(sixteen, path)
        assert a.program_signatures == b.program_signatures
        assert [ProgramKey.from_signature(s) for s in a.program_signatures] == [
            ProgramKey.from_signature(s) for s in b.program_signatures
        ]
        assert a.trace_signature == b.trace_signature
        assert TraceKey.from_signature(a.trace_signature) == TraceKey.from_signature(
            b.trace_signature
        )
        assert capture_schema_fingerprint(a) == capture_schema_fingerprint(b)
    (signature,) = prepared(fifteen, "topk").program_signatures
    assert signature == PrefillSignature("regular-batched", 16, 128, 4, None, "topk")


def test_variants_follow_the_plan() -> None:
    batched, single = plan([100, 100, 500])
    assert prefill_variant(batched) == "regular-batched"
    assert prefill_variant(single) == "regular-single"
    assert prefill_variant(only(plan([100], start_pos=[32]))) == "chunked"


@pytest.mark.parametrize(
    ("length", "path", "static", "tile"),
    [
        (32, "argmax", False, 0),
        (96, "argmax", False, 64),
        (128, "argmax", False, 96),
        (96, "topk", True, 64),
        (96, "topk", False, None),
        (96, "logits", True, None),
        (500, "argmax", True, None),
    ],
)
def test_last_token_tile_is_program_material_only_for_q128_singles(
    length: int, path: SamplingPath, static: bool, tile: int | None
) -> None:
    request = only(plan([length]))
    (signature,) = build_program_signatures(request, path, static_q128_topk_supported=static)
    assert signature.last_token_tile_start == tile


def test_tile_start_is_not_set_for_waves_or_chunked_requests() -> None:
    wave = only(plan([96, 96]))
    cached = only(plan([96], start_pos=[32]))
    for request in (wave, cached):
        (signature,) = build_program_signatures(request, "argmax", static_q128_topk_supported=True)
        assert signature.last_token_tile_start is None


def test_multi_chunk_request_has_one_program_signature_and_first_chunk_trace() -> None:
    request = only(plan([4097], max_actual_page_table_width=200, canonical_page_table_width=264))
    assert len(request.chunks) == 3
    assert build_program_signatures(request, "logits", static_q128_topk_supported=False) == (
        PrefillSignature("chunked", 1, 2048, 264, 64, "logits"),
    )
    assert build_trace_signature(
        request, trace_enabled=True, sampling_path="logits"
    ) == PrefillTraceSignature("chunked", 1, 2048, 264, 64)
    assert build_trace_signature(request, trace_enabled=False, sampling_path="logits") is None


def test_cached_single_chunk_request_uses_its_padded_length() -> None:
    request = only(plan([100], start_pos=[64]))
    (signature,) = build_program_signatures(request, "topk", static_q128_topk_supported=True)
    assert signature == PrefillSignature("chunked", 1, 128, 6, 4, "topk")


def test_sampling_variants_get_three_trace_keys_but_one_capture_schema() -> None:
    request = only(plan([100]))
    variants = [prepared(request, path) for path in ("logits", "argmax", "topk")]
    variants.append(prepared(request, "topk", penalties_enabled=True, logprobs_enabled=True))
    keys = {TraceKey.from_signature(v.trace_signature) for v in variants}
    assert len(keys) == 4
    schemas = {capture_schema_fingerprint(v) for v in variants}
    assert schemas == {
        (
            "prefill-hidden-v2",
            PrefillTraceSignature("regular-single", 1, 128, 4, None),
            (
                "operation_variant",
                "padded_batch_size",
                "padded_sequence_length",
                "page_table_width",
            ),
        )
    }
    chunked = capture_schema_fingerprint(prepared(only(plan([100], start_pos=[64]))))
    assert chunked[2][-1] == "chunk_page_table_width"


def test_capture_schema_needs_a_trace_signature() -> None:
    with pytest.raises(ValueError, match="has no trace signature"):
        capture_schema_fingerprint(prepared(only(plan([100])), trace=False))


def test_workspace_fingerprint_depends_on_sampling_shape() -> None:
    request = only(plan([100]))
    assert workspace_fingerprint(prepared(request, "topk"), sampling_output_rows=32) == (
        "prefill-postprocess-v1",
        "topk",
        32,
        True,
    )
    assert workspace_fingerprint(prepared(request), sampling_output_rows=1) == (
        "prefill-postprocess-v1",
        "logits",
        1,
        False,
    )
    with pytest.raises(ValueError, match="sampling_output_rows must be a positive integer"):
        workspace_fingerprint(prepared(request), sampling_output_rows=0)


def test_prepared_prefill_keeps_its_sampling_consistent() -> None:
    request = only(plan([100]))
    good = prepared(request, "topk")
    with pytest.raises(ValueError, match="must be 'logits' exactly when sampling_params is None"):
        attrs.evolve(good, sampling_params=None)
    with pytest.raises(ValueError, match="has sampling_path 'topk', the prepared request has"):
        attrs.evolve(good, sampling_path="argmax")
    with pytest.raises(ValueError, match="program_signatures"):
        attrs.evolve(good, program_signatures=())
    with pytest.raises(TypeError, match="program_signatures"):
        attrs.evolve(good, program_signatures=[good.program_signatures[0]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request"):
        attrs.evolve(good, request="request")  # type: ignore[arg-type]


_VALID_PROGRAM: dict[str, Any] = {
    "operation_variant": "regular-single",
    "padded_batch_size": 1,
    "invocation_sequence_length": 128,
    "page_table_width": 8,
    "chunk_page_table_width": None,
    "sampling_path": "topk",
}


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ({"operation_variant": "batched"}, ValueError, "operation_variant must be one of"),
        ({"padded_batch_size": 0}, ValueError, "padded_batch_size must be a positive"),
        ({"invocation_sequence_length": True}, ValueError, "invocation_sequence_length"),
        ({"page_table_width": 2.0}, ValueError, "page_table_width must be a positive"),
        ({"chunk_page_table_width": 0}, ValueError, "chunk_page_table_width must be None or"),
        ({"chunk_page_table_width": 4}, ValueError, "exactly for the chunked variant"),
        ({"operation_variant": "chunked"}, ValueError, "exactly for the chunked variant"),
        ({"padded_batch_size": 2}, ValueError, "runs one row"),
        ({"sampling_path": "greedy"}, ValueError, "sampling_path must be one of"),
        ({"penalties_enabled": 1}, TypeError, "penalties_enabled must be bool"),
        ({"logprobs_enabled": "yes"}, TypeError, "logprobs_enabled must be bool"),
        ({"sampling_path": "logits", "logprobs_enabled": True}, ValueError, "need a sampled"),
        ({"last_token_tile_start": 16}, ValueError, "multiple of 32"),
        ({"last_token_tile_start": 128}, ValueError, r"multiple of 32 in \[0, 128\)"),
        ({"last_token_tile_start": -32}, ValueError, "last_token_tile_start"),
    ],
)
def test_invalid_program_signatures_are_rejected(
    overrides: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        PrefillSignature(**{**_VALID_PROGRAM, **overrides})


def test_invalid_trace_signatures_are_rejected() -> None:
    with pytest.raises(ValueError, match="exactly for the chunked variant"):
        PrefillTraceSignature("chunked", 1, 512, 32, None)
    with pytest.raises(ValueError, match="need a sampled path"):
        PrefillTraceSignature("regular-batched", 4, 128, 8, None, "logits", True)
    with pytest.raises(TypeError, match="trace_enabled must be bool"):
        build_trace_signature(only(plan([100])), trace_enabled=1, sampling_path="logits")  # type: ignore[arg-type]


# --- decode ----------------------------------------------------------------------------------


def test_decode_key_material_and_shared_identity() -> None:
    program = DecodeSignature(32, 104, "argmax", True)
    assert program.key_material() == (
        ("operation", "decode"),
        ("batch_size", 32),
        ("page_table_width", 104),
        ("sampling_path", "argmax"),
        ("device_feedback", True),
    )
    trace = DecodeSignature.for_program(program)
    assert trace.key_material() == program.key_material()
    assert trace == DecodeSignature(32, 104, "argmax", True)
    flagged = DecodeSignature(32, 104, "topk", False, True, True)
    assert flagged.key_material()[-2:] == (("penalties_enabled", True), ("logprobs_enabled", True))
    assert ProgramKey.from_signature(program) != ProgramKey.from_signature(flagged)
    assert ProgramKey.from_signature(DecodeSignature(32, 104, "logits", False)) != (
        ProgramKey.from_signature(DecodeSignature(32, 112, "logits", False))
    )


@pytest.mark.parametrize(
    ("arguments", "error", "fragment"),
    [
        ((0, 8, "logits", False), ValueError, "batch_size must be a positive"),
        ((32, -8, "logits", False), ValueError, "page_table_width must be a positive"),
        ((32, 8, "sample", False), ValueError, "sampling_path must be one of"),
        ((32, 8, "topk", 1), TypeError, "device_feedback must be bool"),
        ((32, 8, "logits", True), ValueError, "device_feedback=True"),
        ((32, 8, "logits", False, True), ValueError, "need a sampled path"),
    ],
)
@pytest.mark.parametrize("kind", [DecodeSignature, DecodeSignature])
def test_invalid_decode_signatures_are_rejected(
    kind: type, arguments: tuple[Any, ...], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        kind(*arguments)

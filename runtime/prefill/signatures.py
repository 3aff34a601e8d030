"""Prefill signatures: what the programs and the trace of a planned request depend on.

Signatures carry padded geometry (padded batch, invocation length, page-table widths) and the
sampling path, never the active row count, so 15 and 16 active rows share one program, one
trace and one capture schema. The trace's capture schema is sampling free: logits, argmax and
top-k requests of one geometry share a hidden-state trace family and differ only in their
post-processing workspace.
"""

from __future__ import annotations

import functools
from typing import Literal

import attrs

from runtime.identity import KeyMaterial, KeyPairs
from runtime.prefill.request import PrefillRequest
from runtime.sampling import SamplingPath
from runtime.signature_fields import (
    bool_field,
    check_sampling_flags,
    optional_positive_field,
    positive_field,
    sampling_flag_pairs,
    sampling_path_field,
)
from runtime.validation import is_int

PrefillVariant = Literal["regular-single", "regular-batched", "chunked"]
PREFILL_VARIANTS: tuple[PrefillVariant, ...] = ("regular-single", "regular-batched", "chunked")

TILE_SIZE = 32
"""Rows per device tile: the last-token tile start is program material in steps of this."""
STATIC_TILE_SEQUENCE_LENGTH = 128
"""The Q128 padded length whose single-row sampling programs bake in the last-token tile."""

CAPTURE_SCHEMA_TAG = "prefill-hidden-v2"
WORKSPACE_TAG = "prefill-postprocess-v1"


def _variant(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in PREFILL_VARIANTS:
        raise ValueError(f"{attribute.name} must be one of {PREFILL_VARIANTS}, got {value!r}")


def _check_geometry(
    variant: str, padded_batch_size: int, chunk_page_table_width: int | None
) -> None:
    if (variant == "chunked") != (chunk_page_table_width is not None):
        raise ValueError(
            f"chunk_page_table_width must be set exactly for the chunked variant, got "
            f"{chunk_page_table_width!r} for {variant!r}"
        )
    if variant != "regular-batched" and padded_batch_size != 1:
        raise ValueError(
            f"variant {variant!r} runs one row, got padded_batch_size {padded_batch_size}"
        )


@attrs.frozen
class PrefillSignature:
    """What one eager prefill program depends on: one invocation geometry and sampling path.

    A request's trace is identified at a coarser grain, `PrefillTraceSignature`.
    """

    operation_variant: PrefillVariant = attrs.field(validator=_variant)
    padded_batch_size: int = attrs.field(validator=positive_field)
    invocation_sequence_length: int = attrs.field(validator=positive_field)
    page_table_width: int = attrs.field(validator=positive_field)
    chunk_page_table_width: int | None = attrs.field(validator=optional_positive_field)
    sampling_path: SamplingPath = attrs.field(validator=sampling_path_field)
    penalties_enabled: bool = attrs.field(default=False, validator=bool_field)
    logprobs_enabled: bool = attrs.field(default=False, validator=bool_field)
    last_token_tile_start: int | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        _check_geometry(self.operation_variant, self.padded_batch_size, self.chunk_page_table_width)
        check_sampling_flags(self.sampling_path, self.penalties_enabled, self.logprobs_enabled)
        tile = self.last_token_tile_start
        if tile is not None and (
            not is_int(tile)
            or tile < 0
            or tile % TILE_SIZE
            or tile >= self.invocation_sequence_length
        ):
            raise ValueError(
                f"last_token_tile_start must be None or a multiple of {TILE_SIZE} in "
                f"[0, {self.invocation_sequence_length}), got {tile!r}"
            )

    def key_material(self) -> KeyPairs:
        pairs: tuple[tuple[str, KeyMaterial], ...] = (
            ("operation_variant", self.operation_variant),
            ("padded_batch_size", self.padded_batch_size),
            ("invocation_sequence_length", self.invocation_sequence_length),
            ("page_table_width", self.page_table_width),
            ("chunk_page_table_width", self.chunk_page_table_width),
            ("sampling_path", self.sampling_path),
        )
        flags = sampling_flag_pairs(self.penalties_enabled, self.logprobs_enabled)
        return (*pairs, *flags, ("last_token_tile_start", self.last_token_tile_start))


@attrs.frozen
class PrefillTraceSignature:
    """What one prefill trace depends on: the first invocation's geometry plus sampling.

    The trace grain of a request's `PrefillSignature`s: the first chunk's geometry without
    the last-token tile. Its key material names the length `padded_sequence_length` and
    leaves out the default `logits` path (the reference's trace digests are pinned on
    exactly that material).
    """

    operation_variant: PrefillVariant = attrs.field(validator=_variant)
    padded_batch_size: int = attrs.field(validator=positive_field)
    padded_sequence_length: int = attrs.field(validator=positive_field)
    page_table_width: int = attrs.field(validator=positive_field)
    chunk_page_table_width: int | None = attrs.field(validator=optional_positive_field)
    sampling_path: SamplingPath = attrs.field(default="logits", validator=sampling_path_field)
    penalties_enabled: bool = attrs.field(default=False, validator=bool_field)
    logprobs_enabled: bool = attrs.field(default=False, validator=bool_field)

    def __attrs_post_init__(self) -> None:
        _check_geometry(self.operation_variant, self.padded_batch_size, self.chunk_page_table_width)
        check_sampling_flags(self.sampling_path, self.penalties_enabled, self.logprobs_enabled)

    def key_material(self) -> KeyPairs:
        pairs: tuple[tuple[str, KeyMaterial], ...] = (
            ("operation_variant", self.operation_variant),
            ("padded_batch_size", self.padded_batch_size),
            ("padded_sequence_length", self.padded_sequence_length),
            ("page_table_width", self.page_table_width),
            ("chunk_page_table_width", self.chunk_page_table_width),
        )
        if self.sampling_path != "logits":
            pairs += (("sampling_path", self.sampling_path),)
        return pairs + sampling_flag_pairs(self.penalties_enabled, self.logprobs_enabled)


@attrs.frozen
class PreparedPrefill:
    """A planned request with its identities, ready to compile, invoke or capture.

    `sampling_params` (raw, sliced to the request's source rows) and `prepared_sampling` are
    opaque here: the sampling module owns their types; identity needs only the path and flags.
    """

    request: PrefillRequest = attrs.field(validator=attrs.validators.instance_of(PrefillRequest))
    sampling_params: object | None
    sampling_path: SamplingPath = attrs.field(validator=sampling_path_field)
    program_signatures: tuple[PrefillSignature, ...] = attrs.field(
        validator=[
            attrs.validators.deep_iterable(
                member_validator=attrs.validators.instance_of(PrefillSignature),
                iterable_validator=attrs.validators.instance_of(tuple),
            ),
            attrs.validators.min_len(1),
        ]
    )
    trace_signature: PrefillTraceSignature | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(PrefillTraceSignature))
    )
    prepared_sampling: object | None = None

    def __attrs_post_init__(self) -> None:
        if (self.sampling_params is None) != (self.sampling_path == "logits"):
            raise ValueError(
                f"sampling_path {self.sampling_path!r} must be 'logits' exactly when "
                f"sampling_params is None (sampling_params is "
                f"{'None' if self.sampling_params is None else 'set'})"
            )
        signatures: list[PrefillSignature | PrefillTraceSignature] = [*self.program_signatures]
        if self.trace_signature is not None:
            signatures.append(self.trace_signature)
        for signature in signatures:
            if signature.sampling_path != self.sampling_path:
                raise ValueError(
                    f"{type(signature).__name__} has sampling_path "
                    f"{signature.sampling_path!r}, the prepared request has "
                    f"{self.sampling_path!r}"
                )


def prefill_variant(request: PrefillRequest) -> PrefillVariant:
    """The program family of a request: chunked, regular batched or regular single."""
    if request.uses_chunked_prefill:
        return "chunked"
    return "regular-batched" if request.kind == "batched" else "regular-single"


@functools.lru_cache(maxsize=4096)
def _program_signature(
    variant: PrefillVariant,
    padded_batch_size: int,
    invocation_sequence_length: int,
    page_table_width: int,
    chunk_page_table_width: int | None,
    sampling_path: SamplingPath,
    penalties_enabled: bool,
    logprobs_enabled: bool,
    last_token_tile_start: int | None,
) -> PrefillSignature:
    """A (frozen, hence shareable) signature; a lane's few geometries are built once."""
    return PrefillSignature(
        operation_variant=variant,
        padded_batch_size=padded_batch_size,
        invocation_sequence_length=invocation_sequence_length,
        page_table_width=page_table_width,
        chunk_page_table_width=chunk_page_table_width,
        sampling_path=sampling_path,
        penalties_enabled=penalties_enabled,
        logprobs_enabled=logprobs_enabled,
        last_token_tile_start=last_token_tile_start,
    )


def build_program_signatures(
    request: PrefillRequest,
    sampling_path: SamplingPath,
    *,
    static_q128_topk_supported: bool,
    penalties_enabled: bool = False,
    logprobs_enabled: bool = False,
) -> tuple[PrefillSignature, ...]:
    """One signature per distinct chunk geometry, in order (a chunked request normally has one).

    Single, non-chunked Q128 requests on the argmax path (or top-k with the static Q128
    sampler) bake the last token's tile into the program, so its tile start is identity.
    """
    variant = prefill_variant(request)
    tile_start: int | None = None
    if (
        variant == "regular-single"
        and request.padded_sequence_length == STATIC_TILE_SEQUENCE_LENGTH
        and (sampling_path == "argmax" or (sampling_path == "topk" and static_q128_topk_supported))
    ):
        relative_last = request.last_token_indices[0] - request.cached_tokens[0]
        tile_start = relative_last // TILE_SIZE * TILE_SIZE
    signatures: list[PrefillSignature] = []
    geometries: set[tuple[int, int | None]] = set()
    for chunk in request.chunks:
        geometry = (chunk.chunk_size, chunk.chunk_page_table_width)
        if geometry in geometries:
            continue  # equal chunks share one program (a long request has many)
        geometries.add(geometry)
        signature = _program_signature(
            variant,
            request.padded_batch_size,
            chunk.chunk_size,
            request.page_table_width,
            chunk.chunk_page_table_width,
            sampling_path,
            penalties_enabled,
            logprobs_enabled,
            tile_start,
        )
        if signature not in signatures:
            signatures.append(signature)
    return tuple(signatures)


def build_trace_signature(
    request: PrefillRequest,
    *,
    trace_enabled: bool,
    sampling_path: SamplingPath,
    penalties_enabled: bool = False,
    logprobs_enabled: bool = False,
) -> PrefillTraceSignature | None:
    """The trace family of a request, from its first chunk; None when tracing is off for it."""
    if not isinstance(trace_enabled, bool):
        raise TypeError(f"trace_enabled must be bool, got {type(trace_enabled).__name__}")
    if not trace_enabled:
        return None
    first = request.first_chunk
    return PrefillTraceSignature(
        operation_variant=prefill_variant(request),
        padded_batch_size=request.padded_batch_size,
        padded_sequence_length=first.chunk_size,
        page_table_width=request.page_table_width,
        chunk_page_table_width=first.chunk_page_table_width,
        sampling_path=sampling_path,
        penalties_enabled=penalties_enabled,
        logprobs_enabled=logprobs_enabled,
    )


CaptureSchema = tuple[str, PrefillTraceSignature, tuple[str, ...]]


def capture_schema_fingerprint(prepared: PreparedPrefill) -> CaptureSchema:
    """What a captured hidden-state trace depends on: geometry only, sampling reset to logits.

    Requests that differ only in sampling share one captured trace (and one fingerprint).
    """
    if prepared.trace_signature is None:
        raise ValueError(
            "prepared prefill has no trace signature, so it has no capture schema; "
            "build it with trace_enabled=True"
        )
    hidden = attrs.evolve(
        prepared.trace_signature,
        sampling_path="logits",
        penalties_enabled=False,
        logprobs_enabled=False,
    )
    names = tuple(name for name, value in hidden.key_material() if value is not None)
    return (CAPTURE_SCHEMA_TAG, hidden, names)


def workspace_fingerprint(
    prepared: PreparedPrefill, *, sampling_output_rows: int
) -> tuple[str, SamplingPath, int, bool]:
    """What an alias's post-processing workspace depends on: the sampling shape, not geometry."""
    if not is_int(sampling_output_rows) or sampling_output_rows <= 0:
        raise ValueError(
            f"sampling_output_rows must be a positive integer, got {sampling_output_rows!r}"
        )
    return (
        WORKSPACE_TAG,
        prepared.sampling_path,
        sampling_output_rows,
        prepared.sampling_params is not None,
    )

"""What warmup made available, as a value: the coverage manifest and how it is built.

The manifest lists eager programs, traced programs, traces and the program-to-trace aliases,
every list in digest order so it does not depend on warmup order; `to_json` writes each
signature as its key material (what `--coverage-out` files hold).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence

import attrs

from runtime.decode_signatures import DecodeSignature
from runtime.identity import ProgramKey, TraceKey, key_material_of
from runtime.json_types import JSONObject, JSONValue
from runtime.program_compiler import CompiledProgram, ProgramCompiler
from runtime.trace_compiler import TraceCompiler
from runtime.warmup_coverage import identity_field_counts


@attrs.frozen
class CoverageAlias:
    """A compiled program, the trace it replays through, and the fingerprints that keep
    alias capture independent of request order (capture schema, post-processing workspace)."""

    program_signature: object
    trace_signature: object
    schema_fingerprint: object = None
    workspace_fingerprint: object = None


@attrs.frozen
class CoverageManifest:
    """What warmup made available: eager programs, traced programs, traces, aliases, and
    the kernels the model chose for them (its `choose_kernels` JSON, or None)."""

    eager_program_signatures: tuple[object, ...]
    traced_source_program_signatures: tuple[object, ...]
    trace_signatures: tuple[object, ...]
    aliases: tuple[CoverageAlias, ...]
    kernels: JSONValue = None

    def identity_fields(self) -> dict[str, dict[str, dict[str, int]]]:
        """Which identity fields (and values) produced how many programs and traces."""
        groups: dict[str, list[object]] = {
            "prefill_programs": [],
            "decode_programs": [],
            "prefill_traces": [],
            "decode_traces": [],
        }
        for signature in self.eager_program_signatures:
            operation = "decode" if isinstance(signature, DecodeSignature) else "prefill"
            groups[f"{operation}_programs"].append(signature)
        for signature in self.trace_signatures:
            operation = "decode" if isinstance(signature, DecodeSignature) else "prefill"
            groups[f"{operation}_traces"].append(signature)
        return {name: identity_field_counts(items) for name, items in groups.items()}

    def to_json(self) -> JSONObject:
        """A JSON-ready description (signatures as their key material)."""

        def material(signature: object) -> JSONValue:
            return _jsonable(key_material_of(signature))

        return {
            "identity_fields": self.identity_fields(),
            "eager_programs": [material(s) for s in self.eager_program_signatures],
            "traced_programs": [material(s) for s in self.traced_source_program_signatures],
            "traces": [
                {"trace_key": TraceKey.from_signature(s).digest, "signature": material(s)}
                for s in self.trace_signatures
            ],
            "aliases": [
                {
                    "program": material(alias.program_signature),
                    "trace_key": TraceKey.from_signature(alias.trace_signature).digest,
                    "schema_fingerprint": _jsonable(alias.schema_fingerprint),
                    "workspace_fingerprint": _jsonable(alias.workspace_fingerprint),
                }
                for alias in self.aliases
            ],
            "kernels": self.kernels,
        }

    def dumps(self) -> str:
        """The manifest as indented JSON text."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True)


def eager_manifest(required: Sequence[CompiledProgram], *, kernels: JSONValue) -> CoverageManifest:
    """The manifest of an untraced warmup (no traces, no aliases)."""
    eager = _dedupe(p.signature for p in required)
    return CoverageManifest(_sorted_signatures(eager), (), (), (), kernels=kernels)


def traced_manifest(
    *,
    required: Sequence[CompiledProgram],
    required_traced: Sequence[CompiledProgram],
    program_compiler: ProgramCompiler,
    trace_compiler: TraceCompiler | None,
    kernels: JSONValue,
) -> CoverageManifest:
    """The manifest once every traced case registered: each traced program must be compiled
    and aliased to a trace, else RuntimeError names the missing program digests."""
    compiler = program_compiler
    eager = _dedupe(p.signature for p in required)
    traced = _dedupe(p.signature for p in required_traced)
    aliases: list[CoverageAlias] = []
    missing: list[str] = []
    traces: list[object] = []
    for program in _dedupe_programs(required_traced):
        if program.key not in {p.key for p in compiler.compiled_programs}:
            missing.append(program.key.digest)
            continue
        if trace_compiler is None:
            continue
        trace_key = trace_compiler.trace_key_for_program(program.key)
        if trace_key is None:
            missing.append(program.key.digest)
            continue
        record = trace_compiler.get(trace_key)
        alias = trace_compiler.alias_for_program(program.key)
        assert record is not None and alias is not None
        aliases.append(
            CoverageAlias(
                program.signature,
                record.signature,
                schema_fingerprint=record.plan.schema_fingerprint,
                workspace_fingerprint=alias.workspace_fingerprint,
            )
        )
        if all(key_material_of(t) != key_material_of(record.signature) for t in traces):
            traces.append(record.signature)
    if missing:
        raise RuntimeError(
            f"Coverage manifest is missing required compiled programs/trace aliases: {missing}"
        )
    if not aliases:
        raise RuntimeError("Configured trace warmup registered no program-to-trace aliases")
    return CoverageManifest(
        eager_program_signatures=_sorted_signatures(eager),
        traced_source_program_signatures=_sorted_signatures(traced),
        trace_signatures=_sorted_signatures(traces),
        aliases=tuple(
            sorted(aliases, key=lambda a: ProgramKey.from_signature(a.program_signature).digest)
        ),
        kernels=kernels,
    )


def _jsonable(value: object) -> JSONValue:
    """JSON text for key material and fingerprints (signatures become their key material)."""
    if isinstance(value, tuple | list):
        return [_jsonable(item) for item in value]
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "key_material"):
        return _jsonable(key_material_of(value))
    return repr(value)


def _dedupe(signatures: Iterable[object]) -> tuple[object, ...]:
    seen: list[object] = []
    keys: set[object] = set()
    for signature in signatures:
        material = key_material_of(signature)
        if material not in keys:
            keys.add(material)
            seen.append(signature)
    return tuple(seen)


def _sorted_signatures(signatures: Sequence[object]) -> tuple[object, ...]:
    """Signatures in digest order, so the manifest does not depend on warmup order."""
    return tuple(sorted(signatures, key=lambda s: ProgramKey.from_signature(s).digest))


def _dedupe_programs(programs: Sequence[CompiledProgram]) -> list[CompiledProgram]:
    seen: dict[ProgramKey, CompiledProgram] = {}
    for program in programs:
        seen.setdefault(program.key, program)
    return list(seen.values())

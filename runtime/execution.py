"""`EagerExecutor` and `TracedExecutor`: compose the runtimes, never fall back.

There is one eager execution object (prefill runtime, decode runtime, program compiler) and,
when tracing is configured, one traced object over that exact eager instance and its
compiler. A traced operation preflights its complete prepared call before any device work; a
coverage miss raises `TraceCoverageError` naming the missing signature and the remedies. It
is never silently downgraded to eager execution: choosing eager is the caller's decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Protocol, Unpack

import torch

from runtime.decode import DecodeRuntime
from runtime.decode_batch import PreparedDecode
from runtime.decode_staging import DecodeInvocationResult
from runtime.identity import KEY_SCHEMA_VERSION, TRACE_KEY_DOMAIN, key_pairs_of, signature_digest
from runtime.prefill.batch import PrefillArguments, PrefillBatch
from runtime.prefill.replay import PrefillReplayEvidence, replay_prepared
from runtime.prefill.result_collector import InvocationResult, PrefillOutput
from runtime.prefill.runtime import PrefillRuntime
from runtime.prefill.signatures import PrefillSignature, PreparedPrefill
from runtime.program_compiler import CompiledProgram, OutputSpec, ProgramCompiler
from runtime.sampling import SamplingParams
from runtime.trace_compiler import (
    RefreshDecision,
    TraceArtifact,
    TraceCompiler,
)

logger = logging.getLogger(__name__)

_REMEDIES = (
    "Remedies: (1) add the missing signature to construction-time trace coverage "
    "(WarmupConfig prefill_seq_lens / prefill_batch_sizes, or warm it up before capture); "
    "(2) rerun with TraceConfig(mode='none') (--trace none) for debugging."
)


_NEAREST = 8
"""Compiled programs a closed-gate error lists, nearest to the missing signature first."""


class TraceCoverageError(RuntimeError):
    """A traced operation's prepared request has no captured trace; nothing ran."""


class CompileGateClosedError(TraceCoverageError):
    """An eager call after capture needs a program warmup never compiled; nothing ran."""


def _compact(signature: Any) -> str:
    """`name=value` pairs of a signature's key material (None values left out)."""
    pairs = key_pairs_of(signature)
    return ", ".join(f"{name}={value}" for name, value in pairs if value is not None)


def _request_fields(prepared: PreparedPrefill) -> str:
    """The request facts behind a prefill signature: rows, prompt lengths, cached tokens."""
    request = prepared.request
    return (
        f"active_rows={request.active_batch_size}, prompt_lengths={list(request.prompt_lengths)}, "
        f"cached_tokens={list(request.cached_tokens)}, chunks={len(request.chunks)}"
    )


def _gate_remedies(operation: str) -> str:
    shape = (
        "WarmupConfig(prefill_seq_lens=..., prefill_batch_sizes=...)"
        if operation == "prefill"
        else "WarmupConfig(include_decode_top_k=...)"
    )
    return (
        "Remedies: (1) warm up this signature before capture: the default coverage is derived "
        f"from the planner and covers every request the lane admits, so widen a trimmed {shape}"
        ", warm up with can_sample_on_device=True when requests sample, or call "
        f"compile_{operation}() with this request before capture(); (2) serve it on a lane "
        "built with TraceConfig(mode='none') (--trace none), where the compile gate never "
        "closes; (3) if the lane was warmed with its defaults, this is a coverage bug: report "
        "the signature above."
    )


def _model_name(model: object) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def _result_spec(result: Any) -> OutputSpec:
    return OutputSpec.from_value(result.value)


def _result_owned(result: Any) -> Any:
    return result.owned


class _CompilesDecodeSteps(Protocol):
    """What the warm-up decode entry needs of an executor."""

    @property
    def decode(self) -> DecodeRuntime: ...

    def compile_decode_batch(self, prepared: PreparedDecode) -> CompiledProgram: ...


class _WarmupDecodeEntry:
    """Warm-up builds its decode steps by keyword (`runtime.warmup`); both executors take
    them the same way: the step is checked at the decode boundary, then compiled their way."""

    def compile_decode(
        self: _CompilesDecodeSteps,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        page_table: torch.Tensor,
        sampling_params: SamplingParams | None = None,
    ) -> CompiledProgram:
        """Check one warm-up step (`DecodeRuntime.prepare`), then `compile_decode_batch` it."""
        return self.compile_decode_batch(
            self.decode.prepare(tokens, start_pos, page_table, sampling_params=sampling_params)
        )


class EagerExecutor(_WarmupDecodeEntry):
    """Compiles and runs eager requests over the prefill and decode runtimes."""

    def __init__(
        self,
        *,
        prefill: PrefillRuntime,
        decode: DecodeRuntime,
        program_compiler: ProgramCompiler,
        trace_mode: str = "none",
    ) -> None:
        if not isinstance(program_compiler, ProgramCompiler):
            raise TypeError(
                f"program_compiler must be a ProgramCompiler, got {type(program_compiler).__name__}"
            )
        for name, value, needs in (
            ("prefill", prefill, ("prepare", "invoke", "assemble")),
            ("decode", decode, ("prepare", "invoke", "consume", "program_signature")),
        ):
            missing = [attr for attr in needs if not callable(getattr(value, attr, None))]
            if missing:
                raise TypeError(f"{name} runtime lacks {', '.join(missing)}(); got {value!r}")
        self.prefill = prefill
        self.decode = decode
        self.program_compiler = program_compiler
        self.trace_mode = trace_mode
        self._gate_refusals = 0
        self._eager_prefill_count = 0
        self._eager_decode_count = 0

    # -- prefill --------------------------------------------------------------------------------

    def prefill_batch(self, operation: str, arguments: PrefillArguments) -> PrefillBatch:
        """The keywords of public call `operation` as a checked batch (every caller error)."""
        batch: PrefillBatch = self.prefill.batch(arguments, operation=operation)
        return batch

    def prepare_prefill(self, batch: PrefillBatch) -> tuple[PreparedPrefill, ...]:
        """Plan and classify a checked prefill call once."""
        return tuple(self.prefill.prepare_batch(batch))

    def compile_prefill_prepared(
        self, prepared: Sequence[PreparedPrefill]
    ) -> tuple[CompiledProgram, ...]:
        """Compile every program signature of already prepared requests."""
        programs: list[CompiledProgram] = []
        for item in prepared:
            for signature in item.program_signatures:
                programs.append(
                    self.program_compiler.compile(
                        signature,
                        self._compile_invoke(item),
                        output_spec=_result_spec,
                        release_output=_result_owned,
                    )
                )
        return tuple(programs)

    def _compile_invoke(self, prepared: PreparedPrefill) -> Callable[[object], InvocationResult]:
        def invoke(context: object) -> InvocationResult:
            result: InvocationResult = self.prefill.invoke(prepared, count_tokens=False)
            return result

        return invoke

    def compile_prefill(self, **arguments: Unpack[PrefillArguments]) -> tuple[CompiledProgram, ...]:
        """Compile the programs a prefill call needs (run once each, outputs released)."""
        return self.compile_prefill_batch(self.prefill_batch("compile_prefill", arguments))

    def compile_prefill_batch(self, batch: PrefillBatch) -> tuple[CompiledProgram, ...]:
        """`compile_prefill` of a checked batch."""
        return self.compile_prefill_prepared(self.prepare_prefill(batch))

    def prefill_forward(self, **arguments: Unpack[PrefillArguments]) -> PrefillOutput:
        """Run prefill eagerly; after capture, only already-compiled signatures may run."""
        return self.prefill_forward_batch(self.prefill_batch("prefill_forward", arguments))

    def prefill_forward_batch(self, batch: PrefillBatch) -> PrefillOutput:
        """`prefill_forward` of a checked batch (rows come back in source order)."""
        prepared = self.prepare_prefill(batch)
        self.preflight_prefill(prepared)

        def results() -> Iterator[tuple[PreparedPrefill, InvocationResult]]:
            for item in prepared:
                result = self.prefill.invoke(item)
                self._eager_prefill_count += 1
                yield item, result

        output: PrefillOutput = self.prefill.assemble(
            results(), batch_size=batch.batch_size, sampling_params=batch.sampling_params
        )
        return output

    def preflight_prefill(self, prepared: Sequence[PreparedPrefill]) -> None:
        """Once the gate closed, every signature must be compiled; checked before any run."""
        if not self.program_compiler.gate_closed:
            return
        for item in prepared:
            for signature in item.program_signatures:
                if not self.program_compiler.is_compiled(signature):
                    self._refuse("prefill", signature, _request_fields(item))

    @property
    def compile_gate_refusals(self) -> int:
        """Eager calls refused because the closed gate lacked their program."""
        return self._gate_refusals

    def _refuse(self, operation: str, signature: Any, request: str) -> None:
        self._gate_refusals += 1
        compiler = self.program_compiler
        key = compiler.key_for(signature)
        family = type(signature)
        wanted = dict(key_pairs_of(signature))

        def distance(program: CompiledProgram) -> int:
            pairs = dict(key_pairs_of(program.signature))
            return sum(pairs.get(name) != value for name, value in wanted.items())

        siblings = sorted(
            (p for p in compiler.compiled_programs if type(p.signature) is family), key=distance
        )
        listed = "; ".join(
            f"{program.key.digest[:12]}: {_compact(program.signature)}"
            for program in siblings[:_NEAREST]
        )
        if len(siblings) > _NEAREST:
            listed += (
                f"; ... {len(siblings) - _NEAREST} more compiled {operation} programs (the "
                "coverage manifest lists them all)"
            )
        raise CompileGateClosedError(
            f"{operation} program was not compiled before the compile gate closed at trace "
            f"capture: operation={operation}; trace_mode={self.trace_mode}; "
            f"model={_model_name(self.prefill.config.model)}; signature "
            f"{family.__name__}({_compact(signature)}); request {request}; "
            f"signature_digest={key.digest}; configured_coverage (nearest first)=[{listed}]. "
            "Nothing was "
            f"executed and no KV cache entry was written. {_gate_remedies(operation)}"
        )

    # -- decode ---------------------------------------------------------------------------------

    def compile_decode_batch(self, prepared: PreparedDecode) -> CompiledProgram:
        """Compile the program of a checked decode step (run once, outputs released)."""
        signature = self.decode.program_signature(prepared)
        return self.program_compiler.compile(
            signature,
            lambda context: self.decode.invoke(prepared, device_feedback=prepared.device_feedback),
            output_spec=_result_spec,
            release_output=_result_owned,
        )

    def decode_forward(self, prepared: PreparedDecode, *, read_from_device: bool = True) -> Any:
        """Run one checked decode step eagerly (only compiled signatures once the gate closed)."""
        if self.program_compiler.gate_closed:
            signature = self.decode.program_signature(prepared)
            if not self.program_compiler.is_compiled(signature):
                self._refuse(
                    "decode",
                    signature,
                    f"active_rows={prepared.active_rows}, reset_batch={prepared.reset_batch}",
                )
        result = self.decode.invoke(prepared, device_feedback=False)
        self._eager_decode_count += 1
        return self.decode.consume(result, read_from_device=read_from_device)

    def runtime_summary(self) -> dict[str, Any]:
        """Counters for bring-up logs."""
        return {
            "eager_prefill_executions": self._eager_prefill_count,
            "eager_decode_executions": self._eager_decode_count,
            "semantic_program_count": len(self.program_compiler.compiled_programs),
            "rejected_post_activation_compile_attempts": (
                self.program_compiler.post_activation_compile_rejections
            ),
            "compile_gate_refusals": self._gate_refusals,
        }


class TracedExecutor(_WarmupDecodeEntry):
    """Registers and replays traces over the exact eager executor; misses raise."""

    def __init__(
        self, *, eager: EagerExecutor, trace_compiler: TraceCompiler, trace_mode: str = "all"
    ) -> None:
        if not isinstance(eager, EagerExecutor):
            raise TypeError(f"eager must be an EagerExecutor, got {type(eager).__name__}")
        if not isinstance(trace_compiler, TraceCompiler):
            raise TypeError(
                f"trace_compiler must be a TraceCompiler, got {type(trace_compiler).__name__}"
            )
        if trace_compiler.program_compiler is not eager.program_compiler:
            raise ValueError("trace_compiler must compose eager.program_compiler")
        if trace_mode not in ("decode_only", "all"):
            raise ValueError(
                f"trace_mode must be 'decode_only' or 'all' for a TracedExecutor, got "
                f"{trace_mode!r} (trace mode 'none' uses the EagerExecutor alone)"
            )
        self.eager_executor = eager
        self.trace_compiler = trace_compiler
        self.trace_mode = trace_mode
        self._coverage_misses = 0
        self.recent_prefill_replay_evidence: tuple[PrefillReplayEvidence, ...] = ()

    @property
    def program_compiler(self) -> ProgramCompiler:
        """The one compiler shared with the eager executor."""
        return self.eager_executor.program_compiler

    @property
    def prefill(self) -> PrefillRuntime:
        """The prefill runtime of the eager executor."""
        return self.eager_executor.prefill

    @property
    def decode(self) -> DecodeRuntime:
        """The decode runtime of the eager executor."""
        return self.eager_executor.decode

    @property
    def coverage_miss_count(self) -> int:
        """Traced calls refused because coverage was missing."""
        return self._coverage_misses

    @property
    def prefill_traced(self) -> bool:
        """Whether prefill is a traced operation in this mode."""
        return self.trace_mode == "all"

    # -- prefill --------------------------------------------------------------------------------

    def compile_prefill(self, **arguments: Unpack[PrefillArguments]) -> tuple[CompiledProgram, ...]:
        """Compile eagerly, then register a capture plan for each new program."""
        return self.compile_prefill_batch(
            self.eager_executor.prefill_batch("compile_prefill", arguments)
        )

    def compile_prefill_batch(self, batch: PrefillBatch) -> tuple[CompiledProgram, ...]:
        """`compile_prefill` of a checked batch."""
        prepared = self.eager_executor.prepare_prefill(batch)
        programs = self.eager_executor.compile_prefill_prepared(prepared)
        by_key = {program.key: program for program in programs}
        for item in prepared:
            if item.trace_signature is None:
                continue
            for signature in item.program_signatures:
                key = self.program_compiler.key_for(signature)
                if key not in by_key or self.trace_compiler.trace_key_for_program(key):
                    continue
                self.trace_compiler.register_capture_plan(
                    self.prefill.capture_plan(item).trace_capture_plan(key)
                )
        return programs

    def preflight_prefill(self, prepared: Sequence[PreparedPrefill]) -> tuple[PreparedPrefill, ...]:
        """Check every prepared request has a captured trace before anything runs."""
        for item in prepared:
            if item.trace_signature is None:
                self._miss_prefill(item, None, "the prepared request is not trace-eligible")
            for signature in item.program_signatures:
                key = self.program_compiler.key_for(signature)
                if not self.program_compiler.is_compiled(signature) or not (
                    self.trace_compiler.is_captured(key)
                ):
                    self._miss_prefill(
                        item, signature, "the required trace is not registered and captured"
                    )
        return tuple(prepared)

    def _coverage_text(self, operation: str) -> str:
        coverage = self.trace_compiler.registered_coverage(operation)
        listed = "; ".join(f"{key.digest[:16]}={signature!r}" for key, signature in coverage)
        return f"[{listed}]"

    def _miss_prefill(
        self, item: PreparedPrefill, signature: PrefillSignature | None, reason: str
    ) -> NoReturn:
        self._coverage_misses += 1
        trace_signature = item.trace_signature
        trace_digest = (
            signature_digest(TRACE_KEY_DOMAIN, KEY_SCHEMA_VERSION, trace_signature)
            if trace_signature is not None
            else "unavailable"
        )
        program_key = (
            self.program_compiler.key_for(signature).digest if signature is not None else "n/a"
        )
        raise TraceCoverageError(
            f"Required prefill trace is unavailable ({reason}): operation=prefill; "
            f"trace_mode={self.trace_mode}; model={_model_name(self.prefill.config.model)}; "
            f"signature={trace_signature if trace_signature is not None else signature!r}; "
            f"signature_digest={trace_digest}; program_key={program_key}; "
            f"trace_key={trace_digest}; configured_coverage={self._coverage_text('prefill')}. "
            f"Nothing was executed. {_REMEDIES}"
        )

    def execute_prepared_prefill(
        self,
        prepared: Sequence[PreparedPrefill],
        *,
        batch_size: int,
        sampling_params: SamplingParams | None = None,
        lane: int = 0,
    ) -> PrefillOutput:
        """Replay preflighted requests chunk by chunk and assemble in source-row order."""
        evidence: list[PrefillReplayEvidence] = []

        def results() -> Iterator[tuple[PreparedPrefill, InvocationResult]]:
            for item in prepared:
                result, replayed = replay_prepared(self.prefill, self.trace_compiler, item, lane)
                evidence.append(replayed)
                yield item, result

        value: PrefillOutput = self.prefill.assemble(
            results(), batch_size=batch_size, sampling_params=sampling_params
        )
        self.recent_prefill_replay_evidence = tuple(evidence)
        return value

    def _require_prefill_traced(self) -> None:
        if not self.prefill_traced:
            raise TraceCoverageError(
                f"prefill is not traced in trace_mode={self.trace_mode}; call "
                f"eager_executor.prefill_forward() for intentionally eager prefill. {_REMEDIES}"
            )

    def prefill_forward(self, **arguments: Unpack[PrefillArguments]) -> PrefillOutput:
        """Prepare, preflight every request, then replay (mode 'all' only)."""
        self._require_prefill_traced()
        return self.prefill_forward_batch(
            self.eager_executor.prefill_batch("prefill_forward", arguments)
        )

    def prefill_forward_batch(self, batch: PrefillBatch) -> PrefillOutput:
        """`prefill_forward` of a checked batch."""
        self._require_prefill_traced()
        prepared = self.preflight_prefill(self.eager_executor.prepare_prefill(batch))
        return self.execute_prepared_prefill(
            prepared, batch_size=batch.batch_size, sampling_params=batch.sampling_params
        )

    # -- decode ---------------------------------------------------------------------------------

    def compile_decode_batch(self, prepared: PreparedDecode) -> CompiledProgram:
        """Compile eagerly, then register the decode capture plan if it has none."""
        program = self.eager_executor.compile_decode_batch(prepared)
        if self.trace_compiler.trace_key_for_program(program.key) is None:
            plan = self.decode.capture_plan(prepared)
            self.trace_compiler.register_capture_plan(
                plan.to_trace_capture_plan(program.key, self.decode.trace_signature(prepared))
            )
        return program

    def decode_forward(self, prepared: PreparedDecode, *, read_from_device: bool = True) -> Any:
        """Replay the captured decode trace of a checked step, or raise `TraceCoverageError`."""
        signature = self.decode.program_signature(prepared)
        key = self.program_compiler.key_for(signature)
        if not self.program_compiler.is_compiled(signature) or not self.trace_compiler.is_captured(
            key
        ):
            self._miss_decode(prepared, key.digest)

        def refresh(artifact: TraceArtifact, decision: RefreshDecision) -> None:
            self.decode.refresh_trace(artifact, prepared, decision)

        outputs = self.trace_compiler.replay(
            key,
            refresh,
            reset_batch=prepared.reset_batch,
            device_feedback_enabled=self.decode.config.position_feedback_capable,
            feedback_compatible=prepared.device_feedback,
            page_table_changed=prepared.page_table_changed,
        )
        self.decode.note_submitted(prepared)
        result = DecodeInvocationResult(
            value=outputs, owned=None, is_tokens=prepared.sampling_path != "logits"
        )
        return self.decode.consume(result, read_from_device=read_from_device)

    def _miss_decode(self, prepared: PreparedDecode, program_key: str) -> NoReturn:
        self._coverage_misses += 1
        trace_signature = self.decode.trace_signature(prepared)
        digest = signature_digest(TRACE_KEY_DOMAIN, KEY_SCHEMA_VERSION, trace_signature)
        raise TraceCoverageError(
            "Required decode trace is unavailable: operation=decode; "
            f"trace_mode={self.trace_mode}; model={_model_name(self.decode.config.model)}; "
            f"signature={trace_signature!r}; signature_digest={digest}; "
            f"program_key={program_key}; trace_key=unavailable; "
            f"configured_coverage={self._coverage_text('decode')}. Nothing was executed. "
            f"{_REMEDIES}"
        )

    def runtime_summary(self) -> dict[str, Any]:
        """Eager counters plus replay and coverage counters."""
        summary = self.eager_executor.runtime_summary()
        summary.update(
            {
                "successful_trace_replays": self.trace_compiler.replay_count,
                "trace_replays_by_operation": self.trace_compiler.replay_counts,
                "strict_coverage_misses": self._coverage_misses,
                "semantic_trace_count": self.trace_compiler.trace_count,
                "trace_association_count": self.trace_compiler.trace_association_count,
            }
        )
        return summary


__all__ = [
    "CompileGateClosedError",
    "EagerExecutor",
    "PrefillReplayEvidence",
    "TraceCoverageError",
    "TracedExecutor",
]

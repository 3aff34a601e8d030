"""Traced prefill replay: each prepared request's chunks through its one captured trace.

A request replays its trace once per planned chunk, each replay's persistent inputs refreshed
with that chunk's tokens and start; the final replay's output is finished (its logits, or
sampled into the alias workspace). `PrefillReplayEvidence` records what ran.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from runtime.prefill.request import PrefillChunk
from runtime.prefill.result_collector import InvocationResult
from runtime.prefill.runtime import PrefillRuntime
from runtime.prefill.signatures import PreparedPrefill
from runtime.trace_compiler import RefreshDecision, TraceArtifact, TraceCompiler


@attrs.frozen
class PrefillReplayEvidence:
    """What one traced prefill request replayed (for bring-up logs and tests)."""

    operation: str
    variant: str
    sampling_path: str
    active_batch_size: int
    padded_batch_size: int
    padded_sequence_length: int
    lane: int
    program_key: str
    trace_key: str
    replay_steps: int


def replay_prepared(
    prefill: PrefillRuntime, trace_compiler: TraceCompiler, item: PreparedPrefill, lane: int
) -> tuple[InvocationResult, PrefillReplayEvidence]:
    """Replay each chunk of one preflighted request through its trace, then finish it."""
    keys = {trace_compiler.program_compiler.key_for(s) for s in item.program_signatures}
    if len(keys) != 1:
        raise RuntimeError(
            "Traced chunk replay requires one shared program geometry per prepared "
            f"request, got {len(keys)}"
        )
    key = next(iter(keys))
    workspace = trace_compiler.workspace_for_program(key)
    output: object = None
    request = item.request
    for chunk in request.chunks:
        output = trace_compiler.replay(
            key, _chunk_refresh(prefill, item, workspace, chunk), reset_batch=True
        )
    result = prefill.finish_trace(item, output, workspace)
    trace_key = trace_compiler.trace_key_for_program(key)
    return result, PrefillReplayEvidence(
        operation="prefill",
        variant=item.program_signatures[0].operation_variant,
        sampling_path=item.sampling_path,
        active_batch_size=len(request.source_rows),
        padded_batch_size=request.padded_batch_size,
        padded_sequence_length=request.padded_sequence_length,
        lane=lane,
        program_key=key.digest,
        trace_key=trace_key.digest if trace_key else "unavailable",
        replay_steps=len(request.chunks),
    )


def _chunk_refresh(
    prefill: PrefillRuntime, item: PreparedPrefill, workspace: object, chunk: PrefillChunk
) -> Callable[[TraceArtifact, RefreshDecision], None]:
    """The refresh before one chunk's replay: its inputs into the trace's persistent ones."""

    def refresh(artifact: TraceArtifact, decision: RefreshDecision) -> None:
        prefill.refresh_trace(item, artifact.persistent_inputs.values, workspace, chunk)

    return refresh

"""Traced prefill: capture plans, per-replay input refresh and post-replay finishing.

A prefill trace captures one model invocation over persistent inputs (tokens, page table,
prompt lengths, absolute chunk starts) and is sampling free: sampling runs eagerly after the
replay, into the alias-local workspace. Regular requests capture the whole padded wave (all
physical rows; padding rows have prompt length 0 and write nothing). Chunked and cached
requests capture one fixed chunk trace; a request replays it once per planned chunk with that
chunk's tokens and start refreshed, and only the final replay's output is finished.

Everything a replay reads is a persistent input refreshed before the replay: nothing is
allocated inside the captured function.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from runtime.backends.base import Device, DeviceTensor, TraceOutputs
from runtime.identity import ProgramKey
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.inputs import (
    INPUT_FIELDS,
    PrefillDeviceInputs,
    PrefillInputStager,
    ReleaseTransient,
)
from runtime.prefill.postprocess import PrefillPostprocessor
from runtime.prefill.request import PrefillChunk
from runtime.prefill.result_collector import InvocationResult
from runtime.prefill.sequence_runner import run_prefill_body
from runtime.prefill.signatures import (
    CaptureSchema,
    PrefillTraceSignature,
    PreparedPrefill,
    capture_schema_fingerprint,
    workspace_fingerprint,
)
from runtime.sampling import SamplingPath
from runtime.trace_compiler import InputRefreshPolicy, PersistentInputs, TraceCapturePlan

WorkspaceFingerprint = tuple[str, SamplingPath, int, bool]


@attrs.frozen(eq=False)
class PrefillReplayWorkspace:
    """Alias-local post-processing buffers: the persistent sampled output of one program.

    Logits requests need none (the trace output is read directly). Sampled requests copy the
    sampler's tokens (and log-probs) here, so every replay of the alias returns the same
    device objects.
    """

    sampling_path: SamplingPath
    sampled_tokens: DeviceTensor | None = None
    sampled_log_probs: DeviceTensor | None = None

    def owned_tensor_values(self) -> tuple[DeviceTensor, ...]:
        """What the trace compiler releases with the workspace."""
        return tuple(v for v in (self.sampled_tokens, self.sampled_log_probs) if v is not None)


@attrs.frozen(eq=False)
class PrefillCapturePlan:
    """How to capture the trace of one prepared prefill, before a program key is attached."""

    signature: PrefillTraceSignature
    prepare_inputs: Callable[[], PrefillDeviceInputs]
    capture: Callable[[PersistentInputs], TraceOutputs]
    prepare_workspace: Callable[[], PrefillReplayWorkspace]
    schema_fingerprint: CaptureSchema
    workspace_fingerprint: WorkspaceFingerprint
    refresh_fields: tuple[str, ...] = INPUT_FIELDS
    prime: Callable[[PersistentInputs], TraceOutputs] | None = None
    release_prime_output: Callable[[object], list[BaseException]] | None = None

    def trace_capture_plan(
        self, program_key: ProgramKey, *, refresh_policy: InputRefreshPolicy | None = None
    ) -> TraceCapturePlan:
        """The registry's plan for `program_key` (every replay refreshes `refresh_fields`)."""
        return TraceCapturePlan(
            program_key=program_key,
            trace_signature=self.signature,
            operation="prefill",
            prepare_inputs=self.prepare_inputs,
            capture=self.capture,
            refresh_policy=refresh_policy or InputRefreshPolicy(every_replay=self.refresh_fields),
            schema_fingerprint=self.schema_fingerprint,
            prepare_workspace=self.prepare_workspace,
            workspace_fingerprint=self.workspace_fingerprint,
            prime=self.prime,
            release_prime_output=self.release_prime_output,
        )


def persistent_device_inputs(persistent: object) -> PrefillDeviceInputs:
    """The prefill inputs inside `persistent` (a `PersistentInputs` or the inputs themselves)."""
    value = persistent.values if isinstance(persistent, PersistentInputs) else persistent
    if not isinstance(value, PrefillDeviceInputs):
        raise TypeError(
            f"persistent prefill inputs must be PrefillDeviceInputs (or PersistentInputs "
            f"holding them), got {type(value).__name__}"
        )
    return value


def _require_trace(prepared: PreparedPrefill, operation: str) -> PrefillTraceSignature:
    if not isinstance(prepared, PreparedPrefill):
        raise TypeError(f"prepared must be a PreparedPrefill, got {type(prepared).__name__}")
    if prepared.trace_signature is None:
        raise ValueError(
            f"{operation}: prepared prefill for source rows {prepared.request.source_rows} has no "
            "configured trace family (can_enable_trace refused its invocation length); run it "
            "eagerly or extend the trace configuration"
        )
    return prepared.trace_signature


class PrefillTraceLifecycle:
    """Builds capture plans and runs the refresh/finish halves around each replay."""

    def __init__(
        self,
        *,
        config: PrefillRuntimeConfig,
        input_stager: PrefillInputStager,
        postprocessor: PrefillPostprocessor,
        release_transient: ReleaseTransient,
    ) -> None:
        self._config = config
        self._stager = input_stager
        self._postprocessor = postprocessor
        self._release = release_transient

    def configure(self, config: PrefillRuntimeConfig) -> None:
        """Swap in a new config (late page-table layout)."""
        self._config = config

    @property
    def _device(self) -> Device:
        return self._config.device

    def capture_plan(self, prepared: PreparedPrefill) -> PrefillCapturePlan:
        """The capture plan of `prepared`'s trace family; ValueError without a trace signature."""
        signature = _require_trace(prepared, "capture_plan")
        request = prepared.request
        model = self._config.model
        host = self._stager.trace_inputs(request)
        rows = self._postprocessor.sampling_output_rows(prepared)
        path = prepared.sampling_path
        logprobs = signature.logprobs_enabled

        def prepare_inputs() -> PrefillDeviceInputs:
            return self._stager.stage(host)

        def capture(persistent: object) -> TraceOutputs:
            return run_prefill_body(model, persistent_device_inputs(persistent))

        def prepare_workspace() -> PrefillReplayWorkspace:
            return self._allocate_workspace(path, rows, logprobs)

        prime: Callable[[PersistentInputs], TraceOutputs] | None = None
        release_prime: Callable[[object], list[BaseException]] | None = None
        primed = self._config.trace_capture_prime_sequence_lengths
        if request.kind == "batched" and request.padded_sequence_length in primed:
            prime, release_prime = capture, self._release
        return PrefillCapturePlan(
            signature=signature,
            prepare_inputs=prepare_inputs,
            capture=capture,
            prepare_workspace=prepare_workspace,
            schema_fingerprint=capture_schema_fingerprint(prepared),
            workspace_fingerprint=workspace_fingerprint(prepared, sampling_output_rows=rows),
            prime=prime,
            release_prime_output=release_prime,
        )

    def _allocate_workspace(
        self, path: SamplingPath, rows: int, logprobs: bool
    ) -> PrefillReplayWorkspace:
        if path == "logits":
            return PrefillReplayWorkspace(path)
        tokens = self._device.allocate((rows,), torch.int64)
        try:
            log_probs = self._device.allocate((rows,), torch.float32) if logprobs else None
        except BaseException as error:
            attach_cleanup_failures(error, self._release(tokens), note="allocating a workspace")
            raise
        return PrefillReplayWorkspace(path, tokens, log_probs)

    def check_replay(
        self, prepared: PreparedPrefill, workspace: object, operation: str
    ) -> PrefillReplayWorkspace:
        """The workspace of a replay of `prepared` (`operation` names the public call).

        ValueError when `prepared` has no trace family; TypeError for a foreign workspace;
        RuntimeError when sampling parameters changed the compiled sampling path.
        """
        _require_trace(prepared, operation)
        if not isinstance(workspace, PrefillReplayWorkspace):
            raise TypeError(
                f"workspace must be a PrefillReplayWorkspace, got {type(workspace).__name__}"
            )
        needs_log_probs = bool(
            prepared.trace_signature is not None and prepared.trace_signature.logprobs_enabled
        )
        if workspace.sampling_path != prepared.sampling_path or (
            needs_log_probs and workspace.sampled_log_probs is None
        ):
            raise RuntimeError(
                f"sampling parameters changed the compiled sampling path: the workspace was "
                f"prepared for {workspace.sampling_path!r}"
                f"{' with' if workspace.sampled_log_probs is not None else ' without'} "
                f"log-probs, the request is {prepared.sampling_path!r}"
                f"{' with' if needs_log_probs else ' without'} log-probs"
            )
        return workspace

    def refresh(
        self, prepared: PreparedPrefill, inputs: PrefillDeviceInputs, chunk: PrefillChunk | None
    ) -> None:
        """Copy the inputs of `chunk` (default: the first) of `prepared` into `inputs`."""
        self._stager.refresh(self._stager.host_inputs(prepared.request, chunk), inputs)

    def finish(
        self, prepared: PreparedPrefill, output: object, workspace: PrefillReplayWorkspace
    ) -> InvocationResult:
        """Finish the request's final replay: its logits, or sampled into the workspace.

        `workspace` passed `check_replay`. The trace output and the workspace buffers are not
        the caller's to release; only eager post-processing intermediates are.
        """
        assert prepared.trace_signature is not None, "check_replay refuses untraced requests"
        if prepared.sampling_path == "logits":
            return InvocationResult(output, ())
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"a prefill trace replay must return the logits torch.Tensor, got "
                f"{type(output).__name__}"
            )
        sampled = self._postprocessor.sample(prepared, output)
        assert workspace.sampled_tokens is not None
        self._device.from_host(sampled.tokens, into=workspace.sampled_tokens)
        value: object = workspace.sampled_tokens
        if sampled.log_probs is not None:
            assert workspace.sampled_log_probs is not None
            self._device.from_host(sampled.log_probs, into=workspace.sampled_log_probs)
            value = (workspace.sampled_tokens, workspace.sampled_log_probs)
        return InvocationResult(value, sampled.intermediates)

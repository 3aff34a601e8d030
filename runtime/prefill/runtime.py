"""`PrefillRuntime`: the prefill facade a model executor drives.

`batch` checks a public prefill call's keywords once into a `PrefillBatch` (every caller
error is raised there); `prepare_batch` plans it (immutable requests and chunks), classifies
each request's sampling path and derives its program and trace identities (`prepare` does
both). `invoke` runs one
prepared request eagerly; `capture_plan`, `refresh_trace` and `finish_trace` are the traced
counterparts around `TraceCompiler.replay`; `assemble` reads the results back in source-row
order. Every transient the runtime cannot release immediately lands in one retryable orphan
list; while it is not empty the runtime refuses new work until `cleanup()` succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Unpack

import attrs
import torch

from lifecycle.errors import raise_cleanup_failures
from runtime.config import PageTableLayout
from runtime.prefill.batch import (
    IntVector,
    PlanLimits,
    PrefillArguments,
    PrefillBatch,
    PrefillRowArguments,
    check_batch,
    check_prefill_keywords,
)
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.inputs import PrefillInputStager
from runtime.prefill.plan import plan_batch, prefill_chunk_size
from runtime.prefill.postprocess import PrefillPostprocessor, classify_sampling_path
from runtime.prefill.request import PrefillChunk, PrefillRequest
from runtime.prefill.result_collector import (
    InvocationResult,
    PrefillOutput,
    PrefillResultAssembler,
)
from runtime.prefill.sampling_helpers import (
    default_prompt_history,
    pad_history_rows,
    select_history_rows,
)
from runtime.prefill.sequence_runner import PrefillSequenceRunner
from runtime.prefill.shared_forward import SharedCompileForward
from runtime.prefill.signatures import (
    PrefillSignature,
    PreparedPrefill,
    build_program_signatures,
    build_trace_signature,
)
from runtime.prefill.trace import (
    PrefillCapturePlan,
    PrefillTraceLifecycle,
    persistent_device_inputs,
)
from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    SamplingPath,
    slice_sampling_params,
)
from runtime.tensor_resources import TensorResourceOrphan, release_or_orphan, release_orphans

logger = logging.getLogger(__name__)

STATIC_Q128_TOPK_SUPPORTED = False
"""The torch runtime has no static-tile top-k sampler; program identities never bake a tile."""


def _trace_vector(value: object, batch: int, default: int) -> list[int] | None:
    """A per-row int vector for `can_trace`, or None when it is malformed (no exception)."""
    if value is None:
        return [default] * batch
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            return None
        items: list[object] = list(value.tolist())
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = list(value)
    else:
        return None
    ints = [item for item in items if isinstance(item, int) and not isinstance(item, bool)]
    return ints if len(ints) == len(items) == batch else None


class PrefillRuntime:
    """Plans, invokes, traces and assembles prefill for one lane (see the module docstring)."""

    def __init__(self, config: PrefillRuntimeConfig) -> None:
        if not isinstance(config, PrefillRuntimeConfig):
            raise TypeError(f"config must be a PrefillRuntimeConfig, got {type(config).__name__}")
        self._config = config
        self._limits = config.plan_limits()
        self._orphans: list[TensorResourceOrphan] = []
        self._stager = PrefillInputStager(
            device=config.device, release_transient=self._release_transient
        )
        self._postprocessor = PrefillPostprocessor(config)
        self._assembler = PrefillResultAssembler(config, self._release_transient)
        self._runner = PrefillSequenceRunner(
            model=config.model,
            input_stager=self._stager,
            postprocessor=self._postprocessor,
            release_transient=self._release_transient,
        )
        self._shared_forward = SharedCompileForward()
        self._trace = PrefillTraceLifecycle(
            config=config,
            input_stager=self._stager,
            postprocessor=self._postprocessor,
            release_transient=self._release_transient,
        )

    # -- state --------------------------------------------------------------------------------

    @property
    def config(self) -> PrefillRuntimeConfig:
        return self._config

    @property
    def shared_compile_forwards(self) -> int:
        """Compile runs that reused a sibling program's model forward (warmup redundancy cut)."""
        return self._shared_forward.hits

    @property
    def transient_orphan_count(self) -> int:
        """Transient value trees whose release failed; `cleanup()` retries them."""
        return len(self._orphans)

    def _release_transient(self, value: object) -> list[BaseException]:
        orphan, failures = release_or_orphan(value, self._config.device)
        if orphan is not None:
            logger.warning(
                "%d prefill transient release(s) failed; kept as an orphan", len(failures)
            )
            self._orphans.append(orphan)
        return failures

    def _require_usable(self, operation: str) -> None:
        if self._orphans:
            raise RuntimeError(
                f"{operation}: PrefillRuntime has unreleased transient resources; cleanup is "
                f"required ({len(self._orphans)} orphan(s); call cleanup())"
            )

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Adopt a late (smaller or equal) page-table layout; block size is fixed."""
        config = self._config.with_page_table_layout(layout)
        self._config = config
        self._limits = config.plan_limits()
        self._postprocessor.configure(config)
        self._assembler.configure(config)
        self._trace.configure(config)

    def cleanup(self) -> None:
        """Retry every orphaned transient; raise the first failure (rest attached) if any."""
        self._shared_forward.clear()
        failures = release_orphans(self._orphans)
        if failures:
            raise_cleanup_failures(failures)

    # -- planning -------------------------------------------------------------------------------

    def can_trace(
        self, *, tokens: object, prompt_lens: IntVector = None, start_pos: IntVector = None
    ) -> bool:
        """Whether every row's invocation length has a trace family; plans and allocates nothing.

        The cached offset is deliberately passed to `can_enable_trace` as 0: offsets are
        refreshed inputs of one chunk trace, not trace geometry.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] == 0:
            return False
        batch, width = int(tokens.shape[0]), int(tokens.shape[1])
        lengths = _trace_vector(prompt_lens, batch, width)
        starts = _trace_vector(start_pos, batch, 0)
        if lengths is None or starts is None:
            return False
        config = self._config
        block = config.page_table_layout.block_size
        for length, cached in zip(lengths, starts, strict=True):
            if cached < 0 or cached % block or length <= cached or length > width:
                return False
            padded = config.policy.padded_prefill_length(length - cached)
            try:
                size = prefill_chunk_size(
                    padded, config.max_prefill_chunk_size, policy=config.policy
                )
            except ValueError:
                return False
            if not config.can_enable_trace(size, 0):
                return False
        return True

    @property
    def plan_limits(self) -> PlanLimits:
        """The lane geometry every call is checked and planned against (from the config)."""
        return self._limits

    def batch(self, arguments: PrefillArguments, *, operation: str = "prepare") -> PrefillBatch:
        """The caller's arguments as a checked `PrefillBatch`: every caller error raises here.

        Checks the keyword names (as `operation()`), the sampling request against this
        runtime's device sampling, then the rows against its lane geometry.
        """
        check_prefill_keywords(operation, arguments)
        self._postprocessor.validate_sampling_request(arguments.get("sampling_params"))
        return check_batch(arguments, self._limits, arguments)

    def prepare(self, **arguments: Unpack[PrefillArguments]) -> tuple[PreparedPrefill, ...]:
        """Check and plan one prefill call (`prepare_batch` of `batch(arguments)`)."""
        self._require_usable("prepare")
        return self.prepare_batch(self.batch(arguments))

    def prepare_batch(self, batch: PrefillBatch) -> tuple[PreparedPrefill, ...]:
        """Plan one checked call; fully cached rows produce no request.

        `cached_tokens` is each row's cached (block-aligned) prefix. With `sampling_params`,
        `prompt_tokens` defaults to the prompt itself and `slot_remap` goes to the first
        request only.
        """
        self._require_usable("prepare")
        sampling_params = batch.sampling_params
        requests = self.plan_batch(batch, sampled=sampling_params is not None)
        prepared: list[PreparedPrefill] = []
        for index, request in enumerate(requests):
            raw: SamplingParams | None = None
            sampling: PreparedSamplingParams | None = None
            if sampling_params is not None:
                raw = slice_sampling_params(sampling_params, request.source_rows)
                sampling = self.prepare_request_sampling(
                    request,
                    raw,
                    batch.tokens,
                    prompt_tokens=batch.prompt_tokens,
                    output_tokens=batch.output_tokens,
                    slot_remap=batch.slot_remap if index == 0 else None,
                )
            prepared.append(self.identify(request, raw, sampling))
        logger.debug("prepared %d prefill request(s)", len(prepared))
        return tuple(prepared)

    def plan(
        self, *, sampled: bool = False, **arguments: Unpack[PrefillRowArguments]
    ) -> tuple[PrefillRequest, ...]:
        """The planner call `prepare` makes (warmup coverage derives identities from it).

        `sampled` says whether sampling parameters come with the call: without batched
        extraction they turn batching off.
        """
        return self.plan_batch(check_batch(arguments, self._limits), sampled=sampled)

    def plan_batch(self, batch: PrefillBatch, *, sampled: bool) -> tuple[PrefillRequest, ...]:
        """Plan a checked call (batching off for sampled calls without batched extraction)."""
        limits = self._limits
        if sampled and not self._config.batched_prefill_batched_extract:
            limits = attrs.evolve(limits, disable_batched_prefill=True)
        return plan_batch(batch, limits)

    def prepare_request_sampling(
        self,
        request: PrefillRequest,
        raw: SamplingParams,
        tokens: torch.Tensor,
        *,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
        slot_remap: IntVector = None,
    ) -> PreparedSamplingParams:
        """The prepared sampling of one planned request (`raw` sliced to its rows)."""
        return self._postprocessor.prepare_request_sampling(
            request,
            raw,
            prompt_tokens=self._prompt_history(request, tokens, prompt_tokens),
            output_tokens=self._history("output_tokens", request, tokens, output_tokens),
            slot_remap=slot_remap,
        )

    def _history(
        self,
        name: str,
        request: PrefillRequest,
        tokens: torch.Tensor,
        value: torch.Tensor | None,
    ) -> torch.Tensor | None:
        if value is None:
            return None
        rows = select_history_rows(
            name,
            value,
            source_rows=request.source_rows,
            slots=request.slots,
            request_batch=int(tokens.shape[0]),
            lane_capacity=self._config.max_batch_size,
        )
        return pad_history_rows(rows, self._postprocessor.sampling_batch_size(request))

    def _prompt_history(
        self, request: PrefillRequest, tokens: torch.Tensor, value: torch.Tensor | None
    ) -> torch.Tensor:
        if value is not None:
            history = self._history("prompt_tokens", request, tokens, value)
            assert history is not None
            return history
        rows = tokens[list(request.source_rows)]
        history = default_prompt_history(rows, request.prompt_lengths)
        return pad_history_rows(history, self._postprocessor.sampling_batch_size(request))

    def program_signatures(
        self, request: PrefillRequest, sampling: PreparedSamplingParams | None
    ) -> tuple[SamplingPath, tuple[PrefillSignature, ...]]:
        """The sampling path and program identities of a planned request (what `identify`
        and derived warmup coverage both use)."""
        path = classify_sampling_path(request, sampling)
        return path, build_program_signatures(
            request,
            path,
            static_q128_topk_supported=STATIC_Q128_TOPK_SUPPORTED,
            penalties_enabled=sampling is not None and sampling.penalties_enabled,
            logprobs_enabled=sampling is not None and sampling.log_probs_enabled,
        )

    def plan_single_rows(
        self, prompt_lens: Sequence[int], cached_tokens: Sequence[int]
    ) -> tuple[PrefillRequest, ...]:
        """Plan each row alone, as the planner plans a lane row it does not batch.

        One planner call for many rows (warmup coverage probes every prompt length): batching
        is off and the slot range is the row count, since a single row's plan depends on
        neither. A row the planner refuses makes the whole call raise `ValueError`.
        """
        rows = len(prompt_lens)
        width = max(prompt_lens)
        # Zero probes, never read: one zero row viewed as every row.
        arguments = PrefillRowArguments(
            tokens=torch.zeros(1, width, dtype=torch.long).expand(rows, width),
            page_table=torch.zeros(
                1, -(-width // self._limits.block_size), dtype=torch.int32
            ).expand(rows, -1),
        )
        arguments["prompt_lens"], arguments["start_pos"] = list(prompt_lens), list(cached_tokens)
        limits = attrs.evolve(self._limits, max_batch_size=rows, disable_batched_prefill=True)
        return plan_batch(check_batch(arguments, limits), limits)

    def identify(
        self,
        request: PrefillRequest,
        raw: SamplingParams | None,
        sampling: PreparedSamplingParams | None,
    ) -> PreparedPrefill:
        """A planned request with its sampling path and program and trace identities."""
        path, program_signatures = self.program_signatures(request, sampling)
        penalties = sampling is not None and sampling.penalties_enabled
        logprobs = sampling is not None and sampling.log_probs_enabled
        length = request.first_chunk.chunk_size
        trace_enabled = self._config.can_enable_trace(length, 0)
        if not isinstance(trace_enabled, bool):
            raise TypeError(
                f"can_enable_trace({length}, 0) must return bool, got "
                f"{type(trace_enabled).__name__} {trace_enabled!r}"
            )
        return PreparedPrefill(
            request=request,
            sampling_params=raw,
            sampling_path=path,
            program_signatures=program_signatures,
            trace_signature=build_trace_signature(
                request,
                trace_enabled=trace_enabled,
                sampling_path=path,
                penalties_enabled=penalties,
                logprobs_enabled=logprobs,
            ),
            prepared_sampling=sampling,
        )

    # -- execution ------------------------------------------------------------------------------

    def invoke(self, prepared: PreparedPrefill, *, count_tokens: bool = True) -> InvocationResult:
        """Run every planned chunk of `prepared` eagerly; the result owns its transients.

        `count_tokens=False` marks a compile run (the reference's call shape; this runtime has
        no sampling-state controller whose token counters it would drive): compile runs of
        programs that differ only in sampling path share one model forward.
        """
        if not isinstance(prepared, PreparedPrefill):
            raise TypeError(f"prepared must be a PreparedPrefill, got {type(prepared).__name__}")
        if not isinstance(count_tokens, bool):
            raise TypeError(f"count_tokens must be bool, got {type(count_tokens).__name__}")
        self._require_usable("invoke")
        if count_tokens:
            self._shared_forward.clear()
            return self._runner.run(prepared)
        return self._runner.run(prepared, shared=self._shared_forward)

    def assemble(
        self,
        prepared_results: Iterable[tuple[PreparedPrefill, InvocationResult]],
        *,
        batch_size: int,
        sampling_params: SamplingParams | None = None,
    ) -> PrefillOutput:
        """Read every result (lazily) and restore source-row order; see the assembler."""
        return self._assembler.assemble(
            prepared_results, batch_size=batch_size, sampling_params=sampling_params
        )

    # -- traces ---------------------------------------------------------------------------------

    def capture_plan(self, prepared: PreparedPrefill) -> PrefillCapturePlan:
        """The capture plan of `prepared`'s trace family (ValueError without one)."""
        self._require_usable("capture_plan")
        return self._trace.capture_plan(prepared)

    def refresh_trace(
        self,
        prepared: PreparedPrefill,
        persistent: object,
        workspace: object,
        chunk: PrefillChunk | None = None,
    ) -> None:
        """Refresh the persistent inputs for `chunk` (default: first) before a replay.

        `persistent` is the trace's `PersistentInputs` (or the `PrefillDeviceInputs` in it).
        """
        self._require_usable("refresh_trace")
        self._trace.check_replay(prepared, workspace, "refresh_trace")
        self._trace.refresh(prepared, persistent_device_inputs(persistent), chunk)

    def finish_trace(
        self, prepared: PreparedPrefill, output: object, workspace: object
    ) -> InvocationResult:
        """Finish a request after its final replay (logits, or sampled into the workspace)."""
        self._require_usable("finish_trace")
        checked = self._trace.check_replay(prepared, workspace, "finish_trace")
        return self._trace.finish(prepared, output, checked)

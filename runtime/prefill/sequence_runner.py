"""Run every planned chunk of one prefill request, in order, with failure-safe ownership.

Each chunk stages its inputs (owned transients) and invokes `model.prefill`. A chunk that does
not hold the request's last token only fills the KV cache, so its output is released at once;
the sequence stops at the chunk that holds the last token and post-processes that output.
If anything fails, everything the sequence owns so far is released as one unit and the
release failures travel on the primary error as `cleanup_failures`.
"""

from __future__ import annotations

import logging
from typing import Any

from lifecycle.errors import attach_cleanup_failures, raise_cleanup_failures
from runtime.model_contract import PagedModel
from runtime.prefill.inputs import PrefillDeviceInputs, PrefillInputStager, ReleaseTransient
from runtime.prefill.postprocess import PrefillPostprocessor
from runtime.prefill.result_collector import InvocationResult
from runtime.prefill.shared_forward import SharedCompileForward
from runtime.prefill.signatures import PreparedPrefill

logger = logging.getLogger(__name__)


def run_prefill_body(model: PagedModel, inputs: PrefillDeviceInputs) -> Any:
    """One model invocation over staged (or persistent) inputs: last-token logits `[B, V]`."""
    return model.prefill(
        inputs.tokens,
        page_table=inputs.page_table,
        prompt_lens=inputs.prompt_lens,
        chunk_start=inputs.chunk_start,
    )


class PrefillSequenceRunner:
    """Eager execution of one prepared request (regular: one step; chunked: several)."""

    def __init__(
        self,
        *,
        model: PagedModel,
        input_stager: PrefillInputStager,
        postprocessor: PrefillPostprocessor,
        release_transient: ReleaseTransient,
    ) -> None:
        self._model = model
        self._stager = input_stager
        self._postprocessor = postprocessor
        self._release = release_transient

    def run(
        self, prepared: PreparedPrefill, *, shared: SharedCompileForward | None = None
    ) -> InvocationResult:
        """Execute `prepared`; the result owns the staged inputs and the final output.

        With `shared` (compile runs only), a sibling program's forward is reused.
        """
        request = prepared.request
        owned: list[Any] = []
        reused = None if shared is None else shared.lookup(request)
        if reused is not None:
            try:
                return InvocationResult(
                    self._postprocessor.finish(prepared, reused, owned), tuple(owned)
                )
            except BaseException as error:
                attach_cleanup_failures(error, self._release(tuple(owned)))
                raise
        try:
            final: Any = None
            for index, chunk in enumerate(request.chunks):
                inputs = self._stager.stage(self._stager.host_inputs(request, chunk))
                owned.append(inputs)
                output = run_prefill_body(self._model, inputs)
                if not chunk.contains_last_token:
                    logger.debug(
                        "prefill rows %s: chunk %d filled the cache", request.source_rows, index
                    )
                    failures = self._release(output)
                    if failures:
                        raise_cleanup_failures(failures)
                    continue
                owned.append(output)
                final = output
                break
            if final is None:
                raise RuntimeError(
                    f"planned prefill sequence did not produce a final output for source rows "
                    f"{request.source_rows}"
                )
            if shared is not None:
                shared.remember(request, final)
            value = self._postprocessor.finish(prepared, final, owned)
        except BaseException as error:
            attach_cleanup_failures(
                error, self._release(tuple(owned)), note="releasing a failed prefill sequence"
            )
            raise
        return InvocationResult(value, tuple(owned))

"""Prefill result assembly: read each request's output and restore source-row order.

Results are consumed lazily, one (prepared, result) pair at a time, and each is read before
the next is pulled: trace replays may write every request's output into the same persistent
buffer. After a result is read (or fails to read) its owned values are released.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures, raise_cleanup_failures
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.inputs import ReleaseTransient
from runtime.prefill.plan import restore_source_order
from runtime.prefill.request import PrefillRequest
from runtime.prefill.signatures import PreparedPrefill
from runtime.sampling import LogProbRowPayload, merge_log_probs
from runtime.validation import positive_int

logger = logging.getLogger(__name__)

PrefillOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
"""Logits `[batch, 1, vocab]` float32, or `(tokens int64 [batch], log_probs float32 | None)`."""


def _owned_tuple(value: object) -> tuple[object, ...]:
    if not isinstance(value, tuple):
        raise TypeError(f"owned must be a tuple, got {type(value).__name__}")
    return value


@attrs.frozen(eq=False)
class InvocationResult:
    """One invoked request: the value to read and the transients the reader must release."""

    value: object
    """A device output: logits, tokens, or `(tokens, log_probs)`."""
    owned: tuple[object, ...] = attrs.field(default=(), converter=_owned_tuple)


def _host_rows(name: str, value: object, request: PrefillRequest, minimum: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor after the host read, got {type(value).__name__}")
    if value.dim() == 0 or int(value.shape[0]) < minimum:
        raise ValueError(
            f"{name} of the request for source rows {request.source_rows} has shape "
            f"{tuple(value.shape)}; expected at least {minimum} leading rows"
        )
    return value


class PrefillResultAssembler:
    """Reads prefill results through the output reader and assembles the public output."""

    def __init__(self, config: PrefillRuntimeConfig, release_transient: ReleaseTransient) -> None:
        self._config = config
        self._release = release_transient

    def configure(self, config: PrefillRuntimeConfig) -> None:
        """Swap in a new config (late page-table layout)."""
        self._config = config

    def assemble(
        self,
        prepared_results: Iterable[tuple[PreparedPrefill, InvocationResult]],
        *,
        batch_size: int,
        sampling_params: object | None = None,
    ) -> PrefillOutput:
        """Logits `[batch_size, 1, vocab]` (fully cached rows stay zero), or sampled tokens.

        Sampled output is `(tokens int64 [batch_size], log_probs)`, log-probs merged with 1.0
        for rows without them (None when no row asked). If the call fails, results not yet
        consumed from a sequence are released too; an iterator's remaining results stay with
        the caller.
        """
        positive_int("batch_size", batch_size)
        sampled = sampling_params is not None
        requests: list[PrefillRequest] = []
        rows: list[list[torch.Tensor]] = []
        payloads: list[LogProbRowPayload] = []
        pending = list(prepared_results) if isinstance(prepared_results, Sequence) else None
        iterator = iter(pending if pending is not None else prepared_results)
        consumed = 0
        try:
            for item in iterator:
                consumed += 1
                prepared, result = self._unpack(item)
                host = self._read(prepared, result, sampled=sampled)
                requests.append(prepared.request)
                if sampled:
                    tokens, payload = self._sampled_rows(prepared, host)
                    rows.append(tokens)
                    payloads.append((prepared.request.source_rows, payload))
                else:
                    rows.append(self._logit_rows(prepared, host))
            restored = restore_source_order(requests, rows, batch_size) if requests else ()
        except BaseException as error:
            if pending is not None:
                owned = tuple(
                    item[1].owned
                    for item in pending[consumed:]
                    if isinstance(item, tuple)
                    and len(item) == 2
                    and isinstance(item[1], InvocationResult)
                )
                attach_cleanup_failures(error, self._release(owned), note="assembling prefill")
            raise
        return self._output(restored, batch_size, sampled, payloads)

    def _unpack(self, item: object) -> tuple[PreparedPrefill, InvocationResult]:
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not isinstance(item[0], PreparedPrefill)
            or not isinstance(item[1], InvocationResult)
        ):
            raise TypeError(
                f"prepared_results must yield (PreparedPrefill, InvocationResult) pairs, got "
                f"{type(item).__name__}"
            )
        return item[0], item[1]

    def _read(
        self, prepared: PreparedPrefill, result: InvocationResult, *, sampled: bool
    ) -> object:
        """Read one result to host, then release its owned values (also when reading failed)."""
        try:
            if (prepared.sampling_path != "logits") != sampled:
                raise ValueError(
                    f"prefill sampling path disagrees with the public request: the request for "
                    f"source rows {prepared.request.source_rows} is on the "
                    f"{prepared.sampling_path!r} path, the public call "
                    f"{'has' if sampled else 'has no'} sampling_params"
                )
            host = self._config.output_reader.read_synchronized(result.value)
            if isinstance(host, tuple) and len(host) != 2:
                raise TypeError(
                    f"a sampled prefill output tuple must be (tokens, log_probs), got "
                    f"{len(host)} elements"
                )
        except BaseException as error:
            attach_cleanup_failures(error, self._release(result.owned), note="reading prefill")
            raise
        failures = self._release(result.owned)
        if failures:
            raise_cleanup_failures(failures)
        return host

    def _local_rows(self, request: PrefillRequest) -> range | list[int]:
        return range(request.active_batch_size) if request.kind == "batched" else [0]

    def _logit_rows(self, prepared: PreparedPrefill, host: object) -> list[torch.Tensor]:
        request = prepared.request
        vocab = self._config.model.vocab_size
        logits = _host_rows("prefill logits", host, request, request.active_batch_size)
        if logits.dim() != 2 or int(logits.shape[1]) < vocab:
            raise ValueError(
                f"prefill logits must be [rows, vocab >= {vocab}], got {tuple(logits.shape)}"
            )
        return [logits[local, :vocab].to(torch.float32) for local in self._local_rows(request)]

    def _sampled_rows(
        self, prepared: PreparedPrefill, host: object
    ) -> tuple[list[torch.Tensor], object]:
        request = prepared.request
        tokens, log_probs = host if isinstance(host, tuple) else (host, None)
        tokens = _host_rows("sampled tokens", tokens, request, request.active_batch_size)
        flat = tokens.reshape(int(tokens.shape[0]), -1)[:, 0].to(torch.int64)
        return [flat[local] for local in self._local_rows(request)], log_probs

    def _output(
        self,
        restored: tuple[torch.Tensor | None, ...],
        batch_size: int,
        sampled: bool,
        payloads: list[LogProbRowPayload],
    ) -> PrefillOutput:
        if sampled:
            tokens = torch.zeros(batch_size, dtype=torch.int64)
            for row, token in enumerate(restored):
                if token is not None:
                    tokens[row] = token
            return tokens, merge_log_probs(payloads, batch_size)
        logits = torch.zeros((batch_size, 1, self._config.model.vocab_size), dtype=torch.float32)
        for row, values in enumerate(restored):
            if values is not None:
                logits[row, 0] = values
        return logits

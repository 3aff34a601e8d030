"""Prefill post-processing: the sampling path of a request and device sampling of its logits.

The model already returns each row's last-token logits `[padded_batch, vocab]`, so the
logits path needs no work here. Sampled paths fit those logits to the sampler batch, stage the
request's prepared parameters into `model.sampling` (a single active row is copied to every
sampler row) and run it. Batched waves always use top-k: forced argmax is a single-row path.
"""

from __future__ import annotations

import logging
from collections.abc import MutableSequence, Sequence

import attrs
import torch

from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.request import PrefillRequest
from runtime.prefill.sampling_helpers import fit_sampling_logits
from runtime.prefill.signatures import PreparedPrefill
from runtime.sampling import (
    PreparedSamplingParams,
    Sampler,
    SamplingParams,
    SamplingPath,
    broadcast_active_row,
    prepare_sampling_params,
)

logger = logging.getLogger(__name__)


def classify_sampling_path(
    request: PrefillRequest, prepared_sampling: PreparedSamplingParams | None
) -> SamplingPath:
    """`logits` without sampling; `topk` for batched waves; else the prepared batch path."""
    if prepared_sampling is None:
        return "logits"
    if request.kind == "batched":
        return "topk"
    return prepared_sampling.sampling_path


def retain_owned(owned: MutableSequence[object], value: object) -> None:
    """Append `value` to `owned` unless it is None or already there (by identity)."""
    if value is None or any(existing is value for existing in owned):
        return
    owned.append(value)


@attrs.frozen(eq=False)
class SampledOutput:
    """Sampler results of one request, plus intermediates the caller owns."""

    tokens: torch.Tensor
    log_probs: torch.Tensor | None
    intermediates: tuple[torch.Tensor, ...]

    @property
    def value(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What the result collector reads: tokens, or `(tokens, log_probs)`."""
        return self.tokens if self.log_probs is None else (self.tokens, self.log_probs)


class PrefillPostprocessor:
    """Classifies sampling paths and samples a request's final logits on the device."""

    def __init__(self, config: PrefillRuntimeConfig) -> None:
        self._config = config

    @property
    def config(self) -> PrefillRuntimeConfig:
        return self._config

    def configure(self, config: PrefillRuntimeConfig) -> None:
        """Swap in a new config (late page-table layout); nothing else changes."""
        self._config = config

    def validate_sampling_request(self, sampling_params: object) -> None:
        """Sampling parameters need static device sampling; they must be `SamplingParams`."""
        if sampling_params is None:
            return
        if not self._config.device_sampling_enabled:
            raise ValueError(
                "sampling_params were supplied but device sampling is disabled for this prefill "
                "runtime; omit sampling_params to get logits, or resolve the config with "
                "device_sampling_enabled=True"
            )
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be SamplingParams or None, got "
                f"{type(sampling_params).__name__}"
            )

    def sampling_batch_size(self, request: PrefillRequest) -> int:
        """Sampler rows: the sampler batch with device sampling, else the padded batch."""
        if self._config.device_sampling_enabled:
            return self._config.sampling_batch_size
        return request.padded_batch_size

    def sampling_output_rows(self, prepared: PreparedPrefill) -> int:
        """Rows of the sampled output (and of the logits fed to the sampler)."""
        return self.sampling_batch_size(prepared.request)

    def prepare_request_sampling(
        self,
        request: PrefillRequest,
        sampling_params: SamplingParams,
        *,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
        slot_remap: Sequence[int] | torch.Tensor | None = None,
    ) -> PreparedSamplingParams:
        """Normalise a request's (sliced) parameters to the sampler batch.

        Local rows `0..active-1` are active. Batched waves are prepared without forced argmax,
        so their prepared path is top-k like their program identity.
        """
        config = self._config
        rows = self.sampling_batch_size(request)
        active = request.active_batch_size
        return prepare_sampling_params(
            sampling_params,
            rows,
            max_device_top_k=config.max_device_top_k,
            allow_force_argmax=config.allow_force_argmax and request.kind == "single",
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            slot_remap=slot_remap,
            active_mask=[row < active for row in range(rows)],
        )

    def prepared_sampling(self, prepared: PreparedPrefill) -> PreparedSamplingParams | None:
        """The prepared value's normalised sampling, prepared now from raw params if absent."""
        value = prepared.prepared_sampling
        if value is not None:
            if not isinstance(value, PreparedSamplingParams):
                raise TypeError(
                    f"prepared_sampling must be PreparedSamplingParams, got {type(value).__name__}"
                )
            return value
        raw = prepared.sampling_params
        if raw is None:
            return None
        self.validate_sampling_request(raw)
        assert isinstance(raw, SamplingParams)
        return self.prepare_request_sampling(prepared.request, raw)

    def _sampler(self, *, materialize: bool) -> Sampler:
        sampling: Sampler | None = getattr(self._config.model, "sampling", None)
        if sampling is None:
            raise RuntimeError(
                "device sampling needs model.sampling, which is no longer attached to the model"
            )
        ready = getattr(sampling, "materialize", None)
        if materialize and callable(ready) and not getattr(sampling, "materialized", True):
            # Eager only: a replay finishing after capture must find the buffers already there.
            ready(self._config.device.torch_device)
        return sampling

    def sample(
        self, prepared: PreparedPrefill, logits: torch.Tensor, *, materialize: bool = False
    ) -> SampledOutput:
        """Sample the final logits `[padded_batch, vocab]` of a request on the device.

        `materialize=True` (eager execution) lets a sampler whose buffers do not exist yet
        allocate them; traced finishing never does (buffers are materialised before capture).
        """
        if prepared.sampling_path == "logits":
            raise ValueError("sample() needs a sampled request; this one is on the logits path")
        params = self.prepared_sampling(prepared)
        if params is None:
            raise ValueError(
                f"sampling path {prepared.sampling_path!r} needs sampling parameters, the "
                "prepared request has none"
            )
        request = prepared.request
        rows = self.sampling_output_rows(prepared)
        if params.batch_size != rows:
            raise ValueError(
                f"prepared sampling has {params.batch_size} rows, the sampler batch is {rows}"
            )
        single = request.kind == "single"
        staged = broadcast_active_row(params) if single else params
        fitted = fit_sampling_logits(logits, rows)
        positions = torch.zeros(rows, dtype=torch.int64)
        if single:
            positions.fill_(request.last_token_indices[0])
        else:
            positions[: request.active_batch_size] = torch.tensor(request.last_token_indices)
        positions = positions.to(fitted.device)
        sampler = self._sampler(materialize=materialize)
        plan = sampler.stage(staged)
        output = sampler.run(
            fitted,
            plan,
            positions=positions,
            prompt_tokens=staged.prompt_tokens,
            output_tokens=staged.output_tokens,
        )
        tokens = output.tokens
        log_probs = output.log_probs if params.log_probs_enabled else None
        if params.log_probs_enabled and log_probs is None:
            raise RuntimeError("the sampler returned no log-probabilities although rows asked")
        intermediates = tuple(
            value
            for value in (fitted, positions, tokens, log_probs)
            if value is not None and value is not logits
        )
        return SampledOutput(tokens, log_probs, intermediates)

    def finish(
        self, prepared: PreparedPrefill, logits: torch.Tensor, owned: MutableSequence[object]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The request's value: its logits, or the sampled tokens (and log-probs).

        Every intermediate created here is appended to `owned` (identity de-duplicated).
        """
        if prepared.sampling_path == "logits":
            return logits
        sampled = self.sample(prepared, logits, materialize=True)
        for value in sampled.intermediates:
            retain_owned(owned, value)
        return sampled.value

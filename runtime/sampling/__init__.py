"""Sampling: request parameters, their device form, and the device sampler (reference §2.7, §3).

The jobs, one module each:

* `params`: `SamplingParams`, what a request asks for, validated field by field;
  `slice_sampling_params` picks one planned request's rows.
* `prepared`: `PreparedSamplingParams`, the per-physical-row form the device sampler reads, and
  the row moves on it (slice, place into lane slots, broadcast one active row).
* `prepare`: `prepare_sampling_params`, request parameters -> prepared form (all host-side).
* `log_probs`: merging per-request sampled-token log-prob payloads.
* `sampler`: `DeviceSampler` (its buffers, staging, and the trace-safe run), with
  `penalties` and `noise` as its steps.
* `checks`: the row-list, slot-remap and bool checks these modules share.

Import from here: the names callers use are re-exported.
"""

from runtime.sampling.log_probs import (
    LogProbRowPayload,
    merge_log_probs,
    sampled_log_probs_for_rows,
)
from runtime.sampling.params import MAX_SEED, NO_SEED, SamplingParams, slice_sampling_params
from runtime.sampling.penalties import apply_penalties
from runtime.sampling.prepare import prepare_sampling_params
from runtime.sampling.prepared import (
    PreparedSamplingParams,
    SamplingPath,
    broadcast_active_row,
    place_prepared_sampling_params,
    slice_prepared_sampling_params,
)
from runtime.sampling.sampler import (
    BufferedSampler,
    DeviceSampler,
    SampleOutput,
    Sampler,
    SamplerConfig,
    SamplerPlan,
)

__all__ = [
    "MAX_SEED",
    "NO_SEED",
    "BufferedSampler",
    "DeviceSampler",
    "LogProbRowPayload",
    "PreparedSamplingParams",
    "SampleOutput",
    "Sampler",
    "SamplerConfig",
    "SamplerPlan",
    "SamplingParams",
    "SamplingPath",
    "apply_penalties",
    "broadcast_active_row",
    "merge_log_probs",
    "place_prepared_sampling_params",
    "prepare_sampling_params",
    "sampled_log_probs_for_rows",
    "slice_prepared_sampling_params",
    "slice_sampling_params",
]

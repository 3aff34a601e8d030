"""The device sampler: what a model exposes as `model.sampling` (model-independent).

The sampler works on torch tensors on any device and is written so it can run inside a
captured trace (a CUDA graph, or the CPU backend's re-run trace):

* `materialize(device)` allocates every persistent buffer up front (per-row top_k, top_p,
  inverse temperature, seeds, penalties, log-prob row mask), so nothing is allocated lazily
  inside capture; given a runtime `Device` it allocates through it, so the device counts
  them; `release()` frees them (idempotent, retryable); `buffers` shows them.
* `stage(prepared)` copies one `PreparedSamplingParams` into those buffers in place (host work;
  run it before capture and before every replay) and returns the `SamplerPlan`: the static facts
  (batch, path, penalties on, log-probs on, top-n width, seeded) the computation branches on.
* `run(logits, plan, ...)` is the device computation. It branches only on the plan, never on
  tensor values, and reads per-row values from the buffers. A trace captured for one plan can
  be replayed for any prepared value with the same plan after `stage`.
* `sample(logits, prepared, ...)` is `stage` + `run`, for eager use.

Semantics, per row, in this order:

1. Penalties (only when any active row has one), from request-owned history; the rules are in
   `runtime.sampling.penalties`.
2. Scaling by the inverse temperature (1 for greedy rows).
3. Candidates: the row's `top_k` highest logits; then the nucleus: the smallest prefix (by
   descending probability of the top-k renormalised distribution) whose mass reaches `top_p`.
   The highest candidate is always kept, so `top_p = 0` (the greedy representation) keeps one.
4. Choice by Gumbel-max over the kept candidates, i.e. an exact draw from the renormalised
   distribution. Rows with top_k 1 (every greedy row) take `argmax` of the penalised logits
   instead, so greedy is exactly argmax (first index on ties).
5. Log-probability of the chosen token: `log_softmax` of the step-2 logits (penalised and
   temperature-scaled, before top-k/top-p truncation), float32. Rows that did not ask read 1.0.

Seeding is counter based (`runtime.sampling.noise`): a seeded row's noise is a function of
`(seed, position, token)` with `position` the caller's absolute position of the row. Equal seeds
at equal positions draw the same noise (no salting by slot). Unseeded rows draw a fresh random
32-bit key per call from torch's default generator on the logits' device (graph-safe on CUDA).

Trace limits: history tensors are arguments, not sampler buffers, so inside a trace they must
be persistent device tensors of fixed shape that the caller refreshes; the top-n width is part
of the plan; seeded rows need `positions` (a `[B]` int64 tensor, persistent inside a trace).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Literal, Protocol

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures, raise_cleanup_failures
from runtime.backends import Device, allocates_torch_tensors
from runtime.sampling.greedy import greedy_tokens
from runtime.sampling.noise import gumbel_noise, seeded_row_keys
from runtime.sampling.params import SamplingParams
from runtime.sampling.penalties import apply_penalties
from runtime.sampling.prepare import prepare_sampling_params
from runtime.sampling.prepared import PreparedSamplingParams
from runtime.validation import plain_bool, positive_int

logger = logging.getLogger(__name__)


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    positive_int(attribute.name, value)


def _is_bool(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    plain_bool(attribute.name, value)


@attrs.frozen
class SamplerConfig:
    """Static sampler capabilities the runtime reads (`model.sampling.config`).

    `max_batch_size` is the sampler batch (rows of every buffer); `max_top_k` is the device
    top-k ceiling (`max_device_top_k`); `allow_force_argmax` permits the argmax path.
    """

    max_batch_size: int = attrs.field(validator=_positive)
    max_top_k: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    allow_force_argmax: bool = attrs.field(default=True, validator=_is_bool)


@attrs.frozen
class SamplerPlan:
    """The static shape of one sampling computation; a trace is valid for one plan."""

    batch_size: int
    sampling_path: Literal["argmax", "topk"]
    penalties_enabled: bool
    log_probs_enabled: bool
    top_n: int
    seeded: bool

    @classmethod
    def from_prepared(cls, prepared: PreparedSamplingParams) -> SamplerPlan:
        return cls(
            batch_size=prepared.batch_size,
            sampling_path=prepared.sampling_path,
            penalties_enabled=prepared.penalties_enabled,
            log_probs_enabled=prepared.log_probs_enabled,
            top_n=prepared.max_num_logprobs,
            seeded=prepared.seeded,
        )

    @property
    def reads_buffers(self) -> bool:
        """Whether `run` reads the staged per-row buffers: the argmax path without
        penalties does not, so staging it only checks (no host-to-buffer copies a step)."""
        return self.sampling_path != "argmax" or self.penalties_enabled


@attrs.frozen
class SampleOutput:
    """Sampled tokens int64 `[B]`; float32 `[B]` log-probs when any row asked (others 1.0).

    `top_tokens`/`top_log_probs` (`[B, top_n]`) are present when any row asked for top-n;
    callers trim each row to its own `num_logprobs`.
    """

    tokens: torch.Tensor = attrs.field(eq=False)
    log_probs: torch.Tensor | None = attrs.field(default=None, eq=False)
    top_tokens: torch.Tensor | None = attrs.field(default=None, eq=False)
    top_log_probs: torch.Tensor | None = attrs.field(default=None, eq=False)


class Sampler(Protocol):
    """What prefill and decode ask of `model.sampling`; `DeviceSampler` implements it."""

    def stage(self, prepared: PreparedSamplingParams) -> SamplerPlan: ...

    def run(
        self,
        logits: torch.Tensor,
        plan: SamplerPlan,
        *,
        positions: torch.Tensor | None = None,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
    ) -> SampleOutput: ...


class BufferedSampler(Sampler, Protocol):
    """A `Sampler` owning persistent buffers an executor materialises and releases."""

    @property
    def materialized(self) -> bool: ...

    def materialize(self, device: Device | torch.device | str) -> None: ...

    def release(self) -> None: ...


_BUFFER_DTYPES: tuple[tuple[str, torch.dtype], ...] = (
    ("top_k", torch.int64),
    ("top_p", torch.float32),
    ("inverse_temperature", torch.float32),
    ("seed_low", torch.int64),
    ("seed_high", torch.int64),
    ("seeded", torch.bool),
    ("presence_penalty", torch.float32),
    ("frequency_penalty", torch.float32),
    ("repetition_penalty", torch.float32),
    ("log_prob_rows", torch.bool),
)


def _allocate_through(device: Device, rows: int) -> dict[str, torch.Tensor]:
    """Every sampler buffer allocated through `device`, or none: a failure deallocates the
    ones already made (their failures attached to the primary error) and re-raises."""
    made: dict[str, torch.Tensor] = {}
    try:
        for name, dtype in _BUFFER_DTYPES:
            tensor = device.allocate((rows,), dtype)
            if not isinstance(tensor, torch.Tensor):
                device.deallocate(tensor)
                raise TypeError(
                    f"sampler buffers must be torch tensors; device {device.name!r} allocated "
                    f"a {type(tensor).__name__}"
                )
            made[name] = tensor
    except BaseException as error:
        failures: list[BaseException] = []
        for tensor in made.values():
            try:
                device.deallocate(tensor)
            except BaseException as failure:
                failures.append(failure)
        attach_cleanup_failures(error, failures, note="allocating sampler buffers")
        raise
    return made


def _staged_values(prepared: PreparedSamplingParams) -> dict[str, torch.Tensor]:
    """The host tensors `stage` copies into the buffers, one per buffer name."""
    seeds = [0 if seed is None else seed for seed in prepared.seeds]
    return {
        "top_k": torch.tensor(prepared.top_k, dtype=torch.int64),
        "top_p": torch.tensor(prepared.top_p, dtype=torch.float32),
        "inverse_temperature": torch.tensor(prepared.inverse_temperature, dtype=torch.float32),
        "seed_low": torch.tensor([seed & 0xFFFFFFFF for seed in seeds], dtype=torch.int64),
        "seed_high": torch.tensor([seed >> 32 for seed in seeds], dtype=torch.int64),
        "seeded": torch.tensor([seed is not None for seed in prepared.seeds]),
        "presence_penalty": torch.tensor(prepared.presence_penalty, dtype=torch.float32),
        "frequency_penalty": torch.tensor(prepared.frequency_penalty, dtype=torch.float32),
        "repetition_penalty": torch.tensor(prepared.repetition_penalty, dtype=torch.float32),
        "log_prob_rows": torch.tensor([mode != "none" for mode in prepared.logprob_modes]),
    }


def _candidates(
    scaled: torch.Tensor, buf: Mapping[str, torch.Tensor], max_top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, ids, keep, top_k): each row's top-k candidates and which of them the nucleus
    keeps (step 3); `top_k` is the row's k clamped to the candidate width."""
    width = min(max_top_k, int(scaled.shape[1]))
    values, ids = torch.topk(scaled, width, dim=-1)
    ranks = torch.arange(width, device=scaled.device)
    top_k = buf["top_k"].clamp(max=width)
    in_top_k = ranks[None, :] < top_k[:, None]
    probs = torch.softmax(values.masked_fill(~in_top_k, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = in_top_k & ((mass_before < buf["top_p"][:, None]) | (ranks == 0)[None, :])
    return values, ids, keep, top_k


def _row_keys(buf: Mapping[str, torch.Tensor], positions: torch.Tensor | None) -> torch.Tensor:
    """Per-row noise keys: counter-based for seeded rows, fresh random for the others."""
    device = buf["seeded"].device
    rows = int(buf["seeded"].shape[0])
    pos = torch.zeros(rows, dtype=torch.int64, device=device) if positions is None else positions
    seeded_keys = seeded_row_keys(buf["seed_low"], buf["seed_high"], pos.to(device))
    random_keys = torch.randint(0, 2**32, (rows,), dtype=torch.int64, device=device)
    return torch.where(buf["seeded"], seeded_keys, random_keys)


def _with_log_probs(
    scaled: torch.Tensor, tokens: torch.Tensor, log_prob_rows: torch.Tensor, top_n: int
) -> SampleOutput:
    """`tokens` with their log-probabilities (step 5) and, for `top_n > 0`, the top-n table."""
    log_softmax = torch.log_softmax(scaled, dim=-1)
    chosen = log_softmax.gather(1, tokens[:, None]).squeeze(1)
    log_probs = torch.where(log_prob_rows, chosen, torch.ones_like(chosen))
    top_tokens: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    if top_n > 0:
        top_log_probs, top_tokens = torch.topk(log_softmax, min(top_n, scaled.shape[1]), dim=-1)
    return SampleOutput(
        tokens=tokens, log_probs=log_probs, top_tokens=top_tokens, top_log_probs=top_log_probs
    )


class DeviceSampler:
    """Per-row top-k / top-p / temperature sampling with seeds, penalties and log-probs."""

    def __init__(self, config: SamplerConfig) -> None:
        if not isinstance(config, SamplerConfig):
            raise TypeError(f"config must be SamplerConfig, got {type(config).__name__}")
        self.config = config
        self._buffers: dict[str, torch.Tensor] = {}
        self._device: torch.device | None = None
        self._owner: Device | None = None  # the runtime device the buffers came from, if any

    # ---- buffers -----------------------------------------------------------------------

    @property
    def materialized(self) -> bool:
        return self._device is not None

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """The persistent per-row buffers (empty before `materialize` and after `release`)."""
        return MappingProxyType(self._buffers)

    def materialize(self, device: Device | torch.device | str) -> None:
        """Allocate every buffer a sampling step (or a trace of one) reads; idempotent.

        Call it before trace capture. Given a runtime `Device`, the buffers are allocated
        through it, so its `live_allocations` counts them and `release()` deallocates them
        there (a leak shows up in the executor's cleanup checks); a plain torch device or
        name, or a backend whose tensors are not torch tensors, allocates with torch. Moving
        to another device needs `release()` first, so a captured trace can never be left
        reading freed buffers.
        """
        owner = device if isinstance(device, Device) else None
        target = device.torch_device if isinstance(device, Device) else torch.device(device)
        if self._device is not None:
            same_type = self._device.type == target.type
            if same_type and target.index in (None, self._device.index):
                return
            raise RuntimeError(
                f"sampler buffers are materialized on {self._device}; call release() before "
                f"materializing on {target}"
            )
        rows = self.config.max_batch_size
        if owner is not None and allocates_torch_tensors(owner):
            self._buffers = _allocate_through(owner, rows)
        else:
            owner = None
            self._buffers = {
                name: torch.zeros(rows, dtype=dtype, device=target)
                for name, dtype in _BUFFER_DTYPES
            }
        self._owner = owner
        # The buffers' own device: "cuda" resolves to "cuda:N", which logits report.
        self._device = self._buffers["top_k"].device
        logger.debug("sampler buffers materialized on %s for %d rows", self._device, rows)

    def release(self) -> None:
        """Free the buffers; idempotent and retryable. A later `materialize` allocates anew.

        Buffers owned by a runtime `Device` are deallocated there, each exactly once; a buffer
        whose deallocation fails stays held (so a retry releases it) and the first failure is
        raised with the others attached.
        """
        if self._owner is not None:
            failures: list[BaseException] = []
            for name in list(self._buffers):
                try:
                    self._owner.deallocate(self._buffers[name])
                except BaseException as error:
                    failures.append(error)
                else:
                    del self._buffers[name]
            if failures:
                raise_cleanup_failures(failures)
        self._buffers = {}
        self._device = None
        self._owner = None

    # ---- host side ---------------------------------------------------------------------

    def prepare(
        self,
        sp: SamplingParams,
        batch_size: int | None = None,
        *,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
        slot_remap: Sequence[int] | torch.Tensor | None = None,
        active_mask: Sequence[bool] | torch.Tensor | None = None,
    ) -> PreparedSamplingParams:
        """`prepare_sampling_params` with this sampler's top-k ceiling and argmax policy."""
        return prepare_sampling_params(
            sp,
            self.config.max_batch_size if batch_size is None else batch_size,
            max_device_top_k=self.config.max_top_k,
            allow_force_argmax=self.config.allow_force_argmax,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            slot_remap=slot_remap,
            active_mask=active_mask,
        )

    def _require_buffers(self) -> torch.device:
        if self._device is None:
            raise RuntimeError(
                "sampler buffers are not materialized; call materialize(device) before "
                "sampling (and before any trace capture)"
            )
        return self._device

    def stage(self, prepared: PreparedSamplingParams) -> SamplerPlan:
        """Copy `prepared` into the persistent buffers in place; returns its plan. A plan
        that reads no buffer (`SamplerPlan.reads_buffers`) is checked and copies nothing.

        Host work: run it outside a trace, before capture and before each replay.
        """
        if not isinstance(prepared, PreparedSamplingParams):
            raise TypeError(
                f"prepared must be PreparedSamplingParams, got {type(prepared).__name__}"
            )
        self._require_buffers()
        rows = prepared.batch_size
        if rows > self.config.max_batch_size:
            raise ValueError(
                f"prepared batch {rows} exceeds the sampler batch {self.config.max_batch_size}"
            )
        widest = max(prepared.top_k)
        if widest > self.config.max_top_k:
            raise ValueError(
                f"prepared top_k {widest} exceeds the sampler's max_top_k {self.config.max_top_k}"
            )
        if prepared.sampling_path == "argmax" and not self.config.allow_force_argmax:
            raise ValueError(
                "prepared for the argmax path, but this sampler has allow_force_argmax=False; "
                "prepare with allow_force_argmax=False"
            )
        plan = SamplerPlan.from_prepared(prepared)
        if plan.reads_buffers:
            for name, value in _staged_values(prepared).items():
                self._buffers[name][:rows].copy_(value)
        return plan

    # ---- device side -------------------------------------------------------------------

    def _check_run_inputs(
        self, logits: torch.Tensor, plan: SamplerPlan, positions: torch.Tensor | None
    ) -> None:
        """Refuse logits/positions that do not fit the plan and the buffers (before any op)."""
        device = self._require_buffers()
        if logits.dim() != 2 or logits.shape[0] != plan.batch_size:
            raise ValueError(
                f"logits must be [{plan.batch_size}, vocab] for this plan, got "
                f"{tuple(logits.shape)}"
            )
        rows, vocab = logits.shape
        if vocab != self.config.vocab_size:
            raise ValueError(
                f"logits have {vocab} columns; the sampler vocab is {self.config.vocab_size}"
            )
        if logits.device != device:
            raise ValueError(f"logits are on {logits.device}; sampler buffers are on {device}")
        if positions is not None and positions.shape != (rows,):
            raise ValueError(f"positions must be [{rows}], got {tuple(positions.shape)}")
        if plan.seeded and positions is None:
            raise ValueError(
                "seeded rows need positions: the seeded stream is a function of (seed, position)"
            )

    def run(
        self,
        logits: torch.Tensor,
        plan: SamplerPlan,
        *,
        positions: torch.Tensor | None = None,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Sample from `logits [B, V]` with the staged parameters; trace-safe (module doc)."""
        self._check_run_inputs(logits, plan, positions)
        x = logits.to(torch.float32)
        if not plan.reads_buffers:
            return SampleOutput(tokens=greedy_tokens(x))
        buf = {name: value[: plan.batch_size] for name, value in self._buffers.items()}
        if plan.penalties_enabled:
            x = apply_penalties(
                x,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                presence_penalty=buf["presence_penalty"],
                frequency_penalty=buf["frequency_penalty"],
                repetition_penalty=buf["repetition_penalty"],
            )
        greedy = greedy_tokens(x)
        if plan.sampling_path == "argmax":
            return SampleOutput(tokens=greedy)
        scaled = x * buf["inverse_temperature"][:, None]
        values, ids, keep, top_k = _candidates(scaled, buf, self.config.max_top_k)
        noise = gumbel_noise(_row_keys(buf, positions), ids)
        scores = torch.where(keep, values + noise, float("-inf"))
        sampled = ids.gather(1, torch.argmax(scores, dim=-1, keepdim=True)).squeeze(1)
        tokens = torch.where(top_k == 1, greedy, sampled)
        if not plan.log_probs_enabled:
            return SampleOutput(tokens=tokens)
        return _with_log_probs(scaled, tokens, buf["log_prob_rows"], plan.top_n)

    def sample(
        self,
        logits: torch.Tensor,
        prepared: PreparedSamplingParams,
        *,
        positions: torch.Tensor | None = None,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Eager sampling: `stage` then `run`; history defaults to the prepared history."""
        plan = self.stage(prepared)
        return self.run(
            logits,
            plan,
            positions=positions,
            prompt_tokens=prepared.prompt_tokens if prompt_tokens is None else prompt_tokens,
            output_tokens=prepared.output_tokens if output_tokens is None else output_tokens,
        )

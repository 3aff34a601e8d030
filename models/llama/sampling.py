"""Device sampling for the Llama family: the module a model exposes as `model.sampling`.

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

1. Penalties (only when any active row has one), from request-owned history (`-1` = no token;
   ids outside `[0, vocab)` are ignored): a token seen in the prompt or the output has a
   positive logit divided by `repetition_penalty` and a negative logit multiplied by it; then
   `frequency_penalty * count` is subtracted, with `count` the token's occurrences in the
   output; then `presence_penalty` is subtracted once for every token present in the output.
2. Scaling by the inverse temperature (1 for greedy rows).
3. Candidates: the row's `top_k` highest logits; then the nucleus: the smallest prefix (by
   descending probability of the top-k renormalised distribution) whose mass reaches `top_p`.
   The highest candidate is always kept, so `top_p = 0` (the greedy representation) keeps one.
4. Choice by Gumbel-max over the kept candidates, i.e. an exact draw from the renormalised
   distribution. Rows with top_k 1 (every greedy row) take `argmax` of the penalised logits
   instead, so greedy is exactly argmax (first index on ties).
5. Log-probability of the chosen token: `log_softmax` of the step-2 logits (penalised and
   temperature-scaled, before top-k/top-p truncation), float32. Rows that did not ask read 1.0.

Seeding is counter based: the noise of token `t` in a seeded row is a hash of
`(seed, position, t)` where `position` is the caller's absolute position of the row. So a
seeded row's stream depends only on its seed, its positions and its logits: not on the slot it
occupies, the other rows in the batch, or earlier calls. Equal seeds at equal positions draw
the same noise (no salting by slot). Unseeded rows draw a fresh random 32-bit key per call from
torch's default generator on the logits' device (graph-safe on CUDA).

Trace limits: history tensors are arguments, not sampler buffers, so inside a trace they must
be persistent device tensors of fixed shape that the caller refreshes; the top-n width is part
of the plan; seeded rows need `positions` (a `[B]` int64 tensor, persistent inside a trace).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures, raise_cleanup_failures
from runtime.backends import Device, allocates_torch_tensors
from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    prepare_sampling_params,
)

logger = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x85EBCA6B


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _is_bool(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be bool, got {value!r}")


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


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------


def _row_values(
    name: str, value: float | torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        out = value.to(device=device, dtype=torch.float32).reshape(-1)
        if out.shape[0] != rows:
            raise ValueError(f"{name} has {out.shape[0]} rows; expected {rows}")
        return out
    return torch.full((rows,), float(value), dtype=torch.float32, device=device)


def _token_counts(
    name: str, tokens: torch.Tensor | None, rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """Per-row occurrences of each vocab id, float32 `[rows, vocab]`; ids outside it skipped."""
    counts = torch.zeros((rows, vocab + 1), dtype=torch.float32, device=device)
    if tokens is None:
        return counts[:, :vocab]
    if tokens.dim() != 2 or tokens.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, length], got shape {tuple(tokens.shape)}")
    ids = tokens.to(device=device, dtype=torch.int64)
    index = torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_tokens: torch.Tensor | None = None,
    output_tokens: torch.Tensor | None = None,
    presence_penalty: float | torch.Tensor = 0.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    repetition_penalty: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Penalised float32 copy of `logits [B, V]` (see the module docstring, step 1).

    Penalties are a float (every row) or a `[B]` tensor. History is `[B, length]` integer,
    `-1` padded. Neutral values (0, 0, 1) leave a row bit-identical.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    x = logits.to(torch.float32)
    output_counts = _token_counts("output_tokens", output_tokens, rows, vocab, device)
    prompt_counts = _token_counts("prompt_tokens", prompt_tokens, rows, vocab, device)
    in_output = output_counts > 0
    seen = in_output | (prompt_counts > 0)
    repetition = _row_values("repetition_penalty", repetition_penalty, rows, device)[:, None]
    frequency = _row_values("frequency_penalty", frequency_penalty, rows, device)[:, None]
    presence = _row_values("presence_penalty", presence_penalty, rows, device)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * output_counts
    return torch.where(in_output, x - presence, x)


# --------------------------------------------------------------------------------------------
# Counter-based noise
# --------------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """`x * constant mod 2**32` for int64 `x` in [0, 2**32), without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply), exact on every device."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_row_keys(
    seed_low: torch.Tensor, seed_high: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Per-row 32-bit key from a 64-bit seed (two 32-bit halves) and an absolute position."""
    key = _mix32(seed_high ^ _SEED_SALT)
    key = _mix32(key ^ seed_low)
    return _mix32(key ^ (positions.to(torch.int64) & _MASK32))


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) float32 noise for `token_ids [B, C]` of rows with `keys [B]`."""
    bits = _mix32(_mix32((token_ids & _MASK32) ^ _TOKEN_SALT) ^ keys[:, None])
    # 23 bits -> uniform strictly inside (0, 1), exactly representable in float32.
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(uniform))


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


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


class LlamaSampler:
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
        target = owner.torch_device if owner is not None else torch.device(device)
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
        **kwargs: Any,
    ) -> PreparedSamplingParams:
        """`prepare_sampling_params` with this sampler's top-k ceiling and argmax policy."""
        return prepare_sampling_params(
            sp,
            self.config.max_batch_size if batch_size is None else batch_size,
            max_device_top_k=self.config.max_top_k,
            allow_force_argmax=self.config.allow_force_argmax,
            **kwargs,
        )

    def _require_buffers(self) -> torch.device:
        if self._device is None:
            raise RuntimeError(
                "sampler buffers are not materialized; call materialize(device) before "
                "sampling (and before any trace capture)"
            )
        return self._device

    def stage(self, prepared: PreparedSamplingParams) -> SamplerPlan:
        """Copy `prepared` into the persistent buffers in place; returns its plan.

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
        seeds = [0 if seed is None else seed for seed in prepared.seeds]
        host: dict[str, torch.Tensor] = {
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
        for name, value in host.items():
            self._buffers[name][:rows].copy_(value)
        return SamplerPlan.from_prepared(prepared)

    # ---- device side -------------------------------------------------------------------

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
        buf = {name: value[:rows] for name, value in self._buffers.items()}

        x = logits.to(torch.float32)
        if plan.penalties_enabled:
            x = apply_penalties(
                x,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                presence_penalty=buf["presence_penalty"],
                frequency_penalty=buf["frequency_penalty"],
                repetition_penalty=buf["repetition_penalty"],
            )
        greedy_tokens = torch.argmax(x, dim=-1)
        if plan.sampling_path == "argmax":
            return SampleOutput(tokens=greedy_tokens)

        scaled = x * buf["inverse_temperature"][:, None]
        width = min(self.config.max_top_k, vocab)
        values, ids = torch.topk(scaled, width, dim=-1)
        ranks = torch.arange(width, device=device)
        top_k = buf["top_k"].clamp(max=width)
        in_top_k = ranks[None, :] < top_k[:, None]
        probs = torch.softmax(values.masked_fill(~in_top_k, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = in_top_k & ((mass_before < buf["top_p"][:, None]) | (ranks == 0)[None, :])

        pos = (
            torch.zeros(rows, dtype=torch.int64, device=device) if positions is None else positions
        )
        seeded_keys = seeded_row_keys(buf["seed_low"], buf["seed_high"], pos.to(device))
        random_keys = torch.randint(0, 2**32, (rows,), dtype=torch.int64, device=device)
        keys = torch.where(buf["seeded"], seeded_keys, random_keys)
        scores = torch.where(keep, values + gumbel_noise(keys, ids), float("-inf"))
        choice = torch.argmax(scores, dim=-1, keepdim=True)
        sampled = ids.gather(1, choice).squeeze(1)
        tokens = torch.where(top_k == 1, greedy_tokens, sampled)

        if not plan.log_probs_enabled:
            return SampleOutput(tokens=tokens)
        log_softmax = torch.log_softmax(scaled, dim=-1)
        chosen = log_softmax.gather(1, tokens[:, None]).squeeze(1)
        log_probs = torch.where(buf["log_prob_rows"], chosen, torch.ones_like(chosen))
        top_tokens: torch.Tensor | None = None
        top_log_probs: torch.Tensor | None = None
        if plan.top_n > 0:
            top_log_probs, top_tokens = torch.topk(log_softmax, min(plan.top_n, vocab), dim=-1)
        return SampleOutput(
            tokens=tokens, log_probs=log_probs, top_tokens=top_tokens, top_log_probs=top_log_probs
        )

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

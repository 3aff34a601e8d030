"""The lane group's boundary: a caller error is refused here, before any lane is called.

Every check is a single-lane boundary rule (`runtime.prefill.batch.check_batch`,
`runtime.decode_batch`, `runtime.sampling.prepare_sampling_params`) applied once to the whole
global batch against the group's geometry: global slots, and each lane's own KV pool of
`num_blocks` blocks (block ids are lane-local, every lane has the same pool). A refused call
changes nothing; only a failure while the lanes execute takes the group's clean-up path.
Facts a lane does not report (a small fake lane) skip the checks that need them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from runtime import validation
from runtime.config import PageTableLayout
from runtime.decode_batch import (
    DecodeArguments,
    check_decode_options,
    check_lane_inputs,
    check_sampling_arguments,
    check_token_ids,
    page_table_copy_counts,
)
from runtime.lane_routing import route_prefill_rows
from runtime.lanes.protocol import LaneFacts
from runtime.prefill.batch import PlanLimits, PrefillArguments, check_batch, check_prefill_keywords
from runtime.sampling import SamplingParams, prepare_sampling_params, slice_sampling_params
from runtime.steps import DecodeCheck
from runtime.validation import require_bool

__all__ = [
    "GroupBoundary",
    "GroupGeometry",
    "SamplingMemo",
    "check_cache_spec_given",
    "check_group_cache_shape",
    "check_group_decode",
    "check_group_prefill",
    "check_traced_executions",
]


@attrs.frozen
class GroupGeometry:
    """What the group's calls are checked against, read from lane 0's facts (every lane has
    the same capacity and pool) with the batch widened to the group's global slots."""

    operation_owner: str
    lanes: int
    per_lane: int
    num_blocks: int | None
    block_size: int | None
    page_table_layout: PageTableLayout | None
    plan_limits: PlanLimits | None
    vocab_size: int | None
    device_sampling_enabled: bool
    max_device_top_k: int | None
    decode_check: DecodeCheck | None = None
    """The stamp of a decode step checked against this geometry (None: a fact is missing)."""

    @property
    def capacity(self) -> int:
        """Global slots (rows of one decode step)."""
        return self.lanes * self.per_lane

    @classmethod
    def of(cls, owner: str, facts: Sequence[LaneFacts], per_lane: int) -> GroupGeometry:
        first = facts[0]
        layout = (
            first.page_table_layout
            if isinstance(first.page_table_layout, PageTableLayout)
            else None
        )
        limits = first.plan_limits
        vocab = first.vocab_size
        check = (
            None
            if vocab is None or layout is None
            else DecodeCheck(
                lane_capacity=per_lane,
                vocab_size=vocab,
                page_table_layout=layout,
                num_blocks=first.num_blocks,
                device_sampling_enabled=first.device_sampling_enabled,
            )
        )
        return cls(
            operation_owner=owner,
            lanes=len(facts),
            per_lane=per_lane,
            num_blocks=first.num_blocks,
            block_size=first.block_size,
            page_table_layout=layout,
            plan_limits=limits,
            vocab_size=vocab,
            device_sampling_enabled=first.device_sampling_enabled,
            max_device_top_k=first.max_device_top_k,
            decode_check=check,
        )

    def prefill_limits(self) -> PlanLimits | None:
        """The lane's own plan limits over the group's global slots (None: not reported)."""
        if self.plan_limits is None:
            return None
        return attrs.evolve(self.plan_limits, max_batch_size=self.capacity)


# -- prefill --------------------------------------------------------------------------------------


@attrs.define
class SamplingMemo:
    """The last sampling request that passed the sampler's row rules, with its active rows:
    a caller that sends the same `SamplingParams` object every step is checked once."""

    params: SamplingParams | None = None
    active: tuple[bool, ...] = ()

    def passed(self, params: SamplingParams, active: tuple[bool, ...]) -> bool:
        return params is self.params and active == self.active

    def remember(self, params: SamplingParams, active: tuple[bool, ...]) -> None:
        self.params, self.active = params, active


class GroupBoundary:
    """The group's boundary with what stays put between calls kept: the geometry (rebuilt
    only when a lane's facts change) and the last sampling request that passed."""

    def __init__(self, owner: str, per_lane: int) -> None:
        self.owner = owner
        self.per_lane = per_lane
        self._facts: tuple[LaneFacts, ...] = ()
        self._geometry: GroupGeometry | None = None
        self._sampling = SamplingMemo()

    def geometry(self, facts: Sequence[LaneFacts]) -> GroupGeometry:
        """The geometry of the lanes' current facts (the same object while they hold)."""
        same = len(facts) == len(self._facts) and all(
            a is b for a, b in zip(facts, self._facts, strict=True)
        )
        if self._geometry is None or not same:
            self._facts = tuple(facts)
            self._geometry = GroupGeometry.of(self.owner, facts, self.per_lane)
        return self._geometry

    def check_prefill(self, arguments: PrefillArguments, facts: Sequence[LaneFacts]) -> None:
        check_group_prefill(arguments, self.geometry(facts))

    def check_decode(
        self, arguments: DecodeArguments, facts: Sequence[LaneFacts]
    ) -> DecodeCheck | None:
        return check_group_decode(arguments, self.geometry(facts), sampling=self._sampling)


def check_group_prefill(arguments: PrefillArguments, geometry: GroupGeometry) -> None:
    """Refuse a prefill call a lane would refuse (keywords, rows, slots, sampling, block ids)."""
    operation = f"{geometry.operation_owner}.prefill_forward"
    check_prefill_keywords(operation, arguments)
    tokens = arguments["tokens"]
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 1:
        # Slots first, in the group's words (global slots over the lanes).
        route_prefill_rows(
            int(tokens.shape[0]),
            arguments.get("empty_slots"),
            per_lane=geometry.per_lane,
            lanes=geometry.lanes,
        )
    limits = geometry.prefill_limits()
    read = None
    if limits is not None:
        batch = check_batch(arguments, attrs.evolve(limits, num_blocks=None), arguments)
        rows = batch.batch_size
        read = batch.blocks_read(limits.block_size)
    else:
        rows = _rows_of("tokens", tokens, rank=2)
    _check_sampling(
        geometry,
        arguments.get("sampling_params"),
        active=[True] * rows,
        kind="prefill",
    )
    check_block_ids(arguments["page_table"], geometry.num_blocks, read=read)


# -- decode ---------------------------------------------------------------------------------------


def check_group_decode(
    arguments: DecodeArguments, geometry: GroupGeometry, *, sampling: SamplingMemo | None = None
) -> DecodeCheck | None:
    """Refuse a decode step a lane would refuse (batch, dtypes, ids, positions, sampling).

    Returns the stamp the lanes' steps carry (`DecodeCheck`: what every lane boundary rule
    was checked against), so a lane of that geometry does not check its part again; None
    when a lane fact a rule needs was not reported (a small fake lane checks its own).
    """
    operation = f"{geometry.operation_owner}.decode_forward"
    options = {
        name: value
        for name, value in arguments.items()
        if name not in ("tokens", "start_pos", "page_table")
    }
    check_decode_options(operation, options)
    for name in ("tokens", "start_pos", "page_table"):
        if name not in arguments:
            raise TypeError(f"{operation}() missing required keyword-only argument {name!r}")
    _check_global_batch(arguments, geometry)
    lane = check_lane_inputs(
        geometry.capacity, arguments["tokens"], arguments["start_pos"], arguments["page_table"]
    )
    require_bool("reset_batch", arguments.get("reset_batch", False))
    params = check_sampling_arguments(
        geometry.device_sampling_enabled,
        arguments.get("sampling_params"),
        prompt_tokens=arguments.get("prompt_tokens"),
        output_tokens=arguments.get("output_tokens"),
        slot_remap=arguments.get("slot_remap"),
    )
    if geometry.vocab_size is not None:
        check_token_ids(lane, geometry.vocab_size)
    read = None
    if geometry.page_table_layout is not None:
        read = page_table_copy_counts(
            lane.page_table,
            lane.positions,
            layout=geometry.page_table_layout,
            device_feedback=False,
        )
    check_block_ids(lane.page_table, geometry.num_blocks, read=read)
    if params is not None:
        _check_decode_sampling(geometry, params, lane.active, sampling)
    return geometry.decode_check


def _check_decode_sampling(
    geometry: GroupGeometry,
    params: SamplingParams,
    active_mask: torch.Tensor,
    sampling: SamplingMemo | None,
) -> None:
    """The sampler's row rules over the global slots (once per repeated request)."""
    active = tuple(bool(flag) for flag in active_mask.tolist())
    if sampling is None or not sampling.passed(params, active):
        _check_sampling(geometry, params, active=list(active), kind="decode")
        if sampling is not None:
            sampling.remember(params, active)


def _check_global_batch(arguments: DecodeArguments, geometry: GroupGeometry) -> None:
    """The group's fixed global batch (in the group's words, before the tensor checks)."""
    for name in ("tokens", "start_pos", "page_table"):
        value = arguments[name]
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            rows = int(value.shape[0])
            if rows != geometry.capacity:
                raise ValueError(
                    f"DP decode expects fixed global batch {geometry.capacity}; {name} has "
                    f"{rows} rows ({geometry.lanes} lanes x {geometry.per_lane})"
                )


# -- shared rules ---------------------------------------------------------------------------------


def _rows_of(name: str, value: object, *, rank: int) -> int:
    if not isinstance(value, torch.Tensor) or value.dim() != rank:
        raise ValueError(f"{name} must be a rank-{rank} torch tensor, got {value!r:.80}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
    return int(value.shape[0])


def _check_sampling(
    geometry: GroupGeometry, params: object, *, active: list[bool], kind: str
) -> None:
    """The device sampler's row rules (top_k range, temperature, row coverage, an active
    row) over the whole batch; a lane sees a slice of rows that passed them."""
    if params is None:
        return
    if not geometry.device_sampling_enabled:
        raise ValueError(
            f"sampling_params were supplied but device sampling is disabled for this {kind}; "
            "omit sampling_params to get logits, or load the lanes with device sampling"
        )
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if not any(active):
        raise ValueError(
            "sampling_params need at least one active decode row (start_pos >= 0); "
            "every row is inactive"
        )
    if geometry.max_device_top_k is None:
        return
    # The rows the lanes will see (as the router slices them), then the sampler's rules.
    prepare_sampling_params(
        slice_sampling_params(params, range(len(active))),
        len(active),
        max_device_top_k=geometry.max_device_top_k,
        allow_force_argmax=False,
        active_mask=active,
    )


def check_block_ids(
    page_table: object, num_blocks: int | None, *, read: torch.Tensor | None = None
) -> None:
    """The pool rule (`runtime.validation.check_block_ids`) against each lane's own pool."""
    if num_blocks is None or not isinstance(page_table, torch.Tensor):
        return
    note = (
        f" (each DP lane's KV pool holds num_blocks={num_blocks} blocks; block ids are lane-local)"
    )
    validation.check_block_ids(page_table, num_blocks, read=read, note=note)


def check_traced_executions(
    executions: Sequence[str | None], operation: str, facts: Sequence[LaneFacts]
) -> None:
    """`execution='traced'` only for an operation every lane traces (as a lane refuses it)."""
    for lane, (execution, fact) in enumerate(zip(executions, facts, strict=True)):
        traced = fact.prefill_traced if operation == "prefill" else fact.decode_traced
        if execution == "traced" and not traced:
            raise ValueError(
                f"execution='traced' asked for {operation} on DP lane {lane}, which trace mode "
                f"{fact.trace_mode!r} does not trace"
            )


# -- the KV cache spec ----------------------------------------------------------------------------


def check_cache_spec_given(kv_cache_shape: object, dtype: object, num_layers: object) -> None:
    """A server passes its cache spec whole (shape, dtype and layer count) or not at all."""
    given = [value is not None for value in (kv_cache_shape, dtype, num_layers)]
    if any(given) and not all(given):
        raise TypeError(
            "allocate_kv_cache takes kv_cache_shape, dtype and num_layers together or not at all"
        )


def check_group_cache_shape(
    facts: Sequence[LaneFacts], kv_cache_shape: Sequence[int], num_layers: int | None
) -> None:
    """Once capacity is resolved, the server's shape must be every layer's model shape on
    every lane (as one lane refuses it), checked before any lane allocates."""
    for fact in facts:
        expected = fact.kv_cache_shapes
        if not expected:
            continue  # a lane that does not report its shapes checks the spec itself
        if num_layers is not None and num_layers != len(expected):
            raise ValueError(
                f"num_layers {num_layers} does not match the model's {len(expected)} layers"
            )
        if any(tuple(kv_cache_shape) != shape for shape in expected):
            raise ValueError(
                f"kv_cache_shape {tuple(kv_cache_shape)} does not match the model-derived "
                f"shapes {sorted(set(expected))}"
            )

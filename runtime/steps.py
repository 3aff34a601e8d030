"""Typed steps: one prefill or decode call's inputs as a frozen value, and the target API.

A `LaneGroupExecutor` checks a call once at its boundary, builds one `PrefillStep` or
`DecodeStep`, splits it per lane (`runtime.lane_routing`) and sends each lane its own step
through the lane protocol (the process transport pickles it); the executing side hands the
step's keywords to the lane executor. `ExecutionTarget` names what a lane group, an eager
executor's host (`ModelExecutor`) and a traced one each offer a caller. `page_table` keeps
that name from the boundary to the model.

A decode step the group's boundary checked carries a `DecodeCheck`: the lane geometry it was
checked against. A lane whose own geometry is that one trusts the step and does not check it
again (`DecodeRuntime.prepare_step`); any other step, or one without the stamp, is checked by
the lane's own boundary as every public call is. Only `runtime.lanes.boundary` stamps steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Unpack, runtime_checkable

import attrs
import torch

from runtime.config import PageTableLayout
from runtime.decode_batch import DecodeArguments, SlotRemap
from runtime.prefill.batch import IntVector, PrefillArguments
from runtime.sampling import SamplingParams

__all__ = ["DecodeCheck", "DecodeStep", "ExecutionTarget", "LaneStep", "PrefillStep"]


@attrs.frozen(eq=False)
class PrefillStep:
    """One prefill call: the `PrefillArguments` plus where it runs (`kv_cache`, `execution`).

    None means "not given" for every optional field, exactly as an omitted keyword.
    """

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: IntVector = None
    start_pos: IntVector = None
    empty_slots: IntVector = None
    sampling_params: SamplingParams | None = None
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    slot_remap: IntVector = None
    kv_cache: object = None
    execution: str | None = None

    @classmethod
    def of(
        cls, arguments: PrefillArguments, *, kv_cache: object = None, execution: str | None = None
    ) -> PrefillStep:
        """The step of checked keyword arguments (the boundary built and checked them)."""
        return cls(
            tokens=arguments["tokens"],
            page_table=arguments["page_table"],
            prompt_lens=arguments.get("prompt_lens"),
            start_pos=arguments.get("start_pos"),
            empty_slots=arguments.get("empty_slots"),
            sampling_params=arguments.get("sampling_params"),
            prompt_tokens=arguments.get("prompt_tokens"),
            output_tokens=arguments.get("output_tokens"),
            slot_remap=arguments.get("slot_remap"),
            kv_cache=kv_cache,
            execution=execution,
        )

    def keywords(self) -> dict[str, object]:
        """The executor call's keywords: the given arguments plus `kv_cache`/`execution`."""
        return _given(
            tokens=self.tokens,
            page_table=self.page_table,
            prompt_lens=self.prompt_lens,
            start_pos=self.start_pos,
            empty_slots=self.empty_slots,
            sampling_params=self.sampling_params,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            slot_remap=self.slot_remap,
            kv_cache=self.kv_cache,
            execution=self.execution,
        )


@attrs.frozen
class DecodeCheck:
    """The lane geometry a group boundary checked a decode step against: the rows of one lane,
    the vocabulary, the page-table layout, the KV pool's blocks (None: not judged) and whether
    sampling parameters are accepted. Every caller error of `DecodeRuntime.prepare` depends on
    these and on the step alone."""

    lane_capacity: int
    vocab_size: int
    page_table_layout: PageTableLayout
    num_blocks: int | None
    """Compared on its own: a layout's pool is not part of the layout's equality."""
    device_sampling_enabled: bool


@attrs.frozen(eq=False)
class DecodeStep:
    """One decode step over a lane (or the whole group): `DecodeArguments` plus placement.

    `checked` is set by the group boundary only (see the module docstring).
    """

    tokens: torch.Tensor
    start_pos: torch.Tensor
    page_table: torch.Tensor
    sampling_params: SamplingParams | None = None
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    slot_remap: SlotRemap | None = None
    reset_batch: bool = False
    kv_cache: object = None
    execution: str | None = None
    read_from_device: bool = True
    checked: DecodeCheck | None = None

    @classmethod
    def of(
        cls,
        arguments: DecodeArguments,
        *,
        kv_cache: object = None,
        execution: str | None = None,
        read_from_device: bool = True,
        checked: DecodeCheck | None = None,
    ) -> DecodeStep:
        """The step of checked keyword arguments (the boundary built and checked them)."""
        return cls(
            tokens=arguments["tokens"],
            start_pos=arguments["start_pos"],
            page_table=arguments["page_table"],
            sampling_params=arguments.get("sampling_params"),
            prompt_tokens=arguments.get("prompt_tokens"),
            output_tokens=arguments.get("output_tokens"),
            slot_remap=arguments.get("slot_remap"),
            reset_batch=arguments.get("reset_batch", False),
            kv_cache=kv_cache,
            execution=execution,
            read_from_device=read_from_device,
            checked=checked,
        )

    def keywords(self, *, with_read: bool = True) -> dict[str, object]:
        """The executor call's keywords (`read_from_device` only for `decode_forward`; a
        False `reset_batch` is omitted, as the caller omitted it)."""
        given = _given(
            tokens=self.tokens,
            start_pos=self.start_pos,
            page_table=self.page_table,
            sampling_params=self.sampling_params,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            slot_remap=self.slot_remap,
            reset_batch=True if self.reset_batch else None,
            kv_cache=self.kv_cache,
            execution=self.execution,
        )
        if with_read:
            given["read_from_device"] = self.read_from_device
        return given


def _given(**values: object) -> dict[str, object]:
    """The keywords whose value was given (None means omitted, as for every step field)."""
    return {name: value for name, value in values.items() if value is not None}


LaneStep = PrefillStep | DecodeStep
"""What a lane call may carry as its one `step` argument."""


@runtime_checkable
class ExecutionTarget(Protocol):
    """What every execution target offers its caller with the same keywords: a lane group
    (`LaneGroupExecutor`), an eager executor and a traced executor (`runtime.execution`).

    Decode is not named here: an executor's `decode_forward` takes the `PreparedDecode` its
    host's boundary built, a group's takes the `DecodeArguments` keywords.
    """

    def prefill_forward(self, **arguments: Unpack[PrefillArguments]) -> object:
        """Prefill `PrefillArguments` rows into their slots: logits or sampled tokens."""
        ...

    def compile_prefill(self, **arguments: Unpack[PrefillArguments]) -> object:
        """Compile (warm) the programs one such prefill runs."""
        ...

    def runtime_summary(self) -> Mapping[str, object]:
        """The target's host bookkeeping (counts and per-step times)."""
        ...

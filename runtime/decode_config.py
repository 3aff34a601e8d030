"""`DecodeRuntimeConfig`: the static decode policy of one lane, checked once.

`DecodeRuntimeConfig.resolve` reads the collaborators (model, device, output reader, lane
capacity, page-table layout, sampling capability) and fixes the construction-time page-table
ceilings; direct construction runs the same rules, so a config that exists is valid and the
decode runtime and its batches trust it.
"""

from __future__ import annotations

import attrs

from runtime.backends.base import Device
from runtime.config import PageTableLayout, RuntimePolicy
from runtime.model_contract import DecodeModel
from runtime.output_reader import OutputReader
from runtime.validation import positive_int, require_bool

__all__ = ["DecodeRuntimeConfig"]


@attrs.frozen
class _SamplerFacts:
    """What the runtime reads from `model.sampling.config` once."""

    allow_force_argmax: bool
    max_device_top_k: int
    sampling_batch_size: int
    vocab_size: int


def _sampler_facts(model: object) -> _SamplerFacts:
    """Check that `model.sampling` is a usable device sampler and read its static facts."""
    sampler = getattr(model, "sampling", None)
    if not (callable(getattr(sampler, "stage", None)) and callable(getattr(sampler, "run", None))):
        raise TypeError(
            "device_sampling_enabled=True requires model.sampling with callable stage() and "
            f"run() (e.g. model.sampling = DecoderSampler(...)); got {type(sampler).__name__}"
        )
    config = getattr(sampler, "config", None)
    allow = getattr(config, "allow_force_argmax", None)
    if not isinstance(allow, bool):
        raise TypeError(f"model.sampling.config.allow_force_argmax must be a bool, got {allow!r}")
    facts = {
        name: positive_int(f"model.sampling.config.{name}", getattr(config, name, None))
        for name in ("max_top_k", "max_batch_size", "vocab_size")
    }
    return _SamplerFacts(
        allow_force_argmax=allow,
        max_device_top_k=facts["max_top_k"],
        sampling_batch_size=facts["max_batch_size"],
        vocab_size=facts["vocab_size"],
    )


def _check_collaborators(config: DecodeRuntimeConfig) -> None:
    """The output reader, device and policy are the right kinds and share one device."""
    if not isinstance(config.output_reader, OutputReader):
        raise TypeError(
            f"output_reader must be an OutputReader, got {type(config.output_reader).__name__}"
        )
    if not isinstance(config.device, Device):
        raise TypeError(
            f"device must implement the Device protocol, got {type(config.device).__name__}"
        )
    if config.output_reader.device is not config.device:
        raise ValueError(
            f"device {config.device.name!r} must be the same device as the output reader's "
            f"({config.output_reader.device.name!r}); construct the OutputReader with this device"
        )
    if not isinstance(config.policy, RuntimePolicy):
        raise TypeError(f"policy must be a RuntimePolicy, got {type(config.policy).__name__}")


def _check_lane(config: DecodeRuntimeConfig) -> None:
    """The lane capacity is a positive int within the policy's limit; the flags are bools."""
    lane = positive_int("lane_capacity", config.lane_capacity)
    limit = config.policy.decode_lane_capacity_limit
    if lane > limit:
        raise ValueError(
            f"lane_capacity {lane} exceeds the decode lane capacity limit {limit} "
            f"(RuntimePolicy.decode_lane_capacity_limit); allowed: 1..{limit}"
        )
    for name in (
        "device_sampling_enabled",
        "force_greedy_top_k",
        "allow_force_argmax",
        "position_feedback_capable",
    ):
        require_bool(name, getattr(config, name))


def _check_model(config: DecodeRuntimeConfig) -> None:
    """The model decodes, and the derived vocab size and feedback capability are its own."""
    model = config.model
    if not callable(getattr(model, "decode", None)):
        raise TypeError(
            f"model must provide decode(tokens, *, positions, page_table) (see "
            f"runtime.model_contract.PagedModel), got {type(model).__name__}"
        )
    vocab = positive_int("model.vocab_size", getattr(model, "vocab_size", None))
    if config.vocab_size != vocab:
        raise ValueError(
            f"vocab_size {config.vocab_size!r} does not match model.vocab_size {vocab}"
        )
    capable = callable(getattr(model, "increment_positions", None))
    if config.position_feedback_capable != capable:
        raise ValueError(
            f"position_feedback_capable={config.position_feedback_capable} does not match the "
            f"model (callable increment_positions: {capable})"
        )


def _check_sampling_facts(config: DecodeRuntimeConfig) -> None:
    """The sampler facts are unset without device sampling, else exactly the sampler's."""
    if not config.device_sampling_enabled:
        if config.allow_force_argmax or config.max_device_top_k is not None:
            raise ValueError(
                "allow_force_argmax and max_device_top_k come from model.sampling and must be "
                "False/None while device sampling is disabled"
            )
        if config.sampling_batch_size is not None:
            raise ValueError("sampling_batch_size must be None while device sampling is disabled")
        return
    facts = _sampler_facts(config.model)
    derived = (facts.allow_force_argmax, facts.max_device_top_k, facts.sampling_batch_size)
    given = (config.allow_force_argmax, config.max_device_top_k, config.sampling_batch_size)
    if derived != given:
        raise ValueError(
            f"(allow_force_argmax, max_device_top_k, sampling_batch_size) {given} do not match "
            f"model.sampling.config {derived}"
        )
    if facts.sampling_batch_size < config.lane_capacity:
        raise ValueError(
            f"model.sampling.config.max_batch_size {facts.sampling_batch_size} is smaller than "
            f"lane_capacity {config.lane_capacity}; the sampler must hold every lane row"
        )
    if facts.vocab_size != config.vocab_size:
        raise ValueError(
            f"model.sampling.config.vocab_size {facts.vocab_size} does not match "
            f"model.vocab_size {config.vocab_size}"
        )


def _check_layout_within_ceilings(
    layout: PageTableLayout,
    *,
    block_size: int,
    max_raw_capacity_width: int,
    max_decode_page_table_width: int,
) -> None:
    if layout.block_size != block_size:
        raise ValueError(
            f"page-table layout block_size {layout.block_size} differs from the configured "
            f"block_size {block_size}; late capacity may not change the block size"
        )
    if layout.raw_capacity_width > max_raw_capacity_width:
        raise ValueError(
            f"page-table layout raw_capacity_width {layout.raw_capacity_width} exceeds the "
            f"construction-time ceiling {max_raw_capacity_width}; late capacity may only shrink"
        )
    if layout.decode_width > max_decode_page_table_width:
        raise ValueError(
            f"page-table layout decode width {layout.decode_width} exceeds the construction-time "
            f"decode width ceiling {max_decode_page_table_width}; late capacity may only shrink"
        )


def _check_layout(config: DecodeRuntimeConfig) -> None:
    layout = config.page_table_layout
    if not isinstance(layout, PageTableLayout):
        raise TypeError(f"page_table_layout must be a PageTableLayout, got {type(layout).__name__}")
    _check_layout_within_ceilings(
        layout,
        block_size=layout.block_size,
        max_raw_capacity_width=config.max_raw_capacity_width,
        max_decode_page_table_width=config.max_decode_page_table_width,
    )


@attrs.frozen
class DecodeRuntimeConfig:
    """Static decode policy of one lane, resolved once (use `resolve`).

    The ceilings are the layout widths at construction; `with_page_table_layout` may replace
    the layout later only within them and with the same block size.
    """

    model: DecodeModel
    device: Device
    output_reader: OutputReader
    lane_capacity: int
    page_table_layout: PageTableLayout
    policy: RuntimePolicy
    vocab_size: int
    device_sampling_enabled: bool
    force_greedy_top_k: bool
    allow_force_argmax: bool
    position_feedback_capable: bool
    max_raw_capacity_width: int
    max_decode_page_table_width: int
    max_device_top_k: int | None = None
    sampling_batch_size: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_collaborators(self)
        _check_lane(self)
        _check_layout(self)
        _check_model(self)
        _check_sampling_facts(self)

    @classmethod
    def resolve(
        cls,
        *,
        model: DecodeModel,
        device: Device,
        output_reader: OutputReader,
        lane_capacity: int,
        page_table_layout: PageTableLayout,
        device_sampling_enabled: bool,
        force_greedy_top_k: bool = False,
        policy: RuntimePolicy,
    ) -> DecodeRuntimeConfig:
        """Validate the collaborators and derive the model/sampler facts decode depends on."""
        if not isinstance(output_reader, OutputReader):
            raise TypeError(
                f"output_reader must be an OutputReader, got {type(output_reader).__name__}"
            )
        require_bool("device_sampling_enabled", device_sampling_enabled)
        require_bool("force_greedy_top_k", force_greedy_top_k)
        if not isinstance(page_table_layout, PageTableLayout):
            raise TypeError(
                f"page_table_layout must be a PageTableLayout, got "
                f"{type(page_table_layout).__name__}"
            )
        facts = _sampler_facts(model) if device_sampling_enabled else None
        vocab_size = positive_int("model.vocab_size", getattr(model, "vocab_size", None))
        return cls(
            model=model,
            device=device,
            output_reader=output_reader,
            lane_capacity=lane_capacity,
            page_table_layout=page_table_layout,
            policy=policy,
            vocab_size=vocab_size,
            device_sampling_enabled=device_sampling_enabled,
            force_greedy_top_k=force_greedy_top_k,
            allow_force_argmax=facts.allow_force_argmax if facts is not None else False,
            position_feedback_capable=callable(getattr(model, "increment_positions", None)),
            max_raw_capacity_width=page_table_layout.raw_capacity_width,
            max_decode_page_table_width=page_table_layout.decode_width,
            max_device_top_k=facts.max_device_top_k if facts is not None else None,
            sampling_batch_size=facts.sampling_batch_size if facts is not None else None,
        )

    def with_page_table_layout(self, layout: PageTableLayout) -> DecodeRuntimeConfig:
        """A copy with a late layout: same block size, widths within the original ceilings."""
        if not isinstance(layout, PageTableLayout):
            raise TypeError(f"layout must be a PageTableLayout, got {type(layout).__name__}")
        _check_layout_within_ceilings(
            layout,
            block_size=self.page_table_layout.block_size,
            max_raw_capacity_width=self.max_raw_capacity_width,
            max_decode_page_table_width=self.max_decode_page_table_width,
        )
        return attrs.evolve(self, page_table_layout=layout)

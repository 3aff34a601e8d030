"""`PrefillRuntimeConfig`: the prefill runtime's static policy, validated once.

Everything the prefill runtime reads at serve time (collaborators, lane capacity, chunk limit,
batching switches, sampler capabilities, the canonical page-table layout and its ceiling) is
resolved here, so a bad combination fails at construction with the offending argument named,
instead of surfacing as a wrong shape in the middle of a prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch

from runtime.backends.base import Device
from runtime.config import PageTableLayout, RuntimePolicy
from runtime.model_contract import PagedModel
from runtime.output_reader import OutputReader
from runtime.prefill.batch import PlanLimits
from runtime.validation import is_int, plain_bool, positive_int

TraceCapability = Callable[[int, int], bool]
"""`can_enable_trace(invocation_length, cached_tokens) -> bool`."""


@attrs.frozen
class SamplerCapabilities:
    """What the runtime may ask of `model.sampling`, derived from its config."""

    allow_force_argmax: bool
    max_device_top_k: int
    sampling_batch_size: int


def resolve_sampler_capabilities(
    model: object,
    *,
    device_sampling_enabled: bool,
    max_batch_size: int,
    max_prefill_batch_size: int,
) -> SamplerCapabilities:
    """Read `model.sampling.config`; without device sampling: no argmax, top-k 0, lane rows."""
    if not device_sampling_enabled:
        return SamplerCapabilities(False, 0, max_batch_size)
    sampling = getattr(model, "sampling", None)
    sampler_config = getattr(sampling, "config", None)
    if sampling is None or sampler_config is None:
        raise TypeError(
            "device sampling requires model.sampling.config (attach a sampler, e.g. "
            "model.sampling = DecoderSampler(SamplerConfig(...))), or pass "
            "device_sampling_enabled=False"
        )
    for method in ("stage", "run"):
        if not callable(getattr(sampling, method, None)):
            raise TypeError(
                f"device sampling requires model.sampling.{method}(...); "
                f"{type(sampling).__name__} has none"
            )
    allow = getattr(sampler_config, "allow_force_argmax", None)
    if not isinstance(allow, bool):
        raise TypeError(f"model.sampling.config.allow_force_argmax must be bool, got {allow!r}")
    top_k = positive_int(
        "model.sampling.config.max_top_k", getattr(sampler_config, "max_top_k", None)
    )
    rows = positive_int(
        "model.sampling.config.max_batch_size", getattr(sampler_config, "max_batch_size", None)
    )
    widest_wave = min(max_batch_size, max_prefill_batch_size)
    if rows < widest_wave:
        raise ValueError(
            f"model.sampling.config.max_batch_size ({rows}) must be >= the widest prefill wave "
            f"min(max_batch_size, max_prefill_batch_size) = {widest_wave}"
        )
    sampler_vocab = getattr(sampler_config, "vocab_size", None)
    model_vocab = getattr(model, "vocab_size", None)
    if sampler_vocab is not None and sampler_vocab != model_vocab:
        raise ValueError(
            f"model.sampling.config.vocab_size ({sampler_vocab}) must equal model.vocab_size "
            f"({model_vocab})"
        )
    return SamplerCapabilities(allow, top_k, rows)


def check_layout_within(layout: PageTableLayout, ceiling: PageTableLayout) -> None:
    """A replacement layout may shrink widths; it may not change block size or grow."""
    if not isinstance(layout, PageTableLayout):
        raise TypeError(f"page_table_layout must be a PageTableLayout, got {type(layout).__name__}")
    if layout.block_size != ceiling.block_size:
        raise ValueError(
            f"page_table_layout cannot change block_size: ceiling {ceiling.block_size}, got "
            f"{layout.block_size}"
        )
    if layout.raw_capacity_width > ceiling.raw_capacity_width:
        raise ValueError(
            f"page_table_layout raw_capacity_width {layout.raw_capacity_width} exceeds the "
            f"capacity ceiling {ceiling.raw_capacity_width}"
        )
    for name in ("prefill_width", "decode_width"):
        width: int = getattr(layout, name)
        limit: int = getattr(ceiling, name)
        if width > limit:
            raise ValueError(
                f"page_table_layout cannot expand canonical geometry: {name} {width} exceeds "
                f"the construction-time {name} {limit}"
            )


def _same_device(model_device: torch.device, runtime_device: torch.device) -> bool:
    if model_device.type != runtime_device.type:
        return False
    indices = (model_device.index, runtime_device.index)
    return None in indices or indices[0] == indices[1]


@attrs.frozen(eq=False)
class PrefillRuntimeConfig:
    """Resolved prefill policy; build it with `resolve(...)`.

    `page_table_layout_ceiling` is the construction-time layout: late capacity may shrink the
    layout (`with_page_table_layout`) but never change its block size or grow it. Sampler
    fields mirror `model.sampling.config` and are re-derived on every construction.
    """

    model: PagedModel
    device: Device
    output_reader: OutputReader
    page_table_layout: PageTableLayout
    page_table_layout_ceiling: PageTableLayout
    max_batch_size: int
    max_prefill_chunk_size: int
    policy: RuntimePolicy
    supports_batched_prefill: bool | None
    disable_batched_prefill: bool
    max_prefill_batch_size: int
    batched_prefill_batched_extract: bool
    device_sampling_enabled: bool
    can_enable_trace: TraceCapability
    trace_capture_prime_sequence_lengths: tuple[int, ...]
    allow_force_argmax: bool
    max_device_top_k: int
    sampling_batch_size: int

    def __attrs_post_init__(self) -> None:
        if self.output_reader.device is not self.device:
            raise ValueError(
                "output_reader and prefill runtime must use the same device: "
                f"output_reader.device is {self.output_reader.device!r}, device is {self.device!r}"
            )
        check_layout_within(self.page_table_layout, self.page_table_layout_ceiling)
        expected = resolve_sampler_capabilities(
            self.model,
            device_sampling_enabled=self.device_sampling_enabled,
            max_batch_size=self.max_batch_size,
            max_prefill_batch_size=self.max_prefill_batch_size,
        )
        actual = SamplerCapabilities(
            self.allow_force_argmax, self.max_device_top_k, self.sampling_batch_size
        )
        if actual != expected:
            raise ValueError(
                f"sampler fields {actual} must match the resolved sampler capabilities {expected}"
            )

    @classmethod
    def resolve(
        cls,
        *,
        model: PagedModel,
        device: Device,
        output_reader: OutputReader,
        page_table_layout: PageTableLayout,
        max_batch_size: int,
        max_prefill_chunk_size: int,
        policy: RuntimePolicy,
        supports_batched_prefill: bool | None = True,
        disable_batched_prefill: bool = False,
        max_prefill_batch_size: int = 8,
        batched_prefill_batched_extract: bool = True,
        device_sampling_enabled: bool,
        can_enable_trace: TraceCapability,
        trace_capture_prime_sequence_lengths: tuple[int, ...] = (),
    ) -> PrefillRuntimeConfig:
        """Validate every collaborator and value once; see the module docstring."""
        _check_limits(policy, max_batch_size, max_prefill_chunk_size, max_prefill_batch_size)
        switches = {
            "disable_batched_prefill": disable_batched_prefill,
            "batched_prefill_batched_extract": batched_prefill_batched_extract,
            "device_sampling_enabled": device_sampling_enabled,
        }
        _check_switches(supports_batched_prefill, switches)
        if not callable(can_enable_trace):
            raise TypeError(
                f"can_enable_trace must be callable (length, cached) -> bool, got "
                f"{type(can_enable_trace).__name__}"
            )
        primes = _prime_lengths(trace_capture_prime_sequence_lengths, max_prefill_chunk_size)
        _check_collaborators(model, device, output_reader, page_table_layout)
        capabilities = resolve_sampler_capabilities(
            model,
            device_sampling_enabled=device_sampling_enabled,
            max_batch_size=max_batch_size,
            max_prefill_batch_size=max_prefill_batch_size,
        )
        return cls(
            model=model,
            device=device,
            output_reader=output_reader,
            page_table_layout=page_table_layout,
            page_table_layout_ceiling=page_table_layout,
            max_batch_size=max_batch_size,
            max_prefill_chunk_size=max_prefill_chunk_size,
            policy=policy,
            supports_batched_prefill=supports_batched_prefill,
            disable_batched_prefill=disable_batched_prefill,
            max_prefill_batch_size=max_prefill_batch_size,
            batched_prefill_batched_extract=batched_prefill_batched_extract,
            device_sampling_enabled=device_sampling_enabled,
            can_enable_trace=can_enable_trace,
            trace_capture_prime_sequence_lengths=primes,
            allow_force_argmax=capabilities.allow_force_argmax,
            max_device_top_k=capabilities.max_device_top_k,
            sampling_batch_size=capabilities.sampling_batch_size,
        )

    def plan_limits(self) -> PlanLimits:
        """The planner's limits under this config (batching off when the config says so)."""
        layout = self.page_table_layout
        return PlanLimits(
            block_size=layout.block_size,
            max_batch_size=self.max_batch_size,
            max_prefill_chunk_size=self.max_prefill_chunk_size,
            max_prefill_batch_size=self.max_prefill_batch_size,
            supports_batched_prefill=self.supports_batched_prefill,
            disable_batched_prefill=self.disable_batched_prefill,
            max_actual_width=layout.raw_capacity_width,
            canonical_width=layout.prefill_width,
            policy=self.policy,
            num_blocks=layout.num_blocks,
        )

    def with_page_table_layout(self, layout: PageTableLayout) -> PrefillRuntimeConfig:
        """A copy using `layout` (late capacity); this config is unchanged."""
        check_layout_within(layout, self.page_table_layout_ceiling)
        return attrs.evolve(self, page_table_layout=layout)


def _prime_lengths(value: object, max_prefill_chunk_size: int) -> tuple[int, ...]:
    if not isinstance(value, tuple):
        raise TypeError(
            f"trace_capture_prime_sequence_lengths must be a tuple, got {type(value).__name__} "
            f"{value!r}"
        )
    for length in value:
        if not is_int(length) or not 0 < length <= max_prefill_chunk_size:
            raise ValueError(
                f"trace_capture_prime_sequence_lengths entries must be positive integers "
                f"<= max_prefill_chunk_size ({max_prefill_chunk_size}), got {length!r}"
            )
    if len(set(value)) != len(value):
        raise ValueError(f"trace_capture_prime_sequence_lengths must be unique, got {value!r}")
    return value


def _check_limits(
    policy: object, max_batch_size: int, max_prefill_chunk_size: int, max_prefill_batch_size: int
) -> None:
    """The lane's sizes against the policy (the reference's lane and chunk rules)."""
    if not isinstance(policy, RuntimePolicy):
        raise TypeError(f"policy must be a RuntimePolicy, got {type(policy).__name__}")
    positive_int("max_batch_size", max_batch_size)
    positive_int("max_prefill_chunk_size", max_prefill_chunk_size)
    positive_int("max_prefill_batch_size", max_prefill_batch_size)
    if max_batch_size > policy.decode_lane_capacity_limit:
        raise ValueError(
            f"max_batch_size {max_batch_size} exceeds the policy's lane capacity limit "
            f"{policy.decode_lane_capacity_limit}"
        )
    if max_prefill_chunk_size % policy.chunk_size_multiple:
        raise ValueError(
            f"max_prefill_chunk_size must be a multiple of the policy's chunk_size_multiple "
            f"({policy.chunk_size_multiple}), got {max_prefill_chunk_size}"
        )
    if max_prefill_batch_size not in policy.supported_prefill_batch_sizes:
        raise ValueError(
            f"max_prefill_batch_size must be one of {policy.supported_prefill_batch_sizes}, "
            f"got {max_prefill_batch_size}"
        )


def _check_switches(supports_batched_prefill: object, switches: Mapping[str, object]) -> None:
    """`supports_batched_prefill` is a bool or None (the legacy rule); the others are bools."""
    if supports_batched_prefill is not None:
        plain_bool("supports_batched_prefill", supports_batched_prefill)
    for name, value in switches.items():
        plain_bool(name, value)


def _check_collaborators(
    model: object, device: object, output_reader: object, page_table_layout: object
) -> None:
    if not isinstance(page_table_layout, PageTableLayout):
        raise TypeError(
            f"page_table_layout must be a PageTableLayout, got {type(page_table_layout).__name__}"
        )
    if not isinstance(device, Device):
        raise TypeError(f"device must implement the Device protocol, got {device!r}")
    if not isinstance(output_reader, OutputReader):
        raise TypeError(
            f"output_reader must be an OutputReader, got {type(output_reader).__name__}"
        )
    _check_model(model, device)


def _check_model(model: object, device: Device) -> None:
    if not callable(getattr(model, "prefill", None)):
        raise TypeError(
            f"model must implement prefill(tokens, *, page_table, prompt_lens, chunk_start); "
            f"{type(model).__name__} does not"
        )
    vocab = getattr(model, "vocab_size", None)
    if not is_int(vocab) or vocab <= 0:
        raise TypeError(f"model.vocab_size must be a positive int, got {vocab!r}")
    model_device = getattr(model, "device", None)
    if isinstance(model_device, torch.device) and not _same_device(
        model_device, device.torch_device
    ):
        raise ValueError(
            f"model and prefill runtime must use the same device: model is on {model_device}, "
            f"the runtime device is {device.torch_device}"
        )

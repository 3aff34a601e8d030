"""Build the runtime components of one lane, wired in the seed's order.

Paged KV cache, output reader, prefill and decode runtimes, program compiler, the eager
executor and, for traced lanes, the trace compiler and traced executor, then the warmup
coordinator over whichever executor serves. `ModelExecutor` owns what this returns and
is their cleanup root; building them here keeps its constructor about the lane itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from lifecycle.journal import Journal
from models.executor_config import ModelExecutorConfig
from models.lane_capacity import check_kv_memory
from models.progress import ProgressSink
from runtime.backends.base import Device
from runtime.config import PagedKVCacheConfig, PageTableLayout
from runtime.decode import DecodeRuntime, DecodeRuntimeConfig
from runtime.execution import EagerExecutor, TracedExecutor
from runtime.output_reader import OutputReader
from runtime.paged_kv_cache import PagedKVCacheManager
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.runtime import PrefillRuntime
from runtime.program_compiler import ProgramCompiler
from runtime.trace_compiler import TraceCompiler
from runtime.warmup import WarmupCoordinator, WarmupCoordinatorConfig


@attrs.frozen
class LaneCallbacks:
    """What the warmup coordinator calls back into the lane that owns it."""

    ensure_sampling_buffers: Callable[[], None]
    validate_bound_cache: Callable[[Any], None]
    progress: ProgressSink


@attrs.frozen(eq=False)
class LaneComponents:
    """Every runtime component of one lane (traced parts are None on eager lanes)."""

    kv_cache_manager: PagedKVCacheManager
    output_reader: OutputReader
    prefill_runtime: PrefillRuntime
    decode_runtime: DecodeRuntime
    program_compiler: ProgramCompiler
    eager_executor: EagerExecutor
    trace_compiler: TraceCompiler | None
    traced_executor: TracedExecutor | None
    warmup: WarmupCoordinator

    def install_capacity(
        self, kv_config: PagedKVCacheConfig, layout: PageTableLayout, device: Device
    ) -> None:
        """Give every component the late-resolved capacity and its page-table layout.

        Every replacement is validated before anything changes, so a refused layout leaves
        the components as they were.
        """
        self.prefill_runtime.config.with_page_table_layout(layout)
        self.decode_runtime.config.with_page_table_layout(layout)
        warmup_config = self.warmup.config.with_page_table_layout(layout)
        manager = self.kv_cache_manager
        if manager.state.value == "unresolved":
            manager.configure(kv_config)
        elif manager.config != kv_config:
            raise ValueError(
                f"paged KV capacity is already resolved to {manager.config}; "
                f"cannot replace it with {kv_config}"
            )
        assert kv_config.num_blocks is not None
        check_kv_memory(manager, device, kv_config.num_blocks)
        # Nothing below can fail: the configs were validated above.
        self.prefill_runtime.configure_page_table_layout(layout)
        self.decode_runtime.configure_page_table_layout(layout)
        self.warmup.config = warmup_config

    def held_resources(self) -> tuple[str, ...]:
        """What a failed release left, by component (each refuses work until cleaned)."""
        counts = [
            ("program compiler", self.program_compiler.compile_orphan_count),
            ("prefill runtime", self.prefill_runtime.transient_orphan_count),
            ("decode runtime", self.decode_runtime.transient_orphan_count),
        ]
        if self.trace_compiler is not None:
            counts.append(("trace compiler", self.trace_compiler.unreleased_resource_count))
        kv = self.kv_cache_manager
        if kv.state.value != "bound":
            counts.append(("paged KV cache", kv.owned_tensor_count))
        return tuple(f"{count} unreleased {name} resource(s)" for name, count in counts if count)

    def cleanup_steps(
        self, release_sampling: Callable[[], Any] | None
    ) -> list[tuple[str, Callable[[], Any]]]:
        """The seed's cleanup order: leases and reads, transients, traces, programs, KV last.

        `release_sampling` frees the model's device-sampling buffers (None: none to free).
        """
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("external decode leases", self.decode_runtime.drain_external_outputs),
            ("pending output reads", self.output_reader.drain),
            ("prefill transients", self.prefill_runtime.cleanup),
            ("decode transients", self.decode_runtime.cleanup_transients),
        ]
        if self.trace_compiler is not None:
            steps.append(("traces", self.trace_compiler.cleanup))
        steps.append(("program registry", self.program_compiler.cleanup))
        if release_sampling is not None:
            steps.append(("sampling buffers", release_sampling))
        steps.append(("paged KV cache", self.kv_cache_manager.release))
        return steps


def build_lane_components(
    model: Any,
    config: ModelExecutorConfig,
    *,
    layout: PageTableLayout,
    device: Device,
    journal: Journal,
    owner_name: str,
    callbacks: LaneCallbacks,
) -> LaneComponents:
    """The components of one lane over `model` and `layout`, journaled under `owner_name`."""
    kv_cache_manager = PagedKVCacheManager(
        model,
        config.paged_kv_cache,
        device=device,
        journal=journal,
        owner_name=f"{owner_name}.kv-cache",
    )
    output_reader = OutputReader(device)
    prefill = _prefill_runtime(model, config, device, output_reader, layout)
    decode = _decode_runtime(model, config, device, output_reader, layout)
    program_compiler = ProgramCompiler(
        device,
        lambda: kv_cache_manager.bound_context,
        journal=journal,
        owner_name=f"{owner_name}.program-compiler",
    )
    eager = EagerExecutor(
        prefill=prefill,
        decode=decode,
        program_compiler=program_compiler,
        trace=config.trace,
    )
    trace_compiler, traced = (
        _traced_parts(config, eager, program_compiler, journal, owner_name)
        if config.traced
        else (None, None)
    )
    warmup = WarmupCoordinator(
        config=_warmup_config(config, prefill, decode),
        execution=traced or eager,
        ensure_sampling_buffers=callbacks.ensure_sampling_buffers,
        validate_bound_cache=callbacks.validate_bound_cache,
        progress=callbacks.progress,
        auto_capture=False,
        journal=journal,
        owner_name=f"{owner_name}.warmup",
    )
    return LaneComponents(
        kv_cache_manager=kv_cache_manager,
        output_reader=output_reader,
        prefill_runtime=prefill,
        decode_runtime=decode,
        program_compiler=program_compiler,
        eager_executor=eager,
        trace_compiler=trace_compiler,
        traced_executor=traced,
        warmup=warmup,
    )


def _traced_parts(
    config: ModelExecutorConfig,
    eager: EagerExecutor,
    program_compiler: ProgramCompiler,
    journal: Journal,
    owner_name: str,
) -> tuple[TraceCompiler, TracedExecutor]:
    """The trace compiler over the lane's program compiler, and the traced executor."""
    trace_compiler = TraceCompiler(
        program_compiler, journal=journal, owner_name=f"{owner_name}.trace-compiler"
    )
    traced = TracedExecutor(eager=eager, trace_compiler=trace_compiler, trace=config.trace)
    return trace_compiler, traced


def _prefill_runtime(
    model: Any,
    config: ModelExecutorConfig,
    device: Device,
    output_reader: OutputReader,
    layout: PageTableLayout,
) -> PrefillRuntime:
    trace = config.trace
    return PrefillRuntime(
        PrefillRuntimeConfig.resolve(
            model=model,
            device=device,
            output_reader=output_reader,
            page_table_layout=layout,
            max_batch_size=config.max_batch_size,
            max_prefill_chunk_size=config.max_prefill_chunk_size,
            policy=config.policy,
            supports_batched_prefill=config.supports_batched_prefill,
            max_prefill_batch_size=config.max_prefill_batch_size,
            device_sampling_enabled=config.device_sampling_enabled,
            can_enable_trace=lambda length, cached: trace.prefill_enabled,
        )
    )


def _decode_runtime(
    model: Any,
    config: ModelExecutorConfig,
    device: Device,
    output_reader: OutputReader,
    layout: PageTableLayout,
) -> DecodeRuntime:
    return DecodeRuntime(
        DecodeRuntimeConfig.resolve(
            model=model,
            device=device,
            output_reader=output_reader,
            lane_capacity=config.max_batch_size,
            page_table_layout=layout,
            device_sampling_enabled=config.device_sampling_enabled,
            force_greedy_top_k=config.warmup.include_decode_top_k,
            policy=config.policy,
        )
    )


def _warmup_config(
    config: ModelExecutorConfig, prefill: PrefillRuntime, decode: DecodeRuntime
) -> WarmupCoordinatorConfig:
    lengths = config.default_prefill_lengths()
    return WarmupCoordinatorConfig.resolve(
        warmup=config.warmup,
        trace=config.trace,
        prefill=prefill,
        decode=decode,
        prefill_sequence_lengths=lengths,
        # Traced lanes close the compile gate, so every wave the planner can form must be
        # covered; eager lanes keep the reference's smallest-bucket waves.
        batched_sequence_lengths=lengths if config.traced else None,
        max_seq_len=config.max_seq_len,
    )

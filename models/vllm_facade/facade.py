"""`DecoderVLLMModel`: every decoder family's facade for a vLLM-style serving engine.

The engine (vLLM with the Tenstorrent model-runner contract) drives a model class through
`initialize_vllm_model`, `allocate_kv_cache`, a two-phase warmup and then `prefill_forward` /
`decode_forward` / `read_decode_output` / `process_decode_output_host`, and drops the object at
the end. Every call goes through `runtime.vllm_adapter.VLLMAdapter` (argument forms, the
compatibility keywords, `enable_trace` against the static trace policy, the engine's KV spec)
and then through the execution target's phase-guarded calls, so the lifecycle maps onto the
engine's steps:

    allocate_kv_cache            -> ALLOCATED
    warmup phase 1 (no trace)    -> COMPILED
    warmup phase 2 (trace)       -> CAPTURED   (trace modes decode_only / all)
    first prefill/decode forward -> SERVING

Nothing here names a family: the weights the engine names are loaded through the family
registry (`models.families`), and a family's declared capabilities
(`Family.vllm_capabilities`) become the `model_capabilities` of its facade class
(`facade_for(family)`: the shared class itself when they are the defaults).

The target is one `DecoderExecutor` lane (typed as such: the facade calls its phase-guarded
API, its KV config and its warmup's capture barrier); a lane group over global slots will
take its place behind the same calls. `models.vllm_plugin.facades.VLLMFacade` is the
contract this class implements (mypy checks it there).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal, overload

import attrs
import torch

from lifecycle import Phase
from lifecycle.errors import PhaseError
from models.decoder.executor import DecoderExecutor, build_executor
from models.decoder.sources import LoadedModel, load_model
from models.families import DEFAULT_VLLM_CAPABILITIES, Family
from models.vllm_facade.engine_args import (
    OPTIMIZATIONS,
    VLLMFacadeOptions,
    check_bool,
    check_hf_config,
    engine_device,
    engine_model_name,
    engine_options,
)
from models.vllm_facade.outputs import DecodeOutput, HostDecodeOutput
from models.vllm_sleep import FacadeSleepMode, SleepTarget
from runtime.backends.base import Device, DeviceTensor
from runtime.config import PagedKVCacheConfig, TraceConfig, require_positive_int
from runtime.decode_staging import DecodeHostOutput
from runtime.prefill.result_collector import PrefillOutput
from runtime.vllm_adapter import VLLMAdapter, VLLMAdapterConfig

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _TargetHolder:
    """Owns the execution target; the facade's finalizer closes it without the facade."""

    target: DecoderExecutor

    def close(self) -> None:
        self.target.close()

    @staticmethod
    def close_quietly(holder: _TargetHolder) -> None:
        """Close from a finalizer (garbage collection or interpreter exit); never raises."""
        try:
            holder.target.close()
        except BaseException as error:  # a finalizer must not raise
            logger.warning("dropped vLLM facade: cleanup failed: %s", error)


class DecoderVLLMModel(FacadeSleepMode):
    """The model object a vLLM engine drives; one per engine, over one execution target."""

    model_capabilities: ClassVar[dict[str, bool]] = dict(DEFAULT_VLLM_CAPABILITIES)

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        device: Device,
        options: VLLMFacadeOptions,
        max_batch_size: int,
        max_seq_len: int,
    ) -> None:
        self.loaded = loaded
        self.device = device
        self.options = options
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.trace = TraceConfig.of(options.trace_mode)
        blocks_per_seq = -(-max_seq_len // options.block_size)
        target = self._build_target(
            block_size=options.block_size,
            max_num_blocks=max_batch_size * blocks_per_seq,
            num_blocks=None,
        )
        self._traced_warmups: set[str] = set()
        self._holder = _TargetHolder(target)
        self._finalizer = weakref.finalize(self, _TargetHolder.close_quietly, self._holder)
        args = loaded.args
        self.adapter = VLLMAdapter(
            VLLMAdapterConfig.resolve(
                trace=self.trace,
                paged_kv_cache=target.config.paged_kv_cache,
                expected_num_layers=args.n_layers,
                expected_kv_heads_per_device=args.n_kv_heads,
                expected_head_dim=args.head_dim,
                model_kv_cache_dtype=loaded.model.dtype,
            )
        )

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def initialize_vllm_model(
        cls,
        hf_config: object,
        mesh_device: object,
        max_batch_size: int,
        max_seq_len: int | None = None,
        tt_data_parallel: int = 1,
        optimizations: str | None = None,
        **options: object,
    ) -> DecoderVLLMModel:
        """Load the weights `hf_config` names and build the facade in CONSTRUCTED.

        `max_batch_size` is the global slot count (lanes x per lane). Extra keywords are
        `VLLMFacadeOptions` (trace_mode, block_size, max_prefill_chunk_size, device_sampling,
        warmup, seed, model). Every argument is checked before any weights load.
        """
        facade_options = engine_options(
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            tt_data_parallel=tt_data_parallel,
            optimizations=optimizations,
            options=options,
        )
        name = engine_model_name(hf_config, facade_options.model)
        device = engine_device(mesh_device)
        loaded = load_model(
            name,
            dtype=OPTIMIZATIONS[optimizations],
            device=device.torch_device,
            seed=facade_options.seed,
        )
        check_hf_config(hf_config, loaded)
        model_max = loaded.args.max_seq_len
        seq_len = model_max if max_seq_len is None else max_seq_len
        if seq_len > model_max:
            raise ValueError(
                f"max_seq_len={seq_len} exceeds the model's maximum sequence length {model_max}; "
                f"start the engine with max_model_len <= {model_max}"
            )
        return cls(
            loaded=loaded,
            device=device,
            options=facade_options,
            max_batch_size=max_batch_size,
            max_seq_len=seq_len,
        )

    def _build_target(
        self, *, block_size: int, max_num_blocks: int, num_blocks: int | None
    ) -> DecoderExecutor:
        options = self.options
        return build_executor(
            self.loaded,
            device=self.device,
            trace=self.trace,
            block_size=block_size,
            max_num_blocks=max_num_blocks,
            num_blocks=num_blocks,
            max_batch_size=self.max_batch_size,
            max_prefill_chunk_size=options.max_prefill_chunk_size,
            max_seq_len=self.max_seq_len,
            device_sampling=options.device_sampling,
            warmup=options.warmup,
        )

    # -- capacity (classmethods the engine may ask before loading) -------------------------------

    @classmethod
    def get_max_tokens_all_users(
        cls,
        *,
        max_model_len: int,
        max_num_seqs: int,
        model_name: str | None = None,
        num_devices: int = 1,
        tt_data_parallel: int = 1,
    ) -> int:
        """KV tokens one lane needs so every one of its slots can reach `max_model_len`.

        `max_num_seqs` is the per-lane slot count; the engine adds one block per slot.
        """
        require_positive_int("max_model_len", max_model_len)
        require_positive_int("max_num_seqs", max_num_seqs)
        require_positive_int("num_devices", num_devices)
        require_positive_int("tt_data_parallel", tt_data_parallel)
        return max_model_len * max_num_seqs

    @classmethod
    def get_kv_cache_spec(cls, vllm_config: object) -> None:
        """None: every layer is full attention with one geometry, the engine's default spec."""
        return None

    # -- the execution target --------------------------------------------------------------------

    @property
    def executor(self) -> DecoderExecutor:
        """The execution target the facade drives (a lane executor)."""
        return self._holder.target

    @property
    def sleep_target(self) -> SleepTarget:
        """Sleep mode drives the execution target (`FacadeSleepMode`)."""
        return self.executor

    @property
    def weights_source(self) -> str | Path:
        """The weights this facade loaded (a path, or a preset's name)."""
        source = self.loaded.source
        return source.path if source.path is not None else source.name

    @property
    def phase(self) -> Phase:
        """The target's lifecycle phase."""
        phase = self.executor.phase
        assert isinstance(phase, Phase)
        return phase

    @property
    def max_device_top_k(self) -> int | None:
        """The device sampler's top-k ceiling (None without device sampling).

        An engine sends a stochastic request with a wider top_k, or none, to its host sampler.
        """
        sampler = getattr(self.loaded.model, "sampling", None)
        if not self.options.device_sampling or sampler is None:
            return None
        return int(sampler.config.max_top_k)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The torch dtype the engine must allocate the KV cache with."""
        return self.adapter.config.kv_cache_torch_dtype

    # -- allocate ---------------------------------------------------------------------------------

    def allocate_kv_cache(
        self, kv_cache_shape: Sequence[int], dtype: torch.dtype, num_layers: int
    ) -> list[list[DeviceTensor]]:
        """Adopt the engine's KV spec and allocate it: CONSTRUCTED -> ALLOCATED.

        The engine fixes block size and capacity; a target built for another geometry is
        rebuilt first (it holds no device memory before allocation).
        """
        target = self.executor
        if target.phase is not Phase.CONSTRUCTED:
            return target.allocate_kv_cache(kv_cache_shape, dtype, num_layers)  # PhaseError
        kv_config = self.adapter.resolve_legacy_kv_cache_config(kv_cache_shape, dtype, num_layers)
        chunk = self.options.max_prefill_chunk_size
        if chunk % kv_config.block_size:
            raise ValueError(
                f"the engine's block_size {kv_config.block_size} does not divide the facade's "
                f"max_prefill_chunk_size {chunk}; start the engine with a block size that "
                "divides it, or initialize the facade with a matching max_prefill_chunk_size"
            )
        target = self._adopt_geometry(target, kv_config)
        handle = target.allocate_kv_cache(tuple(kv_cache_shape), dtype, num_layers)
        self.adapter = VLLMAdapter(attrs.evolve(self.adapter.config, paged_kv_cache=kv_config))
        return handle

    def _adopt_geometry(
        self, target: DecoderExecutor, kv_config: PagedKVCacheConfig
    ) -> DecoderExecutor:
        current = target.config.paged_kv_cache
        assert kv_config.num_blocks is not None
        if (
            kv_config.block_size == current.block_size
            and kv_config.num_blocks <= current.max_num_blocks
        ):
            return target
        logger.info(
            "adopting the engine's KV geometry: %d blocks of %d tokens (was a ceiling of %d "
            "blocks of %d)",
            kv_config.num_blocks,
            kv_config.block_size,
            current.max_num_blocks,
            current.block_size,
        )
        try:
            replacement = self._build_target(
                block_size=kv_config.block_size,
                max_num_blocks=kv_config.max_num_blocks,
                num_blocks=kv_config.num_blocks,
            )
        except BaseException:
            self.loaded.model.configure_paged_attention(
                block_size=current.block_size, max_num_blocks=current.max_num_blocks
            )
            raise
        self._holder.target = replacement
        target.close()  # the placeholder held no device memory
        return replacement

    # -- warmup -----------------------------------------------------------------------------------

    def warmup_model_prefill(
        self, *, kv_cache: object, enable_trace: bool, can_sample_on_device: bool
    ) -> None:
        """Phase 1 (enable_trace=False) compiles prefill; phase 2 registers its traces."""
        self.adapter.check_enable_trace("warmup_model_prefill", enable_trace)
        self._warm(
            "prefill",
            enable_trace,
            kv_cache=kv_cache,
            can_sample_on_device=can_sample_on_device,
            enable_trace=enable_trace,
        )

    def warmup_model_decode(
        self,
        *,
        kv_cache: object,
        enable_trace: bool,
        max_batch_size: int,
        num_blocks: int,
        can_sample_on_device: bool,
    ) -> None:
        """Phase 1 compiles decode (-> COMPILED with prefill); phase 2 captures (-> CAPTURED)."""
        self.adapter.check_enable_trace("warmup_model_decode", enable_trace)
        if max_batch_size != self.max_batch_size:
            raise ValueError(
                f"warmup_model_decode max_batch_size={max_batch_size!r} differs from the "
                f"{self.max_batch_size} global slots the facade was initialized with"
            )
        self._warm(
            "decode",
            enable_trace,
            kv_cache=kv_cache,
            max_batch_size=max_batch_size,
            num_blocks=num_blocks,
            can_sample_on_device=can_sample_on_device,
            enable_trace=enable_trace,
        )

    def _warm(self, kind: str, traced: bool, **engine_arguments: object) -> None:
        """Forward one warmup with the engine's arguments; capture once all traced ones ran.

        While another statically traced operation still awaits its traced warmup, the
        target's capture barrier is deferred: phase 1 left that operation's latest hint
        eager, and the barrier would otherwise stage a capture without it.
        """
        target = self.executor
        waiting = self._traced_operations() - self._traced_warmups - {kind}
        deferral = target.warmup.defer_capture() if traced and waiting else contextlib.nullcontext()
        with deferral:
            getattr(target, f"warmup_model_{kind}")(**engine_arguments)
        if traced:
            self._traced_warmups.add(kind)
        if (
            target.phase is Phase.COMPILED
            and self._traced_warmups >= self._traced_operations()
            and target.warmup.capture_pending
        ):
            target.capture()

    def _traced_operations(self) -> set[str]:
        operations = set()
        if self.trace.prefill_enabled:
            operations.add("prefill")
        if self.trace.decode_enabled:
            operations.add("decode")
        return operations

    # -- serving ----------------------------------------------------------------------------------

    def _require_servable(self, operation: str) -> None:
        """Refuse a forward before warmup finished, naming the engine's next calls."""
        target = self.executor
        phase = target.phase
        if phase in (Phase.SERVING, Phase.CAPTURED):
            return
        if phase is Phase.COMPILED:
            if not self.trace.enabled:
                return
            missing = [
                f"warmup_model_{kind}"
                for kind in ("prefill", "decode")
                if kind in self._traced_operations() - self._traced_warmups
            ]
            phase_two = ", ".join(f"{call}(enable_trace=True)" for call in missing)
            raise PhaseError(
                owner=type(self).__name__,
                operation=operation,
                phase=phase.value,
                legal_phases=(Phase.SERVING.value,),
                next_calls=tuple(missing),
                reason=(
                    f"the facade traces (trace mode {self.trace.mode!r}) but the engine has not "
                    f"run the traced warmup {phase_two}; give the engine the same trace mode, "
                    "or build the facade with trace_mode='none'"
                ),
            )
        next_calls = {
            Phase.CONSTRUCTED: ("allocate_kv_cache",),
            Phase.ALLOCATED: ("warmup_model_prefill", "warmup_model_decode"),
        }.get(phase)
        if next_calls is None:
            return  # CLOSING, FAULTED, TERMINAL: the target's guard raises its own error
        raise PhaseError(
            owner=type(self).__name__,
            operation=operation,
            phase=phase.value,
            legal_phases=(Phase.SERVING.value,),
            next_calls=next_calls,
        )

    def prefill_forward(
        self,
        *,
        tokens: object,
        page_table: object,
        kv_cache: object = None,
        enable_trace: bool,
        prompt_lens: object = None,
        start_pos: object = None,
        sampling_params: object = None,
        empty_slots: object = None,
        **compatibility: object,
    ) -> PrefillOutput:
        """Prefill whole prompts from position 0; `start_pos > 0` skips a cached prefix.

        Returns sampled tokens `[B]` with sampling params, else logits, rows in source order.
        """
        self._require_servable("prefill_forward")
        normalized, trace = self.adapter.normalize_prefill(
            tokens,
            page_table,
            enable_trace=enable_trace,
            prompt_lens=prompt_lens,
            start_pos=start_pos,
            empty_slots=empty_slots,
            kv_cache=kv_cache,
            sampling_params=sampling_params,
            compatibility_kwargs=compatibility,
        )
        self._serve_if_needed()
        # The forwarded compatibility values (typed `object` by the adapter) are checked by
        # the executor's boundary (`check_sampling_arguments`), which takes any value.
        return self.executor.prefill_forward(
            **normalized,  # type: ignore[arg-type]
            execution="traced" if trace else "eager",
        )

    def decode_forward(
        self,
        *,
        tokens: object,
        page_table: object,
        kv_cache: object = None,
        start_pos: object,
        sampling_params: object = None,
        reset_batch: bool = False,
        enable_trace: bool,
        read_from_device: bool = True,
        **compatibility: object,
    ) -> torch.Tensor | DecodeOutput:
        """One decode step over every slot (`start_pos` -1 marks a padding row).

        `read_from_device=True` returns host tokens `[B]` / logits `[B, 1, V]`; False returns
        a `DecodeOutput` for `read_decode_output` or `process_decode_output_host`.
        """
        check_bool("read_from_device", read_from_device)
        self._require_servable("decode_forward")
        normalized, trace = self.adapter.normalize_decode(
            tokens,
            start_pos,
            page_table,
            enable_trace=enable_trace,
            kv_cache=kv_cache,
            sampling_params=sampling_params,
            reset_batch=reset_batch,
            compatibility_kwargs=compatibility,
        )
        self._serve_if_needed()
        out = self.executor.decode_forward(
            **normalized,  # type: ignore[arg-type]  # the executor checks them (see prefill)
            read_from_device=read_from_device,
            execution="traced" if trace else "eager",
        )
        if read_from_device:
            assert isinstance(out, torch.Tensor)  # host tokens [B] or logits [B, 1, V]
            return out
        return DecodeOutput(raw=out, is_tokens=normalized["sampling_params"] is not None)

    @overload
    def read_decode_output(
        self, out: object, async_read: Literal[True]
    ) -> tuple[HostDecodeOutput, list[object]]: ...
    @overload
    def read_decode_output(
        self, out: object, async_read: Literal[False] = False
    ) -> HostDecodeOutput: ...
    def read_decode_output(
        self, out: object, async_read: bool = False
    ) -> HostDecodeOutput | tuple[HostDecodeOutput, list[object]]:
        """Start reading a `DecodeOutput`: async -> `(HostDecodeOutput, events)`.

        The engine waits for the events, then calls `process_decode_output_host`.
        """
        check_bool("async_read", async_read)
        if not isinstance(out, DecodeOutput):
            raise TypeError(
                "read_decode_output expects the DecodeOutput that decode_forward("
                f"read_from_device=False) returned, got {type(out).__name__}"
            )
        if out.read:
            raise RuntimeError(
                "this decode output was already read; pass its HostDecodeOutput to "
                "process_decode_output_host()"
            )
        if async_read:
            host, events = self.executor.read_decode_output(out.raw, async_read=True)
            out.read = True
            return HostDecodeOutput(host=host, is_tokens=out.is_tokens), list(events)
        host = self.executor.read_decode_output(out.raw, async_read=False)
        out.read = True
        return HostDecodeOutput(host=host, is_tokens=out.is_tokens)

    def process_decode_output_host(self, out: object, is_tokens: bool = False) -> DecodeHostOutput:
        """Finish a decode read: tokens int64 `[B]` (sampled) or logits float32 `[B, 1, V]`.

        Accepts a `HostDecodeOutput` (after the read's events) or an unread `DecodeOutput`
        (read here, blocking).
        """
        check_bool("is_tokens", is_tokens)
        if isinstance(out, DecodeOutput):
            if out.read:
                raise RuntimeError(
                    "this decode output was read asynchronously; pass the HostDecodeOutput "
                    "that read_decode_output returned"
                )
            self._check_kind(out.is_tokens, is_tokens)
            host = self.executor.read_decode_output(out.raw, async_read=False)
            out.read = True
            processed: DecodeHostOutput = self.executor.process_decode_output_host(
                host, is_tokens=out.is_tokens
            )
            return processed
        if not isinstance(out, HostDecodeOutput):
            raise TypeError(
                "process_decode_output_host expects a HostDecodeOutput from read_decode_output "
                f"or a DecodeOutput from decode_forward, got {type(out).__name__}"
            )
        if out.processed:
            raise RuntimeError("this decode output was already processed")
        self._check_kind(out.is_tokens, is_tokens)
        result: DecodeHostOutput = self.executor.process_decode_output_host(
            out.host, is_tokens=out.is_tokens
        )
        out.processed = True
        return result

    @staticmethod
    def _check_kind(sampled: bool, is_tokens: bool) -> None:
        if is_tokens and not sampled:
            raise ValueError(
                "is_tokens=True but this decode step ran without sampling_params and returned "
                "logits; pass is_tokens=False"
            )

    def runtime_summary(self) -> Mapping[str, object]:
        """The execution target's counters (eager executions, trace replays, programs)."""
        return self.executor.runtime_summary()

    # -- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything the facade owns; idempotent (also runs when it is collected)."""
        self._holder.close()

    @property
    def closed(self) -> bool:
        """Whether the target reached TERMINAL."""
        return bool(self.executor.is_terminal)


_FAMILY_FACADES: dict[str, type[DecoderVLLMModel]] = {}


def facade_for(family: Family) -> type[DecoderVLLMModel]:
    """The facade class serving `family`: `DecoderVLLMModel` when the family declares the
    default capabilities, else a subclass carrying the family's (made once per family)."""
    capabilities = dict(family.vllm_capabilities)
    if capabilities == DecoderVLLMModel.model_capabilities:
        return DecoderVLLMModel
    made = _FAMILY_FACADES.get(family.name)
    if made is None or made.model_capabilities != capabilities:
        name = f"{family.name.title().replace('_', '')}VLLMModel"
        made = type(name, (DecoderVLLMModel,), {"model_capabilities": capabilities})
        _FAMILY_FACADES[family.name] = made
    return made

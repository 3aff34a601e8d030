"""Which vLLM facade serves a Hugging Face architecture, and what it offers.

The architecture is looked up in the family registry (`models.families`); every registered
family is served by the generic facade (`models.vllm_facade.facade.DecoderVLLMModel`) with
the family's declared capabilities. `VLLMFacade` / `VLLMFacadeClass` name the calls the
worker makes on a facade (the Tenstorrent model-runner contract), so the runner is typed
against the contract rather than one class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, overload, runtime_checkable

import torch

from models.families import UnknownArchitectureError, families, family_for_architectures
from runtime.decode_staging import DecodeHostOutput

FacadeOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
"""A forward's host result: logits, or sampled tokens (maybe with their log-probs)."""


class HasArchitectures(Protocol):
    """The part of a Hugging Face config that picks the facade."""

    @property
    def architectures(self) -> list[str] | None: ...


class VLLMFacade(Protocol):
    """The calls the worker makes on a loaded facade, in lifecycle order."""

    @property
    def device(self) -> object: ...
    @property
    def max_device_top_k(self) -> int | None: ...

    def allocate_kv_cache(
        self, kv_cache_shape: tuple[int, ...], dtype: torch.dtype, num_layers: int
    ) -> object: ...

    def warmup_model_prefill(
        self, *, kv_cache: object, enable_trace: bool, can_sample_on_device: bool
    ) -> None: ...

    def warmup_model_decode(
        self,
        *,
        enable_trace: bool,
        can_sample_on_device: bool,
        kv_cache: object,
        max_batch_size: int,
        num_blocks: int,
    ) -> None: ...

    def prefill_forward(
        self,
        *,
        enable_trace: bool,
        tokens: torch.Tensor,
        page_table: torch.Tensor,
        prompt_lens: object = None,
        start_pos: object = None,
        empty_slots: object = None,
        kv_cache: object = None,
        sampling_params: object = None,
        **compatibility: object,
    ) -> FacadeOutput: ...

    def decode_forward(
        self,
        *,
        enable_trace: bool,
        read_from_device: bool = True,
        tokens: torch.Tensor,
        start_pos: object,
        page_table: torch.Tensor,
        kv_cache: object = None,
        sampling_params: object = None,
        reset_batch: bool = False,
        **compatibility: object,
    ) -> object: ...

    @overload
    def read_decode_output(
        self, out: object, async_read: Literal[True]
    ) -> tuple[object, list[object]]: ...
    @overload
    def read_decode_output(self, out: object, async_read: Literal[False] = False) -> object: ...

    def process_decode_output_host(
        self, out: object, is_tokens: bool = False
    ) -> DecodeHostOutput: ...

    def runtime_summary(self) -> Mapping[str, object]: ...

    def close(self) -> None: ...


@runtime_checkable
class SleepModeFacade(Protocol):
    """A facade with vLLM's sleep mode (`models.vllm_sleep.FacadeSleepMode`)."""

    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self, tags: Sequence[str] | None = None) -> object | None: ...
    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
    ) -> None: ...


class VLLMFacadeClass(Protocol):
    """A facade class: its capabilities, capacity rule and loader (classmethods)."""

    @property
    def model_capabilities(self) -> Mapping[str, bool]: ...

    def get_max_tokens_all_users(self, *, max_model_len: int, max_num_seqs: int) -> int: ...

    def initialize_vllm_model(
        self,
        hf_config: object,
        mesh_device: object,
        max_batch_size: int,
        *,
        optimizations: str | None = None,
        max_seq_len: int | None = None,
        tt_data_parallel: int = 1,
        **options: object,
    ) -> VLLMFacade: ...


def supported_architectures() -> list[str]:
    """Every HF architecture a registered family serves."""
    return sorted(name for family in families() for name in family.hf_architectures)


def facade_class(hf_config: HasArchitectures) -> VLLMFacadeClass:
    """The facade class for `hf_config.architectures` (a clear error when there is none)."""
    from models.vllm_facade.facade import facade_for

    architectures = list(getattr(hf_config, "architectures", None) or [])
    try:
        family = family_for_architectures(architectures)
    except UnknownArchitectureError:
        raise ValueError(
            f"llm-runtime has no vLLM facade for architectures {architectures}; supported are "
            f"{supported_architectures()} (serve other models with vLLM's own platform: "
            "LLM_RUNTIME_VLLM_PLATFORM=0)"
        ) from None
    return facade_for(family)


if TYPE_CHECKING:  # mypy checks each family's facade against the contract here
    from models.vllm_facade.facade import DecoderVLLMModel

    def _decoder_class(cls: type[DecoderVLLMModel]) -> VLLMFacadeClass:
        return cls

    def _decoder_facade(facade: DecoderVLLMModel) -> VLLMFacade:
        return facade

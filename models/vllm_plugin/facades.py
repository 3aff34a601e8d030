"""Which model family's vLLM facade serves a Hugging Face architecture, and what it offers.

`VLLMFacade` / `VLLMFacadeClass` name the calls the worker makes on a facade (the
Tenstorrent model-runner contract that `models.llama.vllm.LlamaVLLMModel` implements), so
the runner is typed against the contract rather than one family's class.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Literal, Protocol, cast, overload

import torch

FACADES: dict[str, str] = {
    "LlamaForCausalLM": "models.llama.vllm:LlamaVLLMModel",
}

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
        kv_cache: object,
        enable_trace: bool,
        max_batch_size: int,
        num_blocks: int,
        can_sample_on_device: bool,
    ) -> None: ...

    def prefill_forward(
        self,
        *,
        tokens: torch.Tensor,
        page_table: torch.Tensor,
        kv_cache: object = None,
        enable_trace: bool,
        prompt_lens: object = None,
        start_pos: object = None,
        sampling_params: object = None,
        empty_slots: object = None,
        **compatibility: object,
    ) -> FacadeOutput: ...

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor,
        page_table: torch.Tensor,
        kv_cache: object = None,
        start_pos: object,
        sampling_params: object = None,
        reset_batch: bool = False,
        enable_trace: bool,
        read_from_device: bool = True,
        **compatibility: object,
    ) -> object: ...

    @overload
    def read_decode_output(
        self, out: object, async_read: Literal[True]
    ) -> tuple[object, list[object]]: ...
    @overload
    def read_decode_output(self, out: object, async_read: Literal[False] = False) -> object: ...

    def process_decode_output_host(self, out: object, is_tokens: bool = False) -> torch.Tensor: ...

    def runtime_summary(self) -> Mapping[str, object]: ...

    def close(self) -> None: ...


class VLLMFacadeClass(Protocol):
    """A facade class: its capabilities, capacity rule and loader (classmethods)."""

    __name__: str

    @property
    def model_capabilities(self) -> Mapping[str, bool]: ...

    def get_max_tokens_all_users(self, *, max_model_len: int, max_num_seqs: int) -> int: ...

    def initialize_vllm_model(
        self,
        hf_config: object,
        mesh_device: object,
        max_batch_size: int,
        max_seq_len: int | None = None,
        tt_data_parallel: int = 1,
        optimizations: str | None = None,
        **options: object,
    ) -> VLLMFacade: ...


def facade_class(hf_config: HasArchitectures) -> VLLMFacadeClass:
    """The facade class for `hf_config.architectures` (a clear error when there is none)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        target = FACADES.get(name)
        if target is not None:
            module, _, attribute = target.partition(":")
            found: object = getattr(importlib.import_module(module), attribute)
            return cast(VLLMFacadeClass, found)  # FACADES names classes of the contract
    raise ValueError(
        f"llm-runtime has no vLLM facade for architectures {architectures}; supported are "
        f"{sorted(FACADES)} (serve other models with vLLM's own platform: "
        "LLM_RUNTIME_VLLM_PLATFORM=0)"
    )

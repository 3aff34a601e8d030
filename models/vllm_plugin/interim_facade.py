"""Interim Llama facade over `LlamaExecutor`, until issue #15's facade lands on this branch.

It follows issue #15's call table (numpy `prompt_lens` / `start_pos`, `enable_trace`, the
two-phase warmup, phases entered as the engine's steps arrive) with the executor's guarded
calls underneath; `facades.FACADES` switches to the family's own facade once it exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lifecycle.phases import Phase
from models.llama.executor import LlamaExecutor, load_executor

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _long(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.int64))
    if isinstance(value, torch.Tensor):
        return value.to(torch.long)
    return value


class LlamaVLLMFacade:
    model_capabilities = {  # noqa: RUF012
        "supports_prefix_caching": True,
        "supports_sample_on_device": False,
        "supports_async_decode": True,
    }

    def __init__(self, executor: LlamaExecutor) -> None:
        self.executor = executor

    @classmethod
    def initialize_vllm_model(
        cls,
        hf_config: Any,
        mesh_device: Any,
        max_batch_size: int,
        max_seq_len: int | None = None,
        tt_data_parallel: int = 1,
        optimizations: Any = None,
        *,
        model_path: str,
        block_size: int = 32,
        dtype: torch.dtype = torch.float32,
        trace_mode: str = "none",
        max_prefill_chunk_size: int | None = None,
    ) -> LlamaVLLMFacade:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
        chunk = max_prefill_chunk_size or 8 * block_size
        executor = load_executor(
            model_path,
            device=torch.device(mesh_device).type,
            dtype=DTYPE_NAMES[dtype],
            trace_mode=trace_mode,
            block_size=block_size,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_prefill_chunk_size=chunk,
            device_sampling=False,
        )
        return cls(executor)

    def kv_cache_num_blocks(self) -> int:
        return int(self.executor.config.paged_kv_cache.max_num_blocks)

    def allocate_kv_cache(self, kv_cache_shape: Any, dtype: torch.dtype, num_layers: int) -> Any:
        return self.executor.allocate_kv_cache(tuple(kv_cache_shape), dtype, num_layers)

    def warmup_model_prefill(
        self, *, enable_trace: bool, kv_cache: Any, can_sample_on_device: bool
    ) -> None:
        if not enable_trace:
            self.executor.warmup_prefill(kv_cache=kv_cache, can_sample_on_device=False)

    def warmup_model_decode(
        self,
        *,
        enable_trace: bool,
        kv_cache: Any,
        max_batch_size: int,
        num_blocks: int,
        can_sample_on_device: bool,
    ) -> None:
        if not enable_trace:
            self.executor.warmup_decode(kv_cache=kv_cache, can_sample_on_device=False)

    def _serving(self) -> None:
        executor = self.executor
        if executor.phase is Phase.COMPILED and executor.trace_mode != "none":
            executor.capture()
        if executor.phase is not Phase.SERVING:
            executor.serve()

    def prefill_forward(
        self,
        *,
        tokens: Any,
        page_table: Any,
        kv_cache: Any,
        enable_trace: bool,
        prompt_lens: Any,
        start_pos: Any,
        empty_slots: Any = None,
        **_: Any,
    ) -> Any:
        self._serving()
        return self.executor.prefill_forward(
            tokens=_long(tokens),
            page_table=page_table,
            kv_cache=kv_cache,
            prompt_lens=_long(prompt_lens),
            start_pos=_long(start_pos),
            empty_slots=empty_slots,
        )

    def decode_forward(
        self,
        *,
        tokens: Any,
        page_table: Any,
        kv_cache: Any,
        start_pos: Any,
        enable_trace: bool,
        read_from_device: bool = True,
        **_: Any,
    ) -> Any:
        self._serving()
        return self.executor.decode_forward(
            tokens=_long(tokens).reshape(-1),
            start_pos=_long(start_pos),
            page_table=page_table,
            kv_cache=kv_cache,
            read_from_device=read_from_device,
        )

    def read_decode_output(self, out: Any, async_read: bool = False) -> Any:
        return self.executor.read_decode_output(out, async_read=async_read)

    def process_decode_output_host(self, out: Any, is_tokens: bool = False) -> Any:
        return self.executor.process_decode_output_host(out, is_tokens=is_tokens)

    def close(self) -> None:
        self.executor.close()

"""`LlamaExecutor`: the family facade that turns a model name into a lane executor.

It owns the family's policy: the torch runtime policy values, a device sampler attached to
the model, and the default KV geometry (enough blocks for every lane slot to reach the
maximum sequence length).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lifecycle.journal import Journal
from models.executor import ModelExecutor, ModelExecutorConfig
from models.llama.kernels import KernelPlan, load_kernel_plan
from models.llama.sampling import LlamaSampler, SamplerConfig
from models.llama.sources import LoadedModel, load_model
from models.llama.tokenizer import LlamaTokenizer
from runtime.backends import make_device
from runtime.backends.base import Device
from runtime.backends.cpu_features import CpuFeatures, require_native_bf16
from runtime.config import (
    PagedKVCacheConfig,
    RuntimePolicy,
    TraceConfig,
    WarmupConfig,
    require_positive_int,
)
from runtime.warmup import Progress

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_TOP_K = 64


class LlamaExecutor(ModelExecutor):
    """A `ModelExecutor` over a Llama-family model, with its tokenizer attached."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: ModelExecutorConfig,
        *,
        device: Device,
        journal: Journal | None = None,
        progress: Progress | None = None,
    ) -> None:
        super().__init__(
            loaded.model,
            config,
            device=device,
            owner_name="LlamaExecutor",
            journal=journal,
            progress=progress,
        )
        self.loaded = loaded

    @property
    def tokenizer(self) -> LlamaTokenizer | None:
        """The model's tokenizer (None for tiny-random models)."""
        return self.loaded.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a completion."""
        return tuple(self.loaded.args.eos_token_ids or ())


def load_executor(
    model: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    trace_mode: str = "none",
    block_size: int = 32,
    num_blocks: int | None = None,
    max_batch_size: int = 8,
    max_prefill_chunk_size: int = 256,
    max_seq_len: int | None = None,
    device_sampling: bool = True,
    warmup: WarmupConfig | None = None,
    faults: str | None = None,
    progress: Progress | None = None,
    seed: int = 0,
    kernels: str | Path | KernelPlan | None = None,
    cpu_features: CpuFeatures | None = None,
) -> LlamaExecutor:
    """Load `model` (a name, HF directory or .gguf) and build its executor in CONSTRUCTED.

    `kernels`: a kernel plan (or the path of a saved one, `--kernels FILE`) that warmup
    applies instead of timing kernels. `cpu_features`: the CPU probe's answer (default: probe
    this host); bfloat16 on CPU needs native bf16. Every argument is checked before any
    weights load.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and device == "cpu":
        require_native_bf16(cpu_features or CpuFeatures.probe())
    plan = load_kernel_plan(kernels) if isinstance(kernels, str | Path) else kernels
    trace = TraceConfig(mode=trace_mode)  # type: ignore[arg-type]
    require_positive_int("block_size", block_size)
    require_positive_int("max_batch_size", max_batch_size)
    require_positive_int("max_prefill_chunk_size", max_prefill_chunk_size)
    if num_blocks is not None:
        require_positive_int("num_blocks", num_blocks)
    if max_seq_len is not None:
        require_positive_int("max_seq_len", max_seq_len)
    target = make_device(device, faults=faults)
    loaded = load_model(model, dtype=DTYPES[dtype], device=target.torch_device, seed=seed)
    args = loaded.args
    seq_len = min(max_seq_len or args.max_seq_len, args.max_seq_len)
    if max_prefill_chunk_size % block_size:
        raise ValueError(
            f"max_prefill_chunk_size ({max_prefill_chunk_size}) must be a multiple of "
            f"block_size ({block_size})"
        )
    blocks_per_seq = -(-seq_len // block_size)
    max_blocks = max_batch_size * blocks_per_seq
    if num_blocks is not None and num_blocks > max_blocks:
        max_blocks = num_blocks
    kv_dtype = DTYPES[dtype]
    loaded.model.configure_paged_attention(block_size=block_size, max_num_blocks=max_blocks)
    if plan is not None:
        where = f"--kernels {kernels}" if isinstance(kernels, str | Path) else "kernels"
        loaded.model.replay_kernels(plan, where=where)
    if device_sampling:
        loaded.model.sampling = LlamaSampler(
            SamplerConfig(
                max_batch_size=max_batch_size,
                max_top_k=DEFAULT_MAX_TOP_K,
                vocab_size=args.vocab_size,
            )
        )
    policy = RuntimePolicy.torch_default(
        chunk_size_multiple=block_size, decode_lane_capacity_limit=max(256, max_batch_size)
    )
    config = ModelExecutorConfig(
        trace=trace,
        warmup=warmup or WarmupConfig(),
        paged_kv_cache=PagedKVCacheConfig(
            block_size=block_size,
            max_num_blocks=max_blocks,
            dtype=kv_dtype,
            num_blocks=num_blocks,
        ),
        device_sampling_enabled=device_sampling,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=min(max_prefill_chunk_size, seq_len),
        max_seq_len=seq_len,
        policy=policy,
    )
    return LlamaExecutor(loaded, config, device=target, progress=progress)

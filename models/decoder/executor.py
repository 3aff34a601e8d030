"""`DecoderExecutor`: the family facade that turns a model name into a lane executor.

It owns the family's policy: the torch runtime policy values, a device sampler attached to
the model, and the default KV geometry (enough blocks for every lane slot to reach the
maximum sequence length).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from lifecycle.journal import Journal, Outcome
from models.decoder.gguf_weights import BLOCK_MODES, WEIGHTS_MODES, WeightsMode
from models.decoder.kernels import KernelPlan, int8_activations_available, load_kernel_plan
from models.decoder.layers import Projection
from models.decoder.residency import check_state_dtypes
from models.decoder.sampling import DecoderSampler, SamplerConfig
from models.decoder.sources import LoadedModel, load_model
from models.decoder.tokenizer import DecoderTokenizer
from models.executor import ModelExecutor, ModelExecutorConfig
from models.progress import ProgressSink, as_progress
from runtime.backends import make_device
from runtime.backends.base import Device
from runtime.backends.cpu_features import (
    CpuFeatures,
    UnsupportedCpuFeatureError,
    require_native_bf16,
)
from runtime.config import (
    PagedKVCacheConfig,
    RuntimePolicy,
    TraceConfig,
    WarmupConfig,
    require_positive_int,
)
from runtime.json_types import JSONValue

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_TOP_K = 64


class DecoderExecutor(ModelExecutor):
    """A `ModelExecutor` over a decoder-family model, with its tokenizer attached."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: ModelExecutorConfig,
        *,
        device: Device,
        journal: Journal | None = None,
        progress: ProgressSink | None = None,
    ) -> None:
        super().__init__(
            loaded.model,
            config,
            device=device,
            owner_name="DecoderExecutor",
            journal=journal,
            progress=progress,
        )
        self.loaded = loaded
        # Its own machine: loading weights is no phase transition of the executor.
        self.journal.record(
            machine="weights",
            trigger="load",
            source="-",
            dest="LOADED",
            started=time.time(),
            duration_s=0.0,
            outcome=Outcome.OK,
            detail=f"weights {loaded.weights}: {_megabytes(loaded.model.weight_bytes())} resident",
        )

    def _prepare_reload(self, source: object) -> object:
        """Accept a model name or path (loaded as this executor's weights are: same dtype
        and weights mode), a `LoadedModel`, a `DecoderModel` or a canonical state dict."""
        return super()._prepare_reload(self._reload_source(source))

    def _reload_source(self, source: object) -> object:
        model = self.loaded.model
        if isinstance(source, LoadedModel):
            return source.model
        if isinstance(source, str | Path):
            return load_model(
                source,
                dtype=model.dtype,
                device="cpu",
                seed=self.loaded.seed,
                with_tokenizer=False,
                weights=self.loaded.weights_mode,
            ).model
        if isinstance(source, Mapping):
            check_state_dtypes(source, model.dtype)
            return type(model).from_state_dict(model.args, source, dtype=model.dtype)
        return source

    def memory_summary(self) -> str:
        """Resident bytes of the weights, the KV cache and the workspace (for `bringup`)."""
        model = self.loaded.model
        cache = model.kv_cache
        kv = 0 if cache is None else sum(t.numel() * t.element_size() for t in _tensors(cache))
        packed = model.packed_weight_bytes()
        return (
            f"weights {_megabytes(model.weight_bytes())} ({self.loaded.weights}), "
            f"KV {_megabytes(kv)}, workspace {_megabytes(model.workspace_bytes())}"
            + (f", oneDNN packed weight copies {_megabytes(packed)}" if packed else "")
        )

    def runtime_summary(self) -> dict[str, JSONValue]:
        """The execution counters, plus how the weights are held (vLLM's stats show them)."""
        summary = super().runtime_summary()
        model = self.loaded.model
        summary["weight_bytes"] = model.weight_bytes()
        summary["block_weight_projections"] = sum(
            1 for module in model.modules() if isinstance(module, Projection) and module.blocks
        )
        return summary

    @property
    def tokenizer(self) -> DecoderTokenizer | None:
        """The model's tokenizer (None for tiny-random models)."""
        return self.loaded.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a completion."""
        return tuple(self.loaded.args.eos_token_ids or ())


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def _tensors(cache: object) -> list[torch.Tensor]:
    """Every tensor of a bound KV cache (layers of K/V pairs)."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    if isinstance(cache, list | tuple):
        return [t for item in cache for t in _tensors(item)]
    return []


PREFILL_PADDING_START = 32


def geometry_problem(
    block_size: int,
    prefill_chunk: int,
    *,
    names: tuple[str, str] = ("block_size", "max_prefill_chunk_size"),
) -> str | None:
    """What is wrong with a KV block size and prefill chunk together, or None.

    The rule: prompts are padded to powers of two from 32 tokens, and a padded prompt longer
    than the chunk runs as equal chunks of whole blocks, so the block size must be a power of
    two and the chunk a multiple of it.
    """
    block_name, chunk_name = names
    if block_size & (block_size - 1):
        return (
            f"{block_name} {block_size} is invalid: allowed is a power of two (1, 2, 4, ... "
            f"32, 64, ...), because prompts are padded to powers of two from "
            f"{PREFILL_PADDING_START} tokens and split into chunks of whole blocks"
        )
    if prefill_chunk % block_size:
        nearest = block_size * max(1, prefill_chunk // block_size)
        return (
            f"{chunk_name} {prefill_chunk} is invalid with {block_name} {block_size}: the "
            f"chunk must be a multiple of the block size (e.g. {nearest})"
        )
    return None


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
    progress: object = None,
    seed: int = 0,
    kernels: str | Path | KernelPlan | None = None,
    cpu_features: CpuFeatures | None = None,
    weights: str = "stored",
) -> DecoderExecutor:
    """Load `model` (a name, HF directory or .gguf) and build its executor in CONSTRUCTED.

    Every argument is checked before any weights load. `progress` (a `models.progress` sink
    or a bare warmup callback) shows load, KV allocation, warmup and capture, and stays for
    generation. `kernels`: a kernel plan (or its file, `--kernels FILE`) that warmup applies
    instead of timing. `cpu_features`: the CPU probe's answer (bfloat16 on CPU needs native
    bf16). `weights` (`--weights`): `stored` keeps a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors
    in their blocks; `float32` / `bfloat16` dequantize every tensor to the model's dtype.
    """
    sink = as_progress(progress)
    plan, trace = _checked_choices(dtype, device, cpu_features, weights, kernels, trace_mode)
    _check_geometry(block_size, num_blocks, max_batch_size, max_prefill_chunk_size, max_seq_len)
    target = make_device(device, faults=faults)
    with sink.step(f"load model {model}"):
        loaded = load_model(
            model,
            dtype=DTYPES[dtype],
            device=target.torch_device,
            seed=seed,
            weights=cast(WeightsMode, weights),
        )
    seq_len, max_blocks = _kv_extent(
        loaded.args.max_seq_len, max_seq_len, block_size, max_batch_size, num_blocks
    )
    if plan is not None:
        loaded.model.replay_kernels(plan, where=_kernels_flag(kernels))
    return build_executor(
        loaded,
        device=target,
        trace=trace,
        block_size=block_size,
        max_num_blocks=max_blocks,
        num_blocks=num_blocks,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=max_prefill_chunk_size,
        max_seq_len=seq_len,
        device_sampling=device_sampling,
        warmup=warmup,
        progress=sink,
    )


def _checked_choices(
    dtype: str,
    device: str,
    cpu_features: CpuFeatures | None,
    weights: str,
    kernels: str | Path | KernelPlan | None,
    trace_mode: str,
) -> tuple[KernelPlan | None, TraceConfig]:
    """The dtype, weights, kernel plan and trace mode checked (before any weights load)."""
    _check_dtype(dtype, device, cpu_features)
    _check_weights(weights, dtype)
    plan = load_kernel_plan(kernels) if isinstance(kernels, str | Path) else kernels
    return plan, TraceConfig.of(trace_mode)


def _kernels_flag(kernels: str | Path | KernelPlan | None) -> str:
    """How a replayed plan's errors name it: the flag with its file, or the argument."""
    return f"--kernels {kernels}" if isinstance(kernels, str | Path) else "kernels"


def _check_dtype(dtype: str, device: str, cpu_features: CpuFeatures | None) -> None:
    """A known dtype; bfloat16 on CPU only with native bf16 (`cpu_features`, else probed)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and device == "cpu":
        require_native_bf16(cpu_features or CpuFeatures.probe())


def _check_weights(weights: str, dtype: str) -> None:
    """A known `--weights`; a dequantizing one must name the model's dtype."""
    if weights not in WEIGHTS_MODES:
        raise ValueError(
            f"weights (--weights) must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}"
        )
    if weights == "stored-int8" and not int8_activations_available():
        raise UnsupportedCpuFeatureError(
            "weights='stored-int8' (--weights stored-int8) runs block products with int8 "
            "activations, which needs a CPU with AVX-512 VNNI and gcc; this one cannot: allowed "
            "here are --weights stored, float32 or bfloat16"
        )
    if weights not in BLOCK_MODES and weights != dtype:
        raise ValueError(
            f"weights={weights!r} (--weights {weights}) dequantizes into the model's dtype, "
            f"but dtype is {dtype!r} (--dtype {dtype}): allowed are weights='stored' or "
            f"weights={dtype!r}"
        )


def _check_geometry(
    block_size: int,
    num_blocks: int | None,
    max_batch_size: int,
    max_prefill_chunk_size: int,
    max_seq_len: int | None,
) -> None:
    """The KV and batch geometry arguments, before any weights load."""
    require_positive_int("block_size", block_size)
    require_positive_int("max_batch_size", max_batch_size)
    require_positive_int("max_prefill_chunk_size", max_prefill_chunk_size)
    if num_blocks is not None:
        require_positive_int("num_blocks", num_blocks)
    if max_seq_len is not None:
        require_positive_int("max_seq_len", max_seq_len)
    problem = geometry_problem(block_size, max_prefill_chunk_size)
    if problem:
        raise ValueError(problem)


def _kv_extent(
    model_context: int,
    max_seq_len: int | None,
    block_size: int,
    max_batch_size: int,
    num_blocks: int | None,
) -> tuple[int, int]:
    """`(max_seq_len, max_num_blocks)`: the lane's sequence limit within the model's context,
    and blocks for every slot to reach it (or `num_blocks`, when larger)."""
    seq_len = min(max_seq_len or model_context, model_context)
    if max_seq_len is not None and max_seq_len > model_context:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the model's context of {model_context} "
            f"tokens: allowed is 1..{model_context}"
        )
    max_blocks = max_batch_size * -(-seq_len // block_size)
    if num_blocks is not None and num_blocks > max_blocks:
        max_blocks = num_blocks
    return seq_len, max_blocks


def build_executor(
    loaded: LoadedModel,
    *,
    device: Device,
    trace: TraceConfig,
    block_size: int,
    max_num_blocks: int,
    num_blocks: int | None,
    max_batch_size: int,
    max_prefill_chunk_size: int,
    max_seq_len: int,
    device_sampling: bool,
    warmup: WarmupConfig | None = None,
    progress: ProgressSink | None = None,
    journal: Journal | None = None,
) -> DecoderExecutor:
    """An executor in CONSTRUCTED over an already loaded model, with this KV geometry.

    The model's paged attention is (re)configured to the geometry and, with device sampling,
    a sampler for the lane is attached unless one of the right size is already there.
    """
    args = loaded.args
    model = loaded.model
    model.configure_paged_attention(block_size=block_size, max_num_blocks=max_num_blocks)
    if device_sampling:
        current = getattr(model, "sampling", None)
        if not (
            isinstance(current, DecoderSampler) and current.config.max_batch_size == max_batch_size
        ):
            model.sampling = DecoderSampler(
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
            max_num_blocks=max_num_blocks,
            dtype=model.dtype,
            num_blocks=num_blocks,
        ),
        device_sampling_enabled=device_sampling,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=min(max_prefill_chunk_size, max_seq_len),
        max_seq_len=max_seq_len,
        policy=policy,
    )
    return DecoderExecutor(loaded, config, device=device, progress=progress, journal=journal)

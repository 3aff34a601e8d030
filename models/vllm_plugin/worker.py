"""The vLLM worker process of this runtime: device setup and the calls vLLM's executor makes.

vLLM's engine core calls these methods over its executor (in this process or a spawned
one); each delegates to `LLMRuntimeModelRunner`. Capacity comes from the runtime: the
reported "available memory" is exactly the bytes of the block count the runtime resolved,
so vLLM's arithmetic turns it back into that count; vLLM's memory profiler never runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from models.vllm_plugin.model_runner import LLMRuntimeModelRunner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)


class LLMRuntimeWorker(WorkerBase):  # type: ignore[misc]
    """A vLLM worker whose model runs through `llm-runtime`'s lifecycle and facade."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(
            vllm_config,
            local_rank,
            rank,
            distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        self.model_runner: LLMRuntimeModelRunner | None = None

    @property
    def runner(self) -> LLMRuntimeModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the llm-runtime worker is not initialised; call init_device()")
        return self.model_runner

    def init_device(self) -> None:
        platform = self.current_platform
        if platform.device_type == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            platform.dist_backend,
        )
        self.model_runner = LLMRuntimeModelRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("load_format='dummy' is not supported by the llm-runtime worker")
        self.runner.load_model()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.runner.kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, kv_cache_layout: str) -> None:
        """The facade owns its cache layout; vLLM's choice only affects its block arithmetic."""
        logger.debug("vLLM resolved KV cache layout %s (the facade keeps its own)", kv_cache_layout)

    def determine_available_memory(self) -> int:
        blocks = self.runner.num_kv_blocks()
        logger.info(
            "llm-runtime capacity: %d KV blocks of %d tokens", blocks, self.runner.block_size
        )
        return self.runner.kv_cache_bytes()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks

    def compile_or_warm_up_model(self) -> CompilationTimes:
        self.runner.warm_up()
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Issue the step; None tells the engine to call `sample_tokens` for its output."""
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output (an `AsyncModelRunnerOutput` under async scheduling)."""
        return self.runner.sample_tokens(grammar_output)

    def runtime_stats(self) -> dict[str, float]:
        """Counters of the facade calls made so far and of its executor, and the worker's
        torch thread count (`LLM.collective_rpc("runtime_stats")`; a server logs them and
        writes `stats_file`, see `stats_report`)."""
        return self.runner.runtime_stats()

    def execute_dummy_batch(self) -> None:
        """A data-parallel rank with nothing to run has nothing to synchronise (dense models)."""

    def take_draft_token_ids(self) -> None:
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> object:
        return getattr(self.runner.model, "model", self.runner.model)

    def get_cache_block_size_bytes(self) -> int:
        return self.runner.kv_cache_bytes() // max(self.runner.num_kv_blocks(), 1)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def add_lora(self, lora_request: LoRARequest) -> bool:
        raise ValueError("LoRA adapters are not supported by the llm-runtime worker")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def reset_prefix_cache(self) -> None:
        """The KV contents stay valid; vLLM's own block pool forgets its hashes."""

    def reset_encoder_cache(self) -> None:
        """No encoder, so no encoder cache (vLLM resets it when it pauses for sleep)."""

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (`--enable-sleep-mode`): the facade target drains and sleeps."""
        self.runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake `tags` ("weights", then "kv_cache"; None: both) in the facade target."""
        self.runner.wake_up(tags)

    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        """`LLM.collective_rpc("reload_weights")`: in place, from the loaded file by default."""
        if not is_checkpoint_format:
            raise ValueError(
                "reload_weights(is_checkpoint_format=False) is not supported by the llm-runtime "
                "worker: pass checkpoint (Hugging Face) names"
            )
        self.runner.reload_weights(weights_iterator, weights_path)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.close()

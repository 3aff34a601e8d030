"""A contract driver that plays a vLLM engine (Tenstorrent model-runner contract) on a facade.

It makes the calls the engine makes, in the engine's order, with the engine's argument forms:
class attribute `model_capabilities`; `initialize_vllm_model(hf_config, mesh_device,
max_batch_size, max_seq_len=, tt_data_parallel=, optimizations=)`; the capacity classmethod
`get_max_tokens_all_users` plus one block per slot; positional `allocate_kv_cache(shape, dtype,
num_layers)`; the two-phase warmup; then prefill waves and decode steps:

* prefill: `tokens` int32 `[B, max_end]` holding each whole prompt from position 0 (zero
  padded), `page_table` int32 `[B, W]` zero padded, `prompt_lens` a numpy int64 array,
  `start_pos` a numpy int32 array (> 0 on a prefix-cache hit), `empty_slots` a list of slots;
* decode: `tokens` int32 `[slots, 1]`, `start_pos` int32 `[slots]` with -1 on free slots and
  zero page-table rows there, `read_from_device=False`, then either `read_decode_output(out,
  async_read=True)`, waiting for the events and `process_decode_output_host(host, is_tokens=)`,
  or `process_decode_output_host(out, is_tokens=)` directly (the synchronous engine path).

Prefix caching works like vLLM's: full prompt blocks are hashed by their token chain; a later
request whose prompt starts with cached blocks reuses them and prefills from `start_pos`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class EngineSamplingParams:
    """The engine's per-row sampling lists (the field names of its on-device sampling params)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    presence_penalty: list[float] | float = 0.0
    frequency_penalty: list[float] | float = 0.0
    repetition_penalty: list[float] | float = 1.0
    seed: list[int | None] | int = 0
    num_logprobs: list[int] | int | None = None
    enable_log_probs: list[bool] | None = None

    @classmethod
    def greedy(cls, rows: int) -> EngineSamplingParams:
        return cls(
            temperature=[0.0] * rows,
            top_k=[1] * rows,
            top_p=[1.0] * rows,
            presence_penalty=[0.0] * rows,
            frequency_penalty=[0.0] * rows,
            repetition_penalty=[1.0] * rows,
            seed=[None] * rows,
            num_logprobs=[-2] * rows,  # the engine's "no log-probs" sentinel
            enable_log_probs=[False] * rows,
        )


@attrs.define
class EngineRequest:
    """One request as the engine tracks it."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    blocks: list[int] = attrs.Factory(list)
    output: list[int] = attrs.Factory(list)
    slot: int | None = None
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@attrs.define
class EngineStats:
    """What the driver observed (for assertions)."""

    prefill_calls: int = 0
    decode_steps: int = 0
    prefix_hit_tokens: int = 0
    async_reads: int = 0
    events_synchronized: int = 0
    max_start_pos: int = 0


class BlockPool:
    """vLLM-style block allocation with hashed full prompt blocks (the prefix cache)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.cached: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    def _hashes(self, tokens: Sequence[int]) -> list[bytes]:
        hashes: list[bytes] = []
        previous = b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = np.asarray(tokens[start : start + self.block_size], dtype=np.int64).tobytes()
            previous = hashlib.sha256(previous + chunk).digest()
            hashes.append(previous)
        return hashes

    def _take(self) -> int:
        block = self.free.pop(0)
        stale = self.hash_of.pop(block, None)
        if stale is not None:
            self.cached.pop(stale, None)
        self.refs[block] = 1
        return block

    def allocate_prompt(self, request: EngineRequest, total_tokens: int) -> None:
        """Blocks for `total_tokens`; cached full prompt blocks are shared (the last token is
        always computed)."""
        hashes = self._hashes(request.prompt)
        shared: list[int] = []
        for digest in hashes:
            block = self.cached.get(digest)
            if block is None:
                break
            shared.append(block)
        # vLLM never caches the whole prompt: at least the last token is computed.
        while shared and len(shared) * self.block_size >= len(request.prompt):
            shared.pop()
        for block in shared:
            if self.refs.get(block, 0) == 0:
                self.free.remove(block)
            self.refs[block] = self.refs.get(block, 0) + 1
        needed = -(-total_tokens // self.block_size)
        request.blocks = shared + [self._take() for _ in range(needed - len(shared))]
        request.cached_tokens = len(shared) * self.block_size

    def publish(self, request: EngineRequest) -> None:
        """After prefill, the request's full prompt blocks become prefix-cache entries."""
        for digest, block in zip(self._hashes(request.prompt), request.blocks, strict=False):
            if digest not in self.cached:
                self.cached[digest] = block
                self.hash_of[block] = digest

    def release(self, request: EngineRequest) -> None:
        for block in request.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.free.append(block)  # stays a prefix-cache entry until reused
        request.blocks = []


class EngineDriver:
    """Drives a facade class through the engine's call sequence."""

    def __init__(
        self,
        facade_class: Any,
        hf_config: Any,
        *,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        trace_mode: str,
        sample_on_device: bool,
        async_decode: bool,
        dtype: torch.dtype = torch.float32,
        facade_options: dict[str, Any] | None = None,
        compatibility_keywords: bool = False,
    ) -> None:
        self.facade_class = facade_class
        self.hf_config = hf_config
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.trace_mode = trace_mode
        self.sample_on_device = sample_on_device
        self.async_decode = async_decode
        self.dtype = dtype
        self.facade_options = dict(facade_options or {})
        self.compatibility_keywords = compatibility_keywords
        self.stats = EngineStats()
        self.model: Any = None
        self.kv_cache: Any = None
        self.pool: BlockPool | None = None
        self.num_blocks = 0
        self._last_slots: dict[int, int] | None = None

    # -- engine start-up -------------------------------------------------------------------------

    def _hf(self, name: str) -> Any:
        if isinstance(self.hf_config, dict):
            return self.hf_config.get(name)
        return getattr(self.hf_config, name, None)

    def start(self) -> None:
        capabilities = getattr(self.facade_class, "model_capabilities", None) or {}
        if self.sample_on_device and not capabilities.get("supports_sample_on_device", False):
            raise AssertionError("the facade does not declare on-device sampling")
        if self.async_decode and not capabilities.get("supports_async_decode", False):
            raise AssertionError("the facade does not declare async decode")
        self.prefix_caching = bool(capabilities.get("supports_prefix_caching", False))
        tokens_all_users = self.facade_class.get_max_tokens_all_users(
            model_name="driver",
            num_devices=1,
            tt_data_parallel=1,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_batch_size,
        )
        tokens_all_users += self.block_size * self.max_batch_size
        self.num_blocks = tokens_all_users // self.block_size
        assert self.facade_class.get_kv_cache_spec(None) is None
        self.model = self.facade_class.initialize_vllm_model(
            self.hf_config,
            "cpu",
            self.max_batch_size,
            max_seq_len=self.max_model_len,
            tt_data_parallel=1,
            optimizations=None,
            trace_mode=self.trace_mode,
            **self.facade_options,
        )
        heads = int(self._hf("num_key_value_heads"))
        head_dim = self._hf("head_dim") or self._hf("hidden_size") // self._hf(
            "num_attention_heads"
        )
        shape = (self.num_blocks, heads, self.block_size, int(head_dim))
        self.kv_cache = self.model.allocate_kv_cache(
            shape, self.dtype, int(self._hf("num_hidden_layers"))
        )
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.warmup()

    def warmup(self) -> None:
        prefill_kwargs = {"kv_cache": self.kv_cache, "can_sample_on_device": self.sample_on_device}
        decode_kwargs = {
            "kv_cache": self.kv_cache,
            "max_batch_size": self.max_batch_size,
            "num_blocks": self.max_blocks_per_req,
            "can_sample_on_device": self.sample_on_device,
        }
        self.model.warmup_model_prefill(enable_trace=False, **prefill_kwargs)
        self.model.warmup_model_decode(enable_trace=False, **decode_kwargs)
        if self.trace_mode == "all":
            self.model.warmup_model_prefill(enable_trace=True, **prefill_kwargs)
        if self.trace_mode in ("all", "decode_only"):
            self.model.warmup_model_decode(enable_trace=True, **decode_kwargs)

    # -- sleep mode (vLLM's `LLM.sleep` / `wake_up` / `collective_rpc("reload_weights")`) ---------

    def sleep(self, level: int) -> None:
        """Sleep the facade; like vLLM at level >= 1, forget every cached prefix."""
        self.model.sleep(level)
        self.pool = BlockPool(self.num_blocks, self.block_size)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake `tags`; once the KV stage is awake, every later call passes its new handle."""
        handle = self.model.wake_up(tags)
        if handle is not None:
            self.kv_cache = handle

    # -- steps -------------------------------------------------------------------------------------

    def _sample_host(self, logits: torch.Tensor, rows: int) -> list[int]:
        values = logits.reshape(rows, -1, logits.shape[-1])[:, -1, :]
        return [int(token) for token in values.argmax(dim=-1)]

    def prefill(self, requests: list[EngineRequest]) -> None:
        assert self.pool is not None
        for request in requests:
            self.pool.allocate_prompt(request, len(request.prompt) + request.max_new_tokens)
            if not self.prefix_caching:
                request.cached_tokens = 0
        rows = len(requests)
        max_end = max(len(r.prompt) for r in requests)
        tokens = torch.zeros((rows, max_end), dtype=torch.int32)
        page_table = torch.zeros((rows, self.max_blocks_per_req), dtype=torch.int32)
        for row, request in enumerate(requests):
            tokens[row, : len(request.prompt)] = torch.tensor(request.prompt, dtype=torch.int32)
            page_table[row, : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
        prompt_lens = np.array([len(r.prompt) for r in requests], dtype=np.int64)
        start_pos = np.array([r.cached_tokens for r in requests], dtype=np.int32)
        kwargs: dict[str, Any] = {
            "tokens": tokens,
            "page_table": page_table,
            "kv_cache": self.kv_cache,
            "enable_trace": self.trace_mode == "all",
            "prompt_lens": prompt_lens,
            "start_pos": start_pos,
            "empty_slots": [r.slot for r in requests],
        }
        if self.sample_on_device:
            kwargs["sampling_params"] = EngineSamplingParams.greedy(rows)
        if self.compatibility_keywords:  # what hybrid-attention / mrope deployments add
            kwargs["page_tables_per_layer"] = [page_table] * int(self._hf("num_hidden_layers"))
        out = self.model.prefill_forward(**kwargs)
        if isinstance(out, tuple):
            out, _log_probs = out
        if self.sample_on_device:
            sampled = [int(token) for token in out.reshape(-1)[:rows]]
        else:
            sampled = self._sample_host(out, rows)
        for request, token in zip(requests, sampled, strict=True):
            request.output.append(token)
            self.pool.publish(request)
        self.stats.prefill_calls += 1
        self.stats.prefix_hit_tokens += int(start_pos.sum())
        self.stats.max_start_pos = max(self.stats.max_start_pos, int(start_pos.max()))

    def decode(self, running: dict[int, EngineRequest]) -> None:
        slots = self.max_batch_size
        tokens = torch.zeros((slots, 1), dtype=torch.int32)
        start_pos = torch.full((slots,), -1, dtype=torch.int32)
        page_table = torch.zeros((slots, self.max_blocks_per_req), dtype=torch.int32)
        for slot, request in running.items():
            tokens[slot, 0] = request.output[-1]
            start_pos[slot] = request.num_tokens - 1
            page_table[slot, : len(request.blocks)] = torch.tensor(
                request.blocks, dtype=torch.int32
            )
        layout = {slot: request.index for slot, request in running.items()}
        reset_batch = layout != self._last_slots
        self._last_slots = layout
        kwargs: dict[str, Any] = {
            "tokens": tokens,
            "page_table": page_table,
            "kv_cache": self.kv_cache,
            "start_pos": start_pos,
        }
        if self.sample_on_device:
            kwargs["sampling_params"] = EngineSamplingParams.greedy(slots)
            kwargs["reset_batch"] = reset_batch
        if self.compatibility_keywords:
            kwargs["page_tables_per_layer"] = [page_table] * int(self._hf("num_hidden_layers"))
            kwargs["rope_deltas_all_users"] = None
        out = self.model.decode_forward(
            **kwargs,
            enable_trace=self.trace_mode in ("all", "decode_only"),
            read_from_device=False,
        )
        if self.async_decode:
            host, events = self.model.read_decode_output(out, async_read=True)
            for event in events:
                self.model.device.event_synchronize(event)
            self.stats.async_reads += 1
            self.stats.events_synchronized += len(events)
            out = host
        result = self.model.process_decode_output_host(out, is_tokens=self.sample_on_device)
        if isinstance(result, tuple):
            result, _log_probs = result
        if self.sample_on_device:
            sampled = [int(token) for token in result.reshape(-1)]
        else:
            sampled = self._sample_host(result, slots)
        for slot, request in running.items():
            request.output.append(sampled[slot])
        self.stats.decode_steps += 1

    # -- scheduling --------------------------------------------------------------------------------

    def generate(
        self,
        waves: Sequence[Sequence[Sequence[int]]],
        *,
        max_new_tokens: int,
        decode_steps_between_waves: int = 2,
    ) -> list[list[int]]:
        """Serve prompts in waves: each wave is prefilled into free slots, then decoding runs."""
        assert self.pool is not None
        requests: list[EngineRequest] = []
        running: dict[int, EngineRequest] = {}
        pending = [list(wave) for wave in waves]
        while pending or running:
            if pending:
                free = [slot for slot in range(self.max_batch_size) if slot not in running]
                wave = pending[0]
                admit = wave[: len(free)]
                del wave[: len(admit)]
                if not wave:
                    pending.pop(0)
                admitted: list[EngineRequest] = []
                for slot, prompt in zip(free, admit, strict=False):
                    request = EngineRequest(len(requests), list(prompt), max_new_tokens, slot=slot)
                    requests.append(request)
                    admitted.append(request)
                    running[slot] = request
                if admitted:
                    self.prefill(admitted)
                    self._retire(running)
            steps = decode_steps_between_waves if pending else None
            while running and (steps is None or steps > 0):
                self.decode(running)
                self._retire(running)
                if steps is not None:
                    steps -= 1
        return [request.output for request in requests]

    def _retire(self, running: dict[int, EngineRequest]) -> None:
        assert self.pool is not None
        for slot in [slot for slot, request in running.items() if request.done]:
            request = running.pop(slot)
            request.output = request.output[: request.max_new_tokens]
            self.pool.release(request)
            request.slot = None

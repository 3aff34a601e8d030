"""The model runner: vLLM's worker steps mapped onto a model family's vLLM facade.

vLLM's scheduler decides everything about batching; this runner keeps the request table
(`batch.RequestTable`), turns each `SchedulerOutput` into one `prefill_forward` and one
`decode_forward` on the facade (the engine's block tables as page tables), and samples the
rows that finished a prompt or decoded a token.

Sampling: where the facade declares `supports_sample_on_device` (and the `device_sampling`
setting allows it), a request whose parameters the runtime's `SamplingParams` express is
sampled by the runtime's sampler: on the device when every row its facade call samples is
such a request (the call returns tokens), else on the host over that call's logits with the
same parameters and position-keyed seeded noise, so its tokens never depend on the requests
it shares a call with. Every other request (logprobs, a top_k the device cannot honour,
penalties on a traced lane), and every request without device sampling, is sampled by vLLM's
own `Sampler` on the host logits.

Steps: `execute_model` issues a step's facade calls (the prefill, then the decode with the
facade's async read started) and `sample_tokens` hands back its output. Under vLLM's async
scheduling (on where the facade declares `supports_async_decode`) that output is a
`PendingStep`: vLLM reads it after it has already scheduled the next step, and the next
`execute_model` finishes it first if vLLM has not, since its tokens are the next inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SamplerOutput,
)
from vllm.v1.sample.sampler import Sampler

from models.vllm_plugin.batch import DecodeBatch, PrefillBatch, RequestState, RequestTable
from models.vllm_plugin.device_sampling import (
    DeviceSamplingPolicy,
    FacadeSampling,
    HistoryRow,
    HostRow,
    SamplingKeywords,
    facade_sampling,
    host_runtime_sampler,
    sample_rows_on_host,
)
from models.vllm_plugin.facades import FacadeOutput, SleepModeFacade, VLLMFacade, facade_class
from models.vllm_plugin.pending_step import IssuedDecode, IssuedStep, PendingStep
from models.vllm_plugin.sampling import (
    build_sampling_metadata,
    logprobs_in_request_order,
    sampling_generator,
)
from models.vllm_plugin.settings import PluginSettings
from models.vllm_plugin.stats_report import (
    RUNNER_COUNTERS,
    StatsReporter,
    numeric_counters,
    stats_path,
)
from models.vllm_plugin.step_samples import StepSamples
from runtime.sampling import DeviceSampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

logger = logging.getLogger(__name__)
AsyncModelRunnerOutput.register(PendingStep)  # vLLM's output thread calls its get_output()

OPTIMIZATIONS: dict[torch.dtype, str | None] = {torch.float32: None, torch.bfloat16: "performance"}
"""vLLM's model dtype -> the facade's `optimizations` (which sets weight and KV dtype)."""


def layer_names(num_layers: int) -> list[str]:
    """vLLM's attention layer names for a decoder of `num_layers` layers."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


class LLMRuntimeModelRunner:
    """One facade instance serving vLLM's scheduler steps."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        model_config = vllm_config.model_config
        self.hf_config = model_config.hf_text_config
        self.dtype: torch.dtype = model_config.dtype
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = int(model_config.max_model_len)
        self.settings = PluginSettings.from_additional_config(vllm_config.additional_config)
        self.facade_cls = facade_class(model_config.hf_config)
        self.facade_name = str(getattr(self.facade_cls, "__name__", self.facade_cls))
        capabilities = getattr(self.facade_cls, "model_capabilities", None) or {}
        self.supports_async_decode = bool(capabilities.get("supports_async_decode", False))
        # The platform turned vLLM's async scheduling on only where the facade declares it.
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self._step_index = 0
        self._issued: PendingStep[ModelRunnerOutput] | None = (
            None  # execute_model's step, until sample_tokens
        )
        self._last_step: PendingStep[ModelRunnerOutput] | None = (
            None  # handed to vLLM, maybe not read yet
        )
        self.device_sampling = self._device_sampling(capabilities)
        self.sampling_policy: DeviceSamplingPolicy | None = None  # set once the facade loads
        self.host_runtime_sampler: DeviceSampler | None = None
        self._logged_host_reasons: set[str] = set()
        self._sampled_lane: tuple[str | None, ...] | None = None  # last device-sampled decode
        self.vocab_size = int(model_config.get_vocab_size())
        config = self.hf_config
        self.num_layers = int(config.num_hidden_layers)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.decode_width = -(-self.max_model_len // self.block_size)
        self.requests = RequestTable(
            max_slots=self.max_num_seqs, block_size=self.block_size, decode_width=self.decode_width
        )
        self.sampler = Sampler()
        self.model: VLLMFacade | None = None
        self.kv_cache: object = None
        self.reporter = self._stats_reporter(vllm_config)
        self.stats: dict[str, float] = dict.fromkeys(RUNNER_COUNTERS, 0)

    def _stats_reporter(self, vllm_config: VllmConfig) -> StatsReporter:
        """The counter reports the settings ask for (one file per data-parallel rank)."""
        parallel = vllm_config.parallel_config
        path = stats_path(
            self.settings.stats_file,
            data_parallel_size=int(parallel.data_parallel_size),
            data_parallel_rank=int(parallel.data_parallel_rank),
        )
        return StatsReporter(self.settings.stats_interval_s, path)

    @property
    def facade(self) -> VLLMFacade:
        """The loaded facade (`load_model` builds it)."""
        if self.model is None:
            raise RuntimeError("the llm-runtime model runner has no facade; call load_model()")
        return self.model

    def runtime_stats(self) -> dict[str, float]:
        """The runner's counters, the facade's (its executor's) counters and the worker's
        torch thread count, as one flat `name -> number` mapping."""
        stats = dict(self.stats)
        if self.model is not None:
            stats.update(numeric_counters(self.model.runtime_summary()))
        stats["torch_threads"] = float(torch.get_num_threads())
        return stats

    def _device_sampling(self, capabilities: Mapping[str, bool]) -> bool:
        """On where the facade declares it, unless the `device_sampling` setting says no."""
        declared = bool(capabilities.get("supports_sample_on_device", False))
        wanted = self.settings.device_sampling
        if wanted and not declared:
            raise ValueError(
                "additional_config['llm_runtime']['device_sampling'] is true but the facade "
                f"{self.facade_name} does not declare supports_sample_on_device; set it "
                "to false or leave it unset (vLLM's sampler on the host logits)"
            )
        return declared if wanted is None else wanted

    # -- load, capacity, allocation, warmup -------------------------------------------------------

    def load_model(self) -> None:
        """`initialize_vllm_model` with vLLM's slot count and context length."""
        clock = time.perf_counter()
        self.model = model = self.facade_cls.initialize_vllm_model(
            self.vllm_config.model_config.hf_config,
            str(self.device),
            self.max_num_seqs,
            max_seq_len=self.max_model_len,
            tt_data_parallel=1,
            optimizations=self._optimizations(),
            **self._facade_options(),
        )
        if self.device_sampling:
            self.sampling_policy = DeviceSamplingPolicy(
                vocab_size=self.vocab_size,
                max_top_k=model.max_device_top_k,
                penalties=not self.settings.trace.enabled,
            )
        logger.info(
            "llm-runtime facade %s loaded in %.1f s; sampling: %s",
            self.facade_name,
            time.perf_counter() - clock,
            "on the device where requests allow it" if self.device_sampling else "vLLM's sampler",
        )

    def _optimizations(self) -> str | None:
        """The facade's `optimizations` for vLLM's `--dtype` (it picks weight and KV dtype)."""
        if self.dtype not in OPTIMIZATIONS:
            raise ValueError(
                f"--dtype {self.dtype} is not supported by the llm-runtime worker; allowed are "
                f"{[str(d).removeprefix('torch.') for d in OPTIMIZATIONS]}"
            )
        return OPTIMIZATIONS[self.dtype]

    def _facade_options(self) -> dict[str, object]:
        """The runtime settings the facade takes beyond the table's arguments."""
        options: dict[str, object] = {
            "model": str(self.vllm_config.model_config.model),
            "block_size": self.block_size,
            "trace_mode": self.settings.trace_mode,
            "device_sampling": self.device_sampling,
        }
        if self.settings.max_prefill_chunk_size is not None:
            options["max_prefill_chunk_size"] = self.settings.max_prefill_chunk_size
        return options

    def kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )
        return dict.fromkeys(layer_names(self.num_layers), spec)

    def num_kv_blocks(self) -> int:
        """The runtime's capacity: every slot can reach max_model_len, plus a block per slot.

        The extra block per slot covers vLLM's null block and each request's partial block.
        """
        tokens = self.facade_cls.get_max_tokens_all_users(
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs
        )
        return int(tokens) // self.block_size + self.max_num_seqs

    def kv_cache_bytes(self) -> int:
        """What vLLM's block arithmetic turns back into `num_kv_blocks()` blocks."""
        per_block = sum(int(spec.page_size_bytes) for spec in self.kv_cache_spec().values())
        return self.num_kv_blocks() * per_block

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """`allocate_kv_cache` with the engine's block count (vLLM's block 0 is its null block)."""
        shape = (kv_cache_config.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.kv_cache = self.facade.allocate_kv_cache(shape, self.dtype, self.num_layers)
        logger.info("llm-runtime KV cache: %s x %d layers, %s", shape, self.num_layers, self.dtype)

    def warm_up(self) -> None:
        """The two-phase warmup: compile every shape, then capture traces where the mode says."""
        for enable_trace in (False, True):
            trace_prefill = self.settings.trace.prefill_enabled
            trace_decode = self.settings.trace.decode_enabled
            if not enable_trace or trace_prefill:
                self.facade.warmup_model_prefill(
                    enable_trace=enable_trace,
                    kv_cache=self.kv_cache,
                    can_sample_on_device=self.device_sampling,
                )
            if not enable_trace or trace_decode:
                self.facade.warmup_model_decode(
                    enable_trace=enable_trace,
                    kv_cache=self.kv_cache,
                    max_batch_size=self.max_num_seqs,
                    num_blocks=self.decode_width,  # blocks per request: the page-table width
                    can_sample_on_device=self.device_sampling,
                )

    # -- sleep mode -----------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Finish the last step, then drain and sleep the facade's target (vLLM has paused
        scheduling and aborted or finished every request first)."""
        facade = self._sleep_mode()
        self._finish_previous_step()
        clock = time.perf_counter()
        facade.sleep(level)
        self.kv_cache = None
        logger.info("llm-runtime asleep (level %d) in %.2f s", level, time.perf_counter() - clock)

    def wake_up(self, tags: list[str] | None) -> None:
        """Wake `tags`; the KV stage hands back the handle every later step passes."""
        clock = time.perf_counter()
        handle = self._sleep_mode().wake_up(tags)
        if handle is not None:
            self.kv_cache = handle
        logger.info(
            "llm-runtime woke %s in %.2f s", tags or "everything", time.perf_counter() - clock
        )

    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None,
        weights_path: str | None,
    ) -> None:
        self._sleep_mode().reload_weights(weights_iterator, weights_path)

    def _sleep_mode(self) -> SleepModeFacade:
        facade = self.facade
        if not isinstance(facade, SleepModeFacade):
            raise ValueError(
                f"the facade {self.facade_name} has no sleep mode (sleep, wake_up, "
                "reload_weights); start vLLM without --enable-sleep-mode"
            )
        return facade

    # -- one scheduler step ---------------------------------------------------------------------

    def _update_requests(self, out: SchedulerOutput) -> None:
        table = self.requests
        for req_id in out.finished_req_ids:
            table.finish(req_id)
        for req_id in out.preempted_req_ids or ():
            table.release_slot(req_id)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            if params is None or new.prompt_token_ids is None:
                raise ValueError(
                    f"request {new.req_id!r}: this worker serves token prompts with sampling "
                    "params (no pooling, no prompt embeddings)"
                )
            if new.num_computed_tokens > 0:
                self.stats["prefix_hit_requests"] += 1
            table.add(
                new.req_id,
                new.prompt_token_ids,
                new.block_ids[0],
                new.num_computed_tokens,
                payload=(params, sampling_generator(params, self.device)),
            )
        cached = out.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                self.stats["resumed_requests"] += 1
            table.update(
                req_id,
                num_computed=cached.num_computed_tokens[index],
                new_block_ids=None if new_blocks is None else new_blocks[0],
                resumed=req_id in cached.resumed_req_ids,
                num_output_tokens=cached.num_output_tokens[index],
            )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Issue the step's facade calls; the output comes from `sample_tokens`.

        The previous step is finished first: its tokens are this step's inputs (under async
        scheduling vLLM may not have asked for its output yet).
        """
        self._finish_previous_step()
        self.reporter.step(self.runtime_stats)  # no facade call is in flight here
        self._update_requests(out)
        if not out.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._step_index += 1
        issued = self._issue(out)
        self._issued = PendingStep(self._step_index, lambda: self._finish_step(issued))
        return None

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | PendingStep[ModelRunnerOutput]:
        """The issued step's output: pending under async scheduling, else read now."""
        if grammar_output is not None:
            raise ValueError("structured outputs are not supported by the llm-runtime worker")
        pending, self._issued = self._issued, None
        if pending is None:
            raise RuntimeError("sample_tokens() without a step issued by execute_model()")
        self._last_step = pending
        if self.async_scheduling:
            self.stats["async_steps"] += 1
            return pending
        output: ModelRunnerOutput = pending.get_output()
        return output

    def _finish_previous_step(self) -> None:
        """Wait for the last step (if vLLM has not read it yet) so the table has its tokens."""
        if self._issued is not None:
            raise RuntimeError("execute_model() again before sample_tokens() read the last step")
        last, self._last_step = self._last_step, None
        if last is not None:  # waits if vLLM's output thread is finishing it right now
            if last.finish():
                self.stats["steps_finished_by_next_step"] += 1
            last.get_output()  # re-raises the step's failure here too

    def _issue(self, out: SchedulerOutput) -> IssuedStep:
        """Run the prefill call and start the decode call of one step."""
        plan = self.requests.plan(out.num_scheduled_tokens)
        issued = IssuedStep(req_ids=list(out.num_scheduled_tokens), samples=StepSamples())
        if plan.prefill is not None:
            batch = plan.prefill
            sampled = [r for r, sample in zip(batch.req_ids, batch.sample, strict=True) if sample]
            on_device = self._device_samplable(sampled)
            sampling = self._prefill_sampling(batch, sampled, on_device)
            rows = {req_id: row for row, req_id in enumerate(batch.req_ids)}
            output = self._prefill(batch, sampling)
            issued.samples.collect(output, sampling, [(r, rows[r]) for r in sampled], on_device)
        if plan.decode is not None:
            lane = plan.decode
            on_device = self._device_samplable(list(lane.req_ids))
            sampling = self._decode_sampling(lane, on_device)
            issued.decode = self._start_decode(lane, sampling, on_device)
        return issued

    def _finish_step(self, issued: IssuedStep) -> ModelRunnerOutput:
        """Read the decode output, sample the host rows, record every request's new token."""
        step = issued.samples
        if issued.decode is not None:
            decode = issued.decode
            step.collect(self._read_decode(decode), decode.sampling, decode.rows, decode.on_device)
        req_ids = issued.req_ids
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        chosen = dict(step.device_tokens)
        self.stats["device_sampled_rows"] += len(chosen)
        if step.runtime_ids:
            chosen.update(self._runtime_sample_on_host(step.runtime_ids, step.runtime_logits))
        logprobs = None
        if step.vllm_ids:
            host_tokens, result = self._vllm_sample(step.vllm_ids, step.vllm_logits)
            chosen.update(zip(step.vllm_ids, host_tokens, strict=True))
            if result.logprobs_tensors is not None:
                logprobs = logprobs_in_request_order(result, step.vllm_ids, req_ids)
        tokens: list[list[int]] = [[] for _ in req_ids]
        for req_id, token in chosen.items():
            tokens[index[req_id]] = [token]
            self.requests.append_token(req_id, token)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=index,
            sampled_token_ids=tokens,
            logprobs=logprobs,
        )

    # -- sampling -------------------------------------------------------------------------------

    def _device_samplable(self, sampled: list[str]) -> set[str]:
        """The requests among `sampled` whose parameters the facade's sampler can honour."""
        policy = self.sampling_policy
        if policy is None:
            return set()
        found: set[str] = set()
        for req_id in sampled:
            reason = policy.host_reason(self.requests[req_id].payload[0])
            if reason is None:
                found.add(req_id)
            elif reason not in self._logged_host_reasons:
                self._logged_host_reasons.add(reason)
                logger.info(
                    "llm-runtime: request %s is sampled by vLLM's sampler on the host: %s "
                    "(the calls it shares return logits)",
                    req_id,
                    reason,
                )
        return found

    def _on_device(self, sampled: list[str], on_device: set[str]) -> bool:
        """Whether the facade samples this call: it samples something, all of it samplable."""
        if not sampled or self.sampling_policy is None:
            return False
        if len(on_device) == len(sampled):
            return True
        self.stats["host_sampling_calls"] += 1
        return False

    def _history(self, state: RequestState) -> HistoryRow:
        return HistoryRow(prompt=state.prompt, output=state.output)

    def _prefill_sampling(
        self, batch: PrefillBatch, sampled: list[str], on_device: set[str]
    ) -> FacadeSampling | None:
        """Parameters by the call's rows (chunks that sample nothing neutral), history by slot."""
        if not self._on_device(sampled, on_device):
            return None
        wanted = set(sampled)
        params = [self.requests[r].payload[0] if r in wanted else None for r in batch.req_ids]
        histories: list[HistoryRow | None] = [None] * self.max_num_seqs
        for req_id, slot in zip(batch.req_ids, batch.empty_slots, strict=True):
            histories[slot] = self._history(self.requests[req_id])
        return facade_sampling(params, histories, vocab_size=self.vocab_size)

    def _decode_sampling(self, batch: DecodeBatch, on_device: set[str]) -> FacadeSampling | None:
        """Parameters and history by slot; slots without a running request neutral."""
        if not self._on_device(list(batch.req_ids), on_device):
            return None
        params: list[SamplingParams | None] = [None] * int(batch.tokens.shape[0])
        histories: list[HistoryRow | None] = [None] * len(params)
        for req_id, slot in zip(batch.req_ids, batch.slots, strict=True):
            state = self.requests[req_id]
            params[slot] = state.payload[0]
            histories[slot] = self._history(state)
        return facade_sampling(params, histories, vocab_size=self.vocab_size)

    def _runtime_sample_on_host(
        self, req_ids: list[str], logits: list[torch.Tensor]
    ) -> dict[str, int]:
        """Device-samplable rows of a call that returned logits: the runtime's own sampler on
        the host, so each such request draws what the device would have drawn."""
        policy = self.sampling_policy
        assert policy is not None
        if self.host_runtime_sampler is None:
            self.host_runtime_sampler = host_runtime_sampler(policy, self.max_num_seqs)
        rows = []
        for req_id in req_ids:
            state = self.requests[req_id]
            rows.append(HostRow(state.payload[0], self._history(state), state.num_tokens - 1))
        stacked = torch.stack([row[: self.vocab_size] for row in logits])
        tokens = sample_rows_on_host(self.host_runtime_sampler, stacked, rows)
        self.stats["host_runtime_sampled_rows"] += len(req_ids)
        return dict(zip(req_ids, tokens, strict=True))

    def _vllm_sample(
        self, req_ids: list[str], logits: list[torch.Tensor]
    ) -> tuple[list[int], SamplerOutput]:
        """vLLM's `Sampler` over the host logit rows of `req_ids`."""
        states = [self.requests[r] for r in req_ids]
        metadata = build_sampling_metadata(
            [s.payload[0] for s in states],
            [s.payload[1] for s in states],
            [s.prompt for s in states],
            [s.output for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        stacked = torch.stack([row[: self.vocab_size] for row in logits]).float()
        result = self.sampler(stacked, metadata)
        self.stats["host_sampled_rows"] += len(req_ids)
        return [int(t) for t in result.sampled_token_ids[:, 0].tolist()], result

    # -- facade calls ---------------------------------------------------------------------------

    def _prefill(self, batch: PrefillBatch, sampling: FacadeSampling | None) -> FacadeOutput:
        clock = time.perf_counter()
        output = self.facade.prefill_forward(
            tokens=batch.tokens,
            page_table=batch.page_table,
            kv_cache=self.kv_cache,
            enable_trace=self.settings.trace.prefill_enabled,
            prompt_lens=batch.prompt_lens,
            start_pos=batch.start_pos,
            empty_slots=list(batch.empty_slots),
            **({} if sampling is None else sampling.keywords()),
        )
        stats = self.stats
        stats["prefill_calls"] += 1
        stats["prefill_rows"] += len(batch.req_ids)
        stats["cached_prefill_rows"] += int((batch.start_pos > 0).sum())
        stats["partial_prefill_rows"] += batch.sample.count(False)
        stats["prefill_seconds"] += time.perf_counter() - clock
        return output

    def _start_decode(
        self, batch: DecodeBatch, sampling: FacadeSampling | None, on_device: set[str]
    ) -> IssuedDecode:
        """`decode_forward` over the lane; with the facade's async read, the read is started
        here and waited for in `_read_decode`."""
        clock = time.perf_counter()
        keywords: SamplingKeywords = {}
        reset_batch = False
        if sampling is not None:
            keywords, reset_batch = sampling.keywords(), self._lane_changed(batch)
        else:
            self._sampled_lane = None
        decode = IssuedDecode(
            sampling=sampling,
            rows=list(zip(batch.req_ids, batch.slots, strict=True)),
            on_device=on_device,
        )
        facade = self.facade
        raw = facade.decode_forward(
            tokens=batch.tokens,
            page_table=batch.page_table,
            kv_cache=self.kv_cache,
            start_pos=batch.start_pos,
            enable_trace=self.settings.trace.decode_enabled,
            reset_batch=reset_batch,
            read_from_device=not self.supports_async_decode,
            **keywords,
        )
        if self.supports_async_decode:
            decode.host, decode.events = facade.read_decode_output(raw, async_read=True)
        else:
            decode.output = raw
        self.stats["decode_calls"] += 1
        self.stats["decode_rows"] += len(batch.req_ids)
        self.stats["decode_seconds"] += time.perf_counter() - clock
        return decode

    def _read_decode(self, decode: IssuedDecode) -> object:
        """The decode call's host output (waiting for its read events first)."""
        if decode.host is None:
            return decode.output
        clock = time.perf_counter()
        for event in decode.events or ():
            _synchronize(self.facade, event)
        output = self.facade.process_decode_output_host(
            decode.host, is_tokens=decode.sampling is not None
        )
        self.stats["decode_seconds"] += time.perf_counter() - clock
        return output

    def _lane_changed(self, batch: DecodeBatch) -> bool:
        """`reset_batch` for a device-sampled decode: a facade that feeds sampled tokens back
        on the device must take the host's tokens when a slot changed request since the last
        device-sampled decode (or the previous decode returned logits)."""
        lane: list[str | None] = [None] * int(batch.tokens.shape[0])
        for req_id, slot in zip(batch.req_ids, batch.slots, strict=True):
            lane[slot] = req_id
        layout = tuple(lane)
        changed = layout != self._sampled_lane
        self._sampled_lane = layout
        return changed

    def close(self) -> None:
        """Release the facade's device state now (the engine only drops the object)."""
        if self.model is not None:
            self.reporter.close(self.runtime_stats)
        model, self.model, self.kv_cache = self.model, None, None
        if model is not None:
            model.close()


def _synchronize(model: VLLMFacade, event: object) -> None:
    """Wait for one read event with the facade's device (or the event's own wait)."""
    device = getattr(model, "device", None)
    wait = getattr(device, "event_synchronize", None)
    if callable(wait):
        wait(event)
        return
    synchronize = getattr(event, "synchronize", None)
    if callable(synchronize):
        synchronize()

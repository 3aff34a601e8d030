"""vLLM's own sampler over the host logits the facade returns.

The facade's logits path hands back one row per request that finished its prompt (prefill)
or decoded a token. This module builds vLLM's `SamplingMetadata` for exactly those rows
(the options it has no columns for are refused when a request arrives: `request_options`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.outputs import LogprobsLists, SamplerOutput
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

_EPS = 1e-5


def sampling_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator for a request with a seed (vLLM's own rule), else None."""
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    seed = params.seed
    assert seed is not None, "vLLM gives every RANDOM_SEED request a seed"
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def _sampling_columns(
    params: Sequence[SamplingParams], greedy: Sequence[bool], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(temperature, top_p, top_k) of a batch with a random row; a limit nobody sets is None."""
    temperature = torch.tensor(
        [0.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)],
        dtype=torch.float32,
        device=device,
    )
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    if any(p.top_p < 1.0 - _EPS for p in params):
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
    if any(0 < p.top_k < vocab_size for p in params):
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
            dtype=torch.int32,
        )
    return temperature, top_p, top_k


def _penalties_off(params: Sequence[SamplingParams]) -> bool:
    """True when no row has a presence, frequency or repetition penalty."""
    return all(
        abs(p.presence_penalty) < _EPS
        and abs(p.frequency_penalty) < _EPS
        and abs(p.repetition_penalty - 1.0) < _EPS
        for p in params
    )


def _prompt_tensor(prompts: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Prompts as one int64 tensor, padded with `vocab_size` (vLLM's padding id for penalties)."""
    width = max(len(p) for p in prompts)
    tensor = torch.full((len(prompts), width), vocab_size, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tensor[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
    return tensor


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[list[int]],
    *,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Metadata for rows `0..len(params)-1`, in the order the logits are stacked."""
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    if not all_greedy:
        temperature, top_p, top_k = _sampling_columns(params, greedy, vocab_size, device)
    no_penalties = _penalties_off(params)

    def column(name: str, default: float) -> torch.Tensor:
        values = [float(getattr(p, name)) for p in params]
        return torch.tensor(values or [default], dtype=torch.float32, device=device)

    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=top_p,
        top_k=top_k,
        generators={row: g for row, g in enumerate(generators) if g is not None},
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=no_penalties,
        prompt_token_ids=None if no_penalties else _prompt_tensor(prompts, vocab_size),
        frequency_penalties=column("frequency_penalty", 0.0),
        presence_penalties=column("presence_penalty", 0.0),
        repetition_penalties=column("repetition_penalty", 1.0),
        output_token_ids=list(outputs),
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def logprobs_in_request_order(
    result: SamplerOutput, sampled_ids: list[str], req_ids: list[str]
) -> LogprobsLists:
    """vLLM expects one logprobs row per scheduled request; rows not sampled here are empty."""
    tensors = result.logprobs_tensors
    assert tensors is not None, "vLLM's sampler returned no logprobs for a logprobs request"
    order = {r: i for i, r in enumerate(sampled_ids)}
    width = tensors.logprob_token_ids.shape[1]
    ids = torch.zeros((len(req_ids), width), dtype=tensors.logprob_token_ids.dtype)
    values = torch.full((len(req_ids), width), float("-inf"))
    ranks = torch.zeros(len(req_ids), dtype=tensors.selected_token_ranks.dtype)
    for row, req_id in enumerate(req_ids):
        source = order.get(req_id)
        if source is not None:
            ids[row] = tensors.logprob_token_ids[source]
            values[row] = tensors.logprobs[source]
            ranks[row] = tensors.selected_token_ranks[source]
    return type(tensors)(ids, values, ranks).tolists()

"""The anchor: Hugging Face transformers `generate` on the same weights, timed by a streamer."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from models.benchmark.runtime_engine import RunTimes

if TYPE_CHECKING:
    from transformers.generation.utils import GenerationMixin


def load_transformers(model: str, dtype: str) -> GenerationMixin:
    """transformers' model with the weights our loader reads for `model`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    from models.decoder.sources import load_model, resolve_source

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    source = resolve_source(model)
    if source.kind == "gguf":
        from transformers import AutoModelForCausalLM

        assert source.path is not None
        hf = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch_dtype
        )
        hf.train(False)
        return hf
    if source.kind == "hf_dir":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch_dtype)
        hf.train(False)
        return hf
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = load_model(model, dtype=torch_dtype, with_tokenizer=False)
    # The preset's family names its transformers class (`model_type` in its HF config).
    config = dict(loaded.args.to_hf_config())
    hf_config = AutoConfig.for_model(str(config.pop("model_type")), **config)
    built: Any = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    if torch_dtype == torch.bfloat16:
        built = built.bfloat16()  # built in float32, transformers' default
    result = built.load_state_dict(loaded.model.canonical_state_dict(), strict=False)
    if result.unexpected_keys or not set(result.missing_keys) <= {"lm_head.weight"}:
        raise RuntimeError(f"state dict mismatch: {result}")
    if loaded.args.tie_word_embeddings:
        built.tie_weights()
    built.train(False)
    return cast("GenerationMixin", built)


def hf_run(hf: GenerationMixin, prompts: list[list[int]], new_tokens: int, *, pad: int) -> RunTimes:
    """One timed `generate`: seconds from the first generated token to the last, and wall
    seconds from building the padded inputs to the returned ids."""
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    from models.benchmark.step_clock import StepClock

    clock = StepClock()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=clock,
        )
    total = time.perf_counter() - start
    if out.shape[1] != longest + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - longest} tokens per row")
    # put() #0 is the prompt, #1 the token from prefill, #new_tokens the last decode step.
    if len(clock.stamps) != new_tokens + 1:
        raise RuntimeError(f"expected {new_tokens + 1} streamer calls, got {len(clock.stamps)}")
    return RunTimes(decode_seconds=clock.stamps[-1] - clock.stamps[1], total_seconds=total)

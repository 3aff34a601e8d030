"""A prompt's token ids and the tokenizer that makes them, without an executor.

The Generator encodes here, and so does `llm-runtime generate` before it loads a model (to
refuse a prompt the lane cannot hold before minutes of load and warmup): one rule, so both
count the same tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch

from models.generation.tokenizers import ByteTokenizer, TextTokenizer


def text_tokenizer(found: TextTokenizer | None, vocab_size: int) -> TextTokenizer:
    """The model's tokenizer, or UTF-8 bytes for a model without one (vocab >= 256)."""
    if found is not None:
        return found
    if vocab_size < 256:
        raise ValueError(
            f"the model has no tokenizer and a vocabulary of {vocab_size} < 256 "
            "ids, so text prompts cannot be encoded; pass token-id lists"
        )
    return ByteTokenizer()


def prompt_token_ids(
    index: int,
    prompt: object,
    chat: bool,
    *,
    tokenizer: Callable[[], TextTokenizer],
    vocab_size: int,
) -> list[int]:
    """Request `index`'s token ids: a text prompt encoded (chat template when `chat`), or
    a list of token ids checked against `vocab_size`. `tokenizer` is called only for text."""
    where = f"request {index}"
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: prompt is empty; give at least one character")
        if chat:
            message = {"role": "user", "content": prompt}
            return list(tokenizer().apply_chat_template([message]))
        return list(tokenizer().encode(prompt))
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.reshape(-1).tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise TypeError(
            f"{where}: prompt must be a str or a list of token ids, got {type(prompt).__name__}"
        )
    if chat:
        raise ValueError(f"{where}: chat=True needs a text prompt, got token ids")
    ids: list[int] = []
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"{where}: prompt token {token!r} is not an int")
        if not 0 <= int(token) < vocab_size:
            raise ValueError(
                f"{where}: prompt token id {int(token)} is invalid: allowed are ids in "
                f"[0, {vocab_size})"
            )
        ids.append(int(token))
    return ids

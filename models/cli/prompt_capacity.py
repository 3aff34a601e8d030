"""`generate`'s prompts counted and checked against the lane before any model loads.

A prompt the lane cannot hold used to be found after the weights loaded and warmup ran
(minutes on SmolLM2); it is refused here instead, with the tokenizer alone, naming the
request, its tokens, the capacity and the flag that raises it (`UsageError`: exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from models.cli.errors import UsageError

if TYPE_CHECKING:
    from models.generation.tokenizers import TextTokenizer


def prompt_tokenizer(tokenizer: TextTokenizer | None, vocab_size: int) -> TextTokenizer:
    """What the Generator will encode with: the model's tokenizer, else UTF-8 bytes."""
    from models.generation.prompt_ids import text_tokenizer  # torch: not for --help

    try:
        return text_tokenizer(tokenizer, vocab_size)
    except ValueError as error:
        raise UsageError(f"--model: {error}") from error


def encode_prompts(
    args: argparse.Namespace, prompts: Sequence[str], tokenizer: TextTokenizer, vocab_size: int
) -> list[list[int]]:
    """Every prompt's token ids, exactly as the Generator will see them."""
    from models.generation.prompt_ids import prompt_token_ids

    encoded: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        try:
            ids = prompt_token_ids(
                index, prompt, args.chat, tokenizer=lambda: tokenizer, vocab_size=vocab_size
            )
        except (ValueError, TypeError) as error:
            raise UsageError(error) from error
        if not ids:
            raise UsageError(f"request {index}: prompt encodes to no tokens")
        encoded.append(ids)
    return encoded


def check_prompt_capacity(
    args: argparse.Namespace, prompt_ids: Sequence[Sequence[int]], model_context: int
) -> None:
    """Each prompt fits the lane's context and, when given, `--num-blocks` (per lane).

    Without `--num-blocks` the KV pool is sized to the prompts (`generate._capacity`), so the
    context is the only bound; the prefill planner pads every prompt within the page table.
    """
    limit = min(args.max_seq_len or model_context, model_context)
    for index, ids in enumerate(prompt_ids):
        if len(ids) >= limit:
            raise UsageError(_context_message(args, index, len(ids), limit, model_context))
        if args.num_blocks:
            _check_num_blocks(args, index, len(ids), limit)


def _context_message(
    args: argparse.Namespace, index: int, tokens: int, limit: int, model_context: int
) -> str:
    source = "--max-seq-len" if args.max_seq_len else "the model's context"
    if args.max_seq_len and limit < model_context:
        remedy = f"raise --max-seq-len (up to the model's context of {model_context})"
    else:
        remedy = "shorten the prompt (--max-seq-len cannot exceed the model's context)"
    return (
        f"request {index}: prompt has {tokens} tokens, too long for {source} of {limit} "
        f"tokens; a prompt may have at most {limit - 1} so one token can be generated: "
        f"{remedy}"
    )


def _check_num_blocks(args: argparse.Namespace, index: int, tokens: int, limit: int) -> None:
    """A --num-blocks the user gave holds the request on its own (its KV never reaches the
    last generated token, hence the - 1)."""
    block = args.block_size
    kv_tokens = min(tokens + args.max_new_tokens, limit) - 1
    wanted = -(-kv_tokens // block)
    if wanted > args.num_blocks:
        raise UsageError(
            f"--num-blocks {args.num_blocks} is too small: request {index} (a {tokens}-token "
            f"prompt + --max-new-tokens {args.max_new_tokens}) needs {wanted} KV blocks of "
            f"{block} tokens, and {args.num_blocks} blocks hold {args.num_blocks * block} "
            f"tokens; allowed is --num-blocks >= {wanted}, or omit --num-blocks to size the "
            "cache to the prompts"
        )

"""What a generation call hands back: completions, per-token stream events and its counters."""

from __future__ import annotations

from typing import Literal, NamedTuple

import attrs

from models.generation.scheduler import FinishReason
from runtime.json_types import JSONValue

CompletionReason = FinishReason | Literal["interrupted"]
"""Why a completion ended: the scheduler's reasons, or "interrupted" for what a request had
generated when its stream was stopped early (`GenerationStream.interrupted_completions`)."""


@attrs.frozen
class Completion:
    """One finished request; `prompt` is what the caller passed (text or token ids)."""

    index: int
    prompt: str | tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: CompletionReason

    def to_json(self) -> dict[str, JSONValue]:
        """The CLI's JSON object (lists, not tuples)."""
        return {
            "index": self.index,
            "prompt": self.prompt if isinstance(self.prompt, str) else list(self.prompt),
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }


class StreamEvent(NamedTuple):
    """One generated token: the request index, the token id and the text it added (may be "").

    A tuple, so `for index, token_id, text in stream` works; `index` deliberately shadows
    `tuple.index` to match `Completion.index`.
    """

    index: int  # type: ignore[assignment]
    token_id: int
    text_delta: str


@attrs.define
class GenerationStats:
    """Counters of one generation call (the CLI summary)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    requests: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def progress_detail(self) -> str:
        """Short live figures for a progress display."""
        return f"{self.decode_tokens} tokens, {self.decode_tokens_per_second:.1f} tokens/s"

    def to_json(self) -> dict[str, int | float]:
        """Every counter, plus the decode rate."""
        out: dict[str, int | float] = attrs.asdict(self)
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out

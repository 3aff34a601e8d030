"""Draining a generation without losing a request: finish it, or hand it back.

Why: a serving loop that is told to drain (a trainer wants the device) must end with every
request either completed or returned to the caller with what it generated so far, so it can
be resubmitted after the wake; never silently dropped with the KV cache it lived in.
"""

from __future__ import annotations

import attrs

from models.generation.params import GenerationParams
from models.generation.results import Completion
from models.generation.scheduler import FinishReason
from models.generation.stream import GenerationStream


@attrs.frozen
class HandedBack:
    """A request a drain returned unfinished: resubmit `resume_token_ids` with
    `remaining_tokens` to continue it (greedy continuation gives the same tokens)."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    remaining_tokens: int
    params: GenerationParams
    finish_reason: FinishReason | None
    """Set when a token already read ended it (its completion had not been assembled)."""

    @property
    def resume_token_ids(self) -> tuple[int, ...]:
        """The prompt to resubmit: the original prompt and every token generated so far."""
        return self.prompt_token_ids + self.output_token_ids


@attrs.frozen
class DrainResult:
    """Every request of the stream that was running: completed, or handed back."""

    completions: tuple[Completion, ...]
    handed_back: tuple[HandedBack, ...]


def drain_stream(stream: GenerationStream, *, finish: bool) -> DrainResult:
    """Run `stream` to its end (`finish`), or stop it between steps and hand back the rest."""
    if finish:
        for _ in stream:
            pass
        return DrainResult(tuple(stream.completions), ())
    completed = tuple(r.completion for r in stream.requests if r.completion is not None)
    handed: list[HandedBack] = []
    for request in stream.requests:
        if request.completion is not None:
            continue
        sequence = request.sequence
        output = tuple(sequence.output_token_ids)
        handed.append(
            HandedBack(
                index=sequence.index,
                prompt_token_ids=sequence.prompt_token_ids,
                output_token_ids=output,
                remaining_tokens=max(0, sequence.max_new_tokens - len(output)),
                params=request.params,
                finish_reason=sequence.finish_reason,
            )
        )
    stream.close()
    return DrainResult(completed, tuple(handed))

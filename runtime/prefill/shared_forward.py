"""Compile runs of programs that differ only in their sampling path share one model forward.

Warmup compiles the logits, argmax and top-k programs of one geometry from the same probe
(equal tokens, page table, lengths and cached prefix). The model forward of those runs writes
the same KV entries and returns the same last-token logits, so it runs once: each sibling
program post-processes its own copy of the remembered logits. Only compile runs share, only
torch outputs are remembered, and only the latest forward is kept (siblings compile next to
each other). Serving never reads this memo.
"""

from __future__ import annotations

import attrs
import torch

from runtime.prefill.request import PrefillRequest


def _geometry(request: PrefillRequest) -> tuple[object, ...]:
    return (
        request.kind,
        request.padded_batch_size,
        request.padded_sequence_length,
        request.page_table_width,
        request.prompt_lengths,
        request.cached_tokens,
        request.slots,
        tuple((c.chunk_start_idx, c.chunk_size, c.chunk_page_table_width) for c in request.chunks),
    )


@attrs.define
class _Entry:
    geometry: tuple[object, ...]
    tokens: torch.Tensor
    page_table: torch.Tensor
    logits: torch.Tensor


class SharedCompileForward:
    """The latest compile forward's inputs and logits (see the module docstring)."""

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        self.hits = 0

    def lookup(self, request: PrefillRequest) -> torch.Tensor | None:
        """A copy of the remembered logits when `request` has exactly the remembered inputs."""
        entry = self._entry
        if entry is None or entry.geometry != _geometry(request):
            return None
        if not (
            torch.equal(entry.tokens, request.tokens)
            and torch.equal(entry.page_table, request.page_table)
        ):
            return None
        self.hits += 1
        return entry.logits.clone()

    def remember(self, request: PrefillRequest, logits: object) -> None:
        """Keep `logits` (a copy) for a sibling compile; non-torch outputs are not kept."""
        if not isinstance(logits, torch.Tensor):
            self._entry = None
            return
        self._entry = _Entry(
            _geometry(request),
            request.tokens.clone(),
            request.page_table.clone(),
            logits.detach().clone(),
        )

    def clear(self) -> None:
        """Forget the remembered forward (serving started, or cleanup)."""
        self._entry = None

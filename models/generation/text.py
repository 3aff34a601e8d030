"""Incremental detokenization of one request, with stop strings applied as text arrives."""

from __future__ import annotations

from collections.abc import Sequence

from models.generation.tokenizers import TextTokenizer


class TextTracker:
    """Detokenizes one request incrementally and finds stop strings.

    Decoding a window that starts at an earlier, already complete boundary keeps multi-byte
    characters and tokenizer spacing right; text that could still become the start of a stop
    string is held back from the stream until it cannot.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _append(self, piece: str) -> None:
        if not piece or self.stopped:
            return
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def push(self, token: int) -> None:
        """Add one text token (EOS is not pushed)."""
        if self.stopped:
            return
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._append(after[len(before) :])

    def flush(self) -> None:
        """Take whatever is left undecoded (an incomplete character becomes U+FFFD)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        self._append(after[len(before) :])

    def delta(self, *, final: bool) -> str:
        """Text not yet streamed that can no longer change."""
        limit = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if limit <= self.emitted:
            return ""
        piece = self.text[self.emitted : limit]
        self.emitted = limit
        return piece

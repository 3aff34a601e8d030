"""What generation needs from a tokenizer, and a byte-level stand-in for models without one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from runtime.json_types import JSONValue


class TextTokenizer(Protocol):
    """What generation needs from a tokenizer (`models.decoder.tokenizer.DecoderTokenizer` fits)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, JSONValue]], *, add_generation_prompt: bool = True
    ) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, for models without a tokenizer (tiny-random, vocab >= 256).

    It lets text prompts drive test models end to end; it has no chat template.
    """

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, JSONValue]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        raise ValueError(
            "this model has no tokenizer and therefore no chat template; drop --chat/chat=True"
        )

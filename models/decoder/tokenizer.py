"""Text <-> token ids for every decoder family, from `tokenizer.json` or a GGUF-embedded vocabulary.

Both sources end as one `tokenizers.Tokenizer`, so encoding is the same fast Rust code either
way. The GGUF path rebuilds a byte-level BPE from the file's tokens, merges and token types;
chat templates are rendered with a sandboxed jinja2 environment.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from models.decoder.gguf_weights import GGUFFile
from runtime.json_types import JSONValue

if TYPE_CHECKING:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

T = TypeVar("T")

# llama.cpp token types (gguf `tokenizer.ggml.token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split patterns of pre-tokenizer families whose merges were learned on other splits than
# GPT-2's; any other `tokenizer.ggml.pre` uses GPT-2's byte-level regex.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS: dict[str, str] = {
    "llama3": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
}
GGUF_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2",)


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _respell(token: str, alphabet: frozenset[str]) -> str:
    """Spell a token in the byte alphabet if the file stored it as raw text."""
    if set(token) <= alphabet:
        return token
    spelling = byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _token_content(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _tojson(value: JSONValue, indent: int | None = None) -> str:
    """The templates' ``tojson`` filter: JSON with non-ASCII text kept as is."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


@attrs.frozen
class DecoderTokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts generation needs."""

    backend: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    chat_template: str | None = None
    source: str = ""

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        if not self.eos_token_ids:
            return None
        return self.backend.id_to_token(self.eos_token_ids[0])

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the source says (e.g. BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, JSONValue]],
        *,
        add_generation_prompt: bool = True,
        **extra: JSONValue,
    ) -> str:
        """The chat template applied to `messages` (text, special tokens written literally)."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer from {self.source or 'memory'} has no chat template")
        template = _jinja_env().from_string(self.chat_template)
        return str(
            template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, JSONValue]],
        *,
        add_generation_prompt: bool = True,
        **extra: JSONValue,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> DecoderTokenizer:
        """Load `tokenizer.json` plus the special tokens and template of a HF directory."""
        root = Path(directory)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file {str(tokenizer_file)!r} does not exist")
        backend = Tokenizer.from_file(str(tokenizer_file))

        def read_json(name: str) -> Mapping[str, JSONValue]:
            path = root / name
            if not path.is_file():
                return {}
            loaded: JSONValue = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(loaded, Mapping):
                raise ValueError(
                    f"{str(path)!r} holds a JSON {type(loaded).__name__}: allowed is an object"
                )
            return loaded

        tok_config = read_json("tokenizer_config.json")
        model_config = read_json("config.json")
        gen_config = read_json("generation_config.json")

        def token_id(name: str) -> int | None:
            content = _token_content(tok_config.get(name))
            return None if content is None else backend.token_to_id(content)

        bos = token_id("bos_token")
        if bos is None:
            configured = model_config.get("bos_token_id")
            bos = configured if isinstance(configured, int) else None
        eos: list[int] = []
        candidates: list[JSONValue] = [
            token_id("eos_token"),
            model_config.get("eos_token_id"),
            gen_config.get("eos_token_id"),
        ]
        for value in candidates:
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and item not in eos:
                    eos.append(item)
        template = _chat_template(tok_config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=tuple(eos),
            pad_token_id=token_id("pad_token"),
            chat_template=template,
            source=str(root),
        )

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> DecoderTokenizer:
        """Rebuild the byte-level BPE tokenizer a GGUF file embeds."""
        meta = gguf_file.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind not in GGUF_TOKENIZER_MODELS:
            raise ValueError(
                f"GGUF tokenizer.ggml.model={kind!r} is not supported: allowed are "
                f"{list(GGUF_TOKENIZER_MODELS)}"
            )
        if meta.get("tokenizer.ggml.tokens") is None:
            raise ValueError("GGUF tokenizer.ggml.tokens is missing: it is required")
        tokens = _gguf_list(meta, "tokenizer.ggml.tokens", str)
        types = _gguf_list(meta, "tokenizer.ggml.token_type", int) or [1] * len(tokens)
        merges_raw = _gguf_list(meta, "tokenizer.ggml.merges", str)
        alphabet = frozenset(byte_alphabet().values())
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(_respell(token, alphabet), index)
        merges = [_gguf_merge(line) for line in merges_raw]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre")
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        _add_gguf_special_tokens(backend, tokens, types, vocab, alphabet)
        bos = _gguf_token_id(meta, "tokenizer.ggml.bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        if add_bos and bos is not None:
            backend.post_processor = _bos_template(tokens[bos], bos)
        eos: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            value = _gguf_token_id(meta, key)
            if value is not None and value not in eos:
                eos.append(value)
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError(
                f"GGUF tokenizer.chat_template is a {type(template).__name__}: allowed is a string"
            )
        logger.info(
            "GGUF tokenizer: %d tokens, %d merges, pre=%s, add_bos=%s",
            len(tokens),
            len(merges),
            pre,
            add_bos,
        )
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=tuple(eos),
            pad_token_id=_gguf_token_id(meta, "tokenizer.ggml.padding_token_id"),
            chat_template=template,
            source=str(gguf_file.path),
        )


def _chat_template(value: JSONValue) -> str | None:
    """A tokenizer_config ``chat_template``: one template, or the default of named ones."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list):  # named templates: use the default one
        for entry in value:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
        return None
    raise ValueError(
        f"tokenizer_config chat_template is a {type(value).__name__}: allowed is a string or "
        "a list of named templates"
    )


def _gguf_list(meta: Mapping[str, object], key: str, kind: type[T]) -> list[T]:
    """The list of `kind` values at `key` (empty when absent); ValueError naming the key."""
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, kind) for item in value):
        raise ValueError(f"GGUF {key} is invalid: allowed is a list of {kind.__name__} values")
    return [item for item in value if isinstance(item, kind)]


def _gguf_token_id(meta: Mapping[str, object], key: str) -> int | None:
    """The token id at `key`, or None when absent; ValueError naming the key otherwise."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"GGUF {key}={value!r} is invalid: allowed is a token id (an integer)")
    return value


def _gguf_merge(line: str) -> tuple[str, str]:
    left, sep, right = line.partition(" ")
    if not sep:
        raise ValueError(f"GGUF tokenizer.ggml.merges entry {line!r} is not 'left right'")
    return left, right


def _gguf_pre_tokenizer(pre: object) -> pre_tokenizers.PreTokenizer:
    """The split before byte-level BPE: the family's own regex, else GPT-2's."""
    pattern = _SPLIT_PATTERNS.get(str(pre))
    if pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_gguf_special_tokens(
    backend: Tokenizer,
    tokens: list[str],
    types: list[int],
    vocab: dict[str, int],
    alphabet: frozenset[str],
) -> None:
    """Control tokens become special (never split); user-defined ones plain added tokens."""
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind_id in zip(tokens, types, strict=True)
        if kind_id == _TOKEN_CONTROL and set(token) <= alphabet
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind_id in zip(tokens, types, strict=True)
        if kind_id == _TOKEN_USER_DEFINED and token in vocab
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _bos_template(bos_token: str, bos: int) -> processors.PostProcessor:
    """The post-processor that prepends BOS (the file's `add_bos_token`)."""
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos)],
    )

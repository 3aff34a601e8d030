"""Model arguments of a decoder family, from a HF `config.json`, GGUF metadata or a preset.

One frozen value (`DecoderArgs`, subclassed once per family: `models.llama.LlamaArgs`,
`models.qwen3.Qwen3Args`) describes the architecture; every source is translated into it once,
so the tensor model never reads source-specific keys. The reading is shared; a family's
subclass names what it recognises (`HF_MODEL_TYPES`, `HF_ARCHITECTURES`,
`GGUF_ARCHITECTURES`), its presets (`PRESETS`) and any extra check (`check_hf_extra`).
Validation errors name the field, the value and what is allowed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, SupportsFloat, SupportsInt

import attrs

from runtime.json_types import JSONObject, JSONValue
from runtime.validation import is_int

logger = logging.getLogger(__name__)

RopeKind = Literal["linear", "llama3"]
ROPE_KINDS: tuple[str, ...] = ("linear", "llama3")
TINY_RANDOM_PREFIX = "tiny-random"


def tiny_random_name(preset: str) -> str:
    """The model name a tiny-random preset is served under (`tiny-random-<preset>`)."""
    return f"{TINY_RANDOM_PREFIX}-{preset}"


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r} is invalid: "
            "allowed is a positive integer"
        )


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r} is invalid: "
            "allowed is a finite number > 0"
        )


@attrs.frozen
class RopeScaling:
    """Rotary-frequency scaling; `linear` divides every frequency, `llama3` only the low ones."""

    kind: str = attrs.field()
    factor: float = attrs.field(validator=_positive_float)
    low_freq_factor: float = attrs.field(default=1.0, validator=_positive_float)
    high_freq_factor: float = attrs.field(default=4.0, validator=_positive_float)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=_positive_int)

    @kind.validator
    def _check_kind(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ROPE_KINDS:
            raise ValueError(
                f"RopeScaling.kind={value!r} is not supported: allowed are {list(ROPE_KINDS)}"
            )

    def __attrs_post_init__(self) -> None:
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor!r} is invalid: allowed is "
                f"a value > low_freq_factor={self.low_freq_factor!r}"
            )

    @classmethod
    def from_hf(cls, raw: JSONValue) -> RopeScaling | None:
        """Read HF `rope_scaling` / `rope_parameters`; `default` (or absent) means no scaling."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"config rope_scaling={raw!r} is invalid: allowed is an object or null"
            )
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind not in ROPE_KINDS:
            raise ValueError(
                f"config rope_scaling.rope_type={kind!r} is not supported: allowed are "
                f"{['default', *ROPE_KINDS]}"
            )
        if "factor" not in raw:
            raise ValueError(f"config rope_scaling.factor is missing for rope_type={kind!r}")
        factor = _json_float("config rope_scaling.factor", raw["factor"])
        if kind == "linear":
            return cls(kind="linear", factor=factor)

        def read_float(key: str, default: float) -> float:
            return _json_float(f"config rope_scaling.{key}", raw.get(key, default))

        original = "original_max_position_embeddings"
        return cls(
            kind="llama3",
            factor=factor,
            low_freq_factor=read_float("low_freq_factor", 1.0),
            high_freq_factor=read_float("high_freq_factor", 4.0),
            original_max_position_embeddings=_json_int(
                f"config rope_scaling.{original}", raw.get(original, 8192)
            ),
        )

    def to_hf(self) -> dict[str, JSONValue]:
        """The HF ``rope_scaling`` object for this scaling."""
        if self.kind == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


def _to_eos_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    """One id, several ids or none, as the tuple `DecoderArgs.eos_token_ids` holds."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _json_int(where: str, value: object) -> int:
    """`value`, read at `where` of a JSON config, as an int; ValueError naming `where`."""
    if not is_int(value):
        raise ValueError(f"{where}={value!r} is invalid: allowed is an integer")
    return value


def _json_optional_int(where: str, value: object) -> int | None:
    """`_json_int`, with null (None) allowed."""
    return None if value is None else _json_int(where, value)


def _json_float(where: str, value: object) -> float:
    """`value`, read at `where` of a JSON config, as a float; ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}={value!r} is invalid: allowed is a number")
    return float(value)


def _json_eos(value: object) -> int | list[int] | None:
    """HF ``eos_token_id``: null, one id or a list of ids."""
    if value is None or is_int(value):
        return value
    if isinstance(value, list):
        return [_json_int(f"config eos_token_id[{i}]", v) for i, v in enumerate(value)]
    raise ValueError(
        f"config eos_token_id={value!r} is invalid: allowed is an integer, a list of integers "
        "or null"
    )


@attrs.frozen
class DecoderArgs:
    """The architecture of one pre-norm decoder (what the tensor model is built from).

    `qk_norm`: an RMSNorm over each query and key head before rotary (Qwen3). A family
    subclasses this value (adding fields where its blocks need them) and sets the class
    facts below; the base itself recognises no checkpoint.
    """

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    GGUF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    PRESETS: ClassVar[Mapping[str, DecoderArgs]] = {}

    dim: int = attrs.field(validator=_positive_int)
    n_layers: int = attrs.field(validator=_positive_int)
    n_heads: int = attrs.field(validator=_positive_int)
    n_kv_heads: int = attrs.field(validator=_positive_int)
    vocab_size: int = attrs.field(validator=_positive_int)
    ffn_dim: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    max_seq_len: int = attrs.field(validator=_positive_int)
    norm_eps: float = attrs.field(default=1e-5, validator=_positive_float)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_eos_tuple)
    name: str = "decoder"
    qk_norm: bool = False

    def __attrs_post_init__(self) -> None:
        me = type(self).__name__
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"{me}.n_kv_heads={self.n_kv_heads} is invalid: allowed is a divisor of "
                f"n_heads={self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"{me}.head_dim={self.head_dim} is invalid: allowed is an even number "
                "(rotary embeddings rotate pairs)"
            )
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{me}.eos_token_ids={self.eos_token_ids} is invalid: allowed are ids "
                    f"in [0, vocab_size={self.vocab_size})"
                )
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(
                f"{me}.bos_token_id={self.bos_token_id} is invalid: allowed is an id in "
                f"[0, vocab_size={self.vocab_size}) or None"
            )

    def parameter_count(self) -> int:
        """Parameters of the model these arguments build (embedding, layers, final norm and
        an untied head): what host-memory checks count before any weight loads. A family
        with another MLP block overrides it."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        layer = self.dim * (q + 2 * kv) + q * self.dim + 3 * self.dim * self.ffn_dim
        layer += 2 * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.n_layers * layer + self.dim + head

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    # ----------------------------------------------------------------- Hugging Face
    @classmethod
    def from_hf_config(cls, source: JSONObject | str | Path) -> Self:
        """Translate a HF `config.json` (a mapping, the file, or its directory)."""
        config = read_hf_config(source)
        model_type = _check_hf_support(config, cls.HF_MODEL_TYPES)
        cls.check_hf_extra(config)

        def read_int(key: str, default: int | None = None) -> int:
            return _json_int(f"config {key}", config.get(key, default))

        def read_optional_int(key: str) -> int | None:
            return _json_optional_int(f"config {key}", config.get(key))

        dim = read_int("hidden_size")
        n_heads = read_int("num_attention_heads")
        rope_theta, scaling_raw = _hf_rope(config)
        head_dim = read_optional_int("head_dim")
        if head_dim is None:
            if dim % n_heads != 0:
                raise ValueError(
                    f"config hidden_size={dim} is invalid without head_dim: allowed is a "
                    f"multiple of num_attention_heads={n_heads}"
                )
            head_dim = dim // n_heads
        return cls(
            dim=dim,
            n_layers=read_int("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=read_optional_int("num_key_value_heads") or n_heads,
            vocab_size=read_int("vocab_size"),
            ffn_dim=read_int("intermediate_size"),
            head_dim=head_dim,
            max_seq_len=read_int("max_position_embeddings", 2048),
            norm_eps=_json_float("config rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
            rope_theta=_json_float(
                "config rope_theta", rope_theta if rope_theta is not None else 10000.0
            ),
            rope_scaling=RopeScaling.from_hf(scaling_raw),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=read_optional_int("bos_token_id"),
            eos_token_ids=_json_eos(config.get("eos_token_id")),
            name=str(config.get("_name_or_path") or model_type),
            **cls.hf_extra_fields(config),
        )

    @classmethod
    def check_hf_extra(cls, config: JSONObject) -> None:
        """A family's own refusals of a HF config (options its blocks do not implement)."""

    @classmethod
    def hf_extra_fields(cls, config: JSONObject) -> dict[str, Any]:
        """A family's own fields read from a HF config (none in the base)."""
        return {}

    def to_hf_config(self) -> dict[str, JSONValue]:
        """The equivalent HF `config.json` content (used to build oracles and test fixtures)."""
        out: dict[str, JSONValue] = {
            "architectures": list(self.HF_ARCHITECTURES[:1]),
            "model_type": self.HF_MODEL_TYPES[0] if self.HF_MODEL_TYPES else "decoder",
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            eos = self.eos_token_ids
            out["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
        return out

    # ----------------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, object], tensor_names: frozenset[str] | set[str]
    ) -> Self:
        """Translate GGUF key/values (already decoded to Python values) and tensor names."""
        arch = metadata.get("general.architecture")
        if arch not in cls.GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF general.architecture={arch!r} is not supported by {cls.__name__}: "
                f"allowed are {list(cls.GGUF_ARCHITECTURES)}"
            )

        def need(key: str) -> int | float:
            return _gguf_required(metadata, f"{arch}.{key}")

        def optional(key: str, default: int | float) -> int | float:
            return _gguf_number(f"{arch}.{key}", metadata.get(f"{arch}.{key}", default))

        if "rope_freqs.weight" in tensor_names:
            raise ValueError(
                "GGUF tensor rope_freqs.weight (llama.cpp's llama3 rope factors) is not "
                "supported: allowed are files without it (rope scaling none or linear)"
            )
        dim = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = _gguf_head_dim(metadata, arch, dim // n_heads)
        scaling = _gguf_rope_scaling(metadata, arch)
        vocab = _gguf_vocab_size(metadata, arch)
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            dim=dim,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(optional("attention.head_count_kv", n_heads)),
            vocab_size=vocab,
            ffn_dim=int(need("feed_forward_length")),
            head_dim=head_dim,
            max_seq_len=int(optional("context_length", 2048)),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(optional("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=None
            if bos is None
            else int(_gguf_number("tokenizer.ggml.bos_token_id", bos)),
            eos_token_ids=()
            if eos is None
            else (int(_gguf_number("tokenizer.ggml.eos_token_id", eos)),),
            name=str(metadata.get("general.name", arch)),
        )

    # ----------------------------------------------------------------- tiny-random
    @classmethod
    def tiny_random(cls, preset: str = "gqa") -> DecoderArgs:
        """One of this family's small named shapes for tests (`PRESETS`); weights come from
        `weights.random_state_dict`."""
        if preset not in cls.PRESETS:
            raise ValueError(
                f"tiny-random preset={preset!r} is unknown to {cls.__name__}: allowed are "
                f"{sorted(cls.PRESETS)}"
            )
        return cls.PRESETS[preset]


def read_hf_config(source: JSONObject | str | Path) -> JSONObject:
    """A HF config as a mapping: given as one, or read from `config.json` (or its directory)."""
    if not isinstance(source, str | Path):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config path {str(path)!r} does not exist")
    config: JSONValue = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, Mapping):
        raise ValueError(
            f"config {str(path)!r} holds a JSON {type(config).__name__}: allowed is an object"
        )
    return config


def _check_hf_support(config: JSONObject, model_types: tuple[str, ...]) -> str:
    """Refuse architectures and options the model does not implement; the model type."""
    model_type = config.get("model_type")
    if model_type not in model_types:
        raise ValueError(
            f"config model_type={model_type!r} is not supported: allowed are {list(model_types)}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise ValueError(f"config {flag}={config[flag]!r} is not supported: allowed is false")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config hidden_act={act!r} is not supported: allowed is 'silu'")
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if key not in config:
            raise ValueError(f"config {key} is missing: it is required")
    return str(model_type)


def _hf_rope(config: JSONObject) -> tuple[JSONValue, JSONValue]:
    """`(rope_theta, rope_scaling)` of a config, either at the top level or (newer
    transformers) inside `rope_parameters`."""
    rope_params = config.get("rope_parameters")
    rope_theta = config.get("rope_theta")
    if rope_theta is None and isinstance(rope_params, Mapping):
        rope_theta = rope_params.get("rope_theta")
    scaling_raw = config.get("rope_scaling")
    if scaling_raw is None and isinstance(rope_params, Mapping):
        scaling_raw = rope_params
    return rope_theta, scaling_raw


def _gguf_number(key: str, value: object) -> int | float:
    """A numeric GGUF value (a Python or numpy number); ValueError naming `key` otherwise."""
    if isinstance(value, int | float):
        return value
    if isinstance(value, SupportsInt) and not isinstance(value, str | bytes):
        return int(value)
    if isinstance(value, SupportsFloat) and not isinstance(value, str | bytes):
        return float(value)
    raise ValueError(f"GGUF metadata {key}={value!r} is invalid: allowed is a number")


def _gguf_required(metadata: Mapping[str, object], key: str) -> int | float:
    """The numeric value at `key`; ValueError when it is missing or not a number."""
    if key not in metadata:
        raise ValueError(f"GGUF metadata {key} is missing: it is required")
    return _gguf_number(key, metadata[key])


def _gguf_rope_scaling(metadata: Mapping[str, object], arch: str) -> RopeScaling | None:
    """`{arch}.rope.scaling.*`: none, or linear with its factor."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type != "linear":
        raise ValueError(
            f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported: allowed "
            "are 'none' and 'linear'"
        )
    factor = _gguf_required(metadata, f"{arch}.rope.scaling.factor")
    return RopeScaling(kind="linear", factor=float(factor))


def _gguf_vocab_size(metadata: Mapping[str, object], arch: str) -> int:
    """`{arch}.vocab_size`, or the length of the tokenizer's token list without it."""
    vocab_key = f"{arch}.vocab_size"
    if vocab_key in metadata and metadata[vocab_key] is not None:
        return int(_gguf_required(metadata, vocab_key))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"GGUF metadata {arch}.vocab_size is missing: it is required")
    if not isinstance(tokens, Sequence):
        raise ValueError(
            f"GGUF metadata tokenizer.ggml.tokens is a {type(tokens).__name__}: "
            "allowed is a list of token strings"
        )
    return len(tokens)


def _gguf_head_dim(metadata: Mapping[str, object], arch: str, default: int) -> int:
    """The head dim (`key_length`, else `dim / heads`); values and rotary must use all of it."""
    key_length = f"{arch}.attention.key_length"
    head_dim = int(_gguf_number(key_length, metadata.get(key_length, default)))
    value_dim = metadata.get(f"{arch}.attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise ValueError(
            f"GGUF {arch}.attention.value_length={value_dim} is not supported: allowed is "
            f"key_length={head_dim}"
        )
    rot = metadata.get(f"{arch}.rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rot} is not supported: allowed is "
            f"head_dim={head_dim} (partial rotary embeddings are not implemented)"
        )
    return head_dim


def parse_tiny_random_name(name: str) -> str | None:
    """`tiny-random` -> `gqa`, `tiny-random-<preset>` -> `<preset>`, anything else -> None."""
    if name == TINY_RANDOM_PREFIX:
        return "gqa"
    prefix = TINY_RANDOM_PREFIX + "-"
    if name.startswith(prefix):
        return name[len(prefix) :]
    return None

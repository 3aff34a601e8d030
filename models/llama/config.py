"""Model arguments of the Llama family, from a HF `config.json`, GGUF metadata or a preset.

One frozen value (`LlamaArgs`) describes the architecture; every source is translated into it
once, so the tensor model never reads source-specific keys. Validation errors name the field,
the value and what is allowed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from runtime.validation import is_int

logger = logging.getLogger(__name__)

RopeKind = Literal["linear", "llama3"]
ROPE_KINDS: tuple[str, ...] = ("linear", "llama3")
HF_MODEL_TYPES: tuple[str, ...] = ("llama",)
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama",)
TINY_RANDOM_PREFIX = "tiny-random"


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
    def from_hf(cls, raw: Mapping[str, Any] | None) -> RopeScaling | None:
        """Read HF `rope_scaling` / `rope_parameters`; `default` (or absent) means no scaling."""
        if raw is None:
            return None
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
        if kind == "linear":
            return cls(kind="linear", factor=float(raw["factor"]))
        return cls(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )

    def to_hf(self) -> dict[str, Any]:
        if self.kind == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


def _to_eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@attrs.frozen
class LlamaArgs:
    """The architecture of one Llama-family decoder (what the tensor model is built from)."""

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
    name: str = "llama"

    def __attrs_post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaArgs.n_kv_heads={self.n_kv_heads} is invalid: allowed is a divisor of "
                f"n_heads={self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaArgs.head_dim={self.head_dim} is invalid: allowed is an even number "
                "(rotary embeddings rotate pairs)"
            )
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"LlamaArgs.eos_token_ids={self.eos_token_ids} is invalid: allowed are ids "
                    f"in [0, vocab_size={self.vocab_size})"
                )
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(
                f"LlamaArgs.bos_token_id={self.bos_token_id} is invalid: allowed is an id in "
                f"[0, vocab_size={self.vocab_size}) or None"
            )

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    # ----------------------------------------------------------------- Hugging Face
    @classmethod
    def from_hf_config(cls, source: Mapping[str, Any] | str | Path) -> LlamaArgs:
        """Translate a HF `config.json` (a mapping, the file, or its directory)."""
        config = _read_hf_config(source)
        model_type = _check_hf_support(config)
        dim = config["hidden_size"]
        n_heads = config["num_attention_heads"]
        rope_theta, scaling_raw = _hf_rope(config)
        head_dim = config.get("head_dim")
        if head_dim is None:
            if dim % n_heads != 0:
                raise ValueError(
                    f"config hidden_size={dim} is invalid without head_dim: allowed is a "
                    f"multiple of num_attention_heads={n_heads}"
                )
            head_dim = dim // n_heads
        return cls(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            ffn_dim=config["intermediate_size"],
            head_dim=head_dim,
            max_seq_len=config.get("max_position_embeddings", 2048),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_hf(scaling_raw),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=config.get("eos_token_id"),
            name=str(config.get("_name_or_path") or model_type),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF `config.json` content (used to build oracles and test fixtures)."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
        cls, metadata: Mapping[str, Any], tensor_names: frozenset[str] | set[str]
    ) -> LlamaArgs:
        """Translate GGUF key/values (already decoded to Python values) and tensor names."""
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF general.architecture={arch!r} is not supported: allowed are "
                f"{list(GGUF_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            return _gguf_required(metadata, f"{arch}.{key}")

        if "rope_freqs.weight" in tensor_names:
            raise ValueError(
                "GGUF tensor rope_freqs.weight (llama.cpp's llama3 rope factors) is not "
                "supported: allowed are files without it (rope scaling none or linear)"
            )
        dim = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = _gguf_head_dim(metadata, arch, dim // n_heads)
        scaling: RopeScaling | None = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise ValueError(
                    f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported: allowed "
                    "are 'none' and 'linear'"
                )
            scaling = RopeScaling(kind="linear", factor=float(need("rope.scaling.factor")))
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ValueError(f"GGUF metadata {arch}.vocab_size is missing: it is required")
            vocab = len(tokens)
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            dim=dim,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", n_heads)),
            vocab_size=int(vocab),
            ffn_dim=int(need("feed_forward_length")),
            head_dim=head_dim,
            max_seq_len=int(metadata.get(f"{arch}.context_length", 2048)),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            name=str(metadata.get("general.name", arch)),
        )

    # ----------------------------------------------------------------- tiny-random
    @classmethod
    def tiny_random(cls, preset: str = "gqa") -> LlamaArgs:
        """A small named shape for tests; weights come from `weights.random_state_dict`."""
        if preset not in TINY_PRESETS:
            raise ValueError(
                f"tiny-random preset={preset!r} is unknown: allowed are {sorted(TINY_PRESETS)}"
            )
        return TINY_PRESETS[preset]


def _read_hf_config(source: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """A HF config as a mapping: given as one, or read from `config.json` (or its directory)."""
    if not isinstance(source, str | Path):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config path {str(path)!r} does not exist")
    config: Mapping[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return config


def _check_hf_support(config: Mapping[str, Any]) -> str:
    """Refuse architectures and options the model does not implement; the model type."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"config model_type={model_type!r} is not supported: allowed are {list(HF_MODEL_TYPES)}"
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


def _hf_rope(config: Mapping[str, Any]) -> tuple[Any, Any]:
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


def _gguf_required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata {key} is missing: it is required")
    return metadata[key]


def _gguf_head_dim(metadata: Mapping[str, Any], arch: str, default: int) -> int:
    """The head dim (`key_length`, else `dim / heads`); values and rotary must use all of it."""
    head_dim = int(metadata.get(f"{arch}.attention.key_length", default))
    value_dim = metadata.get(f"{arch}.attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ValueError(
            f"GGUF {arch}.attention.value_length={value_dim} is not supported: allowed is "
            f"key_length={head_dim}"
        )
    rot = metadata.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rot} is not supported: allowed is "
            f"head_dim={head_dim} (partial rotary embeddings are not implemented)"
        )
    return head_dim


def _tiny(name: str, **overrides: Any) -> LlamaArgs:
    base: dict[str, Any] = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 256,
        "ffn_dim": 128,
        "head_dim": 16,
        "max_seq_len": 512,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_ids": (2,),
        "name": f"{TINY_RANDOM_PREFIX}-{name}",
    }
    base.update(overrides)
    return LlamaArgs(**base)


TINY_PRESETS: dict[str, LlamaArgs] = {
    # grouped-query attention, untied head
    "gqa": _tiny("gqa"),
    # multi-head attention with a tied head
    "mha-tied": _tiny("mha-tied", n_kv_heads=4, tie_word_embeddings=True),
    # one KV head, head_dim different from dim / n_heads, three layers
    "mqa": _tiny("mqa", n_heads=4, n_kv_heads=1, head_dim=24, n_layers=3, ffn_dim=96),
    # llama3-style rope scaling; original context small so all three bands are used
    "llama3-rope": _tiny(
        "llama3-rope",
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=True,
    ),
    # linear position interpolation
    "linear-rope": _tiny("linear-rope", rope_scaling=RopeScaling(kind="linear", factor=2.0)),
}


def parse_tiny_random_name(name: str) -> str | None:
    """`tiny-random` -> `gqa`, `tiny-random-<preset>` -> `<preset>`, anything else -> None."""
    if name == TINY_RANDOM_PREFIX:
        return "gqa"
    prefix = TINY_RANDOM_PREFIX + "-"
    if name.startswith(prefix):
        return name[len(prefix) :]
    return None

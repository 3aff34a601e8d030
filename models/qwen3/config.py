"""The Qwen3 family's arguments: `Qwen3Args` (recognised checkpoints) and its tiny presets.

Qwen3 dense is the shared decoder with per-head q/k RMSNorm before rotary (`qk_norm`), no
qkv bias, a head_dim of its own (often not hidden_size / heads), rope theta from the config
and a tied or untied head. Sliding-window attention (`use_sliding_window`) is refused: the
paged attention here is full attention in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs

from models.decoder.config import DecoderArgs, tiny_random_name
from runtime.json_types import JSONObject, JSONValue


@attrs.frozen
class Qwen3Args(DecoderArgs):
    """A Qwen3 dense decoder (always `qk_norm`)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3",)
    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    GGUF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("qwen3",)
    PRESETS: ClassVar[Mapping[str, DecoderArgs]] = {}

    name: str = "qwen3"
    qk_norm: bool = attrs.field(default=True)

    @qk_norm.validator
    def _check_qk_norm(self, attribute: attrs.Attribute[bool], value: bool) -> None:
        if value is not True:
            raise ValueError(
                f"Qwen3Args.qk_norm={value!r} is invalid: allowed is True (every Qwen3 layer "
                "normalises its query and key heads)"
            )

    @classmethod
    def check_hf_extra(cls, config: JSONObject) -> None:
        """Refuse sliding-window layers (full attention is all the paged cache does)."""
        if config.get("use_sliding_window", False):
            raise ValueError(
                f"config use_sliding_window={config['use_sliding_window']!r} is not supported: "
                "allowed is false (every layer attends to the whole context)"
            )
        layer_types: JSONValue = config.get("layer_types")
        if isinstance(layer_types, list):
            other = sorted({str(kind) for kind in layer_types} - {"full_attention"})
            if other:
                raise ValueError(
                    f"config layer_types holds {other}: allowed is only 'full_attention'"
                )

    def to_hf_config(self) -> dict[str, JSONValue]:
        """The HF `config.json` of this model (`transformers.Qwen3Config` reads it)."""
        out = super().to_hf_config()
        out["use_sliding_window"] = False
        return out


_TINY_QWEN3 = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_dim=128,
    head_dim=32,  # not dim / n_heads (16), as in Qwen3's real shapes
    max_seq_len=512,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    name=tiny_random_name("qwen3"),
)

TINY_PRESETS: dict[str, Qwen3Args] = {
    # grouped-query attention, head_dim 2x dim / heads, untied head
    "qwen3": _TINY_QWEN3,
    # tied head, three layers, one KV head
    "qwen3-tied": attrs.evolve(
        _TINY_QWEN3,
        name=tiny_random_name("qwen3-tied"),
        n_kv_heads=1,
        n_layers=3,
        tie_word_embeddings=True,
    ),
}

Qwen3Args.PRESETS = TINY_PRESETS

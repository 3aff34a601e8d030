"""The mixture-of-experts settings of a Qwen3-MoE checkpoint, read from HF config or GGUF.

Checked when read, so a checkpoint with an unusable setting fails at load and names the key.
Which layers are sparse follows transformers: layer `i` is sparse unless it is listed in
`mlp_only_layers` or `(i + 1)` is not a multiple of `decoder_sparse_step`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import attrs

from models.qwen3_moe.experts import ExpertShapes
from models.qwen3_moe.routing import TopKRouting


class MoEConfigError(ValueError):
    """A config value that is missing or unusable; the message names the key."""


GGUF_ARCHITECTURE = "qwen3moe"
SUPPORTED_ACTIVATIONS = ("silu",)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


@attrs.frozen
class MoEArgs:
    """Expert geometry, the routing rule, and which decoder layers are sparse."""

    shapes: ExpertShapes
    routing: TopKRouting
    sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    def __attrs_post_init__(self) -> None:
        if self.routing.num_experts != self.shapes.num_experts:
            raise MoEConfigError(
                f"routing has {self.routing.num_experts} experts but the expert shapes "
                f"{self.shapes.num_experts}: they must agree"
            )
        if isinstance(self.sparse_step, bool) or not isinstance(self.sparse_step, int):
            raise MoEConfigError(
                f"decoder_sparse_step={self.sparse_step!r} is invalid: allowed is an integer >= 1"
            )
        if self.sparse_step < 1:
            raise MoEConfigError(
                f"decoder_sparse_step={self.sparse_step} is invalid: allowed is an integer >= 1"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` runs routed experts (else a dense MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> MoEArgs:
        """From a `config.json` dict (`Qwen3MoeConfig.to_dict()` gives the same keys)."""
        activation = config.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise MoEConfigError(
                f"hidden_act={activation!r} is not supported: allowed are {SUPPORTED_ACTIVATIONS}"
            )
        only = config.get("mlp_only_layers") or ()
        if not isinstance(only, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise MoEConfigError(
                f"mlp_only_layers={only!r} is invalid: allowed is a list of layer indices"
            )
        num_experts = _expert_count(config)
        return cls(
            shapes=ExpertShapes(
                num_experts=num_experts,
                hidden_size=_int(config, "hidden_size"),
                intermediate_size=_int(config, "moe_intermediate_size"),
            ),
            routing=TopKRouting(
                num_experts=num_experts,
                top_k=_int(config, "num_experts_per_tok"),
                # transformers' default when the key is absent.
                norm_topk_prob=_bool(config, "norm_topk_prob", default=False),
            ),
            sparse_step=_int(config, "decoder_sparse_step", default=1),
            mlp_only_layers=frozenset(only),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, object], architecture: str = GGUF_ARCHITECTURE
    ) -> MoEArgs:
        """From GGUF metadata (`{arch}.expert_count` and friends).

        Without `{arch}.expert_weights_norm` the top-k weights are renormalised: llama.cpp's
        qwen3moe graph always renormalises, so that is what such a file means.
        """
        key = f"{architecture}.expert_count"
        num_experts = _gguf_int(metadata, key)
        return cls(
            shapes=ExpertShapes(
                num_experts=num_experts,
                hidden_size=_gguf_int(metadata, f"{architecture}.embedding_length"),
                intermediate_size=_gguf_int(metadata, f"{architecture}.expert_feed_forward_length"),
            ),
            routing=TopKRouting(
                num_experts=num_experts,
                top_k=_gguf_int(metadata, f"{architecture}.expert_used_count"),
                norm_topk_prob=bool(metadata.get(f"{architecture}.expert_weights_norm", True)),
            ),
        )


def _int(config: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise MoEConfigError(f"config has no {key!r}: a Qwen3-MoE config needs it")
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoEConfigError(f"config {key}={value!r} is invalid: allowed is an integer")
    return value


def _expert_count(config: Mapping[str, object]) -> int:
    """Qwen's own configs say `num_experts`; transformers 5 writes `num_local_experts`."""
    names = [key for key in _EXPERT_COUNT_KEYS if key in config]
    if not names:
        raise MoEConfigError(
            f"config has none of {_EXPERT_COUNT_KEYS}: a Qwen3-MoE config needs one"
        )
    counts = {key: _int(config, key) for key in names}
    if len(set(counts.values())) > 1:
        raise MoEConfigError(f"config expert counts disagree: {counts}")
    return counts[names[0]]


def _bool(config: Mapping[str, object], key: str, *, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise MoEConfigError(f"config {key}={value!r} is invalid: allowed are true and false")
    return value


def _gguf_int(metadata: Mapping[str, object], key: str) -> int:
    value = metadata.get(key)
    if value is None:
        raise MoEConfigError(f"GGUF metadata has no {key!r}: a Qwen3-MoE file needs it")
    # The reader may give numpy scalars: any integral number is accepted.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MoEConfigError(f"GGUF metadata {key}={value!r} is invalid: allowed is an integer")
    return int(value)

"""The Qwen3-MoE family's arguments: `Qwen3MoeArgs` (recognised checkpoints) and its presets.

Qwen3-MoE is Qwen3's attention (per-head q/k RMSNorm before rotary, no qkv bias, its own
head_dim, rope theta from the config) with every layer's dense MLP replaced by top-k routed
SwiGLU experts (`MoEArgs`). Refused: sliding windows (the paged cache attends to the whole
context) and dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1:
the shared decoder builds every layer from one class and one set of tensor names), and GGUF
files (the shared GGUF loader maps 2-D tensors by name; this family's are 3-D).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

import attrs

from models.decoder.config import DecoderArgs, tiny_random_name
from models.qwen3_moe.config import GGUF_ARCHITECTURE, MoEArgs
from models.qwen3_moe.experts import ExpertShapes
from models.qwen3_moe.routing import TopKRouting
from runtime.json_types import JSONObject, JSONValue


@attrs.frozen
class Qwen3MoeArgs(DecoderArgs):
    """A Qwen3-MoE decoder: Qwen3 attention (always `qk_norm`), routed experts in every layer.

    `ffn_dim` is the checkpoint's dense `intermediate_size` (kept for its config; no layer
    here uses it), `moe_ffn_dim` each expert's width.
    """

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_moe",)
    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    GGUF_ARCHITECTURES: ClassVar[tuple[str, ...]] = (GGUF_ARCHITECTURE,)
    PRESETS: ClassVar[Mapping[str, DecoderArgs]] = {}

    name: str = "qwen3_moe"
    qk_norm: bool = attrs.field(default=True)
    num_experts: int = attrs.field(kw_only=True)
    top_k: int = attrs.field(kw_only=True)
    moe_ffn_dim: int = attrs.field(kw_only=True)
    norm_topk_prob: bool = attrs.field(kw_only=True)

    @qk_norm.validator
    def _check_qk_norm(self, attribute: attrs.Attribute[bool], value: bool) -> None:
        if value is not True:
            raise ValueError(
                f"Qwen3MoeArgs.qk_norm={value!r} is invalid: allowed is True (every Qwen3-MoE "
                "layer normalises its query and key heads)"
            )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        _moe_args(self)  # its checks name a bad MoE field now, not when a layer is built

    @property
    def moe(self) -> MoEArgs:
        """The experts' geometry and routing rule (every layer sparse)."""
        return _moe_args(self)

    def parameter_count(self) -> int:
        """The dense count with each layer's MLP replaced by its router and experts."""
        dense_mlp = 3 * self.dim * self.ffn_dim
        experts = self.num_experts * (3 * self.dim * self.moe_ffn_dim + self.dim)
        return super().parameter_count() + self.n_layers * (experts - dense_mlp)

    def active_parameter_count(self) -> int:
        """Parameters one token's forward reads: `top_k` experts per layer, not all."""
        unused = (self.num_experts - self.top_k) * 3 * self.dim * self.moe_ffn_dim
        return self.parameter_count() - self.n_layers * unused

    @classmethod
    def check_hf_extra(cls, config: JSONObject) -> None:
        """Refuse sliding windows and dense layers among the sparse ones."""
        if config.get("use_sliding_window", False):
            raise ValueError(
                f"config use_sliding_window={config['use_sliding_window']!r} is not supported: "
                "allowed is false (every layer attends to the whole context)"
            )
        only = config.get("mlp_only_layers") or []
        if only:
            raise ValueError(
                f"config mlp_only_layers={only!r} is not supported: allowed is [] (every layer "
                "sparse; dense layers among sparse ones are not implemented)"
            )
        step = config.get("decoder_sparse_step", 1)
        if step != 1:
            raise ValueError(
                f"config decoder_sparse_step={step!r} is not supported: allowed is 1 (every "
                "layer sparse; dense layers among sparse ones are not implemented)"
            )

    @classmethod
    def hf_extra_fields(cls, config: JSONObject) -> dict[str, Any]:
        """The MoE fields, read (and checked, naming the key) by `MoEArgs.from_hf_config`."""
        moe = MoEArgs.from_hf_config(config)
        return {
            "num_experts": moe.shapes.num_experts,
            "top_k": moe.routing.top_k,
            "moe_ffn_dim": moe.shapes.intermediate_size,
            "norm_topk_prob": moe.routing.norm_topk_prob,
        }

    def to_hf_config(self) -> dict[str, JSONValue]:
        """The HF `config.json` of this model (`transformers.Qwen3MoeConfig` reads it)."""
        out = super().to_hf_config()
        out.update(
            {
                "use_sliding_window": False,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.moe_ffn_dim,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )
        return out

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, object], tensor_names: frozenset[str] | set[str]
    ) -> Self:
        """Refused: the shared GGUF loader maps one 2-D tensor per canonical name, and a
        `qwen3moe` file stacks each projection's experts in one 3-D tensor."""
        raise ValueError(
            f"GGUF general.architecture={metadata.get('general.architecture')!r} (Qwen3-MoE) is "
            "not supported yet: its experts are 3-D tensors (ffn_gate_exps, ffn_up_exps, "
            "ffn_down_exps) the GGUF loader does not map; allowed is the Hugging Face "
            "safetensors folder of the same model"
        )


def _moe_args(args: Qwen3MoeArgs) -> MoEArgs:
    return MoEArgs(
        shapes=ExpertShapes(
            num_experts=args.num_experts,
            hidden_size=args.dim,
            intermediate_size=args.moe_ffn_dim,
        ),
        routing=TopKRouting(
            num_experts=args.num_experts, top_k=args.top_k, norm_topk_prob=args.norm_topk_prob
        ),
    )


_TINY_QWEN3_MOE = Qwen3MoeArgs(
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
    name=tiny_random_name("qwen3-moe"),
    num_experts=8,
    top_k=2,
    moe_ffn_dim=32,
    norm_topk_prob=True,
)

TINY_PRESETS: dict[str, Qwen3MoeArgs] = {
    # 8 experts, top-2 renormalised (Qwen3-30B-A3B's routing), untied head
    "qwen3-moe": _TINY_QWEN3_MOE,
    # top-1 without renormalising, tied head, three layers, one KV head
    "qwen3-moe-top1": attrs.evolve(
        _TINY_QWEN3_MOE,
        name=tiny_random_name("qwen3-moe-top1"),
        n_kv_heads=1,
        n_layers=3,
        tie_word_embeddings=True,
        top_k=1,
        norm_topk_prob=False,
    ),
}

Qwen3MoeArgs.PRESETS = TINY_PRESETS

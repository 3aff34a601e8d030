"""Qwen3-MoE: top-k routed SwiGLU experts, stored once; batched, per-row and gathered paths.

The family (`family.FAMILY`) is Qwen3's attention on the shared decoder with the layer's MLP
block swapped for `MoEBlock` (`layer.Qwen3MoeLayer`, `model.Qwen3MoeModel`); its config class
is `Qwen3MoeArgs` with the tiny presets `tiny-random-qwen3-moe` and `-qwen3-moe-top1`.
"""

from __future__ import annotations

from models.qwen3_moe.args import TINY_PRESETS, Qwen3MoeArgs
from models.qwen3_moe.block import DEFAULT_PER_ROW_MAX_ROWS, MoEBlock
from models.qwen3_moe.config import MoEArgs, MoEConfigError
from models.qwen3_moe.expert_weights import (
    LAYER_NAMES,
    ExpertWeightsError,
    gguf_expert_names,
    hf_expert_names,
    stack_gguf_experts,
    stack_hf_experts,
)
from models.qwen3_moe.experts import (
    EXPERT_PATHS,
    SYNC_FREE_PATHS,
    ExpertPath,
    ExpertShapeError,
    ExpertShapes,
    StackedExperts,
    batched_experts,
    gathered_experts,
    per_row_experts,
)
from models.qwen3_moe.path_plan import ExpertPathPlan, measure_expert_paths
from models.qwen3_moe.routing import Routes, RoutingError, TopKRouting

__all__ = [
    "DEFAULT_PER_ROW_MAX_ROWS",
    "EXPERT_PATHS",
    "LAYER_NAMES",
    "SYNC_FREE_PATHS",
    "TINY_PRESETS",
    "ExpertPath",
    "ExpertPathPlan",
    "ExpertShapeError",
    "ExpertShapes",
    "ExpertWeightsError",
    "MoEArgs",
    "MoEBlock",
    "MoEConfigError",
    "Qwen3MoeArgs",
    "Routes",
    "RoutingError",
    "StackedExperts",
    "TopKRouting",
    "batched_experts",
    "gathered_experts",
    "gguf_expert_names",
    "hf_expert_names",
    "measure_expert_paths",
    "per_row_experts",
    "stack_gguf_experts",
    "stack_hf_experts",
]

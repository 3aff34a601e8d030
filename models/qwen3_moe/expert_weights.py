"""Checkpoint names of one layer's router and experts, mapped onto the stacked layout.

HF Qwen3-MoE folders hold one matrix per expert and projection
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`); GGUF files hold one tensor per
projection with the experts stacked (`blk.{i}.ffn_gate_exps.weight`). Both become the three
tensors of `LAYER_NAMES`, the names transformers uses in memory. Stacking writes each expert
into one preallocated tensor, so a layer's experts exist once plus the expert being copied.
Every tensor is shape-checked and a mismatch names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from models.qwen3_moe.experts import ExpertShapes, check_shape

# Canonical names inside a decoder layer (the `MoEBlock` sits at `mlp`).
ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
LAYER_NAMES = (ROUTER, GATE_UP, DOWN)

_HF_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_GGUF_SUFFIXES = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MAX_LISTED = 8


class ExpertWeightsError(ValueError):
    """Expert tensors a checkpoint lacks; the message lists them (the first few)."""

    def __init__(self, source: str, missing: list[str]) -> None:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        super().__init__(f"{source} lacks {len(missing)} expert tensor(s): {listed}{more}")
        self.missing = tuple(missing)


def hf_layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def hf_expert_names(layer: int, num_experts: int) -> tuple[str, ...]:
    """Every HF checkpoint name of one layer's router and per-expert projections."""
    prefix = hf_layer_prefix(layer)
    return (f"{prefix}{ROUTER}", *(prefix + suffix for suffix in expert_suffixes(num_experts)))


def expert_suffixes(num_experts: int) -> tuple[str, ...]:
    """One layer's per-expert tensor names within the layer (`mlp.experts.{e}.gate_proj.weight`),
    as HF checkpoints hold them: the canonical names the decoder's loaders check."""
    return tuple(
        f"mlp.experts.{expert}.{projection}.weight"
        for expert in range(num_experts)
        for projection in _HF_PROJECTIONS
    )


def stack_expert_tensors(
    tensor: Callable[[str], torch.Tensor], shapes: ExpertShapes, *, where: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gate_up` `[E, 2I, D]` and `down` `[E, D, I]` from per-expert tensors, `tensor(suffix)`
    each (suffixes of `expert_suffixes`, `where` prefixed in errors). Each expert is copied
    into one preallocated tensor as soon as it is read, so a caller that hands tensors over
    (pops them) holds the stack plus one expert at a time."""
    inter = shapes.intermediate_size
    one = (inter, shapes.hidden_size)
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    for expert in range(shapes.num_experts):
        base = f"mlp.experts.{expert}."
        gate = tensor(f"{base}gate_proj.weight")
        up = tensor(f"{base}up_proj.weight")
        down_e = tensor(f"{base}down_proj.weight")
        check_shape(f"{where}{base}gate_proj.weight", gate, one)
        check_shape(f"{where}{base}up_proj.weight", up, one)
        check_shape(f"{where}{base}down_proj.weight", down_e, (shapes.hidden_size, inter))
        if gate_up is None or down is None:
            gate_up = torch.empty(shapes.gate_up, dtype=gate.dtype, device=gate.device)
            down = torch.empty(shapes.down, dtype=gate.dtype, device=gate.device)
        gate_up[expert, :inter].copy_(gate)
        gate_up[expert, inter:].copy_(up)
        down[expert].copy_(down_e)
    assert gate_up is not None and down is not None  # ExpertShapes has num_experts >= 1
    return gate_up, down


def gguf_expert_names(layer: int) -> tuple[str, ...]:
    """The GGUF names of one layer's router and stacked expert projections."""
    return tuple(f"blk.{layer}.{suffix}.weight" for suffix in _GGUF_SUFFIXES)


def _require(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], source: str) -> None:
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ExpertWeightsError(source, missing)


def stack_hf_experts(
    tensors: Mapping[str, torch.Tensor], layer: int, shapes: ExpertShapes, *, source: str = "HF"
) -> dict[str, torch.Tensor]:
    """One layer's `LAYER_NAMES` tensors from per-expert HF names.

    A checkpoint already in the stacked layout (transformers' in-memory names
    `mlp.experts.gate_up_proj` / `down_proj`) is accepted as is.
    """
    prefix = hf_layer_prefix(layer)
    stacked = (f"{prefix}{GATE_UP}", f"{prefix}{DOWN}")
    if all(name in tensors for name in stacked):
        router_name = f"{prefix}{ROUTER}"
        _require(tensors, (router_name,), source)
        return _checked(
            {ROUTER: tensors[router_name], GATE_UP: tensors[stacked[0]], DOWN: tensors[stacked[1]]},
            shapes,
            prefix,
        )
    _require(tensors, hf_expert_names(layer, shapes.num_experts), source)
    gate_up, down = stack_expert_tensors(
        lambda suffix: tensors[f"{prefix}{suffix}"], shapes, where=prefix
    )
    router = tensors[f"{prefix}{ROUTER}"]
    return _checked({ROUTER: router, GATE_UP: gate_up, DOWN: down}, shapes, prefix)


def stack_gguf_experts(
    tensors: Mapping[str, torch.Tensor], layer: int, shapes: ExpertShapes, *, source: str = "GGUF"
) -> dict[str, torch.Tensor]:
    """One layer's `LAYER_NAMES` tensors from GGUF names, in torch (reversed ggml) shapes.

    GGUF keeps gate and up apart (`[E, I, D]` each); they are joined into `gate_up`.
    """
    router_name, gate_name, up_name, down_name = gguf_expert_names(layer)
    _require(tensors, (router_name, gate_name, up_name, down_name), source)
    half = (shapes.num_experts, shapes.intermediate_size, shapes.hidden_size)
    check_shape(gate_name, tensors[gate_name], half)
    check_shape(up_name, tensors[up_name], half)
    check_shape(router_name, tensors[router_name], (shapes.num_experts, shapes.hidden_size))
    check_shape(down_name, tensors[down_name], shapes.down)
    gate_up = torch.cat((tensors[gate_name], tensors[up_name]), dim=1)
    return {ROUTER: tensors[router_name], GATE_UP: gate_up, DOWN: tensors[down_name]}


def _checked(
    layer_tensors: dict[str, torch.Tensor], shapes: ExpertShapes, prefix: str
) -> dict[str, torch.Tensor]:
    check_shape(
        f"{prefix}{ROUTER}", layer_tensors[ROUTER], (shapes.num_experts, shapes.hidden_size)
    )
    check_shape(f"{prefix}{GATE_UP}", layer_tensors[GATE_UP], shapes.gate_up)
    check_shape(f"{prefix}{DOWN}", layer_tensors[DOWN], shapes.down)
    return layer_tensors

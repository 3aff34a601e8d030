"""The Qwen3-MoE decoder layer: the shared layer with its MLP block swapped for `MoEBlock`.

Only the MLP hooks of `DecoderLayer` are overridden; attention, q/k norms, rotary and the
paged cache stay shared. The block's canonical tensors are the per-expert names HF folders
hold (`mlp.experts.{e}.gate_proj.weight`, ...) plus the router (`mlp.gate.weight`), so the
shared safetensors loader and weight checks read them unchanged; the layer stacks them
once (`[E, 2I, D]` and `[E, D, I]`) and gives views of the stack back. The block has no
`Projection`s, so the kernel plan covers the attention projections and the head; the
expert path is planned by the model (`model.Qwen3MoeModel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from models.decoder.config import DecoderArgs
from models.decoder.layers import DecoderLayer, WeightValue
from models.qwen3_moe.args import Qwen3MoeArgs
from models.qwen3_moe.block import MoEBlock
from models.qwen3_moe.config import MoEArgs
from models.qwen3_moe.expert_weights import (
    DOWN,
    GATE_UP,
    ROUTER,
    expert_suffixes,
    stack_expert_tensors,
)


def moe_args(args: DecoderArgs) -> MoEArgs:
    """The MoE settings of `args`, which must be `Qwen3MoeArgs`."""
    if not isinstance(args, Qwen3MoeArgs):
        raise TypeError(
            f"a Qwen3-MoE layer needs Qwen3MoeArgs (num_experts, top_k, moe_ffn_dim), got "
            f"{type(args).__name__}"
        )
    return args.moe


def _dense(value: WeightValue) -> torch.Tensor:
    """Expert and router weights are held as float tensors (blocks are dequantized)."""
    if isinstance(value, torch.Tensor):
        return value
    return value.dequantize()


class Qwen3MoeLayer(DecoderLayer):
    """Qwen3 attention, then routed experts (`self.moe`) in place of the dense MLP."""

    MLP_PROJECTIONS: ClassVar[tuple[str, ...]] = ()

    moe: MoEBlock

    def build_mlp(self, args: DecoderArgs, dtype: torch.dtype, device: torch.device) -> None:
        self.moe = MoEBlock(moe_args(args), dtype=dtype, device=device)

    @classmethod
    def mlp_shapes(cls, args: DecoderArgs) -> dict[str, tuple[int, ...]]:
        shapes = moe_args(args).shapes
        up = (shapes.intermediate_size, shapes.hidden_size)
        down = (shapes.hidden_size, shapes.intermediate_size)
        out: dict[str, tuple[int, ...]] = {ROUTER: (shapes.num_experts, shapes.hidden_size)}
        for suffix in expert_suffixes(shapes.num_experts):
            out[suffix] = down if suffix.endswith("down_proj.weight") else up
        return out

    def load_mlp(self, tensor: Callable[[str], WeightValue]) -> None:
        """Stack the per-expert tensors as they are read (each is let go once copied)."""
        shapes = self.moe.args.shapes
        router = _dense(tensor(ROUTER))
        gate_up, down = stack_expert_tensors(lambda name: _dense(tensor(name)), shapes)
        self.moe.adopt_layer({ROUTER: router, GATE_UP: gate_up, DOWN: down})

    def mlp_tensors(self) -> dict[str, torch.Tensor]:
        """Router and per-expert views of the stacked weights (no copies)."""
        inter = self.moe.args.shapes.intermediate_size
        gate_up = self.moe.experts.gate_up.detach()
        down = self.moe.experts.down.detach()
        out = {ROUTER: self.moe.gate.weight.detach()}
        for expert in range(gate_up.shape[0]):
            base = f"mlp.experts.{expert}."
            out[f"{base}gate_proj.weight"] = gate_up[expert, :inter]
            out[f"{base}up_proj.weight"] = gate_up[expert, inter:]
            out[f"{base}down_proj.weight"] = down[expert]
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(x)
        return out

    def moe_parameters(self) -> dict[str, nn.Parameter]:
        """The block's stored weights by name within the layer (sleep, reload, byte counts)."""
        return {f"moe.{name}": param for name, param in self.moe.named_parameters()}

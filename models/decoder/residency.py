"""The decoder model's resident tensors, named for sleep, wake and in-place reload.

Why here: the family knows which tensors are weights (projections, in float or in quantized
blocks; norms; an untied embedding) and which are buffers the forward needs but no checkpoint
holds (the rotary tables). `runtime.weight_residency` moves them; a reload matches a source
model tensor by tensor in a layout-independent orientation (`[out, in]` views of float
projections, whatever layout the kernel plan chose), so names, shapes and dtypes compare
across a kernel plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from torch import nn

from models.decoder.layers import Projection
from runtime.quant.matrix import QuantizedMatrix
from runtime.weight_reload import ReloadPair, WeightMismatchError, match_tensors


class _Modules(Protocol):
    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def _block_tensors(name: str, blocks: tuple[QuantizedMatrix, ...]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for index, block in enumerate(blocks):
        prefix = f"{name}.blocks.{index}"
        out[f"{prefix}.qs"] = block.qs
        out[f"{prefix}.scales"] = block.scales
        if block.mins is not None:
            out[f"{prefix}.mins"] = block.mins
    return out


def weight_tensors(model: _Modules, *, oriented: bool) -> dict[str, torch.Tensor]:
    """Every weight by module name: the stored tensors, or (`oriented`) `[out, in]` views of
    float projections so two models compare whatever layouts their kernel plans chose."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, Projection):
            if module.blocks is not None:
                out.update(_block_tensors(name, module.blocks))
            else:
                out[f"{name}.weight"] = module.hf_weight() if oriented else module.weight
        elif isinstance(module, nn.RMSNorm | nn.Embedding) and module.weight is not None:
            out[f"{name}.weight"] = module.weight
    return out


def forget_block_descriptors(model: _Modules) -> None:
    """Drop the native kernels' cached descriptors of block weights (they hold addresses)."""
    for _, module in model.named_modules():
        if isinstance(module, Projection) and module.blocks is not None:
            for block in module.blocks:
                block.native_view.clear()


def reload_pairs(model: _Modules, source: _Modules) -> tuple[ReloadPair, ...]:
    """Resident weight views paired with `source`'s; refused at the first mismatch."""
    resident = weight_tensors(model, oriented=True)
    given = weight_tensors(source, oriented=True)
    return match_tensors(resident, given)


def check_state_dtypes(state: Mapping[str, object], dtype: torch.dtype) -> None:
    """Every float tensor of a canonical state dict in the model's dtype (no silent casts)."""
    for name, value in state.items():
        if isinstance(value, QuantizedMatrix):
            continue
        if not isinstance(value, torch.Tensor):
            raise WeightMismatchError(
                name, f"is a {type(value).__name__} in the source, not a torch.Tensor"
            )
        if value.dtype != dtype:
            raise WeightMismatchError(name, f"is {value.dtype} in the source but {dtype} resident")

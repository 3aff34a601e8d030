"""SwiGLU experts stored once, and the ways to run the rows routed to them.

Layout: every layer keeps two stacked tensors, `gate_up` `[E, 2*I, D]` (each expert's gate
rows, then its up rows) and `down` `[E, D, I]`. Each expert's block is one contiguous
`[out, in]` matrix, as `F.linear` wants it, so an expert is a slice (a view, no copy) and the
gathered path takes whole experts with one `index_select`. Gate and up are joined so an
expert's first projection is one matmul. It is also the order transformers and llama.cpp use
in memory, so loading (`expert_weights`) only stacks, never transposes.

Paths (`ExpertPath`), equal within float rounding:
- `batched`: slots (row, choice) sorted by expert; one matmul pair per expert that has rows,
  over exactly its rows; results weighted and added back per row. One host sync (the
  per-expert counts) and a sort; each used expert is read once: prefill and large batches.
- `per_row`: each row's k experts applied directly to that row through weight views: no sort,
  no grouping, no weight copy, one host sync (the ids). For one row and small batches.
- `gathered`: each slot's expert weights gathered (`index_select`) and applied with one
  batched matmul. No host sync at all, so it can be captured in a CUDA graph, but it copies
  every slot's weights (on CPU about 2x slower than `per_row` for one row, measured).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from models.qwen3_moe.routing import Routes
from runtime.backends import native_kernels

ExpertPath: TypeAlias = Literal["batched", "per_row", "gathered"]
EXPERT_PATHS: tuple[ExpertPath, ...] = ("batched", "per_row", "gathered")
# The paths that never read device values on the host (CUDA-graph capturable).
SYNC_FREE_PATHS: tuple[ExpertPath, ...] = ("gathered",)


class ExpertShapeError(ValueError):
    """Expert weights or inputs of the wrong shape; the message names the tensor."""


@attrs.frozen
class ExpertShapes:
    """Geometry of one layer's experts: count, hidden width D, intermediate width I."""

    num_experts: int
    hidden_size: int
    intermediate_size: int

    def __attrs_post_init__(self) -> None:
        for name, value in (
            ("num_experts", self.num_experts),
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.intermediate_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ExpertShapeError(f"{name}={value!r} is invalid: allowed is an integer >= 1")

    @property
    def gate_up(self) -> tuple[int, int, int]:
        return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)

    @property
    def down(self) -> tuple[int, int, int]:
        return (self.num_experts, self.hidden_size, self.intermediate_size)


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Refuse a tensor whose shape differs, naming it with both shapes."""
    if tuple(tensor.shape) != expected:
        raise ExpertShapeError(f"{name} has shape {tuple(tensor.shape)}: expected {expected}")


# Rows up to which an expert's product streams its weight through the native few-row kernel
# (`runtime/backends/native/small_rows_matmul.c`): an expert sees one to a few rows per call,
# where torch's GEMM (MKL, on AMD Zen) runs 2-3x below the read rate (measured: a layer of
# 64 experts, top-8, 1 row: per-row path 3.3 -> 1.3 ms; 16 rows batched 33 -> 21 ms).
_STREAMED_ROWS = 16


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` for one expert's `[out, in]` slice of the stacked weights."""
    if (
        x.shape[0] <= _STREAMED_ROWS
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and native_kernels.unavailable_reason() is None
    ):
        return native_kernels.small_rows_matmul().unchecked(weight, x.contiguous())
    return F.linear(x, weight)


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate = gate_up[..., :intermediate]
    up = gate_up[..., intermediate:]
    activated: torch.Tensor = F.silu(gate) * up
    return activated


def batched_experts(
    x: torch.Tensor, routes: Routes, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Rows grouped by expert: one matmul pair per expert that has rows."""
    k = routes.top_k
    intermediate = down.shape[2]
    flat_ids = routes.expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    source_rows = order // k
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    grouped = x.index_select(0, source_rows)
    results = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        hidden = _swiglu(_linear(grouped[start:stop], gate_up[expert]), intermediate)
        results[start:stop] = _linear(hidden, down[expert])
        start = stop
    results.mul_(routes.weights.reshape(-1).index_select(0, order).unsqueeze(-1))
    return torch.zeros_like(x).index_add_(0, source_rows, results)


def per_row_experts(
    x: torch.Tensor, routes: Routes, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Each row's k experts applied to it directly, through views of the stacked weights:
    the k products per projection, then one SwiGLU over all k and one weighted sum (few
    small ops: at one row the step is the weights' streaming plus per-op overhead)."""
    intermediate = down.shape[2]
    out = torch.empty_like(x)
    for row, experts in enumerate(routes.expert_ids.tolist()):
        vector = x[row : row + 1]
        hidden = _swiglu(torch.cat([_linear(vector, gate_up[e]) for e in experts]), intermediate)
        results = torch.cat([_linear(hidden[i : i + 1], down[e]) for i, e in enumerate(experts)])
        torch.mm(routes.weights[row : row + 1].to(results.dtype), results, out=out[row : row + 1])
    return out


def gathered_experts(
    x: torch.Tensor, routes: Routes, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Every slot's expert gathered and applied in one batched matmul per projection."""
    rows, k = routes.expert_ids.shape
    width = x.shape[1]
    intermediate = down.shape[2]
    flat_ids = routes.expert_ids.reshape(-1)
    # Rows as `[slots, 1, D]` against transposed weights: a row-vector product per slot
    # (on CPU several times faster than the column form `W @ x`, measured).
    slots = x.unsqueeze(1).expand(rows, k, width).reshape(rows * k, 1, width)
    hidden = torch.matmul(slots, gate_up.index_select(0, flat_ids).transpose(1, 2))
    activated = _swiglu(hidden, intermediate)
    out = torch.matmul(activated, down.index_select(0, flat_ids).transpose(1, 2))
    return (out.view(rows, k, width) * routes.weights.unsqueeze(-1)).sum(dim=1)


_PATH_FUNCTIONS = {
    "batched": batched_experts,
    "per_row": per_row_experts,
    "gathered": gathered_experts,
}


class StackedExperts(nn.Module):
    """One layer's experts: the stacked weights and both paths over them."""

    def __init__(self, shapes: ExpertShapes, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.shapes = shapes
        self.gate_up = nn.Parameter(
            torch.zeros(shapes.gate_up, dtype=dtype, device=device), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.zeros(shapes.down, dtype=dtype, device=device), requires_grad=False
        )

    def load(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy stacked weights in (shape-checked); the model's dtype and device are kept."""
        check_shape("experts.gate_up", gate_up, self.shapes.gate_up)
        check_shape("experts.down", down, self.shapes.down)
        with torch.no_grad():
            self.gate_up.copy_(gate_up)
            self.down.copy_(down)

    def adopt(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Hold these stacked weights as they are (shape-checked, no copy): how a model built
        on the meta device takes its weights."""
        check_shape("experts.gate_up", gate_up, self.shapes.gate_up)
        check_shape("experts.down", down, self.shapes.down)
        self.gate_up = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.down = nn.Parameter(down.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor, routes: Routes, path: ExpertPath) -> torch.Tensor:
        """Weighted sum of each row's routed experts: `[rows, D]` in, `[rows, D]` out."""
        if x.dim() != 2 or x.shape[1] != self.shapes.hidden_size:
            raise ExpertShapeError(
                f"expert input has shape {tuple(x.shape)}: expected [rows, "
                f"{self.shapes.hidden_size}]"
            )
        if routes.rows != x.shape[0]:
            raise ExpertShapeError(
                f"routes cover {routes.rows} rows but the expert input has {x.shape[0]}"
            )
        run = _PATH_FUNCTIONS.get(path)
        if run is None:
            raise ValueError(f"expert path {path!r} is invalid: allowed are {EXPERT_PATHS}")
        return run(x, routes, self.gate_up, self.down)

    def extra_repr(self) -> str:
        s = self.shapes
        return (
            f"experts={s.num_experts}, hidden={s.hidden_size}, intermediate={s.intermediate_size}"
        )

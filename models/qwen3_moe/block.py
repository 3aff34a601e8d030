"""The sparse MLP of a Qwen3-MoE decoder layer: router gate, top-k routing, stacked experts.

It takes the place of the dense MLP: `[..., D]` in, `[..., D]` out. The expert path is fixed
by `expert_path`, else by a measured `path_plan`, else by row count (up to
`DEFAULT_PER_ROW_MAX_ROWS` per-row, more batched), so a layer runs before warmup has measured
anything. With `graph_safe` set (the model is, or may be, captured in a CUDA graph) only a
path that never reads device values on the host is taken (`SYNC_FREE_PATHS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from models.qwen3_moe.config import MoEArgs
from models.qwen3_moe.expert_weights import DOWN, GATE_UP, LAYER_NAMES, ROUTER
from models.qwen3_moe.experts import (
    EXPERT_PATHS,
    SYNC_FREE_PATHS,
    ExpertPath,
    StackedExperts,
    check_shape,
)
from models.qwen3_moe.path_plan import ExpertPathPlan, measure_expert_paths
from models.qwen3_moe.routing import Routes

# Without a measured plan: rows up to this many take the per-row path (on CPU it beat the
# batched path at 1 and 2 rows and lost from 4, for 16 experts of 1024x768, top-4, fp32).
DEFAULT_PER_ROW_MAX_ROWS = 2


class MoEBlock(nn.Module):
    """Router gate (`Linear(D, E)`, no bias) and the layer's experts, stored once."""

    def __init__(
        self,
        args: MoEArgs,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_path: ExpertPath | None = None,
        graph_safe: bool = False,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.args = args
        self.gate = nn.Linear(
            args.shapes.hidden_size, args.shapes.num_experts, bias=False, dtype=dtype, device=device
        )
        self.gate.weight.requires_grad_(False)
        self.experts = StackedExperts(args.shapes, dtype=dtype, device=device)
        self._expert_path: ExpertPath | None = None
        self.expert_path = expert_path
        self.graph_safe = graph_safe
        self.path_plan: ExpertPathPlan | None = None

    @property
    def expert_path(self) -> ExpertPath | None:
        """A path forced for every call, or None to choose by row count."""
        return self._expert_path

    @expert_path.setter
    def expert_path(self, path: ExpertPath | None) -> None:
        if path is not None and path not in EXPERT_PATHS:
            raise ValueError(
                f"expert_path={path!r} is invalid: allowed are {EXPERT_PATHS} or None (auto)"
            )
        self._expert_path = path

    def path_for(self, rows: int) -> ExpertPath:
        """The path a call with `rows` rows takes."""
        if self.graph_safe:
            if self._expert_path is not None and self._expert_path not in SYNC_FREE_PATHS:
                raise ValueError(
                    f"expert_path={self._expert_path!r} reads device values on the host, which "
                    f"graph_safe=True forbids: allowed are {SYNC_FREE_PATHS} or None"
                )
            return self._expert_path or SYNC_FREE_PATHS[0]
        if self._expert_path is not None:
            return self._expert_path
        if self.path_plan is not None:
            return self.path_plan.path_for(rows)
        return "per_row" if rows <= DEFAULT_PER_ROW_MAX_ROWS else "batched"

    def route(self, x: torch.Tensor) -> Routes:
        """Routes for rows `[rows, D]`."""
        return self.args.routing(self.gate(x))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        rows = hidden.reshape(-1, shape[-1])
        out: torch.Tensor = self.experts(rows, self.route(rows), self.path_for(rows.shape[0]))
        return out.reshape(shape)

    def load_layer(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy in one layer's `LAYER_NAMES` tensors (from `expert_weights`), shape-checked."""
        missing = [name for name in LAYER_NAMES if name not in tensors]
        if missing:
            raise KeyError(f"MoE layer tensors lack {missing}: allowed keys are {LAYER_NAMES}")
        router = tensors[ROUTER]
        check_shape(ROUTER, router, tuple(self.gate.weight.shape))
        self.experts.load(tensors[GATE_UP], tensors[DOWN])
        with torch.no_grad():
            self.gate.weight.copy_(router)

    def adopt_layer(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold one layer's `LAYER_NAMES` tensors as they are (shape-checked, no copy): a
        model built on the meta device has no storage to copy into."""
        missing = [name for name in LAYER_NAMES if name not in tensors]
        if missing:
            raise KeyError(f"MoE layer tensors lack {missing}: allowed keys are {LAYER_NAMES}")
        router = tensors[ROUTER]
        check_shape(ROUTER, router, tuple(self.gate.weight.shape))
        self.experts.adopt(tensors[GATE_UP], tensors[DOWN])
        self.gate.weight = nn.Parameter(router.contiguous(), requires_grad=False)

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors under `LAYER_NAMES` (the stacked layout)."""
        return {
            ROUTER: self.gate.weight.detach(),
            GATE_UP: self.experts.gate_up.detach(),
            DOWN: self.experts.down.detach(),
        }

    def measure_paths(
        self,
        buckets: Sequence[int],
        *,
        rounds: int = 3,
        paths: Sequence[ExpertPath] | None = None,
    ) -> ExpertPathPlan:
        """Time the eligible paths (or those of `paths`) per bucket; the caller keeps it with
        `path_plan = plan`.

        Under `graph_safe` only the sync-free paths are eligible.
        """
        eligible = SYNC_FREE_PATHS if self.graph_safe else EXPERT_PATHS
        if paths is not None:
            eligible = tuple(path for path in eligible if path in paths)
        return measure_expert_paths(
            self.experts, self.route, buckets, paths=eligible, rounds=rounds
        )

    def extra_repr(self) -> str:
        return (
            f"top_k={self.args.routing.top_k}, expert_path={self._expert_path}, "
            f"graph_safe={self.graph_safe}"
        )

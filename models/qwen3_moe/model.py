"""The Qwen3-MoE tensor model: the shared decoder over `Qwen3MoeLayer`, plus its expert paths.

What it adds to `DecoderModel`, and why:

* the expert path per row bucket (batched or per-row), measured at warmup on layer 0's
  experts at the kernel plan's buckets, once per lane, and recorded as a note of the kernel
  plan (`EXPERT_NOTE` + the plan's JSON) so a replayed plan (`--kernels FILE`, or another lane
  adopting lane 0's plan) reproduces it; on a device where nothing is timed, or on the
  graph-safe path, the sync-free `gathered` path runs and nothing is measured;
* which path family the block may take: the graph-safe decode and prefill (CUDA graphs)
  switch the blocks to sync-free paths, the dynamic ones back;
* the expert and router weights in what sleep moves, reload matches and weight bytes count
  (the shared model counts `Projection`s and norms only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import attrs
import torch

from models.decoder.kernels import KernelPlan
from models.decoder.model import DecoderModel
from models.progress import ProgressSink
from models.qwen3_moe.block import MoEBlock
from models.qwen3_moe.experts import ExpertPath
from models.qwen3_moe.layer import Qwen3MoeLayer
from models.qwen3_moe.path_plan import ExpertPathPlan
from runtime.weight_reload import ReloadPair, match_tensors

logger = logging.getLogger(__name__)

EXPERT_NOTE = "qwen3_moe expert paths: "
"""Prefix of the kernel-plan note recording the expert paths (JSON follows)."""
MEASURED_PATHS: tuple[ExpertPath, ...] = ("batched", "per_row")
"""The paths timed against each other on the dynamic path (`gathered` copies every slot's
weights: for a prefill chunk of a large model that is gigabytes, and it is slower anyway)."""


class Qwen3MoeModel(DecoderModel):
    """`DecoderModel` with routed experts in every layer (see the module docstring)."""

    layer_class = Qwen3MoeLayer
    # The expert paths of a replayed kernel plan (`replay_kernels`), applied at warmup.
    _replayed_experts: ExpertPathPlan | None = None

    # ------------------------------------------------------------------ the blocks
    def moe_blocks(self) -> list[MoEBlock]:
        """Every layer's expert block, in layer order."""
        blocks = []
        for layer in self.layers:
            assert isinstance(layer, Qwen3MoeLayer)
            blocks.append(layer.moe)
        return blocks

    def expert_path_plan(self) -> ExpertPathPlan | None:
        """The expert paths warmup chose (or replayed), None before it ran."""
        return self.moe_blocks()[0].path_plan

    def _entering_path(self, graph_safe: bool) -> None:
        # The graph-safe path's experts run the sync-free gathered product; the dynamic
        # path's run the one warmup chose.
        for block in self.moe_blocks():
            if block.graph_safe != graph_safe:
                block.graph_safe = graph_safe

    # ------------------------------------------------------------ the kernel plan
    def replay_kernels(self, plan: KernelPlan, *, where: str = "kernels") -> None:
        """Also read the plan's expert paths now, so a plan without them (or with broken
        ones) is refused before warmup, naming `where`."""
        recorded, expert_plan = _recorded_expert_plan(plan, where)
        if not recorded:
            raise ValueError(
                f"{where}: the kernel plan has no note starting {EXPERT_NOTE!r}: allowed is a "
                "plan recorded for a Qwen3-MoE model (warmup writes the expert paths there)"
            )
        super().replay_kernels(plan, where=where)
        self._replayed_experts = expert_plan

    def _resolve_kernel_plan(
        self, buckets: Sequence[int], progress: ProgressSink | None
    ) -> KernelPlan:
        plan = super()._resolve_kernel_plan(buckets, progress)
        if self._replay_plan is not None:
            self._use_expert_plan(self._replayed_experts)
            return plan
        if self.device.type != "cpu" or self.uses_graph_safe_path():
            note = f"{EXPERT_NOTE}null (graph-safe: the sync-free gathered path, not timed)"
            self._use_expert_plan(None)
            return attrs.evolve(plan, notes=(*plan.notes, note))
        with torch.inference_mode():
            measured = self.moe_blocks()[0].measure_paths(plan.buckets, paths=MEASURED_PATHS)
        self._use_expert_plan(measured)
        logger.info("expert paths per row bucket: %s", measured.paths)
        note = EXPERT_NOTE + json.dumps(measured.to_json(), sort_keys=True)
        return attrs.evolve(plan, notes=(*plan.notes, note))

    def _use_expert_plan(self, plan: ExpertPathPlan | None) -> None:
        for block in self.moe_blocks():
            block.path_plan = plan

    # ------------------------------------------------- residency and byte counts
    def _moe_weights(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, Qwen3MoeLayer)
            for name, param in layer.moe_parameters().items():
                out[f"layers.{index}.{name}"] = param
        return out

    def resident_weights(self) -> dict[str, torch.Tensor]:
        """The shared weights and every layer's router and stacked experts."""
        return {**super().resident_weights(), **self._moe_weights()}

    def reload_pairs(self, source: object) -> tuple[ReloadPair, ...]:
        shared = super().reload_pairs(source)
        if not isinstance(source, Qwen3MoeModel):
            raise TypeError(
                f"source must be a Qwen3MoeModel (the same family), got {type(source).__name__}"
            )
        return (*shared, *match_tensors(self._moe_weights(), source._moe_weights()))

    def weight_bytes(self) -> int:
        experts = sum(t.numel() * t.element_size() for t in self._moe_weights().values())
        return super().weight_bytes() + experts


def _recorded_expert_plan(plan: KernelPlan, where: str) -> tuple[bool, ExpertPathPlan | None]:
    """Whether a kernel plan's notes record expert paths, and the plan they record (None:
    `null`, recorded where nothing was timed; the block then chooses by row count)."""
    for note in plan.notes:
        if note.startswith(EXPERT_NOTE):
            text = note[len(EXPERT_NOTE) :]
            if text.startswith("null"):
                return True, None
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: expert-path note {note!r} is not JSON ({error}): allowed is the "
                    "note warmup writes"
                ) from error
            return True, ExpertPathPlan.from_json(data, where=where)
    return False, None

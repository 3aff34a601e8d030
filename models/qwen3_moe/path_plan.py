"""Choosing an expert path per row bucket by timing both on the layer's own weights.

Which path is faster depends on the device, the expert sizes and the row count: the per-row
path copies every slot's weights but needs no sort or host sync, the batched path reads each
used expert once but pays for grouping. Warmup times both for each bucket (as it does for the
other kernels) and keeps the faster; the result is recorded with what each path measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch

from models.qwen3_moe.experts import EXPERT_PATHS, ExpertPath, StackedExperts
from models.qwen3_moe.routing import Routes

_ROUNDS = 3


@attrs.frozen
class ExpertPathPlan:
    """Per row bucket (ascending): microseconds of the batched and the per-row path.

    A call with `r` rows uses the first bucket of at least `r` rows, else the largest.
    """

    timings: tuple[tuple[int, float, float], ...]

    def __attrs_post_init__(self) -> None:
        buckets = [bucket for bucket, _, _ in self.timings]
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(
                f"expert path plan buckets {buckets} are invalid: allowed are distinct "
                "ascending row counts >= 1, at least one"
            )

    @property
    def paths(self) -> dict[int, ExpertPath]:
        """Bucket -> the faster path (batched on a tie: it reads each expert once)."""
        return {
            bucket: "batched" if batched <= per_row else "per_row"
            for bucket, batched, per_row in self.timings
        }

    @property
    def microseconds(self) -> dict[int, dict[ExpertPath, float]]:
        return {
            bucket: {"batched": batched, "per_row": per_row}
            for bucket, batched, per_row in self.timings
        }

    def path_for(self, rows: int) -> ExpertPath:
        paths = self.paths
        for bucket, path in paths.items():
            if rows <= bucket:
                return path
        return paths[self.timings[-1][0]]

    def to_json(self) -> dict[str, object]:
        return {
            "paths": [[bucket, path] for bucket, path in self.paths.items()],
            "microseconds": [
                {"bucket": bucket, "batched": round(batched, 1), "per_row": round(per_row, 1)}
                for bucket, batched, per_row in self.timings
            ],
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_us(run: Callable[[], object], device: torch.device, rounds: int) -> float:
    run()  # warm-up: allocator, kernel selection
    best = float("inf")
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _call(
    experts: StackedExperts, x: torch.Tensor, routes: Routes, path: ExpertPath
) -> Callable[[], object]:
    return lambda: experts(x, routes, path)


def measure_expert_paths(
    experts: StackedExperts,
    route: Callable[[torch.Tensor], Routes],
    buckets: Sequence[int],
    *,
    rounds: int = _ROUNDS,
    seed: int = 0,
) -> ExpertPathPlan:
    """Both paths timed (best of `rounds`) for each bucket's row count, on routed random rows.

    Rows go through the layer's own router so the experts hit (how many, how spread) are
    what this layer's weights produce; the routing itself is the same for both paths and
    is not timed.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} is invalid: allowed is an integer >= 1")
    weight = experts.gate_up
    generator = torch.Generator(device="cpu").manual_seed(seed)
    timings: list[tuple[int, float, float]] = []
    with torch.inference_mode():
        for rows in sorted(set(buckets)):
            x = torch.randn(rows, experts.shapes.hidden_size, generator=generator)
            x = x.to(device=weight.device, dtype=weight.dtype)
            times = {
                path: _best_us(_call(experts, x, route(x), path), weight.device, rounds)
                for path in EXPERT_PATHS
            }
            timings.append((rows, times["batched"], times["per_row"]))
    return ExpertPathPlan(timings=tuple(timings))

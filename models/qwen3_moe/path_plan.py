"""Choosing an expert path per row bucket by timing both on the layer's own weights.

Which path is faster depends on the device, the expert sizes and the row count: the batched
path reads each used expert once but pays for sorting and grouping, the per-row path skips
that but runs two small matmuls per (row, expert), the gathered path needs no host sync but
copies every slot's weights. Warmup times both for each bucket (as it does for the
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
    """Per row bucket (ascending): the microseconds each measured path took.

    A call with `r` rows uses the first bucket of at least `r` rows, else the largest.
    `chosen` (a replayed plan: `from_json`) keeps the recorded choice per bucket, so rounding
    of the recorded times cannot turn a near tie the other way.
    """

    timings: tuple[tuple[int, tuple[tuple[ExpertPath, float], ...]], ...]
    chosen: tuple[tuple[int, ExpertPath], ...] = ()

    def __attrs_post_init__(self) -> None:
        buckets = [bucket for bucket, _ in self.timings]
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(
                f"expert path plan buckets {buckets} are invalid: allowed are distinct "
                "ascending row counts >= 1, at least one"
            )
        for bucket, times in self.timings:
            if not times or any(path not in EXPERT_PATHS for path, _ in times):
                raise ValueError(
                    f"expert path plan bucket {bucket} times {times} are invalid: allowed are "
                    f"one or more of {EXPERT_PATHS}"
                )
        if self.chosen:
            timed = {bucket: {path for path, _ in times} for bucket, times in self.timings}
            if [bucket for bucket, _ in self.chosen] != buckets or any(
                path not in timed[bucket] for bucket, path in self.chosen
            ):
                raise ValueError(
                    f"expert path plan choice {list(self.chosen)} is invalid: allowed is one "
                    f"timed path for each of the buckets {buckets}"
                )

    @property
    def paths(self) -> dict[int, ExpertPath]:
        """Bucket -> the fastest path (the earlier of `EXPERT_PATHS` on a tie), or the
        recorded choice of a replayed plan."""
        if self.chosen:
            return dict(self.chosen)
        return {
            bucket: min(times, key=lambda item: (item[1], EXPERT_PATHS.index(item[0])))[0]
            for bucket, times in self.timings
        }

    @property
    def microseconds(self) -> dict[int, dict[ExpertPath, float]]:
        return {bucket: dict(times) for bucket, times in self.timings}

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
                {"bucket": bucket, **{path: round(us, 1) for path, us in times}}
                for bucket, times in self.timings
            ],
        }

    @classmethod
    def from_json(cls, data: object, *, where: str) -> ExpertPathPlan:
        """A plan from `to_json`'s form, its choices kept; `where` names the origin in errors."""
        try:
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            timings = tuple(
                (
                    int(entry["bucket"]),
                    tuple(
                        (_path(name, where), float(us))
                        for name, us in entry.items()
                        if name != "bucket"
                    ),
                )
                for entry in data["microseconds"]
            )
            chosen = tuple((int(bucket), _path(path, where)) for bucket, path in data["paths"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{where}: expert paths {data!r} are invalid ({error}): allowed is the form "
                "ExpertPathPlan.to_json writes"
            ) from error
        return cls(timings=timings, chosen=chosen)


def _path(name: object, where: str) -> ExpertPath:
    for path in EXPERT_PATHS:
        if name == path:
            return path
    raise ValueError(f"{where}: expert path {name!r} is unknown: allowed are {EXPERT_PATHS}")


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
    paths: Sequence[ExpertPath] = EXPERT_PATHS,
    rounds: int = _ROUNDS,
    seed: int = 0,
) -> ExpertPathPlan:
    """Each of `paths` timed (best of `rounds`) per bucket's row count, on routed random rows.

    Rows go through the layer's own router so the experts hit (how many, how spread) are
    what this layer's weights produce; the routing itself is the same for both paths and
    is not timed.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} is invalid: allowed is an integer >= 1")
    unknown = [path for path in paths if path not in EXPERT_PATHS]
    if unknown or not paths:
        raise ValueError(
            f"paths={list(paths)} is invalid: allowed are one or more of {EXPERT_PATHS}"
        )
    weight = experts.gate_up
    generator = torch.Generator(device="cpu").manual_seed(seed)
    timings: list[tuple[int, tuple[tuple[ExpertPath, float], ...]]] = []
    with torch.inference_mode():
        for rows in sorted(set(buckets)):
            x = torch.randn(rows, experts.shapes.hidden_size, generator=generator)
            x = x.to(device=weight.device, dtype=weight.dtype)
            routes = route(x)
            times = tuple(
                (path, _best_us(_call(experts, x, routes, path), weight.device, rounds))
                for path in dict.fromkeys(paths)
            )
            timings.append((rows, times))
    return ExpertPathPlan(timings=tuple(timings))

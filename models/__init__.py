"""The model layer: model families, the shared executor, generation and the CLI."""

from __future__ import annotations

from typing import Any


def load_executor(model: Any, **kwargs: Any) -> Any:
    """Build a `ModelExecutor` for `model` in CONSTRUCTED (see `models.llama.executor`).

    With `lanes=N` (N > 1, or any `lane_transport`/`threads_per_lane`) it builds a
    `LaneGroupExecutor` of N lanes instead (see `models.lane_loading`).
    """
    lane_keys = ("lanes", "lane_transport", "threads_per_lane")
    if any(kwargs.get(key) is not None for key in lane_keys) and kwargs.get("lanes") != 1:
        from models.lane_loading import load_lane_group

        kwargs.setdefault("lanes", 1)
        return load_lane_group(model, **{k: v for k, v in kwargs.items() if v is not None})
    for key in lane_keys:
        kwargs.pop(key, None)
    from models.llama.executor import load_executor as _load

    return _load(model, **kwargs)


__all__ = ["load_executor"]

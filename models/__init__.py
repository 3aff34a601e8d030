"""The model layer: model families, the shared executor, generation and the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_executor(model: str | Path, **kwargs: Any) -> Any:
    """Build a `ModelExecutor` for `model` in CONSTRUCTED (see `models.decoder.executor`).

    With `lanes=N > 1` it builds a `LaneGroupExecutor` of N lanes instead (see
    `models.lane_loading`); with one lane the lane arguments are only validated.
    """
    lane_options = {
        key: kwargs.pop(key)
        for key in ("lanes", "lane_transport", "threads_per_lane")
        if key in kwargs
    }
    if any(value is not None for value in lane_options.values()):
        from models.lane_loading import check_lane_arguments, load_lane_group

        options = {key: value for key, value in lane_options.items() if value is not None}
        options.setdefault("lanes", 1)
        options.setdefault("lane_transport", "process")
        if options["lanes"] != 1:
            return load_lane_group(model, **options, **kwargs)
        check_lane_arguments(
            1,
            options["lane_transport"],
            options.get("threads_per_lane"),
            kwargs.get("max_batch_size", 1),
        )
    from models.decoder.executor import load_executor as _load

    return _load(model, **kwargs)


__all__ = ["load_executor"]

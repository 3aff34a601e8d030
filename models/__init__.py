"""The model layer: model families, the shared executor, generation and the CLI."""

from __future__ import annotations

from typing import Any


def load_executor(model: Any, **kwargs: Any) -> Any:
    """Build a `ModelExecutor` for `model` in CONSTRUCTED (see `models.llama.executor`)."""
    from models.llama.executor import load_executor as _load

    return _load(model, **kwargs)


__all__ = ["load_executor"]

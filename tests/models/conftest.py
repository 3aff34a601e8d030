"""Fixtures shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.backends import native_kernels


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No C compiler on PATH and no prebuilt library: the native kernels cannot load."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LLM_RUNTIME_NATIVE_CACHE", str(tmp_path / "native"))
    native_kernels._load.cache_clear()
    yield
    native_kernels._load.cache_clear()

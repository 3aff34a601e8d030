"""The worked example in docs/lifecycle.md runs and its assertions hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_worked_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks, "docs/lifecycle.md lost its python example"
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "EchoHost.resolve_capacity: CONSTRUCTED -> CAPACITY_RESOLVED [ok]" in printed
    assert "(8 slots)" in printed
    assert "EchoHost.close: SERVING -> TERMINAL [ok]" in printed

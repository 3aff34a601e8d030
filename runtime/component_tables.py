"""Where each stateful component's table lives, for `llm-runtime lifecycle diagram`.

Every table is declared beside the class it governs; this index only names them, without
importing their modules (which import torch), so the CLI starts instantly and loads the one
table a command asks for.
"""

from __future__ import annotations

import importlib

from lifecycle.machine import MachineTable

_OWNERS: dict[str, tuple[str, str]] = {
    "kv-cache": ("runtime.paged_kv_cache", "KV_CACHE_TABLE"),
    "program-compiler": ("runtime.program_compiler", "PROGRAM_COMPILER_TABLE"),
    "trace-compiler": ("runtime.trace_compiler", "TRACE_COMPILER_TABLE"),
    "output-read": ("runtime.output_reader", "OUTPUT_READ_TABLE"),
}

COMPONENT_TABLE_NAMES: tuple[str, ...] = tuple(_OWNERS)
"""The component machines, by table name."""


def component_table(name: str) -> MachineTable:
    """The state table called `name`, imported from the module of the class it governs."""
    if name not in _OWNERS:
        raise ValueError(f"unknown component machine {name!r}; choose one of {', '.join(_OWNERS)}")
    module, attribute = _OWNERS[name]
    table = getattr(importlib.import_module(module), attribute)
    assert isinstance(table, MachineTable) and table.name == name, (module, attribute)
    return table

"""The component-table index: every machine loads from the module of the class it governs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.component_tables import COMPONENT_TABLE_NAMES, component_table
from runtime.output_reader import OUTPUT_READ_TABLE
from runtime.paged_kv_cache import KV_CACHE_TABLE
from runtime.program_compiler import PROGRAM_COMPILER_TABLE
from runtime.trace_compiler import TRACE_COMPILER_TABLE


def test_each_name_loads_the_table_declared_beside_its_class() -> None:
    tables = {name: component_table(name) for name in COMPONENT_TABLE_NAMES}
    assert tables == {
        "kv-cache": KV_CACHE_TABLE,
        "program-compiler": PROGRAM_COMPILER_TABLE,
        "trace-compiler": TRACE_COMPILER_TABLE,
        "output-read": OUTPUT_READ_TABLE,
    }


def test_an_unknown_name_lists_the_machines() -> None:
    with pytest.raises(ValueError, match="unknown component machine 'kv'; choose one of kv-cache"):
        component_table("kv")


def test_the_cli_lists_machines_without_importing_torch() -> None:
    code = "import sys, models.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

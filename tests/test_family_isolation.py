"""Nothing outside a model family's own package (and the registry) imports that family.

The shared code (the runtime, the decoder, the CLI, lanes, the vLLM plugin and facade, the
benchmarks) finds families through `models.families`, which discovers every
`models/<name>/family.py`: a new family edits no shared file, and `models/llama` is one
family among others. Imports made only for the type checker count, as do `importlib` calls
with a literal module name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("lifecycle", "runtime", "models", "benchmarks")
REGISTRY = ROOT / "models" / "families.py"


def family_packages() -> set[str]:
    return {path.parent.name for path in (ROOT / "models").glob("*/family.py")}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` names in an import statement or a literal `import_module`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def violations(families: set[str]) -> list[str]:
    out = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == REGISTRY:
                continue
            relative = path.relative_to(ROOT)
            own = (
                relative.parts[1]
                if relative.parts[0] == "models" and len(relative.parts) > 2
                else None
            )
            for module in sorted(imported_modules(path)):
                parts = module.split(".")
                family = parts[1] if len(parts) >= 2 and parts[0] == "models" else None
                if family in families and family != own:
                    out.append(f"{relative} imports {module}")
    return out


def test_the_families_in_the_tree_are_found() -> None:
    assert {"llama", "qwen3"} <= family_packages()


def test_no_shared_module_imports_a_family() -> None:
    assert violations(family_packages()) == []


def test_the_scan_sees_an_import_of_a_family(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from models.llama.config import LlamaArgs\n"
        "import importlib\n"
        "importlib.import_module('models.qwen3.family')\n"
        "if False:\n    import models.llama\n"
    )
    assert imported_modules(probe) >= {
        "models.llama.config",
        "models.llama.config.LlamaArgs",
        "models.qwen3.family",
        "models.llama",
    }


def test_the_registry_finds_every_family_package() -> None:
    from models.families import families

    assert {family.name for family in families()} >= family_packages()

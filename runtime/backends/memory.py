"""How much memory a device can still hand out, for capacity checks before allocating.

The host's figure is the smaller of the kernel's `MemAvailable` and what the cgroup this
process runs in still allows (the out-of-memory killer acts on the cgroup limit); a CUDA
device's is `torch.cuda.mem_get_info`.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

_MEMINFO = Path("/proc/meminfo")
_STATUS = Path("/proc/self/status")
_CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    try:
        for line in _MEMINFO.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    try:
        limit = (_CGROUP / "memory.max").read_text(encoding="ascii").strip()
        if limit == "max":
            return None
        used = int((_CGROUP / "memory.current").read_text(encoding="ascii").strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def available_memory_bytes(device: torch.device | str) -> int | None:
    """Bytes `device` can still allocate, or None when the platform does not say."""
    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(target)
        return int(free)
    if target.type != "cpu":
        return None
    figures = [value for value in (_meminfo_available(), _cgroup_headroom()) if value is not None]
    return min(figures) if figures else None


def peak_resident_bytes() -> int:
    """This process's own peak resident memory (`VmHWM`).

    `ru_maxrss` is not this: a child started by vfork/exec (Python's `subprocess`) inherits
    its parent's peak, so a fresh worker measured that way reports gigabytes it never held.
    """
    try:
        for line in _STATUS.read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def format_bytes(count: int) -> str:
    """A byte count for people: 1.9 GB, 512.0 MB, 64.0 kB."""
    value = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{count} B"

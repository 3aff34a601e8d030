"""What the host CPU can do natively, read once from the OS (simulated in tests).

Why: a kernel that is fast on one CPU is emulated on another. bfloat16 matrix products are
only fast with hardware bf16 arithmetic (`avx512_bf16` or AMX `amx_bf16`); without it torch
converts element by element and a bf16 matmul runs about 100 times slower than float32.
Setting `LLM_RUNTIME_CPU_FLAGS` (space-separated flags) replaces the probe, so a test or a
user can see how the runtime behaves on a CPU without a feature.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import attrs

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FLAGS_ENV = "LLM_RUNTIME_CPU_FLAGS"


class UnsupportedCpuFeatureError(ValueError):
    """A requested mode needs a CPU feature this host lacks (the message names it)."""


@attrs.frozen
class CpuFeatures:
    """The CPU's model name and feature flags, and where they were read from."""

    model: str
    flags: frozenset[str]
    source: str

    @classmethod
    def probe(cls) -> CpuFeatures:
        """The host's features (`LLM_RUNTIME_CPU_FLAGS` overrides /proc/cpuinfo)."""
        simulated = os.environ.get(FLAGS_ENV)
        if simulated is not None:
            return cls("simulated CPU", frozenset(simulated.split()), f"${FLAGS_ENV}")
        model = platform.processor() or platform.machine()
        flags: set[str] = set()
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return cls(model, frozenset(), "unavailable")
        generation: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("cpu family", "model"):
                generation.setdefault(key, value.strip())
            elif key in ("flags", "Features"):
                flags.update(value.split())
        if len(generation) == 2:
            # A VM's model name can be bare ("AMD EPYC"): family and model tell Zen 4 from 5.
            model = f"{model}, family {generation['cpu family']} model {generation['model']}"
        return cls(model, frozenset(flags), "/proc/cpuinfo")

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 matrix products run in hardware."""
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)

    def summary(self, wanted: tuple[str, ...] = ()) -> str:
        """`model (flag, flag, ...)` listing the SIMD flags that matter for kernels."""
        interesting = wanted or (
            "avx2",
            "fma",
            "avx512f",
            "avx512_bf16",
            "avx512_fp16",
            "avx512_vnni",
            "amx_bf16",
            "amx_tile",
        )
        present = [flag for flag in interesting if flag in self.flags]
        return f"{self.model} ({', '.join(present) or 'none of ' + ', '.join(interesting)})"


def require_native_bf16(features: CpuFeatures) -> None:
    """Refuse bfloat16 on a CPU that would emulate it, naming the missing features."""
    if features.native_bf16:
        return
    raise UnsupportedCpuFeatureError(
        f"--dtype bfloat16 needs a CPU with native bfloat16 arithmetic "
        f"({' or '.join(NATIVE_BF16_FLAGS)}); this CPU ({features.model}, flags from "
        f"{features.source}) has neither, so bf16 matrix products would be emulated "
        f"(about 100x slower than float32): use --dtype float32"
    )

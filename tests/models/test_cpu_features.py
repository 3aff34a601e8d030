"""The CPU feature probe and the bf16 refusal on a CPU without native bf16 (simulated)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from models.cli import main
from models.decoder.executor import load_executor
from runtime.backends import cpu_features
from runtime.backends.cpu_features import (
    FLAGS_ENV,
    CpuFeatures,
    UnsupportedCpuFeatureError,
    require_native_bf16,
)

AVX2_ONLY = CpuFeatures("AMD EPYC (simulated)", frozenset({"avx2", "fma", "sse4_2"}), "test")
WITH_BF16 = CpuFeatures("Xeon (simulated)", frozenset({"avx512f", "avx512_bf16"}), "test")
WITH_AMX = CpuFeatures("Xeon (simulated)", frozenset({"amx_bf16", "amx_tile"}), "test")


def test_simulated_flags_replace_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLAGS_ENV, "avx2 fma")
    probed = CpuFeatures.probe()
    assert probed.flags == {"avx2", "fma"} and not probed.native_bf16
    assert probed.source == f"${FLAGS_ENV}"
    monkeypatch.setenv(FLAGS_ENV, "avx2 amx_bf16")
    assert CpuFeatures.probe().native_bf16


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
    reason="reads x86 flags from /proc/cpuinfo (Linux on x86_64)",
)
def test_real_probe_reads_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FLAGS_ENV, raising=False)
    probed = CpuFeatures.probe()
    assert probed.source == "/proc/cpuinfo"
    assert "sse2" in probed.flags  # every x86_64 CPU has it
    assert probed.native_bf16 == bool({"avx512_bf16", "amx_bf16"} & probed.flags)
    text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    family = next(line for line in text.splitlines() if line.startswith("cpu family"))
    # the generation is named: a VM's bare "AMD EPYC" does not tell Zen 4 from Zen 5
    assert f"family {family.partition(':')[2].strip()} model " in probed.model


def test_the_probe_names_family_and_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\n"
        "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n",
        encoding="utf-8",
    )
    real_path = Path

    def fake_path(name: str) -> Path:
        return cpuinfo if name == "/proc/cpuinfo" else real_path(name)

    monkeypatch.delenv(FLAGS_ENV, raising=False)
    monkeypatch.setattr(cpu_features, "Path", fake_path)
    probed = CpuFeatures.probe()
    assert probed.model == "AMD EPYC, family 25 model 17"
    assert probed.summary() == "AMD EPYC, family 25 model 17 (avx2, avx512f)"


def test_bf16_is_refused_naming_the_missing_features() -> None:
    with pytest.raises(UnsupportedCpuFeatureError) as caught:
        require_native_bf16(AVX2_ONLY)
    message = str(caught.value)
    assert "--dtype bfloat16" in message and "avx512_bf16 or amx_bf16" in message
    assert "AMD EPYC (simulated)" in message and "use --dtype float32" in message
    require_native_bf16(WITH_BF16)
    require_native_bf16(WITH_AMX)


def test_load_executor_refuses_bf16_before_loading_weights() -> None:
    with pytest.raises(UnsupportedCpuFeatureError, match="avx512_bf16 or amx_bf16"):
        # a model that does not exist: the refusal must come first, before any loading
        load_executor("/nonexistent/model.gguf", dtype="bfloat16", cpu_features=AVX2_ONLY)


def test_bf16_runs_where_the_cpu_has_it() -> None:
    executor = load_executor("tiny-random", dtype="bfloat16", cpu_features=WITH_BF16)
    try:
        executor.start()
        assert executor.model.dtype == torch.bfloat16
        assert executor.model.kernel_plan is not None
        assert executor.model.kernel_plan.dtype == "bfloat16"
    finally:
        executor.close()


def test_cli_bf16_refusal_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FLAGS_ENV, "avx2 fma")
    status = main(["bringup", "--model", "tiny-random", "--dtype", "bfloat16"])
    assert status == 2
    err = capsys.readouterr().err
    assert "--dtype bfloat16 needs a CPU with native bfloat16" in err
    assert "simulated CPU" in err

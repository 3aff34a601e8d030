"""`--weights stored-int8`: block weights that decode may multiply with int8 activations.

Int8 activations are not bit-equal to float32 ones (`runtime.quant.rounded_activations`), so
warmup offers them only when asked for; then they must still be deterministic within a
process: every trace mode gives the eager tokens, and a recorded plan replays them (lanes
adopt lane 0's plan; a lane geometry with other row buckets may time other forms, so its
tokens are fixed by replaying one plan with `--kernels FILE`). Without VNNI the mode is
refused before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models import load_executor
from models.decoder.kernel_measure import INT8_NOTE
from models.decoder.kernels import KernelPlan, int8_activations_available
from runtime.backends.cpu_features import UnsupportedCpuFeatureError
from tests.integration.test_stored_weights import PROMPTS, _generate, _gguf

needs_vnni = pytest.mark.skipif(
    not int8_activations_available(),
    reason="int8 activations need gcc and a CPU with AVX-512 VNNI (avx512_vnni in lscpu)",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int8-gguf")


def _plan(path: str) -> KernelPlan:
    executor = load_executor(path, max_batch_size=4, weights="stored-int8")
    executor.start()
    plan = executor.model.kernel_plan
    executor.close()
    assert plan is not None
    return plan


@needs_vnni
def test_int8_is_offered_only_when_asked_for(files: Path) -> None:
    path = str(_gguf(files, "Q4_1"))
    asked = _plan(path)
    assert INT8_NOTE in asked.notes
    offered = {form for _, choice in asked.projections for form, _ in choice.candidates}
    assert "q_int8" in offered
    executor = load_executor(path, max_batch_size=4)
    executor.start()
    default = executor.model.kernel_plan
    executor.close()
    assert default is not None and INT8_NOTE not in default.notes
    used = {form for _, choice in default.projections for _, form in choice.forms}
    assert "q_int8" not in used and default.fused_activations != "int8"


@needs_vnni
@pytest.mark.parametrize("trace_mode", ["decode_only", "all"])
def test_trace_modes_give_the_eager_tokens(files: Path, trace_mode: str) -> None:
    path = str(_gguf(files, "Q4_0"))
    eager = _generate(load_executor(path, max_batch_size=4, weights="stored-int8"))
    traced = _generate(
        load_executor(path, max_batch_size=4, weights="stored-int8", trace_mode=trace_mode)
    )
    assert traced == eager and len(eager) == len(PROMPTS)


@needs_vnni
def test_a_recorded_plan_replays_the_same_tokens(files: Path) -> None:
    path = str(_gguf(files, "Q8_0"))
    plan = _plan(path)
    first = _generate(load_executor(path, max_batch_size=4, weights="stored-int8", kernels=plan))
    again = _generate(load_executor(path, max_batch_size=4, weights="stored-int8", kernels=plan))
    assert first == again


def test_without_vnni_the_mode_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import models.decoder.executor as executor_module

    monkeypatch.setattr(executor_module, "int8_activations_available", lambda: False)
    missing = tmp_path / "never-read.gguf"  # refused before the file is looked at
    with pytest.raises(UnsupportedCpuFeatureError, match=r"--weights stored-int8.*AVX-512 VNNI"):
        load_executor(str(missing), weights="stored-int8")

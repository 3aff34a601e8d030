"""Int16 activations for q4 blocks (`q_int16`, the fused stack's "int16" variant).

They are not bit-equal to float32 ones (`runtime.quant.rounded_activations`), so warmup keeps
them only where they measure faster, and the plan records that choice: a recorded plan
replays the same tokens, its JSON keeps every fused variant's time, and a plan naming them
is refused, naming the file, on a CPU that cannot run them (no AVX-512 VNNI).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

import models.decoder.block_forms as block_forms
import models.decoder.kernels as kernels_module
from models import load_executor
from models.decoder.kernels import KernelPlan, KernelPlanError, int16_activations_available
from tests.integration.test_stored_weights import _generate, _gguf

needs_vnni = pytest.mark.skipif(
    not int16_activations_available(),
    reason="int16 activations need gcc and a CPU with AVX-512 VNNI (avx512_vnni in lscpu)",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int16-gguf")


def _plan(path: str) -> KernelPlan:
    executor = load_executor(path, max_batch_size=4)
    executor.start()
    plan = executor.model.kernel_plan
    executor.close()
    assert plan is not None
    return plan


def _with_int16(plan: KernelPlan) -> KernelPlan:
    """`plan` with the int16 form on every q4 projection's decode buckets and the stack."""
    projections = tuple(
        (
            name,
            attrs.evolve(
                choice,
                forms=tuple(
                    (rows, "q_int16" if form in ("q_rows", "q_int16") else form)
                    for rows, form in choice.forms
                ),
            ),
        )
        if choice.blocks in ("Q4_0", "Q4_1")
        else (name, choice)
        for name, choice in plan.projections
    )
    return attrs.evolve(
        plan, projections=projections, fused_decode=(1, 2, 4), fused_activations="int16"
    )


@needs_vnni
def test_warmup_times_int16_and_a_plan_with_it_replays_the_same_tokens(
    files: Path, tmp_path: Path
) -> None:
    path = str(_gguf(files, "Q4_0"))
    recorded = _plan(path)
    offered = {form for _, choice in recorded.projections for form, _ in choice.candidates}
    assert "q_int16" in offered
    variants = {variant for variant, _, _ in recorded.fused_variant_timings}
    assert {"float32", "int16"} <= variants  # both stacks timed, whichever was kept
    plan = _with_int16(recorded)
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(plan.to_json()))
    first = _generate(load_executor(path, max_batch_size=4, kernels=str(file)))
    again = _generate(load_executor(path, max_batch_size=4, kernels=str(file)))
    assert first == again and len(first) == 4
    measured = plan.to_json()["fused_decode"]
    assert isinstance(measured, dict) and measured["activations"] == "int16"
    assert all("fused_int16" in item for item in measured["measured_us"])


def _float_form(rows: int) -> str:
    """The float32 form for a bucket `q_int16` held: `q_rows` where it fits, else `q_gemm`."""
    fits = block_forms.BLOCK_FORMS["q_rows"].fits(rows)
    return "q_rows" if fits else "q_gemm"


@needs_vnni
def test_a_plan_with_int16_is_refused_where_the_cpu_cannot_run_it(
    files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(_gguf(files, "Q4_1"))
    recorded = _plan(path)
    file = tmp_path / "int16-plan.json"
    file.write_text(json.dumps(_with_int16(recorded).to_json()))
    monkeypatch.setattr(kernels_module, "int16_activations_available", lambda: False)
    monkeypatch.setattr(block_forms, "_int16_available", lambda: False)
    monkeypatch.setitem(
        block_forms.BLOCK_FORMS,
        "q_int16",
        attrs.evolve(block_forms.BLOCK_FORMS["q_int16"], available=lambda: False),
    )
    with pytest.raises(KernelPlanError, match=r"int16-plan\.json.*q_int16.*AVX-512 VNNI"):
        load_executor(path, max_batch_size=4, kernels=str(file))
    # Float forms only (the float32 choice of each q_int16 bucket), the stack in int16.
    float_forms = attrs.evolve(
        recorded,
        projections=tuple(
            (
                name,
                attrs.evolve(
                    choice,
                    forms=tuple(
                        (rows, _float_form(rows) if form == "q_int16" else form)
                        for rows, form in choice.forms
                    ),
                ),
            )
            for name, choice in recorded.projections
        ),
    )
    stack_only = attrs.evolve(float_forms, fused_decode=(1,), fused_activations="int16")
    file.write_text(json.dumps(stack_only.to_json()))
    with pytest.raises(KernelPlanError, match=r"int16-plan\.json.*'int16' cannot run here"):
        load_executor(path, max_batch_size=4, kernels=str(file))

"""Kernel choice at warmup: forms agree with F.linear, plans replay exactly, bad plans refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from models.decoder import DecoderModel, random_state_dict
from models.decoder.executor import load_executor
from models.decoder.kernel_measure import measure_projection, pick_storage, row_buckets
from models.decoder.kernels import (
    FORMS,
    KernelPlan,
    KernelPlanError,
    ProjectionChoice,
    load_kernel_plan,
    parse_kernel_plan,
)
from models.decoder.layers import Projection
from models.llama import LlamaArgs

CPU = torch.device("cpu")


def _projection(weight: torch.Tensor, parts: tuple[int, ...]) -> Projection:
    projection = Projection(
        weight.shape[1], weight.shape[0], dtype=weight.dtype, device=CPU, parts=parts
    )
    projection.load(weight)
    return projection


@given(
    fan_in=st.integers(1, 48),
    parts=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    form=st.sampled_from(sorted(FORMS)),
    split=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_form_layout_and_split_equals_linear(
    fan_in: int, parts: list[int], lead: list[int], form: str, split: bool, seed: int
) -> None:
    """Whatever warmup picks, a projection computes F.linear (to float tolerance)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(sum(parts), fan_in, generator=generator)
    x = torch.randn(*lead, fan_in, generator=generator)
    chosen = FORMS[form]
    assume(chosen.available())  # the native form needs a C compiler
    projection = _projection(weight, tuple(parts))
    # Single-row forms serve the 1-row bucket; more rows fall to the next bucket's form.
    multi = "linear" if chosen.layout == "out_in" else "mm_xw"
    forms = ((chosen.max_rows, form), (64, multi)) if chosen.max_rows else ((64, form),)
    projection.apply_choice(ProjectionChoice(chosen.layout, split and len(parts) > 1, forms))
    out = projection(x)
    assert out.shape == (*lead, sum(parts)) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert torch.equal(projection.hf_weight(), weight)  # one copy, any layout
    assert projection.weight.is_contiguous()
    assert projection.layout == chosen.layout
    assert projection.choice is not None and projection.choice.form_for(1) == form


def test_measured_choice_is_consistent_and_exact() -> None:
    """A measured choice uses one layout for all buckets and only forms that fit them."""
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(36, 20, generator=generator) for _ in range(3)]
    buckets = row_buckets(4, 16)
    assert buckets == (1, 2, 4, 16)
    choice, scores = measure_projection(weights, (12, 12, 12), buckets)
    assert set(scores) == {("out_in", False), ("out_in", True), ("in_out", False), ("in_out", True)}
    assert min(scores.values()) >= len(buckets) - 1e-9  # 1.0 per bucket at best
    assert (choice.layout, choice.split) == pick_storage(scores, len(buckets))
    assert [b for b, _ in choice.forms][-1] == 16 and len(choice.microseconds) == len(buckets)
    for bucket, form in choice.forms:
        assert FORMS[form].layout == choice.layout and FORMS[form].fits(bucket)
    projection = _projection(weights[0], (12, 12, 12))
    projection.apply_choice(choice)
    for rows in (1, 2, 3, 4, 9, 16, 40):
        x = torch.randn(rows, 20, generator=generator)
        torch.testing.assert_close(projection(x), F.linear(x, weights[0]), atol=1e-5, rtol=1e-5)


def test_storage_changes_only_for_a_clear_win() -> None:
    """The checkpoint's [out, in] fused storage stays unless another wins by the margin."""
    near = {("out_in", False): 4.15, ("out_in", True): 4.3, ("in_out", False): 4.0}
    assert pick_storage(near, 4) == ("out_in", False)  # 0.15 <= 0.05 x 4 buckets
    clear = {**near, ("in_out", False): 3.9}
    assert pick_storage(clear, 4) == ("in_out", False)  # 0.25 > 0.2
    assert pick_storage({("in_out", True): 2.0, ("in_out", False): 2.5}, 2) == ("in_out", True)


def _model(preset: str = "gqa") -> DecoderModel:
    args = LlamaArgs.tiny_random(preset)
    return DecoderModel.from_state_dict(args, random_state_dict(args, seed=4))


def test_applied_plan_keeps_model_weights_and_logits() -> None:
    """A warmup choice re-lays weights out without changing any canonical tensor."""
    model = _model()
    before = {k: v.clone() for k, v in model.canonical_state_dict().items()}
    record = model.choose_kernels(decode_rows=4, prefill_rows=32)
    assert record["source"] == "measured" and record["buckets"] == [1, 2, 4, 32]
    assert model.choose_kernels(decode_rows=8, prefill_rows=64) == record  # chosen once
    after = model.canonical_state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    for name, modules in model.projection_groups().items():
        assert {m.layout for m in modules} == {record["projections"][name]["layout"]}


def _write_plan(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _opposite(plan: KernelPlan) -> KernelPlan:
    """A plan no measurement would make: every projection in the other layout."""
    flipped = []
    for name, choice in plan.projections:
        fused = name in ("wqkv", "w_gate_up")
        if choice.layout == "out_in":
            flipped.append((name, ProjectionChoice("in_out", fused, ((1, "mv_t"), (64, "mm_xw")))))
        else:
            forms = ((2, "mm_wxt"), (64, "linear"))
            flipped.append((name, ProjectionChoice("out_in", fused, forms)))
    return KernelPlan(
        projections=tuple(flipped),
        decode_attention="gather",
        buckets=plan.buckets,
        source="hand-written",
        dtype=plan.dtype,
        threads=plan.threads,
        cpu=plan.cpu,
    )


def test_replayed_kernels_file_reproduces_the_choice(tmp_path: Path) -> None:
    """`kernels=FILE` applies exactly the recorded plan at warmup, timing nothing."""
    measured = _model()
    measured.choose_kernels(decode_rows=2, prefill_rows=64)
    assert measured.kernel_plan is not None
    # Replay a plan that differs from what this machine measures, so a re-measurement shows.
    recorded = _opposite(measured.kernel_plan)
    coverage_like = {"eager_programs": [], "kernels": recorded.to_json()}
    path = _write_plan(tmp_path, coverage_like)
    executor = load_executor("tiny-random-gqa", max_batch_size=2, kernels=path)
    try:
        executor.start()
        replayed = executor.model.kernel_plan
        assert replayed is not None and replayed.source.startswith("replayed from kernels.json")
        assert replayed.projections == recorded.projections
        assert executor.model.decode_attention == "gather"
        for name, modules in executor.model.projection_groups().items():
            assert all(m.choice == recorded.choice(name) for m in modules)
            assert {m.layout for m in modules} == {recorded.choice(name).layout}
        manifest = executor.coverage_manifest
        assert (
            manifest is not None
            and manifest.kernels["projections"] == recorded.to_json()["projections"]
        )
        compile_entry = [e for e in executor.journal.entries if e.trigger == "compile"][-1]
        assert "kernels replayed from kernels.json" in compile_entry.detail
    finally:
        executor.close()
    # The plan file round-trips exactly (a saved coverage manifest replays the same plan).
    again = load_kernel_plan(path)
    assert again.projections == recorded.projections


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "is not JSON"),
        ({"kernels": {"projections": {}}}, "has version None"),
        ([1, 2], "is not a kernel plan"),
    ],
)
def test_unusable_kernels_file_is_refused_naming_it(
    tmp_path: Path, content: object, message: str
) -> None:
    path = tmp_path / "kernels.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), "utf-8")
    with pytest.raises(KernelPlanError, match=f"--kernels {path}: {message}"):
        load_executor("tiny-random", kernels=path)


def test_kernels_file_for_another_model_or_form_is_refused(tmp_path: Path) -> None:
    model = _model()
    model.choose_kernels(decode_rows=1, prefill_rows=8)
    assert model.kernel_plan is not None
    data = model.kernel_plan.to_json()
    del data["projections"]["w_down"]
    with pytest.raises(KernelPlanError, match=r"covers projections .* allowed are this model's"):
        load_executor("tiny-random", kernels=_write_plan(tmp_path, data))
    data = model.kernel_plan.to_json()
    data["projections"]["wo"] = {"layout": "in_out", "split": False, "forms": [[4, "linear"]]}
    with pytest.raises(KernelPlanError, match="form 'linear' cannot run 4 rows from in_out"):
        load_executor("tiny-random", kernels=_write_plan(tmp_path, data))
    data["projections"]["wo"] = {"layout": "out_in", "split": True, "forms": [[4, "linear"]]}
    with pytest.raises(KernelPlanError, match="wo is split, but this model's wo has one part"):
        load_executor("tiny-random", kernels=_write_plan(tmp_path, data))
    with pytest.raises(KernelPlanError, match="cannot be read"):
        load_executor("tiny-random", kernels=tmp_path / "missing.json")


def test_untimed_candidates_are_null_so_the_plan_is_strict_json() -> None:
    """A block form that does not run a bucket has no time there: the file says null (not
    NaN, which strict JSON readers refuse) and reads back as untimed."""
    model = _model()
    model.choose_kernels(decode_rows=1, prefill_rows=8)
    assert model.kernel_plan is not None
    name, choice = model.kernel_plan.projections[0]
    timed = attrs.evolve(choice, candidates=(("q_rows", (12.34, math.nan)),))
    plan = attrs.evolve(
        model.kernel_plan, projections=((name, timed), *model.kernel_plan.projections[1:])
    )
    text = json.dumps(plan.to_json(), allow_nan=False)
    entry = json.loads(text)["projections"][name]["candidates_us"]
    assert entry == {"q_rows": [12.3, None]}
    again = dict(parse_kernel_plan(json.loads(text), where="here").projections)[name]
    ((form, times),) = again.candidates
    assert form == "q_rows" and times[0] == 12.3 and math.isnan(times[1])
    data = json.loads(text)
    data["projections"][name]["candidates_us"]["q_rows"][0] = "fast"
    with pytest.raises(KernelPlanError, match=r"here: .*candidates_us\.q_rows holds 'fast'"):
        parse_kernel_plan(data, where="here")


def test_parse_rejects_a_single_row_form_for_many_rows() -> None:
    data = {
        "version": 1,
        "decode_attention": "gather",
        "projections": {"wo": {"layout": "out_in", "forms": [[8, "mv"]]}},
    }
    with pytest.raises(KernelPlanError, match="form 'mv' cannot run 8 rows"):
        parse_kernel_plan(data, where="here")


@pytest.mark.skipif(not FORMS["onednn"].available(), reason="torch built without oneDNN")
def test_onednn_form_repacks_after_an_in_place_reload_and_releases_its_copies() -> None:
    """The packed copy follows the weight: an in-place load (sleep/reload writes weights in
    place) is seen at the next call, and a released weight holds no packed bytes."""
    from models.decoder.kernels import packed_bytes, release_packed

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 24, generator=generator)
    projection = _projection(weight, (40,))
    projection.apply_choice(ProjectionChoice("out_in", False, ((64, "onednn"),)))
    x = torch.randn(12, 24, generator=generator)
    torch.testing.assert_close(projection(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    held = packed_bytes([projection.weight])
    assert held >= weight.numel() * 4
    fresh = torch.randn(40, 24, generator=generator)
    with torch.no_grad():
        projection.weight.copy_(fresh)
    torch.testing.assert_close(projection(x), F.linear(x, fresh), atol=1e-5, rtol=1e-5)
    assert (
        packed_bytes([projection.weight]) == held
    )  # repacked in place of the stale copy, not beside it
    release_packed([projection.weight])
    assert packed_bytes([projection.weight]) == held - weight.numel() * 4


def test_a_plan_naming_a_form_this_machine_lacks_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attrs

    import models.decoder.kernels as kernels

    model = _model()
    model.choose_kernels(decode_rows=1, prefill_rows=8)
    assert model.kernel_plan is not None
    data = model.kernel_plan.to_json()
    data["projections"]["wo"] = {"layout": "out_in", "split": False, "forms": [[8, "onednn"]]}
    path = _write_plan(tmp_path, data)
    lacking = attrs.evolve(kernels.FORMS["onednn"], available=lambda: False)
    monkeypatch.setitem(kernels.FORMS, "onednn", lacking)
    with pytest.raises(KernelPlanError, match=r"--kernels .*uses form 'onednn'.*oneDNN"):
        load_executor("tiny-random", kernels=path)

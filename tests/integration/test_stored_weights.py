"""GGUF block weights held as blocks (`--weights stored`): what is kept, what it computes.

Tiny random models are written as GGUF in every type (`tests.gguf_files`); the `q256` preset
has rows of 256 values, so the K types fit. Stored and dequantized (`float32`) loads of the
same file hold the same weight values, so their greedy tokens agree; every trace mode and a
2-lane group agree with eager on the stored weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from models import load_executor
from models.decoder import greedy_generate, load_model, random_state_dict
from models.decoder.fused_decode import FusedDecodeStack, fused_unsupported_reason
from models.decoder.kernels import KernelPlanError, ProjectionChoice, int8_activations_available
from models.decoder.layers import Projection
from models.generation.generator import GenerationParams, Generator
from models.llama import LlamaArgs
from runtime.backends import native_kernels
from tests.gguf_files import MIXED, write_llama_gguf
from tests.models.llama_oracle import full_prefill_logits

ARGS = LlamaArgs.tiny_random("q256")
STORED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
PROMPTS = [[5, 17, 99, 3], [200, 201, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250]]


def _gguf(tmp: Path, qtype: str) -> Path:
    path = tmp / f"tiny-{qtype}.gguf"
    if not path.exists():
        write_llama_gguf(path, ARGS, random_state_dict(ARGS, seed=3), qtype=qtype)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stored-gguf")


def _projections(model: torch.nn.Module) -> list[Projection]:
    return [m for m in model.modules() if isinstance(m, Projection)]


@pytest.mark.parametrize("qtype", [*STORED, MIXED])
def test_block_types_stay_in_blocks_and_give_the_float32_tokens(files: Path, qtype: str) -> None:
    path = _gguf(files, qtype)
    stored = load_model(path, weights="stored")
    dense = load_model(path, weights="float32")
    held = {p.block_source for p in _projections(stored.model)}
    assert "" not in held, held  # every projection in blocks
    assert stored.weights.startswith("stored (stored "), stored.weights
    assert dense.weights == "float32"
    assert all(p.blocks is None for p in _projections(dense.model))
    assert stored.model.weight_bytes() < 0.4 * dense.model.weight_bytes()
    ours = greedy_generate(stored.model, PROMPTS, 12)
    assert ours == greedy_generate(dense.model, PROMPTS, 12)


def test_mixed_file_keeps_q6k_parts_beside_q4k_in_one_fused_projection(files: Path) -> None:
    loaded = load_model(_gguf(files, MIXED), weights="stored")
    layer = loaded.model.layers[0]
    assert layer.wqkv.block_source == "Q4_K+Q6_K"  # v in Q6_K, q and k in Q4_K
    assert layer.wqkv.blocks is not None and len(layer.wqkv.blocks) == 2
    assert layer.w_down.block_source == "Q6_K"


@pytest.mark.parametrize("qtype", [*STORED, MIXED])
def test_the_fused_stack_over_blocks_gives_the_per_op_tokens(files: Path, qtype: str) -> None:
    model = load_model(_gguf(files, qtype), weights="stored").model
    reason = fused_unsupported_reason(model)
    if reason is not None:
        pytest.skip(f"the fused stack cannot run here ({reason}); install gcc")
    per_op = greedy_generate(model, PROMPTS, 12)
    stack = FusedDecodeStack(model, (1, 2, 4), (1, 2, 4))
    calls = []
    logits = stack.logits

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args[2].shape[0])
        return logits(*args)

    stack.logits = counted  # type: ignore[method-assign]
    model.fused_decode = stack
    try:
        fused = greedy_generate(model, PROMPTS, 12)
    finally:
        model.fused_decode = None
    assert calls and max(calls) == len(PROMPTS), calls  # every decode step took the stack
    assert fused == per_op


@pytest.mark.skipif(
    native_kernels.unavailable_reason() is not None
    or not native_kernels.quant_matmul().int16_available,
    reason="int16 and int8 activations need gcc and a CPU with AVX-512 VNNI (avx512_vnni in lscpu)",
)
@pytest.mark.parametrize("form", ["q_int16", "q_int8"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_stack_runs_the_head_in_the_plans_form(files: Path, qtype: str, form: str) -> None:
    """The head as the stack's last stage meets its input as the plan's form for the head
    would: with int16 or int8 activations where that form is `q_int16` or `q_int8` (one
    row), float32 ones otherwise (two rows). Its logits equal the head run in its own call,
    in that form."""
    model = load_model(_gguf(files, qtype), weights="stored").model
    head = model.head_projection
    assert head.blocks is not None
    head.choice = ProjectionChoice(
        layout="out_in", split=False, forms=((1, form), (4, "q_rows")), blocks=qtype
    )
    in_call = FusedDecodeStack(model, (1, 2, 4), (1, 2, 4))
    apart = FusedDecodeStack(model, (1, 2, 4), (1, 2, 4), head_rows=())
    steps: list[torch.Tensor] = []
    decode_rows = model.decode_rows

    def recorded(*args: Any) -> torch.Tensor:
        logits: torch.Tensor = decode_rows(*args)
        steps.append(logits.clone())
        return logits

    model.decode_rows = recorded  # type: ignore[method-assign]
    for prompts in ([PROMPTS[0]], PROMPTS[:2]):
        steps.clear()
        model.fused_decode = in_call
        in_stack = greedy_generate(model, prompts, 6)
        with_head = list(steps)
        steps.clear()
        model.fused_decode = apart
        assert greedy_generate(model, prompts, 6) == in_stack
        assert len(steps) == len(with_head) == 5
        for got, want in zip(with_head, steps, strict=True):
            assert torch.equal(got, want), (got - want).abs().max()


def test_types_without_block_kernels_are_dequantized_and_named(files: Path) -> None:
    loaded = load_model(_gguf(files, "Q5_K"), weights="stored")
    assert "dequantized" in loaded.weights and "Q5_K" in loaded.weights, loaded.weights
    assert all(p.blocks is None for p in _projections(loaded.model))


def test_stored_logits_equal_float32_within_tolerance(files: Path) -> None:
    path = _gguf(files, "Q4_1")
    stored, dense = load_model(path, weights="stored"), load_model(path, weights="float32")
    got = full_prefill_logits(stored.model, PROMPTS[2])
    want = full_prefill_logits(dense.model, PROMPTS[2])
    # Same weight values; only the order of float32 sums differs.
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def _generate(executor: Any, max_new_tokens: int = 10) -> list[tuple[int, ...]]:
    executor.start()
    try:
        params = GenerationParams(max_new_tokens=max_new_tokens)
        return [c.token_ids for c in Generator(executor).generate(PROMPTS, params)]
    finally:
        executor.close()


@pytest.mark.parametrize("trace_mode", ["decode_only", "all"])
def test_trace_modes_give_the_eager_tokens_on_stored_weights(files: Path, trace_mode: str) -> None:
    path = str(_gguf(files, "Q4_0"))
    eager = _generate(load_executor(path, max_batch_size=4))
    traced = _generate(load_executor(path, max_batch_size=4, trace_mode=trace_mode))
    assert traced == eager


def test_two_lanes_give_the_eager_tokens_on_stored_weights(files: Path) -> None:
    path = str(_gguf(files, "Q4_K"))
    eager = _generate(load_executor(path, max_batch_size=4))
    lanes = _generate(load_executor(path, max_batch_size=4, lanes=2, lane_transport="inprocess"))
    assert lanes == eager


def test_a_plan_recorded_on_blocks_is_refused_on_float32_weights(files: Path) -> None:
    path = str(_gguf(files, "Q8_0"))
    executor = load_executor(path, max_batch_size=2)
    executor.start()
    plan = executor.model.kernel_plan
    executor.close()
    assert plan is not None and plan.choice("w_down").blocks == "Q8_0"
    with pytest.raises(KernelPlanError, match=r"planned for Q8_0 blocks.*--weights"):
        load_executor(path, max_batch_size=2, weights="float32", kernels=plan)


def test_weights_argument_is_checked_before_loading() -> None:
    with pytest.raises(ValueError, match=r"weights \(--weights\) must be one of"):
        load_executor("tiny-random", weights="int4")
    with pytest.raises(ValueError, match=r"--weights bfloat16.*--dtype float32"):
        load_executor("tiny-random", weights="bfloat16")
    if int8_activations_available():  # else refused for the CPU first
        with pytest.raises(ValueError, match=r"stored-int8.*tiny_random source with no blocks"):
            load_executor("tiny-random", weights="stored-int8")

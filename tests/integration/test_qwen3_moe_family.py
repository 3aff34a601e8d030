"""Qwen3-MoE on the runtime: checkpoints built with transformers' own Qwen3-MoE classes.

Greedy tokens equal transformers' `generate` for 8 prompts in eager, `decode_only` and `all`
trace modes, with the prefix cache and chunked prefill on, and over 2 lanes; logits agree at
every step within `family_checks.LOGIT_ATOL`, for top-2 (renormalised) and top-1 (not) routing; the
batched and per-row expert paths give the same tokens; warmup records the expert paths in
the kernel plan and a replayed plan reproduces them; `llm-runtime generate --model DIR`
serves the folder with no flag naming the family; a qwen3moe GGUF is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from models.cli import main
from models.decoder.kernels import KernelPlan
from models.decoder.sources import load_model
from models.families import family_for_hf_config
from models.generation import GenerationParams, Generator
from models.qwen3_moe import Qwen3MoeArgs
from models.qwen3_moe.model import EXPERT_NOTE, Qwen3MoeModel
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.family_checks import (
    CHUNK,
    NEW_TOKENS,
    assert_engine_contract_gives_generator_tokens,
    assert_logits_match_at_every_step,
    lane,
    prompts,
)
from tests.models.qwen3_checkpoint import EOS_ID, hf_greedy_batch
from tests.models.qwen3_moe_checkpoint import write_tiny_qwen3_moe


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def top1_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3-moe-top1"
    return write_tiny_qwen3_moe(folder, "qwen3-moe-top1")


@pytest.fixture(scope="module")
def expected(checkpoint: tuple[Path, Any]) -> list[list[int]]:
    return hf_greedy_batch(checkpoint[1], prompts(), NEW_TOKENS)


def test_the_folder_is_recognised_as_qwen3_moe(checkpoint: tuple[Path, Any]) -> None:
    folder, hf = checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert family_for_hf_config(config).name == "qwen3_moe"
    loaded = load_model(folder)
    args = loaded.args
    assert isinstance(args, Qwen3MoeArgs) and args.qk_norm
    assert (args.num_experts, args.top_k, args.moe_ffn_dim) == (8, 2, 32)
    assert args.norm_topk_prob is True
    assert isinstance(loaded.model, Qwen3MoeModel)
    assert loaded.tokenizer is not None and EOS_ID in args.eos_token_ids
    # Expert weights are held once, stacked: transformers' count equals ours and the args'.
    ours = sum(p.numel() for p in loaded.model.parameters())
    assert ours == sum(p.numel() for p in hf.parameters()) == args.parameter_count()


@pytest.mark.parametrize("which", ["top2", "top1"])
def test_logits_match_transformers_at_every_step(
    which: str, checkpoint: tuple[Path, Any], top1_checkpoint: tuple[Path, Any]
) -> None:
    folder, hf = checkpoint if which == "top2" else top1_checkpoint
    model = load_model(folder, with_tokenizer=False).model
    assert isinstance(model.args, Qwen3MoeArgs)
    assert model.args.top_k == (2 if which == "top2" else 1)
    assert_logits_match_at_every_step(folder, hf)


def _expert_note(plan: KernelPlan | None) -> dict[str, Any]:
    assert plan is not None
    notes = [note for note in plan.notes if note.startswith(EXPERT_NOTE)]
    assert len(notes) == 1, plan.notes
    recorded: dict[str, Any] = json.loads(notes[0][len(EXPERT_NOTE) :])
    return recorded


@pytest.mark.parametrize("trace_mode", ["none", "decode_only", "all"])
def test_greedy_tokens_equal_transformers_in_every_trace_mode(
    trace_mode: str, checkpoint: tuple[Path, Any], expected: list[list[int]]
) -> None:
    executor = lane(checkpoint[0], trace_mode)
    try:
        executor.start()
        generator = Generator(executor)  # prefix cache on
        out = generator.generate(prompts(), GenerationParams(max_new_tokens=NEW_TOKENS))
        assert generator.last_stats.prefix_cache_hit_tokens > 0
        assert max(len(p) for p in prompts()) > CHUNK  # chunked prefill ran
        assert [list(c.token_ids) for c in out] == expected
        model = executor.loaded.model
        plan = model.kernel_plan
        assert plan is not None
        assert any(n.startswith("fused decode off: model family 'qwen3_moe'") for n in plan.notes)
        recorded = _expert_note(plan)
        # Every bucket of the plan was timed on both paths, and the choice is in force.
        assert [bucket for bucket, _ in recorded["paths"]] == list(plan.buckets)
        assert all({"batched", "per_row"} <= set(m) for m in recorded["microseconds"])
        in_force = model.expert_path_plan()
        assert in_force is not None
        assert [[b, p] for b, p in in_force.paths.items()] == recorded["paths"]
    finally:
        executor.close()


def test_greedy_tokens_equal_transformers_over_two_lanes(
    checkpoint: tuple[Path, Any], expected: list[list[int]]
) -> None:
    group = lane(checkpoint[0], "decode_only", lanes=2, lane_transport="inprocess")
    try:
        group.start()
        out = Generator(group).generate(prompts(), GenerationParams(max_new_tokens=NEW_TOKENS))
        assert [list(c.token_ids) for c in out] == expected
    finally:
        group.close()


def test_top1_greedy_tokens_equal_transformers(top1_checkpoint: tuple[Path, Any]) -> None:
    folder, hf = top1_checkpoint
    executor = lane(folder, "decode_only")
    try:
        executor.start()
        out = Generator(executor).generate(prompts(), GenerationParams(max_new_tokens=NEW_TOKENS))
        assert [list(c.token_ids) for c in out] == hf_greedy_batch(hf, prompts(), NEW_TOKENS)
    finally:
        executor.close()


@pytest.mark.parametrize("path", ["batched", "per_row"])
def test_batched_and_per_row_expert_paths_give_the_same_tokens(
    path: str, checkpoint: tuple[Path, Any], expected: list[list[int]]
) -> None:
    executor = lane(checkpoint[0], "none")
    try:
        executor.start()
        model = executor.loaded.model
        assert isinstance(model, Qwen3MoeModel)
        for block in model.moe_blocks():
            block.expert_path = path  # forced for every row count: prefill and decode
        out = Generator(executor).generate(prompts(), GenerationParams(max_new_tokens=NEW_TOKENS))
        assert [list(c.token_ids) for c in out] == expected
    finally:
        executor.close()


def test_a_replayed_plan_reproduces_the_expert_paths(checkpoint: tuple[Path, Any]) -> None:
    first = lane(checkpoint[0], "none")
    try:
        first.start()
        plan = first.loaded.model.kernel_plan
    finally:
        first.close()
    recorded = _expert_note(plan)
    # Flip every choice, so only a replay (not a new measurement) can give these paths.
    flipped = [[b, "batched" if p == "per_row" else "per_row"] for b, p in recorded["paths"]]
    note = EXPERT_NOTE + json.dumps({**recorded, "paths": flipped})
    assert plan is not None
    notes = tuple(n for n in plan.notes if not n.startswith(EXPERT_NOTE))
    edited = KernelPlan(**{**_fields(plan), "notes": (*notes, note)})
    second = lane(checkpoint[0], "none", kernels=edited)
    try:
        second.start()
        in_force = second.loaded.model.expert_path_plan()
        assert in_force is not None
        assert [[b, p] for b, p in in_force.paths.items()] == flipped
    finally:
        second.close()


def _fields(plan: KernelPlan) -> dict[str, Any]:
    import attrs

    return {field.name: getattr(plan, field.name) for field in attrs.fields(KernelPlan)}


def test_a_plan_without_expert_paths_is_refused_naming_it(checkpoint: tuple[Path, Any]) -> None:
    first = lane(checkpoint[0], "none")
    try:
        first.start()
        plan = first.loaded.model.kernel_plan
    finally:
        first.close()
    assert plan is not None
    notes = tuple(n for n in plan.notes if not n.startswith(EXPERT_NOTE))
    bare = KernelPlan(**{**_fields(plan), "notes": notes})
    with pytest.raises(ValueError, match="no note starting 'qwen3_moe expert paths: '"):
        lane(checkpoint[0], "none", kernels=bare)


def test_cli_generate_serves_the_folder_with_no_family_flag(
    checkpoint: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, hf = checkpoint
    argv = ["generate", "--model", str(folder), "--block-size", "8", "--prefill-chunk", "32"]
    status = main([*argv, "--prompt", "hello moe", "--max-new-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    completion = next(row for row in rows if "token_ids" in row)
    assert completion["token_ids"] == hf_greedy_batch(hf, [list(b"hello moe")], 8)[0]


def test_a_qwen3moe_gguf_is_refused_naming_the_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gguf

    path = tmp_path / "tiny-qwen3-moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'qwen3moe' \(Qwen3-MoE\) is not supported yet"):
        load_model(path)
    status = main(["generate", "--model", str(path), "--prompt", "x"])
    _, err = capsys.readouterr()
    assert status == 2 and "ffn_gate_exps" in err and "safetensors folder" in err


def test_the_vllm_facade_serves_qwen3_moe_through_the_engine_contract(
    checkpoint: tuple[Path, Any],
) -> None:
    """The generic facade over the folder gives the Generator's tokens through vLLM's
    engine call sequence (`family_checks`)."""
    assert_engine_contract_gives_generator_tokens(checkpoint[0], "Qwen3MoeForCausalLM")

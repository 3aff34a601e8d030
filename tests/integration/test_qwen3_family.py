"""Qwen3 dense on the runtime: a checkpoint built with transformers' own Qwen3 classes.

Greedy tokens equal transformers' `generate` for 8 prompts in eager, `decode_only` and
`all` trace modes, with the prefix cache and chunked prefill on, and over 2 lanes; logits
agree at every step within `family_checks.LOGIT_ATOL`; a GGUF of the same weights (`qwen3`
architecture, written with the `gguf` package) loads and matches the safetensors run;
`llm-runtime generate --model DIR` serves the folder with no flag naming the family.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from models.cli import main
from models.decoder.sources import load_model
from models.families import family_for_hf_config
from models.generation import GenerationParams, Generator
from models.qwen3 import Qwen3Args
from tests.gguf_files import write_llama_gguf
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.family_checks import (
    CHUNK,
    NEW_TOKENS,
    assert_engine_contract_gives_generator_tokens,
    assert_logits_match_at_every_step,
    lane,
    prompts,
)
from tests.models.qwen3_checkpoint import EOS_ID, hf_greedy_batch, write_tiny_qwen3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-tied", "qwen3-tied")


@pytest.fixture(scope="module")
def expected(checkpoint: tuple[Path, Any]) -> list[list[int]]:
    return hf_greedy_batch(checkpoint[1], prompts(), NEW_TOKENS)


def test_the_folder_is_recognised_as_qwen3(checkpoint: tuple[Path, Any]) -> None:
    folder, hf = checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert family_for_hf_config(config).name == "qwen3"
    loaded = load_model(folder)
    args = loaded.args
    assert isinstance(args, Qwen3Args) and args.qk_norm
    assert args.head_dim == 32 != args.dim // args.n_heads  # head_dim from the config
    assert args.rope_theta == hf.config.rope_parameters["rope_theta"] == 1e6
    assert loaded.tokenizer is not None and EOS_ID in args.eos_token_ids


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_logits_match_transformers_at_every_step(
    which: str, checkpoint: tuple[Path, Any], tied_checkpoint: tuple[Path, Any]
) -> None:
    folder, hf = checkpoint if which == "untied" else tied_checkpoint
    model = load_model(folder, with_tokenizer=False).model
    assert model.args.tie_word_embeddings == (which == "tied")
    assert_logits_match_at_every_step(folder, hf)


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
        plan = executor.loaded.model.kernel_plan
        assert plan is not None and any("model family 'qwen3'" in n for n in plan.notes)
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


def test_a_qwen3_gguf_loads_and_matches_the_safetensors_run(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    folder, _ = checkpoint
    from_folder = load_model(folder, with_tokenizer=False)
    path = tmp_path / "tiny-qwen3.gguf"
    state = {name: t.clone() for name, t in from_folder.model.canonical_state_dict().items()}
    write_llama_gguf(path, from_folder.args, state, qtype="F32")
    from_gguf = load_model(path, with_tokenizer=False)
    assert isinstance(from_gguf.args, Qwen3Args)
    assert from_gguf.args.head_dim == from_folder.args.head_dim
    ours = from_gguf.model.canonical_state_dict()
    for name, tensor in from_folder.model.canonical_state_dict().items():
        assert torch.equal(ours[name], tensor), name
    tokens = {}
    for source in (folder, path):
        executor = lane(source, "none")
        try:
            executor.start()
            out = Generator(executor).generate(
                prompts(), GenerationParams(max_new_tokens=NEW_TOKENS)
            )
            tokens[str(source)] = [list(c.token_ids) for c in out]
        finally:
            executor.close()
    assert tokens[str(path)] == tokens[str(folder)]


def test_cli_generate_serves_the_folder_with_no_family_flag(
    checkpoint: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, hf = checkpoint
    argv = ["generate", "--model", str(folder), "--block-size", "8", "--prefill-chunk", "32"]
    status = main([*argv, "--prompt", "hello qwen", "--max-new-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    completion = next(row for row in rows if "token_ids" in row)
    prompt = list(b"hello qwen")
    assert completion["token_ids"] == hf_greedy_batch(hf, [prompt], 8)[0]


def test_cli_refuses_an_unknown_architecture_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mamba"
    folder.mkdir()
    config = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    status = main(["generate", "--model", str(folder), "--prompt", "x"])
    _, err = capsys.readouterr()
    assert status == 2
    assert "model_type='mamba'" in err and "MambaForCausalLM" in err
    assert "registered are" in err and "llama (" in err and "qwen3 (" in err


def test_the_vllm_facade_serves_qwen3_through_the_engine_contract(
    checkpoint: tuple[Path, Any],
) -> None:
    """The generic facade over the folder gives the Generator's tokens through vLLM's
    engine call sequence (`family_checks`)."""
    assert_engine_contract_gives_generator_tokens(checkpoint[0], "Qwen3ForCausalLM")

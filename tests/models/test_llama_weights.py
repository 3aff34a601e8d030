"""Weights: safetensors (single and sharded), GGUF (types, Q/K permutation), validation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.decoder import (
    DecoderModel,
    GGUFFile,
    WeightsError,
    expected_shapes,
    load_gguf,
    load_model,
    load_safetensors,
    random_state_dict,
)
from models.decoder.gguf_weights import unpermute_rope_rows
from models.decoder.weights import LM_HEAD, ModelFileError, check_finite
from models.llama import LlamaArgs
from tests.models.llama_oracle import full_prefill_logits


def _args(preset: str = "gqa") -> LlamaArgs:
    return LlamaArgs.tiny_random(preset)


def test_expected_shapes_cover_every_tensor() -> None:
    untied = expected_shapes(_args("gqa"))
    tied = expected_shapes(_args("mha-tied"))
    assert len(untied) == 2 + 9 * 2 + 1 and LM_HEAD in untied
    assert len(tied) == 2 + 9 * 2 and LM_HEAD not in tied
    assert untied["model.layers.1.self_attn.k_proj.weight"] == (2 * 16, 64)


def test_single_file_safetensors_round_trip(tmp_path: Path) -> None:
    args = _args()
    state = random_state_dict(args, seed=5)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_safetensors(tmp_path, args)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    as_bf16 = load_safetensors(tmp_path, args, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in as_bf16.values())


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    args = _args("mqa")
    state = random_state_dict(args, seed=6)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_safetensors(tmp_path, args)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load_safetensors(tmp_path, args)


def test_base_model_names_without_prefix_are_mapped(tmp_path: Path) -> None:
    args = _args("mha-tied")
    state = random_state_dict(args, seed=1)
    save_file(
        {k.removeprefix("model."): v for k, v in state.items()}, str(tmp_path / "m.safetensors")
    )
    loaded = load_safetensors(tmp_path, args)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_missing_and_misshaped_tensors_are_named(tmp_path: Path) -> None:
    args = _args()
    state = random_state_dict(args)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError) as info:
        load_safetensors(tmp_path, args)
    message = str(info.value)
    assert "1 missing tensor(s): model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight has shape [3, 64], expected [64, 64]" in message
    assert info.value.missing == ("model.layers.1.mlp.up_proj.weight",)
    assert isinstance(info.value, ValueError)
    with pytest.raises(WeightsError, match="up_proj"):
        DecoderModel.from_state_dict(args, state)


def test_unexpected_tensors_are_reported_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = _args("mha-tied")
    state = random_state_dict(args)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied: tolerated
    state["vision_tower.weight"] = torch.ones(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="models.decoder.weights"):
        loaded = load_safetensors(tmp_path, args)
    assert "vision_tower.weight" not in loaded
    assert "1 unexpected tensor(s)" in caplog.text and "vision_tower.weight" in caplog.text


def test_no_pickle_checkpoints(tmp_path: Path) -> None:
    torch.save({"x": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_safetensors(tmp_path, _args())


# ----------------------------------------------------------------------------------- GGUF
def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj/k_proj rows (written independently here)."""
    out, inp = weight.shape
    return weight.reshape(n_heads, 2, out // n_heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def _write_gguf(path: Path, args: LlamaArgs, state: dict[str, torch.Tensor]) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(args.n_layers)
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_vocab_size(args.vocab_size)
    writer.add_eos_token_id(2)
    qtype = gguf.GGMLQuantizationType
    embed = state["model.embed_tokens.weight"].numpy()
    writer.add_tensor(
        "token_embd.weight", gguf.quants.quantize(embed, qtype.Q8_0), raw_dtype=qtype.Q8_0
    )
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if not args.tie_word_embeddings:
        head = state["lm_head.weight"].numpy().astype(np.float16)
        writer.add_tensor("output.weight", head, raw_dtype=qtype.F16)
    for i in range(args.n_layers):
        pre = f"model.layers.{i}."

        def get(name: str, prefix: str = pre) -> np.ndarray:
            return state[prefix + name].numpy()

        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", get("input_layernorm.weight"))
        q = _llama_cpp_permute(get("self_attn.q_proj.weight"), args.n_heads)
        k = _llama_cpp_permute(get("self_attn.k_proj.weight"), args.n_kv_heads)
        writer.add_tensor(blk + "attn_q.weight", q)
        writer.add_tensor(blk + "attn_k.weight", k)
        writer.add_tensor(blk + "attn_v.weight", get("self_attn.v_proj.weight").astype(np.float16))
        writer.add_tensor(blk + "attn_output.weight", get("self_attn.o_proj.weight"))
        writer.add_tensor(blk + "ffn_norm.weight", get("post_attention_layernorm.weight"))
        writer.add_tensor(blk + "ffn_gate.weight", get("mlp.gate_proj.weight"))
        writer.add_tensor(blk + "ffn_up.weight", get("mlp.up_proj.weight"))
        writer.add_tensor(blk + "ffn_down.weight", get("mlp.down_proj.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("preset", ["gqa", "mha-tied"])
def test_gguf_round_trip_undoes_rope_permutation(tmp_path: Path, preset: str) -> None:
    args = _args(preset)
    state = random_state_dict(args, seed=2)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, args, state)
    file = GGUFFile.open(path)
    read_args = file.args()
    assert read_args.tie_word_embeddings == args.tie_word_embeddings
    assert (read_args.n_heads, read_args.n_kv_heads, read_args.head_dim) == (4, args.n_kv_heads, 16)
    loaded = load_gguf(file, read_args).state
    for name, value in state.items():
        tol = 0.0
        if "embed_tokens" in name:  # Q8_0: 8-bit blocks with an fp16 scale
            tol = 0.02 * float(value.abs().max())
        elif "v_proj" in name or name == LM_HEAD:
            tol = 1e-3
        assert (loaded[name] - value).abs().max().item() <= tol, name
    assert read_args.norm_eps == pytest.approx(args.norm_eps)
    same = attrs.evolve(
        read_args, name=args.name, bos_token_id=args.bos_token_id, norm_eps=args.norm_eps
    )
    assert same == args
    # With the embedding as stored (quantized), the model equals one built from the originals.
    reference = dict(state, **{"model.embed_tokens.weight": loaded["model.embed_tokens.weight"]})
    prompt = list(range(3, 40))
    ours = full_prefill_logits(DecoderModel.from_state_dict(read_args, loaded), prompt)
    theirs = full_prefill_logits(DecoderModel.from_state_dict(args, reference), prompt)
    assert (ours - theirs).abs().max().item() < 1e-2


def test_load_model_from_a_gguf_path(tmp_path: Path) -> None:
    args = _args("mqa")
    state = random_state_dict(args, seed=8)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, args, state)
    loaded = load_model(path)
    assert loaded.source.kind == "gguf" and loaded.tokenizer is None
    assert loaded.model.eos_token_ids == (2,)
    weights = loaded.model.canonical_state_dict()
    assert torch.equal(
        weights["model.layers.2.self_attn.k_proj.weight"],
        state["model.layers.2.self_attn.k_proj.weight"],
    )


def test_canonical_state_dict_round_trips_the_fused_layout() -> None:
    for preset in ("gqa", "mqa", "mha-tied"):
        args = _args(preset)
        state = random_state_dict(args, seed=9)
        back = DecoderModel.from_state_dict(args, state).canonical_state_dict()
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state), preset


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(_llama_cpp_permute(weight.numpy(), 8))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rope_rows(permuted, 8), weight)


def test_gguf_misshaped_tensor_is_named(tmp_path: Path) -> None:
    args = _args()
    state = random_state_dict(args)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, args, state)
    file = GGUFFile.open(path)
    wrong = LlamaArgs(**{**_fields(args), "ffn_dim": 96})
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        load_gguf(file, wrong)
    with pytest.raises(FileNotFoundError, match=r"GGUF file .* does not exist"):
        GGUFFile.open(tmp_path / "missing.gguf")


def _fields(args: LlamaArgs) -> dict[str, object]:
    return attrs.asdict(args, recurse=False)


def test_random_state_dict_is_seeded() -> None:
    args = _args()
    a, b = random_state_dict(args, seed=3), random_state_dict(args, seed=3)
    c = random_state_dict(args, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("at", [0, 1_500_000, -1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_in_any_chunk_is_refused(at: int, bad: float) -> None:
    # Rows of 1000: the check goes through this tensor in slices of about 1M values.
    weight = torch.zeros(2_000, 1_000)
    weight.view(-1)[at] = bad
    with pytest.raises(ModelFileError, match=r"tensor 'w' holds 1 NaN or infinite value\(s\)"):
        check_finite({"w": weight, "ok": torch.ones(3)}, source="test")
    for value in (torch.tensor(bad), torch.tensor([1.0, bad])):  # 0-D and 1-D too
        with pytest.raises(ModelFileError, match="not finite"):
            check_finite({"w": value}, source="test")
    check_finite({"w": torch.zeros(2_000, 1_000), "n": torch.tensor(1.0)}, source="test")

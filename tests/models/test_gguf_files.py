"""The GGUF test files: each type loads as written, and each malformed file is malformed as
its docstring says (checked on the raw header, not through the loader under test)."""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
import torch

from models.decoder import GGUFFile, expected_shapes, load_gguf, load_model
from models.decoder import random_state_dict as random_state
from models.decoder.gguf_weights import unpermute_rope_rows
from models.llama import LlamaArgs
from runtime.quant.matrix import QuantizedMatrix
from tests.gguf_files import (
    FILE_TYPES,
    MATRIX_ROLES,
    MIXED,
    BadFile,
    RawHeader,
    RawTensorInfo,
    gguf_arrays,
    llama_cpp_permute,
    read_raw_header,
    tensor_nbytes,
    write_llama_gguf,
    write_misaligned_rows_gguf,
    write_truncated_gguf,
    write_unknown_type_gguf,
)
from tests.quant_encoders import BLOCK_SIZES, decode, encode

Q256 = LlamaArgs.tiny_random("q256")


def test_q256_preset_fits_k_super_blocks() -> None:
    for name, shape in expected_shapes(Q256).items():
        assert shape[-1] % 256 == 0, name


@pytest.mark.parametrize("qtype", FILE_TYPES)
def test_every_type_loads_as_written(tmp_path: Path, qtype: str) -> None:
    state = random_state(Q256, seed=1)
    path = tmp_path / f"{qtype}.gguf"
    types = write_llama_gguf(path, Q256, state, qtype=qtype)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    assert stored == types
    assert all(kind == "F32" for name, kind in stored.items() if "norm" in name)
    file_type = gguf.LlamaFileType(reader.fields["general.file_type"].contents())
    assert file_type.name.removeprefix("MOSTLY_").removesuffix("_S") in (qtype, "ALL_F32")
    file = GGUFFile.open(path)
    args = file.args()
    assert attrs.evolve(args, norm_eps=Q256.norm_eps) == Q256
    loaded = load_gguf(file, args).state
    kept = load_gguf(file, args, weights="stored").state
    # Exactly the stored bytes' dequantization (Q/K rows back in HF order) ...
    arrays = gguf_arrays(Q256, state)
    for name, value in arrays.items():
        kind = types[name]
        expected = value if value.ndim == 1 else decode(encode(value, kind), kind)
        hf = _hf_name(name)
        if "attn_q" in name or "attn_k" in name:
            heads = Q256.n_heads if "attn_q" in name else Q256.n_kv_heads
            expected = unpermute_rope_rows(torch.from_numpy(expected), heads).numpy()
        as_float, as_stored = loaded[hf], kept[hf]
        assert isinstance(as_float, torch.Tensor)
        assert np.array_equal(as_float.numpy(), expected), name
        if isinstance(as_stored, QuantizedMatrix):  # blocks kept: the same values
            as_stored = as_stored.dequantize()
        assert np.array_equal(as_stored.numpy(), expected), name
        # ... and close to the original weights.
        bits = 32 if kind == "F32" else 10 if kind == "F16" else int(kind[1])
        scale = float(state[hf].abs().max())
        assert (as_float - state[hf]).abs().max().item() <= scale * 2.0 ** (1 - bits), name


def _hf_name(gguf_name: str) -> str:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, role, _ = gguf_name.split(".")
    hf = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }[role]
    return f"model.layers.{layer}.{hf}.weight"


def test_mixed_file_mixes_types_within_fused_projections(tmp_path: Path) -> None:
    types = write_llama_gguf(tmp_path / "m.gguf", Q256, random_state(Q256), qtype=MIXED)
    for i in range(Q256.n_layers):
        layer = {role: types[f"blk.{i}.{role}.weight"] for role in MATRIX_ROLES}
        assert layer == {
            "attn_q": "Q4_K",
            "attn_k": "Q4_K",
            "attn_v": "Q6_K",  # fused QKV: Q4_K, Q4_K, Q6_K
            "attn_output": "Q4_K",
            "ffn_gate": "Q4_K",
            "ffn_up": "Q4_K",
            "ffn_down": "Q6_K",
        }
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q4_K", "Q6_K")


def test_embed_qtype_and_overrides(tmp_path: Path) -> None:
    types = write_llama_gguf(
        tmp_path / "o.gguf",
        Q256,
        random_state(Q256),
        qtype="Q4_0",
        embed_qtype="Q8_0",
        overrides={"ffn_up": "Q4_1", "blk.1.attn_k.weight": "Q6_K"},
    )
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_up.weight"] == types["blk.1.ffn_up.weight"] == "Q4_1"
    assert (types["blk.0.attn_k.weight"], types["blk.1.attn_k.weight"]) == ("Q4_0", "Q6_K")
    with pytest.raises(ValueError, match=r"qtype='Q3_K' is unknown"):
        write_llama_gguf(tmp_path / "x.gguf", Q256, random_state(Q256), qtype="Q3_K")


def test_embedded_byte_tokenizer_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_llama_gguf(path, Q256, random_state(Q256), qtype="Q8_0", tokenizer=True)
    loaded = load_model(path)
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode("hi there")
    assert ids == list(b"hi there")
    assert loaded.tokenizer.decode(ids) == "hi there"


def test_q_and_k_rows_are_stored_permuted() -> None:
    args = LlamaArgs.tiny_random("gqa")
    state = random_state(args)
    arrays = gguf_arrays(args, state)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(arrays["blk.0.attn_q.weight"], llama_cpp_permute(q.numpy(), 4))
    assert not torch.equal(torch.from_numpy(arrays["blk.0.attn_q.weight"]), q)
    back = unpermute_rope_rows(torch.from_numpy(arrays["blk.0.attn_k.weight"]), args.n_kv_heads)
    assert torch.equal(back, state["model.layers.0.self_attn.k_proj.weight"])


# ------------------------------------------------------------------------ bad files
def test_truncated_file_ends_inside_its_last_tensor(tmp_path: Path) -> None:
    state = random_state(Q256)
    bad = write_truncated_gguf(tmp_path / "t.gguf", Q256, state, qtype="Q4_K")
    good = tmp_path / "good.gguf"
    write_llama_gguf(good, Q256, state, qtype="Q4_K")
    header, intact = read_raw_header(bad.path), read_raw_header(good)
    assert header.tensors == intact.tensors  # the header is the valid file's
    assert header.file_size < intact.file_size
    last = header.tensor(bad.tensor)
    assert last.type_code == int(gguf.GGMLQuantizationType.Q4_K)
    start = header.data_start + last.data_offset
    assert start < header.file_size < start + tensor_nbytes(last)
    others = [t for t in header.tensors if t.name != bad.tensor]
    assert all(header.data_start + t.data_offset + tensor_nbytes(t) <= start for t in others)


def test_misaligned_file_has_a_row_length_off_the_block(tmp_path: Path) -> None:
    args = LlamaArgs.tiny_random("gqa")
    bad = write_misaligned_rows_gguf(tmp_path / "m.gguf", args, random_state(args))
    header = read_raw_header(bad.path)
    info = header.tensor(bad.tensor)
    values, size = BLOCK_SIZES["Q4_K"]
    assert info.type_code == int(gguf.GGMLQuantizationType.Q4_K)
    cols, rows = info.dims
    assert (rows, cols) == expected_shapes(args)["model.layers.0.self_attn.q_proj.weight"]
    assert cols % values != 0 and (rows * cols) % values == 0
    # The bytes are all there (element count / block * block bytes) and the file is whole.
    assert header.data_start + info.data_offset + rows * cols // values * size <= header.file_size
    assert all(t.type_code == int(gguf.GGMLQuantizationType.Q8_0) for t in _others(header, bad))
    with pytest.raises(ValueError, match="not a multiple of Q4_K block size"):
        gguf.GGUFReader(str(bad.path))  # the reference reader refuses it too
    with pytest.raises(ValueError, match=r"allowed is a block type"):
        write_misaligned_rows_gguf(tmp_path / "x.gguf", Q256, random_state(Q256))


def _others(header: RawHeader, bad: BadFile) -> list[RawTensorInfo]:
    """The matrices other than the bad one."""
    return [t for t in header.tensors if t.dims[1:] and t.name != bad.tensor]


def test_unknown_type_file_names_code_99(tmp_path: Path) -> None:
    state = random_state(Q256)
    bad = write_unknown_type_gguf(tmp_path / "u.gguf", Q256, state)
    good = tmp_path / "good.gguf"
    write_llama_gguf(good, Q256, state, qtype="Q4_0")
    header, intact = read_raw_header(bad.path), read_raw_header(good)
    changed = [(a, b) for a, b in zip(header.tensors, intact.tensors, strict=True) if a != b]
    assert len(changed) == 1
    patched, original = changed[0]
    assert patched.name == bad.tensor == "blk.0.ffn_up.weight"
    assert (patched.type_code, original.type_code) == (99, int(gguf.GGMLQuantizationType.Q4_0))
    assert attrs.evolve(patched, type_code=original.type_code) == original
    assert bad.path.read_bytes()[header.data_start :] == good.read_bytes()[header.data_start :]
    with pytest.raises(ValueError, match="99"):
        gguf.GGMLQuantizationType(99)
    with pytest.raises(ValueError, match=r"code=2 is a known ggml type"):
        write_unknown_type_gguf(tmp_path / "x.gguf", Q256, state, code=2)

"""Tiny llama GGUF files for tests: every weight type, a Q4_K_M-like mix, and malformed files.

Why a module of its own: the loader, the kernels and the CLI tests all need the same files,
written the way llama.cpp's converter writes them (llama.cpp tensor names, Q/K rows permuted,
`[out, in]` matrices stored with `in` as the row length, norms F32). Dimensions of K types
must be multiples of 256: use the `q256` tiny-random preset for those.

The malformed files (`write_truncated_gguf`, `write_misaligned_rows_gguf`,
`write_unknown_type_gguf`) start from a valid file; `read_raw_header` parses a GGUF header
with `struct` alone, since `gguf.GGUFReader` itself refuses two of them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from models.decoder.config import DecoderArgs
from tests.quant_encoders import BLOCK_SIZES, encode

MIXED = "Q4_K_M"
# Every `qtype` `write_llama_gguf` accepts.
FILE_TYPES: tuple[str, ...] = (*BLOCK_SIZES, MIXED)
# llama.cpp's Q4_K_M keeps these in Q6_K (the rest Q4_K): fused projections then mix types.
MIXED_Q6_ROLES: frozenset[str] = frozenset({"attn_v", "ffn_down", "output"})
MATRIX_ROLES: tuple[str, ...] = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
_HF_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
_FILE_TYPE_NAMES: dict[str, str] = {
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K",
    MIXED: "MOSTLY_Q4_K_M",
}
F32Array = npt.NDArray[np.float32]


def llama_cpp_permute(weight: F32Array, n_heads: int) -> F32Array:
    """What llama.cpp's converter does to q_proj/k_proj rows (pairs interleaved per head)."""
    out, inp = weight.shape
    return weight.reshape(n_heads, 2, out // n_heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_architecture(args: DecoderArgs) -> str:
    """The `general.architecture` a file of `args`' family is written with (`llama`, `qwen3`)."""
    return type(args).GGUF_ARCHITECTURES[0] if type(args).GGUF_ARCHITECTURES else "llama"


def gguf_arrays(args: DecoderArgs, state: Mapping[str, torch.Tensor]) -> dict[str, F32Array]:
    """The float32 tensors of a GGUF, by GGUF name, in llama.cpp's layout and order (Q/K rows
    permuted for `llama` only: llama.cpp converts Qwen3 for NeoX rotary, unpermuted)."""
    permute = gguf_architecture(args) == "llama"
    names = dict(_HF_NAMES)
    if args.qk_norm:
        names.update({"attn_q_norm": "self_attn.q_norm.weight"})
        names.update({"attn_k_norm": "self_attn.k_norm.weight"})

    def get(name: str) -> F32Array:
        return state[name].detach().to(torch.float32).cpu().numpy()

    arrays = {"token_embd.weight": get("model.embed_tokens.weight")}
    arrays["output_norm.weight"] = get("model.norm.weight")
    if not args.tie_word_embeddings:
        arrays["output.weight"] = get("lm_head.weight")
    for i in range(args.n_layers):
        for role, hf_name in names.items():
            value = get(f"model.layers.{i}.{hf_name}")
            if role == "attn_q" and permute:
                value = llama_cpp_permute(value, args.n_heads)
            elif role == "attn_k" and permute:
                value = llama_cpp_permute(value, args.n_kv_heads)
            arrays[f"blk.{i}.{role}.weight"] = np.ascontiguousarray(value)
    return arrays


def _role(name: str) -> str:
    """`blk.3.attn_v.weight` -> `attn_v`; `token_embd.weight` -> `token_embd`."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def tensor_types(
    names: list[str],
    qtype: str,
    embed_qtype: str | None = None,
    overrides: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The GGUF type of each tensor name: norms F32, matrices `qtype` (or the Q4_K_M mix),
    embedding and head `embed_qtype` (default: as the matrices), then `overrides` by role
    (`attn_v`) or full name (`blk.0.attn_v.weight`)."""
    if qtype not in FILE_TYPES:
        raise ValueError(f"qtype={qtype!r} is unknown: allowed are {list(FILE_TYPES)}")
    if embed_qtype is not None and embed_qtype not in BLOCK_SIZES:
        raise ValueError(
            f"embed_qtype={embed_qtype!r} is unknown: allowed are {list(BLOCK_SIZES)} or None"
        )
    extra = dict(overrides or {})
    for kind in extra.values():
        if kind not in BLOCK_SIZES:
            raise ValueError(f"overrides type {kind!r} is unknown: allowed are {list(BLOCK_SIZES)}")
    types: dict[str, str] = {}
    for name in names:
        role = _role(name)
        if role.endswith("norm"):
            kind = "F32"
        elif qtype == MIXED:
            kind = "Q6_K" if role in MIXED_Q6_ROLES else "Q4_K"
        else:
            kind = qtype
        if role in ("token_embd", "output") and embed_qtype is not None:
            kind = embed_qtype
        types[name] = extra.get(name, extra.get(role, kind))
    return types


@attrs.frozen
class _Entry:
    """One tensor as handed to `GGUFWriter.add_tensor` (`shape` only for hand-made infos)."""

    name: str
    data: npt.NDArray[Any]
    kind: str
    shape: tuple[int, ...] | None = None


def _entries(arrays: Mapping[str, F32Array], types: Mapping[str, str]) -> list[_Entry]:
    entries = []
    for name, value in arrays.items():
        kind = types[name]
        if value.ndim == 1 and kind != "F32":
            raise ValueError(f"tensor {name} is 1-D: allowed type is F32, not {kind}")
        data = value if value.ndim == 1 else encode(value, kind)
        entries.append(_Entry(name=name, data=data, kind=kind))
    return entries


def _add_metadata(writer: Any, args: DecoderArgs, qtype: str) -> None:
    import gguf

    writer.add_name(args.name)
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
    writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPE_NAMES[qtype]]))
    if args.rope_scaling is not None:
        if args.rope_scaling.kind != "linear":
            raise ValueError(
                f"args.rope_scaling kind {args.rope_scaling.kind!r} is not written: allowed "
                "are None and linear (the GGUF reader takes no other)"
            )
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(args.rope_scaling.factor)
    if args.bos_token_id is not None:
        writer.add_bos_token_id(args.bos_token_id)
    if args.eos_token_ids:
        writer.add_eos_token_id(args.eos_token_ids[0])


def _add_byte_tokenizer(writer: Any, vocab_size: int) -> None:
    """A byte-level BPE without merges: ids 0..255 are the bytes, later ids `<|extra_i|>`."""
    from models.decoder.tokenizer import byte_alphabet

    if vocab_size < 256:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for tokenizer=True: allowed is >= 256 "
            "(one token per byte)"
        )
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - 256)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (vocab_size - 256))  # normal bytes, control rest
    writer.add_add_bos_token(False)


def _write_file(
    path: Path, args: DecoderArgs, entries: list[_Entry], qtype: str, tokenizer: bool
) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), gguf_architecture(args))
    _add_metadata(writer, args, qtype)
    if tokenizer:
        _add_byte_tokenizer(writer, args.vocab_size)
    for entry in entries:
        raw = None if entry.kind in ("F32", "F16") else gguf.GGMLQuantizationType[entry.kind]
        writer.add_tensor(entry.name, entry.data, raw_shape=entry.shape, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_llama_gguf(
    path: str | Path,
    args: DecoderArgs,
    state: Mapping[str, torch.Tensor],
    *,
    qtype: str,
    embed_qtype: str | None = None,
    overrides: Mapping[str, str] | None = None,
    tokenizer: bool = False,
) -> dict[str, str]:
    """Write `state` (HF names, e.g. from `random_state_dict(args)`) as a loadable llama GGUF.

    `qtype` is one of `FILE_TYPES` (`"Q4_K_M"`: Q6_K for `MIXED_Q6_ROLES`, Q4_K elsewhere);
    see `tensor_types` for `embed_qtype` and `overrides`. `tokenizer=True` embeds a
    byte-level vocabulary. Returns the type written for each GGUF tensor name.
    """
    arrays = gguf_arrays(args, state)
    types = tensor_types(list(arrays), qtype, embed_qtype, overrides)
    _write_file(Path(path), args, _entries(arrays, types), qtype, tokenizer)
    return types


# ------------------------------------------------------------------------ raw header
@attrs.frozen
class RawTensorInfo:
    """One tensor info of a GGUF header, with the file positions of its fields.

    `dims` are in ggml order (`dims[0]` is the row length); `data_offset` is relative to
    the data section; `dims_at` and `type_at` are absolute byte positions in the file.
    """

    name: str
    dims: tuple[int, ...]
    type_code: int
    data_offset: int
    dims_at: int
    type_at: int


@attrs.frozen
class RawHeader:
    """A GGUF header parsed with `struct` alone (works where `gguf.GGUFReader` refuses)."""

    version: int
    tensors: tuple[RawTensorInfo, ...]
    data_start: int
    file_size: int

    def tensor(self, name: str) -> RawTensorInfo:
        for info in self.tensors:
            if info.name == name:
                return info
        raise KeyError(f"tensor {name!r} is not in the header: it has {self.names}")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


# GGUF metadata value type -> struct format of a scalar (8 string, 9 array handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"


def _read(handle: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = handle.read(size)
    if len(data) != size:
        raise ValueError(f"GGUF header ends early at byte {handle.tell()}")
    return struct.unpack("<" + fmt, data)[0]


def _read_string(handle: IO[bytes]) -> str:
    length = _read(handle, "Q")
    return handle.read(length).decode("utf-8")


def _read_value(handle: IO[bytes], kind: int) -> Any:
    if kind in _SCALARS:
        return _read(handle, _SCALARS[kind])
    if kind == 8:
        return _read_string(handle)
    if kind == 9:
        item_kind, count = _read(handle, "I"), _read(handle, "Q")
        return [_read_value(handle, item_kind) for _ in range(count)]
    raise ValueError(f"GGUF metadata value type {kind} is unknown")


def read_raw_header(path: str | Path) -> RawHeader:
    """Parse the header and tensor infos of the GGUF at `path` (no tensor data is read)."""
    with Path(path).open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file")
        version = _read(handle, "I")
        n_tensors, n_kv = _read(handle, "Q"), _read(handle, "Q")
        alignment = 32
        for _ in range(n_kv):
            key = _read_string(handle)
            value = _read_value(handle, _read(handle, "I"))
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            name = _read_string(handle)
            n_dims = _read(handle, "I")
            dims_at = handle.tell()
            dims = tuple(_read(handle, "Q") for _ in range(n_dims))
            type_at = handle.tell()
            type_code, offset = _read(handle, "I"), _read(handle, "Q")
            infos.append(RawTensorInfo(name, dims, type_code, offset, dims_at, type_at))
        end = handle.tell()
    data_start = (end + alignment - 1) // alignment * alignment
    return RawHeader(version, tuple(infos), data_start, os.path.getsize(path))


def tensor_nbytes(info: RawTensorInfo) -> int:
    """Bytes of a tensor's data (its element count over the block, times the block bytes)."""
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.type_code)]
    return int(np.prod(info.dims)) // values * size


# ------------------------------------------------------------------------ bad files
@attrs.frozen
class BadFile:
    """A malformed GGUF fixture: where it is, which tensor is wrong, and how."""

    path: Path
    tensor: str
    detail: str


def write_truncated_gguf(
    path: str | Path,
    args: DecoderArgs,
    state: Mapping[str, torch.Tensor],
    *,
    qtype: str = "Q4_0",
    keep: float = 0.5,
) -> BadFile:
    """A file cut short inside its last tensor's data.

    Made by writing a valid file with `write_llama_gguf`, then truncating it (`os.truncate`)
    so that only the fraction `keep` of the data of the tensor stored last remains. The
    header is intact, so only a reader that checks each tensor's end against the file size
    notices. The last tensor is a quantized matrix (`blk.<last>.ffn_down.weight`).
    """
    if not 0.0 < keep < 1.0:
        raise ValueError(f"keep={keep} is invalid: allowed is a fraction in (0, 1)")
    file = Path(path)
    write_llama_gguf(file, args, state, qtype=qtype)
    header = read_raw_header(file)
    last = max(header.tensors, key=lambda t: t.data_offset)
    start = header.data_start + last.data_offset
    cut = start + int(tensor_nbytes(last) * keep)
    os.truncate(file, cut)
    detail = f"{last.name} starts at byte {start}, needs {tensor_nbytes(last)}; file cut at {cut}"
    return BadFile(path=file, tensor=last.name, detail=detail)


def write_misaligned_rows_gguf(
    path: str | Path,
    args: DecoderArgs,
    state: Mapping[str, torch.Tensor],
    *,
    tensor: str = "blk.0.attn_q.weight",
    qtype: str = "Q4_K",
    rest: str = "Q8_0",
) -> BadFile:
    """A file whose `tensor` is stored as `qtype` although its row length is no multiple of
    the type's block (e.g. the `gqa` preset's 64-wide rows as Q4_K, block 256).

    The shape is the model's (so only the block check can catch it) and the byte count is
    the element count over the block times the block bytes, the rows flattened into valid
    blocks. `GGUFWriter` would refuse such a shape from a byte array, so the tensor goes in
    with its logical shape given as `raw_shape` and its bytes viewed as float32, which the
    writer passes through unchecked. The other matrices are `rest`.
    """
    arrays = gguf_arrays(args, state)
    if tensor not in arrays or arrays[tensor].ndim != 2:
        raise ValueError(f"tensor={tensor!r} is invalid: allowed is a 2-D GGUF tensor name")
    value = arrays[tensor]
    values = BLOCK_SIZES[qtype][0]
    if value.shape[1] % values == 0 or value.size % values or qtype in ("F32", "F16"):
        raise ValueError(
            f"tensor {tensor} {list(value.shape)} as qtype={qtype!r}: allowed is a block type "
            "whose block divides the element count but not the row length"
        )
    entries = _entries(arrays, tensor_types(list(arrays), rest))
    raw = encode(value.reshape(-1, values), qtype).reshape(-1)
    if raw.size % 4:
        raise ValueError(f"qtype={qtype!r}: its bytes are not a whole number of float32")
    bad = _Entry(name=tensor, data=raw.view(np.float32), kind=qtype, shape=value.shape)
    entries = [bad if e.name == tensor else e for e in entries]
    file = Path(path)
    _write_file(file, args, entries, rest, tokenizer=False)
    detail = f"{tensor} has rows of {value.shape[1]}; {qtype} blocks hold {values}"
    return BadFile(path=file, tensor=tensor, detail=detail)


def write_unknown_type_gguf(
    path: str | Path,
    args: DecoderArgs,
    state: Mapping[str, torch.Tensor],
    *,
    tensor: str = "blk.0.ffn_up.weight",
    qtype: str = "Q4_0",
    code: int = 99,
) -> BadFile:
    """A file whose `tensor` declares the ggml type `code`, which no ggml type has.

    Made by writing a valid `qtype` file, then overwriting the 4-byte type field of that
    tensor's info in the header (position from `read_raw_header`). Sizes and offsets are
    untouched: the data is still the `qtype` bytes.
    """
    import gguf

    if code in {int(t) for t in gguf.GGMLQuantizationType}:
        raise ValueError(f"code={code} is a known ggml type: allowed is an unused code")
    file = Path(path)
    write_llama_gguf(file, args, state, qtype=qtype)
    info = read_raw_header(file).tensor(tensor)
    with file.open("r+b") as handle:
        handle.seek(info.type_at)
        handle.write(struct.pack("<I", code))
    return BadFile(path=file, tensor=tensor, detail=f"{tensor} has type code {code}")

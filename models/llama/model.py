"""The Llama-family tensor model with paged attention (implements `PagedModel`).

Each layer's KV cache is K and V of shape `[num_blocks, n_kv_heads, block_size, head_dim]`,
owned by the caller and bound with `set_kv_cache`. Addressing is computed once per call and
shared by all layers: writes and gathers go through one flat row index into the cache viewed
as `[num_blocks * n_kv_heads * block_size, head_dim]`, so no layer loops over batch rows.
Q/K/V and gate/up projections are stored fused, one matrix each; how every projection is
computed (form, layout, fused or split) is chosen by measurement at warmup
(`choose_kernels`, `models.llama.kernels`). The dynamic decode attends with a native kernel
that reads K/V pages in place (`decode_attention`), or gathers them when it cannot run.

Two implementations of decode and prefill share the layers:

* dynamic (default on CPU): reads values on the host to do the least work (only the keys up to
  the longest row, only the active rows). Fastest on CPU; cannot be captured as a CUDA graph.
* graph-safe (`models.llama.graph_safe`): no host synchronisation, shapes fixed by the input
  shapes (whole page-table width, every row). It is used when `uses_graph_safe_path()`: the
  `graph_safe` attribute when set, otherwise automatically on CUDA, so eager and captured CUDA
  calls run the same code and agree bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.llama.attention_layout import GROUP_COST_KEYS, KeyGroup, PackedChunk, plan_key_groups
from models.llama.config import LlamaArgs
from models.llama.graph_safe import (
    Addressing,
    flat_cache_rows,
    prefix_then_causal_mask,
    static_decode,
    static_prefill,
    stream_capturing,
)
from models.llama.kernels import (
    KernelPlan,
    ProjectionShape,
    check_plan_fits,
    fixed_plan,
    measure_kernel_plan,
    parse_kernel_plan,
    row_buckets,
)
from models.llama.layers import DecoderLayer, Projection, rope_tables
from models.llama.weights import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    layer_name,
    validate_state_dict,
)
from runtime.backends import native_kernels
from runtime.model_contract import AttentionMetadata, KVCache, PagedAttentionConfig

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


class LlamaModel(nn.Module):
    """Llama-architecture decoder over a caller-owned paged KV cache.

    With a tied head there is one matrix, stored in the head's layout (`lm_head`); token
    embeddings are looked up in its `[vocab, dim]` view.

    `graph_safe`: None (default) picks the graph-safe decode/prefill on CUDA and the dynamic
    one elsewhere; True or False forces one (tests force True on CPU).

    `decode_attention`: how the dynamic decode attends: "paged_inplace" (a native kernel
    reads K/V pages where they are), "gather" (pages copied into a workspace, then SDPA), or
    None (default): in place when the native kernel is available. The kernel plan chosen at
    warmup sets it (`choose_kernels`).
    """

    graph_safe: bool | None
    decode_attention: str | None
    # Dynamic decode: cost of one more attention group, in row-key units (`plan_key_groups`).
    group_cost: int = GROUP_COST_KEYS

    def __init__(
        self,
        args: LlamaArgs,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        paged_attention: PagedAttentionConfig | None = None,
    ) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype={dtype} is not supported: allowed are {[str(d) for d in SUPPORTED_DTYPES]}"
            )
        self.args = args
        self.dtype = dtype
        self.device = torch.device(device)
        kw: dict[str, Any] = {"dtype": dtype, "device": self.device}
        self.embed_tokens: nn.Embedding | None = None
        if not args.tie_word_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(args, dtype, self.device) for _ in range(args.n_layers)
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps, **kw)
        self.lm_head = Projection(args.dim, args.vocab_size, **kw)
        self.requires_grad_(False)
        self._init_kernel_state()
        cos, sin = rope_tables(args, dtype)
        self._rope_cos = cos.to(self.device)
        self._rope_sin = sin.to(self.device)
        self._paged: PagedAttentionConfig | None = None
        self._kv_cache: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
        # Reused K/V gather buffers of the dynamic decode (see `_grouped_decode_attention`).
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # Optional device-sampling module a family executor attaches (the runtime reads it).
        self.sampling: Any = None
        self.graph_safe = None
        if paged_attention is not None:
            self.configure_paged_attention(
                block_size=paged_attention.block_size,
                max_num_blocks=paged_attention.max_num_blocks,
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state_dict(
        cls,
        args: LlamaArgs,
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        paged_attention: PagedAttentionConfig | None = None,
        consume: bool = False,
    ) -> LlamaModel:
        """Build a model from canonical (HF-named) tensors; validates names and shapes.

        Parameters may share storage with `state_dict` where no conversion is needed. With
        `consume=True` (the caller hands the dict over) entries are released as they are
        used, so re-laying out the weights never holds two copies of all of them at once.
        """
        tensors = validate_state_dict(args, state_dict)
        if consume:
            assert isinstance(state_dict, dict)
            state_dict.clear()
        with torch.device("meta"):
            model = cls(args, dtype=dtype, device="meta")
        model.device = torch.device(device)
        model._init_kernel_state()
        cos, sin = rope_tables(args, dtype)
        model._rope_cos = cos.to(model.device)
        model._rope_sin = sin.to(model.device)

        def get(name: str) -> torch.Tensor:
            value = tensors.pop(name) if consume else tensors[name]
            return value.to(device=model.device, dtype=dtype)

        def param(value: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(value.contiguous(), requires_grad=False)

        if model.embed_tokens is not None:
            model.embed_tokens.weight = param(get(EMBED))
            model.lm_head.load(get(LM_HEAD))
        else:
            model.lm_head.load(get(EMBED))
        model.norm.weight = param(get(FINAL_NORM))
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            layer.input_layernorm.weight = param(get(layer_name(i, "input_layernorm.weight")))
            layer.post_attention_layernorm.weight = param(
                get(layer_name(i, "post_attention_layernorm.weight"))
            )
            layer.wqkv.load(
                torch.cat(
                    [get(layer_name(i, f"self_attn.{p}_proj.weight")) for p in ("q", "k", "v")]
                )
            )
            layer.wo.load(get(layer_name(i, "self_attn.o_proj.weight")))
            layer.w_gate_up.load(
                torch.cat([get(layer_name(i, f"mlp.{p}_proj.weight")) for p in ("gate", "up")])
            )
            layer.w_down.load(get(layer_name(i, "mlp.down_proj.weight")))
        if paged_attention is not None:
            model.configure_paged_attention(
                block_size=paged_attention.block_size,
                max_num_blocks=paged_attention.max_num_blocks,
            )
        return model

    def embedding_matrix(self) -> torch.Tensor:
        """The `[vocab, dim]` token embeddings (a view of the head's matrix when tied)."""
        if self.embed_tokens is not None:
            return self.embed_tokens.weight.detach()
        return self.lm_head.hf_weight()

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under canonical (HF) names as views, split back from the fused ones."""
        args = self.args
        q_out = args.n_heads * args.head_dim
        kv_out = args.n_kv_heads * args.head_dim
        out = {EMBED: self.embedding_matrix(), FINAL_NORM: self.norm.weight.detach()}
        if not args.tie_word_embeddings:
            out[LM_HEAD] = self.lm_head.hf_weight()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            q, k, v = torch.split(layer.wqkv.hf_weight(), [q_out, kv_out, kv_out])
            gate, up = layer.w_gate_up.hf_weight().chunk(2)
            out[layer_name(i, "input_layernorm.weight")] = layer.input_layernorm.weight.detach()
            out[layer_name(i, "self_attn.q_proj.weight")] = q
            out[layer_name(i, "self_attn.k_proj.weight")] = k
            out[layer_name(i, "self_attn.v_proj.weight")] = v
            out[layer_name(i, "self_attn.o_proj.weight")] = layer.wo.hf_weight()
            out[layer_name(i, "post_attention_layernorm.weight")] = (
                layer.post_attention_layernorm.weight.detach()
            )
            out[layer_name(i, "mlp.gate_proj.weight")] = gate
            out[layer_name(i, "mlp.up_proj.weight")] = up
            out[layer_name(i, "mlp.down_proj.weight")] = layer.w_down.hf_weight()
        return out

    # ------------------------------------------------------------------------- kernels
    def _init_kernel_state(self) -> None:
        self.decode_attention = None
        self.kernel_plan: KernelPlan | None = None
        self._replay_plan: KernelPlan | None = None

    def projection_groups(self) -> dict[str, list[Projection]]:
        """Every projection by kind (one per layer; `lm_head` once), in a fixed order."""
        groups: dict[str, list[Projection]] = {}
        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                groups.setdefault(name, []).append(getattr(layer, name))
        groups["lm_head"] = [self.lm_head]
        return groups

    def projection_shapes(self) -> dict[str, ProjectionShape]:
        """Each projection kind's geometry (what a kernel plan must cover)."""
        return {
            name: ProjectionShape(m[0].in_features, m[0].out_features, m[0].parts, len(m))
            for name, m in self.projection_groups().items()
        }

    def replay_kernels(self, plan: KernelPlan, *, where: str = "kernels") -> None:
        """Use `plan` at warmup instead of measuring; checked against this model now.

        `where` names the plan's origin in errors (the CLI passes `--kernels FILE`).
        """
        check_plan_fits(plan, self.projection_shapes(), where)
        if plan.decode_attention == "paged_inplace":
            reason = self._inplace_unavailable()
            if reason is not None:
                raise ValueError(
                    f"{where}: decode_attention 'paged_inplace' cannot run here ({reason}): "
                    "allowed here is 'gather'"
                )
        self._replay_plan = plan

    def adopt_kernels(self, data: Mapping[str, Any]) -> None:
        """Replay another lane's kernel plan (its JSON), checked against this model now."""
        self.replay_kernels(parse_kernel_plan(data, where="lane 0's kernel plan"))

    def choose_kernels(self, *, decode_rows: int, prefill_rows: int) -> dict[str, Any]:
        """Warmup's hook: measure (or replay) the kernel plan, apply it, return its JSON.

        Measures each projection at the row buckets of a lane of `decode_rows` slots and
        prefill chunks of `prefill_rows` tokens (`kernels.measure_kernel_plan`). Once a plan
        is applied, later calls return it unchanged.
        """
        if self.kernel_plan is None:
            buckets = row_buckets(decode_rows, prefill_rows)
            self.apply_kernel_plan(self._resolve_kernel_plan(buckets))
        assert self.kernel_plan is not None
        return self.kernel_plan.to_json()

    def _resolve_kernel_plan(self, buckets: Sequence[int]) -> KernelPlan:
        if self._replay_plan is not None:
            return self._replay_plan
        attention, notes = self._attention_choice()
        if self.device.type != "cpu":
            source = f"fixed ({self.device.type}: F.linear, nothing timed)"
            return fixed_plan(
                self, buckets=buckets, attention=attention, source=source, notes=notes
            )
        return measure_kernel_plan(self, buckets=buckets, attention=attention, notes=notes)

    def _inplace_unavailable(self) -> str | None:
        """Why the in-place paged decode attention cannot run for this model, or None."""
        if self.device.type != "cpu":
            return f"the native kernel is CPU-only, the model is on {self.device.type}"
        return native_kernels.unavailable_reason()

    def _attention_choice(self) -> tuple[str, tuple[str, ...]]:
        if self.decode_attention is not None:
            return self.decode_attention, ("decode attention set by the caller",)
        reason = self._inplace_unavailable()
        if reason is None:
            return "paged_inplace", ()
        return "gather", (f"in-place paged attention unavailable: {reason}",)

    def apply_kernel_plan(self, plan: KernelPlan) -> None:
        """Lay every projection out and pick its forms as `plan` says (checked first)."""
        check_plan_fits(plan, self.projection_shapes(), f"kernel plan ({plan.source})")
        for name, modules in self.projection_groups().items():
            choice = plan.choice(name)
            for module in modules:
                module.apply_choice(choice)
        self.decode_attention = plan.decode_attention
        self.kernel_plan = plan
        logger.info("%s", plan.summary())

    def _decodes_in_place(self) -> bool:
        attention = self.decode_attention
        if attention is None:
            attention = "paged_inplace" if self._inplace_unavailable() is None else "gather"
        return attention == "paged_inplace"

    # ------------------------------------------------------------- contract: metadata
    @property
    def n_layers(self) -> int:
        return self.args.n_layers

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.args.eos_token_ids

    @property
    def paged_attention_config(self) -> PagedAttentionConfig | None:
        return self._paged

    @property
    def kv_cache(self) -> KVCache | None:
        """The bound (borrowed) cache, or None."""
        return self._kv_cache

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of each K and V tensor for `num_blocks` blocks (needs a paged config)."""
        paged = self._require_paged("kv_cache_shape")
        return (num_blocks, self.args.n_kv_heads, paged.block_size, self.args.head_dim)

    def attention_metadata(self) -> Sequence[AttentionMetadata]:
        meta = AttentionMetadata(
            kv_cache_dtype=self.dtype,
            n_kv_heads=self.args.n_kv_heads,
            head_dim=self.args.head_dim,
            paged_attention_config=self._paged,
            n_local_kv_heads=self.args.n_kv_heads,
        )
        return tuple(meta for _ in range(self.args.n_layers))

    def configure_paged_attention(self, *, block_size: int, max_num_blocks: int) -> None:
        """Set every layer's paged geometry; not allowed to disagree with a bound cache."""
        for name, value in (("block_size", block_size), ("max_num_blocks", max_num_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} is invalid: allowed is a positive integer")
        if self._kv_cache is not None:
            bound_blocks, _, bound_block_size, _ = self._kv_cache[0][0].shape
            if bound_block_size != block_size or bound_blocks > max_num_blocks:
                raise RuntimeError(
                    f"configure_paged_attention(block_size={block_size}, max_num_blocks="
                    f"{max_num_blocks}) conflicts with the bound cache (block_size "
                    f"{bound_block_size}, {bound_blocks} blocks): call set_kv_cache(None) first"
                )
        self._paged = PagedAttentionConfig(block_size=block_size, max_num_blocks=max_num_blocks)

    def set_kv_cache(self, cache: KVCache | None) -> None:
        """Bind (or with None unbind) the per-layer K/V tensors; all-or-nothing.

        Every layer's K and V must be `[num_blocks, n_kv_heads, block_size, head_dim]`, the
        model dtype and device, and contiguous; nothing changes unless all of them are.
        """
        if cache is None:
            self._kv_cache = None
            return
        paged = self._require_paged("set_kv_cache")
        if isinstance(cache, torch.Tensor) or not isinstance(cache, Sequence):
            raise TypeError(
                f"cache must be a sequence of (K, V) pairs, one per layer, got "
                f"{type(cache).__name__}"
            )
        if len(cache) != self.args.n_layers:
            raise ValueError(
                f"cache has {len(cache)} layer(s): allowed is exactly n_layers={self.args.n_layers}"
            )
        expected_tail = (self.args.n_kv_heads, paged.block_size, self.args.head_dim)
        num_blocks: int | None = None
        bound: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, pair in enumerate(cache):
            if isinstance(pair, torch.Tensor) or len(pair) != 2:
                raise ValueError(f"cache[{i}] must be a (K, V) pair")
            for which, tensor in zip("KV", pair, strict=True):
                where = f"cache[{i}].{which}"
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
                shape = tuple(tensor.shape)
                if len(shape) != 4 or shape[1:] != expected_tail:
                    raise ValueError(
                        f"{where} has shape {list(shape)}: allowed is [num_blocks, "
                        f"{expected_tail[0]}, {expected_tail[1]}, {expected_tail[2]}] "
                        "([num_blocks, n_kv_heads, block_size, head_dim])"
                    )
                if num_blocks is None:
                    num_blocks = shape[0]
                if shape[0] != num_blocks or not 0 < shape[0] <= paged.max_num_blocks:
                    raise ValueError(
                        f"{where} has {shape[0]} blocks: allowed is the same count in every "
                        f"layer ({num_blocks}), between 1 and max_num_blocks="
                        f"{paged.max_num_blocks}"
                    )
                if tensor.dtype != self.dtype:
                    raise ValueError(
                        f"{where} has dtype {tensor.dtype}: allowed is the model's KV dtype "
                        f"{self.dtype}"
                    )
                if tensor.device != self.device:
                    raise ValueError(
                        f"{where} is on {tensor.device}: allowed is the model device {self.device}"
                    )
                if not tensor.is_contiguous():
                    raise ValueError(f"{where} is not contiguous: allowed are contiguous tensors")
            bound.append((pair[0], pair[1]))
        self._kv_cache = tuple(bound)
        logger.debug("bound KV cache: %d layers x %s blocks", len(bound), num_blocks)

    def iter_executor_named_modules(self) -> Iterator[tuple[str, Any]]:
        """Every submodule with its qualified name (the root excluded)."""
        for name, module in self.named_modules():
            if name:
                yield name, module

    # ------------------------------------------------------------------ forward pieces
    def _require_paged(self, caller: str) -> PagedAttentionConfig:
        if self._paged is None:
            raise RuntimeError(
                f"{caller} needs paged attention: call configure_paged_attention(block_size=..., "
                "max_num_blocks=...) first"
            )
        return self._paged

    def _require_cache(self, caller: str) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        if self._kv_cache is None:
            raise RuntimeError(f"{caller} needs a bound KV cache: call set_kv_cache(cache) first")
        return self._kv_cache

    def uses_graph_safe_path(self) -> bool:
        """Whether `decode`/`prefill` run the graph-safe implementation.

        The `graph_safe` attribute decides when set; otherwise it is True exactly when the model
        lives on CUDA, so every CUDA call (eager, CUDA-graph warm-up and capture) shares one
        implementation and traced results equal eager ones bit for bit, while CPU keeps the
        faster dynamic path.
        """
        if self.graph_safe is not None:
            return self.graph_safe
        return self.device.type == "cuda"

    @staticmethod
    def _check_page_table_layout(page_table: torch.Tensor, batch: int) -> None:
        """Shape and dtype only: reads no values, so it is legal inside a capture."""
        if page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(
                f"page_table has shape {list(page_table.shape)}: allowed is [{batch}, W]"
            )
        if page_table.dtype.is_floating_point or page_table.dtype == torch.bool:
            raise ValueError(
                f"page_table has dtype {page_table.dtype}: allowed is an integer dtype"
            )

    def _check_page_table(self, page_table: torch.Tensor, batch: int, num_blocks: int) -> None:
        self._check_page_table_layout(page_table, batch)
        if page_table.numel():
            low, high = int(page_table.min()), int(page_table.max())
            if low < -1 or high >= num_blocks:
                raise ValueError(
                    f"page_table has entries in [{low}, {high}]: allowed are -1 (unmapped) and "
                    f"block ids in [0, {num_blocks})"
                )

    def _flat_rows(
        self, blocks: torch.Tensor, offsets: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Flat cache rows for (block, offset) pairs, one per KV head: shape `[..., kv]`."""
        return flat_cache_rows(
            blocks, offsets, n_kv_heads=self.args.n_kv_heads, block_size=block_size
        )

    def _token_writes(
        self, block: torch.Tensor, pos: torch.Tensor, bs: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Cache writes of tokens at positions `pos` on pages `block` (`-1`: unmapped, skipped).

        Returns `(write_rows, write_index)` for `Addressing`: the writing tokens (None when
        all of them write) and their flat cache rows.
        """
        mapped = block >= 0
        if bool(mapped.all()):
            return None, self._flat_rows(block, pos % bs, bs).reshape(-1)
        rows = mapped.nonzero().squeeze(1)
        return rows, self._flat_rows(block[rows], pos[rows] % bs, bs).reshape(-1)

    def _key_rows(
        self, page_table: torch.Tensor, n_keys: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat cache rows `[B, kv, n_keys]` of positions `0..n_keys-1`, and which are mapped.

        Exactly `n_keys` keys (not whole blocks) keep the gather and attention minimal.
        """
        kv = self.args.n_kv_heads
        key_pos = torch.arange(n_keys, device=page_table.device)
        pages = page_table[:, key_pos // block_size]  # [B, n_keys]
        mapped = pages >= 0
        heads = torch.arange(kv, device=pages.device).view(1, kv, 1)
        rows = (pages.clamp(min=0).unsqueeze(1) * kv + heads) * block_size + key_pos % block_size
        return rows, mapped

    @staticmethod
    def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` `[B, kv, L]` of a flattened cache as `[B, kv, L, head_dim]`.

        `index_select` copies whole rows and is about twice as fast as advanced indexing.
        """
        return flat.index_select(0, index.view(-1)).view(*index.shape, flat.shape[-1])

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.args.head_dim // 2
        return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)

    def _attention_block(
        self,
        layer: DecoderLayer,
        cache: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        addressing: Addressing,
        *,
        use_cache_for_chunk: bool,
        key_groups: Sequence[KeyGroup] | None = None,
        packed: PackedChunk | None = None,
        last_only: bool = False,
        paged_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention for `h` `[B, S, dim]`: write K/V, attend, project. Returns `[B, S, dim]`.

        With `paged_keys` (`(pages, n_keys)`, dynamic decode) the native kernel reads each
        row's keys from its pages in place; with `key_groups` (dynamic decode) each group of
        rows attends to its own gathered keys. With `packed` (dynamic prefill) `h` is
        `[N, dim]`: see `_packed_prefill_attention`.
        """
        n_q, hd = self.args.n_heads, self.args.head_dim
        q, k, v = self._project_and_write(layer, cache, h, cos, sin, addressing)
        if paged_keys is not None:
            folded = q.reshape(q.shape[0], self.args.n_kv_heads, n_q // self.args.n_kv_heads, hd)
            attended = native_kernels.paged_decode_attention().unchecked(
                folded, cache[0], cache[1], paged_keys[0], paged_keys[1], hd**-0.5
            )
            return layer.attention_out(attended.to(q.dtype).reshape(q.shape[0], 1, n_q * hd))
        if key_groups is not None:
            out = self._grouped_decode_attention(q, cache, key_groups)
            return layer.attention_out(out.reshape(q.shape[0], 1, n_q * hd))
        if packed is not None:
            return self._packed_prefill_attention(
                layer, cache, q, k, v, addressing, packed, last_only=last_only
            )
        batch, seq, _ = h.shape
        if use_cache_for_chunk:
            assert addressing.gather_index is not None
            keys = self._gather(cache[0].view(-1, hd), addressing.gather_index)
            values = self._gather(cache[1].view(-1, hd), addressing.gather_index)
        else:
            keys, values = self._chunk_keys(cache, k, v, addressing)
        n_kv = self.args.n_kv_heads
        if seq == 1 and n_q != n_kv and addressing.any_writer is not None:
            # Graph-safe decode attends over the whole page-table width: fold each KV head's
            # query group into the query axis, so no backend repeats K/V per query head.
            out = F.scaled_dot_product_attention(
                q.reshape(batch, n_kv, n_q // n_kv, hd), keys, values, attn_mask=addressing.mask
            )
            return layer.attention_out(out.reshape(batch, 1, n_q * hd))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=addressing.mask,
            is_causal=addressing.mask is None,
            enable_gqa=n_q != n_kv,
        )
        return layer.attention_out(out.transpose(1, 2).reshape(batch, seq, n_q * hd))

    def _project_and_write(
        self,
        layer: DecoderLayer,
        cache: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        addressing: Addressing,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of `h` `[..., dim]` (rotary applied) as `[..., heads, hd]`; writes K/V."""
        args = self.args
        n_q, n_kv, hd = args.n_heads, args.n_kv_heads, args.head_dim
        qkv = layer.wqkv(h).view(*h.shape[:-1], n_q + 2 * n_kv, hd)
        qk = self._rope(qkv[..., : n_q + n_kv, :], cos, sin)
        q = qk[..., :n_q, :]
        k = qk[..., n_q:, :]
        v = qkv[..., n_q + n_kv :, :]
        k_flat = cache[0].view(-1, hd)
        v_flat = cache[1].view(-1, hd)
        k_tokens = k.reshape(-1, n_kv, hd)
        v_tokens = v.reshape(-1, n_kv, hd)
        if addressing.write_rows is not None:
            k_tokens = k_tokens.index_select(0, addressing.write_rows)
            v_tokens = v_tokens.index_select(0, addressing.write_rows)
        if addressing.write_index.numel():
            k_new = k_tokens.reshape(-1, hd)
            v_new = v_tokens.reshape(-1, hd)
            if addressing.any_writer is not None:
                # Graph-safe calls: when no row may write, every write stores back the
                # value already there (shapes stay fixed; the cache stays bit-identical).
                index = addressing.write_index
                k_new = torch.where(addressing.any_writer, k_new, k_flat.index_select(0, index))
                v_new = torch.where(addressing.any_writer, v_new, v_flat.index_select(0, index))
            k_flat.index_copy_(0, addressing.write_index, k_new)
            v_flat.index_copy_(0, addressing.write_index, v_new)
        return q, k, v

    def _chunk_keys(
        self,
        cache: tuple[torch.Tensor, torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        addressing: Addressing,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's keys and values `[B, kv, P + S, hd]`: the cached prefix
        (`addressing.gather_index`, P keys, when there is one) then the chunk's `[B, S]`."""
        keys = k.transpose(1, 2)
        values = v.transpose(1, 2)
        if addressing.gather_index is None:
            return keys, values
        hd = self.args.head_dim
        prefix_k = self._gather(cache[0].view(-1, hd), addressing.gather_index)
        prefix_v = self._gather(cache[1].view(-1, hd), addressing.gather_index)
        return torch.cat((prefix_k, keys), dim=2), torch.cat((prefix_v, values), dim=2)

    def _packed_prefill_attention(
        self,
        layer: DecoderLayer,
        cache: tuple[torch.Tensor, torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        addressing: Addressing,
        packed: PackedChunk,
        *,
        last_only: bool,
    ) -> torch.Tensor:
        """Attention of a packed chunk's `[N, heads, hd]` Q/K/V on its padded `[B, S]` layout.

        Returns `[N, dim]`, or with `last_only` `[B, dim]` for each row's last real token
        (its query alone; the K/V of every token are already written).
        """
        n_q, n_kv, hd = self.args.n_heads, self.args.n_kv_heads, self.args.head_dim
        batch, seq = packed.batch, packed.seq
        keys, values = self._chunk_keys(cache, packed.pad(k), packed.pad(v), addressing)
        gqa = n_q != n_kv
        if last_only:
            last_q = q.index_select(0, packed.last).unsqueeze(2)  # [B, n_q, 1, hd]
            out = F.scaled_dot_product_attention(
                last_q, keys, values, attn_mask=packed.last_mask, enable_gqa=gqa
            )
            return layer.attention_out(out.reshape(batch, n_q * hd))
        out = F.scaled_dot_product_attention(
            packed.pad(q).transpose(1, 2),
            keys,
            values,
            attn_mask=addressing.mask,
            is_causal=addressing.mask is None,
            enable_gqa=gqa,
        )
        return layer.attention_out(packed.take(out.transpose(1, 2).reshape(batch * seq, n_q * hd)))

    def _grouped_decode_attention(
        self,
        q: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        key_groups: Sequence[KeyGroup],
    ) -> torch.Tensor:
        """Decode attention of `q` `[B, 1, n_q, hd]` group by group; returns `[B, kv, g, hd]`.

        Each group gathers only the key tiles its longest row needs (see `_decode_key_groups`)
        into a reused workspace (a fresh multi-megabyte tensor per layer costs page faults on
        every call), and folds each KV head's query group into the query axis so SDPA reads
        K/V once per KV head instead of once per query head.
        """
        args = self.args
        n_q, n_kv, hd = args.n_heads, args.n_kv_heads, args.head_dim
        folded = q.reshape(q.shape[0], n_kv, n_q // n_kv, hd)
        k_cache, v_cache = cache
        tile = k_cache.shape[2] * hd
        k_tiles = k_cache.view(-1, tile)
        v_tiles = v_cache.view(-1, tile)
        assert self._workspace is not None
        k_space, v_space = self._workspace
        outs = []
        for group in key_groups:
            rows = group.end - group.start
            index = group.gather_index.view(-1)
            size = index.shape[0] * tile
            keys = torch.index_select(k_tiles, 0, index, out=k_space[:size].view(-1, tile))
            values = torch.index_select(v_tiles, 0, index, out=v_space[:size].view(-1, tile))
            outs.append(
                F.scaled_dot_product_attention(
                    folded[group.start : group.end],
                    keys.view(rows, n_kv, -1, hd),
                    values.view(rows, n_kv, -1, hd),
                    attn_mask=group.mask,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _ensure_workspace(self, elements: int) -> None:
        """Grow (never shrink) the flat K and V gather buffers to `elements` values each."""
        if self._workspace is not None and self._workspace[0].shape[0] >= elements:
            return
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        self._workspace = (torch.empty(elements, **kw), torch.empty(elements, **kw))

    def _run_layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        addressing: Addressing,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        *,
        use_cache_for_chunk: bool,
        key_groups: Sequence[KeyGroup] | None = None,
        packed: PackedChunk | None = None,
        paged_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder stack. With `packed` (dynamic prefill) returns only each row's last
        token `[B, dim]`: the last layer writes every token's K/V but attends, projects and
        runs its MLP for those tokens alone (no later layer needs the others)."""
        x = F.embedding(tokens, self.embedding_matrix())
        cos = self._rope_cos[positions].unsqueeze(-2)
        sin = self._rope_sin[positions].unsqueeze(-2)
        final = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            assert isinstance(layer, DecoderLayer)
            last_only = packed is not None and i == final
            attended = self._attention_block(
                layer,
                layer_cache,
                layer.input_layernorm(x),
                cos,
                sin,
                addressing,
                use_cache_for_chunk=use_cache_for_chunk,
                key_groups=key_groups,
                packed=packed,
                last_only=last_only,
                paged_keys=paged_keys,
            )
            if last_only:
                assert packed is not None
                x = x.index_select(0, packed.last)
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits.float()

    # ---------------------------------------------------------------- contract: prefill
    def _prefill_inputs(
        self,
        caller: str,
        tokens: torch.Tensor,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        chunk_start: torch.Tensor,
    ) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], int, tuple[torch.Tensor, ...]]:
        """Shape checks (no value reads) and the inputs as long tensors on the model device.

        Returns `(cache, block_size, (tokens, pages, lens, start))`.
        """
        cache = self._require_cache(caller)
        paged = self._require_paged(caller)
        if tokens.dim() != 2:
            raise ValueError(f"tokens has shape {list(tokens.shape)}: allowed is [B, S]")
        batch, seq = tokens.shape
        if seq == 0:
            raise ValueError("tokens has 0 columns: allowed is a chunk of at least one token")
        for name, value in (("prompt_lens", prompt_lens), ("chunk_start", chunk_start)):
            if value.shape != (batch,):
                raise ValueError(f"{name} has shape {list(value.shape)}: allowed is [{batch}]")
        self._check_page_table_layout(page_table, batch)
        device = self.device
        converted = tuple(
            value.to(device=device, dtype=torch.long)
            for value in (tokens, page_table, prompt_lens, chunk_start)
        )
        return cache, paged.block_size, converted

    def _prefill_extent(
        self, lens: torch.Tensor, start: torch.Tensor, seq: int, bs: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate chunk starts and lengths on the host; `(real, start, end)` per row.

        `real` counts each row's real tokens in this chunk; rows without any read from 0.
        """
        if bool((start < 0).any()):
            raise ValueError(f"chunk_start={start.tolist()} is invalid: allowed are values >= 0")
        real = (lens - start).clamp(min=0, max=seq)  # real tokens of each row in this chunk
        # Rows with nothing to do in this chunk (padding, or prompt already done) read nothing.
        start = torch.where(real > 0, start, torch.zeros_like(start))
        end = start + real
        if bool((end > self.max_seq_len).any()):
            raise ValueError(
                f"prompt positions up to {int(end.max()) - 1} exceed max_seq_len="
                f"{self.max_seq_len}: allowed are positions < max_seq_len"
            )
        needed = int(((end + bs - 1) // bs).max())
        if needed > width:
            raise ValueError(
                f"page_table is too narrow: width {width}, but a row needs {needed} block(s) "
                f"of {bs} tokens"
            )
        return real, start, end

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        *,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        chunk_start: torch.Tensor,
    ) -> torch.Tensor:
        """Run a padded chunk `[B, S]`; write its real tokens' K/V; last-token logits `[B, V]`.

        With `uses_graph_safe_path()` the inputs are validated on the host (skipped while a
        CUDA graph is being captured) and `prefill_graph_safe` computes.
        """
        cache, bs, (tokens, pages, lens, start) = self._prefill_inputs(
            "prefill", tokens, page_table, prompt_lens, chunk_start
        )
        num_blocks = cache[0][0].shape[0]
        batch, seq = tokens.shape
        width = pages.shape[1]
        if self.uses_graph_safe_path():
            if not stream_capturing(self.device):
                self._check_page_table(pages, batch, num_blocks)
                self._prefill_extent(lens, start, seq, bs, width)
            return self._prefill_static(cache, bs, tokens, pages, lens, start)
        self._check_page_table(pages, batch, num_blocks)
        real, start, _ = self._prefill_extent(lens, start, seq, bs, width)
        live = real > 0
        if bool(live.all()):
            return self._prefill_packed(cache, bs, tokens, pages, real, start)
        out = torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=self.device)
        if bool(live.any()):
            rows = live.nonzero().squeeze(1)
            out[rows] = self._prefill_packed(
                cache, bs, tokens[rows], pages[rows], real[rows], start[rows]
            )
        return out

    def _prefill_packed(
        self,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        bs: int,
        tokens: torch.Tensor,
        pages: torch.Tensor,
        real: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        """Dynamic prefill of rows that each have `real` (>= 1) tokens from `start`.

        Why packed: a planner chunk is padded to a bucket shape (a row's last 8 tokens can
        arrive as a `[1, 256]` chunk), so the projections and MLPs, most of the work, run on
        the `N` real tokens only; attention uses the `[B, longest]` padded layout. The last
        layer computes only each row's last token past its K/V write (all the logits need).
        """
        device = self.device
        batch = tokens.shape[0]
        seq = int(real.max())
        cols = torch.arange(seq, device=device)
        positions = start.unsqueeze(1) + cols  # [B, S]
        chunk_ok = cols.unsqueeze(0) < real.unsqueeze(1)  # [B, S]: real tokens
        is_real = chunk_ok.reshape(-1)
        scatter = None if bool(is_real.all()) else is_real.nonzero().squeeze(1)
        # Cached prefix: positions < chunk_start, read from the cache.
        prefix = int(start.max())
        gather_index: torch.Tensor | None = None
        mask: torch.Tensor | None = None  # no prefix: SDPA's own causal path (half the work)
        last_mask = None if scatter is None else chunk_ok.view(batch, 1, 1, seq)
        if prefix:
            gather_index, page_ok = self._key_rows(pages, prefix, bs)
            key_pos = torch.arange(prefix, device=device)
            prefix_ok = (key_pos.unsqueeze(0) < start.unsqueeze(1)) & page_ok  # [B, P]
            mask = prefix_then_causal_mask(prefix_ok, seq)
            last_mask = torch.cat((prefix_ok, chunk_ok), dim=1).view(batch, 1, 1, -1)
        chunk = PackedChunk(
            scatter=scatter,
            batch=batch,
            seq=seq,
            last=torch.cumsum(real, 0) - 1,  # each row's last real token in packed order
            last_mask=last_mask,
        )
        token_ids = chunk.take(tokens[:, :seq].reshape(-1))
        token_pos = chunk.take(positions.reshape(-1))
        block = chunk.take(
            pages.gather(1, positions.clamp(max=pages.shape[1] * bs - 1) // bs).reshape(-1)
        )
        write_rows, write_index = self._token_writes(block, token_pos, bs)
        addressing = Addressing(
            write_rows=write_rows, write_index=write_index, gather_index=gather_index, mask=mask
        )
        hidden = self._run_layers(
            token_ids, token_pos, addressing, cache, use_cache_for_chunk=False, packed=chunk
        )
        return self._logits(hidden)

    @torch.inference_mode()
    def prefill_graph_safe(
        self,
        tokens: torch.Tensor,
        *,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        chunk_start: torch.Tensor,
    ) -> torch.Tensor:
        """`prefill` without host reads or data-dependent shapes: what a CUDA graph records.

        Input values are not validated (shapes and dtypes are); out-of-range values are
        clamped, never read out of bounds. Attention covers the whole page-table width.
        """
        cache, bs, (tokens, pages, lens, start) = self._prefill_inputs(
            "prefill_graph_safe", tokens, page_table, prompt_lens, chunk_start
        )
        return self._prefill_static(cache, bs, tokens, pages, lens, start)

    def _static_limits(self, bs: int) -> dict[str, int]:
        """The geometry and ranges the graph-safe planners clamp against."""
        return {
            "n_kv_heads": self.args.n_kv_heads,
            "block_size": bs,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
        }

    def _prefill_static(
        self,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        bs: int,
        tokens: torch.Tensor,
        pages: torch.Tensor,
        lens: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        batch = tokens.shape[0]
        if pages.shape[1] == 0:
            raise ValueError("page_table has 0 columns: the graph-safe prefill needs W >= 1")
        plan = static_prefill(tokens, pages, lens, start, **self._static_limits(bs))
        hidden = self._run_layers(
            plan.tokens, plan.positions, plan.addressing, cache, use_cache_for_chunk=False
        )
        last_hidden = hidden[torch.arange(batch, device=tokens.device), plan.last]
        logits = self._logits(last_hidden)
        return logits.masked_fill((~plan.has_tokens).unsqueeze(1), 0.0)

    # ----------------------------------------------------------------- contract: decode
    def _decode_inputs(
        self, caller: str, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], int, tuple[torch.Tensor, ...]]:
        """Shape checks (no value reads) and `(cache, block_size, (tokens, pos, pages))`."""
        cache = self._require_cache(caller)
        paged = self._require_paged(caller)
        if tokens.dim() != 1:
            raise ValueError(f"tokens has shape {list(tokens.shape)}: allowed is [B]")
        batch = tokens.shape[0]
        if positions.shape != (batch,):
            raise ValueError(f"positions has shape {list(positions.shape)}: allowed is [{batch}]")
        self._check_page_table_layout(page_table, batch)
        device = self.device
        converted = tuple(
            value.to(device=device, dtype=torch.long) for value in (tokens, positions, page_table)
        )
        return cache, paged.block_size, converted

    def _check_decode_extent(self, pos: torch.Tensor, width: int, bs: int) -> int:
        """Host check of active positions `pos` (non-empty): below max_seq_len, pages to hold
        them. Returns the highest position."""
        top = int(pos.max())
        if top >= self.max_seq_len:
            raise ValueError(
                f"positions up to {top} exceed max_seq_len={self.max_seq_len}: allowed are "
                "positions < max_seq_len"
            )
        n_blocks = top // bs + 1
        if n_blocks > width:
            raise ValueError(
                f"page_table is too narrow: width {width}, but position {top} needs "
                f"{n_blocks} block(s) of {bs} tokens"
            )
        return top

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        """One token per row at `positions` (negative = inactive); logits `[B, V]`.

        Inactive rows read zero logits and write nothing. With `uses_graph_safe_path()` the
        inputs are validated on the host (skipped while a CUDA graph is being captured) and
        `decode_graph_safe` computes.
        """
        cache, bs, (tokens, pos, pages) = self._decode_inputs(
            "decode", tokens, positions, page_table
        )
        batch = tokens.shape[0]
        num_blocks = cache[0][0].shape[0]
        device = self.device
        if self.uses_graph_safe_path():
            if not stream_capturing(device):
                self._check_page_table(pages, batch, num_blocks)
                live = pos[pos >= 0]
                if live.numel():
                    self._check_decode_extent(live, pages.shape[1], bs)
            return self._decode_static(cache, bs, tokens, pos, pages)
        self._check_page_table(pages, batch, num_blocks)
        active = pos >= 0
        if not bool(active.any()):
            return torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=device)
        all_active = bool(active.all())
        if not all_active:
            rows = active.nonzero().squeeze(1)
            tokens, pos, pages = tokens[rows], pos[rows], pages[rows]
        self._check_decode_extent(pos, pages.shape[1], bs)
        if self._decodes_in_place():
            logits = self._decode_in_place(cache, bs, tokens, pos, pages)
        else:
            logits = self._decode_gathered(cache, bs, tokens, pos, pages)
        if all_active:
            return logits
        out = torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=device)
        out[rows] = logits
        return out

    def _decode_in_place(
        self,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        bs: int,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        pages: torch.Tensor,
    ) -> torch.Tensor:
        """Active rows' decode with attention reading K/V pages in place (no sort, no gather)."""
        hidden = self._run_layers(
            tokens.unsqueeze(1),
            pos.unsqueeze(1),
            self._decode_writes(pages, pos, bs),
            cache,
            use_cache_for_chunk=True,
            paged_keys=(pages.contiguous(), pos + 1),
        )
        return self._logits(hidden[:, 0])

    def _decode_gathered(
        self,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        bs: int,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        pages: torch.Tensor,
    ) -> torch.Tensor:
        """Active rows' decode with attention over key tiles gathered per row group."""
        # Attention groups rows of similar length: sort the rows by position (undone on the
        # last hidden state); already-sorted batches (batch 1 included) keep their order.
        order: torch.Tensor | None = None
        if pos.shape[0] > 1 and bool((pos[1:] < pos[:-1]).any()):
            order = torch.argsort(pos, stable=True)
            tokens, pos, pages = tokens[order], pos[order], pages[order]
        hidden = self._run_layers(
            tokens.unsqueeze(1),
            pos.unsqueeze(1),
            self._decode_writes(pages, pos, bs),
            cache,
            use_cache_for_chunk=True,
            key_groups=self._decode_key_groups(pages, pos, order, bs),
        )
        last = hidden[:, 0]
        if order is not None:
            last = torch.empty_like(last).index_copy_(0, order, last)
        return self._logits(last)

    def _decode_writes(self, pages: torch.Tensor, pos: torch.Tensor, bs: int) -> Addressing:
        """Where each decode row writes its new K/V (the dynamic paths read no other rows)."""
        block = pages.gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
        write_rows, write_index = self._token_writes(block, pos, bs)
        return Addressing(
            write_rows=write_rows, write_index=write_index, gather_index=None, mask=None
        )

    def _decode_key_groups(
        self, pages: torch.Tensor, pos: torch.Tensor, order: torch.Tensor | None, bs: int
    ) -> tuple[KeyGroup, ...]:
        """Attention groups of a position-sorted decode batch, and a workspace to fit them.

        Keys are gathered a whole (block, KV head) tile at a time: the cache
        `[num_blocks, kv, block_size, hd]` viewed as `[num_blocks * kv, block_size * hd]`
        has one contiguous row per tile, and gathering rows `(page * kv + head)` in
        `[rows, kv, blocks]` order lands them directly in SDPA's `[rows, kv, keys, hd]`
        layout. Copying 8 KiB tiles is much faster than copying 256-byte key rows; the few
        keys past a row's position are masked.
        """
        n_blocks = [p // bs + 1 for p in pos.tolist()]
        kv = self.args.n_kv_heads
        heads = torch.arange(kv, device=pages.device).view(1, kv, 1)
        groups = []
        largest = 0
        for start, end in plan_key_groups([n * bs for n in n_blocks], group_cost=self.group_cost):
            width = n_blocks[end - 1]
            group_pages = pages[start:end, :width]
            index = group_pages.clamp(min=0).unsqueeze(1) * kv + heads  # [rows, kv, width]
            key_pos = torch.arange(width * bs, device=pages.device)
            visible = key_pos.unsqueeze(0) <= pos[start:end].unsqueeze(1)
            if not bool((group_pages >= 0).all()):
                visible &= (group_pages >= 0).repeat_interleave(bs, dim=1)
            groups.append(KeyGroup(start, end, index, visible.view(end - start, 1, 1, -1)))
            largest = max(largest, index.numel() * bs * self.args.head_dim)
        self._ensure_workspace(largest)
        return tuple(groups)

    @torch.inference_mode()
    def decode_graph_safe(
        self, tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        """`decode` without host reads or data-dependent shapes: what a CUDA graph records.

        Input values are not validated (shapes and dtypes are); out-of-range values are
        clamped, never read out of bounds. Every row computes over the whole page-table width;
        inactive rows' logits are zeroed and their writes repeat an active row's write. With
        no writing row at all, the cache is left bit-identical (see `graph_safe`).
        """
        cache, bs, (tokens, pos, pages) = self._decode_inputs(
            "decode_graph_safe", tokens, positions, page_table
        )
        return self._decode_static(cache, bs, tokens, pos, pages)

    def _decode_static(
        self,
        cache: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        bs: int,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        pages: torch.Tensor,
    ) -> torch.Tensor:
        batch = tokens.shape[0]
        if pages.shape[1] == 0:
            # A static fact: no row can hold a token, so every row must be inactive.
            return torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=self.device)
        plan = static_decode(tokens, pos, pages, **self._static_limits(bs))
        hidden = self._run_layers(
            plan.tokens.unsqueeze(1),
            plan.positions.unsqueeze(1),
            plan.addressing,
            cache,
            use_cache_for_chunk=True,
        )
        logits = self._logits(hidden[:, 0])
        return logits.masked_fill((~plan.active).unsqueeze(1), 0.0)

"""The shared decoder tensor model with paged attention (implements `PagedModel`).

Each layer's KV cache is K and V of shape `[num_blocks, n_kv_heads, block_size, head_dim]`,
owned by the caller and bound with `set_kv_cache`. Addressing is computed once per call and
shared by all layers: writes and gathers go through one flat row index into the cache viewed
as `[num_blocks * n_kv_heads * block_size, head_dim]`, so no layer loops over batch rows.
Q/K/V and gate/up projections are stored fused, one matrix each; how every projection is
computed (form, layout, fused or split) is chosen by measurement at warmup
(`choose_kernels`, `models.decoder.kernel_hooks`). The dynamic decode attends with a native
kernel that reads K/V pages in place (`decode_attention`), or gathers them when it cannot run;
decodes of a few float32 rows may instead run every layer in one native call where warmup
measured that faster (`fused_decode`, `models.decoder.fused_decode`).

Each call plans its addressing once into an attention path (`models.decoder.attention`), and
every layer runs the same `_attention`: project, store K/V, `path.attend`. Two
implementations of decode and prefill plan those paths:

* dynamic (default on CPU, `models.decoder.dynamic_addressing`): reads values on the host to do
  the least work (only the keys up to the longest row, only the active rows). Fastest on CPU;
  cannot be captured as a CUDA graph.
* graph-safe (`models.decoder.graph_safe`): no host synchronisation, shapes fixed by the input
  shapes (whole page-table width, every row). It is used when `uses_graph_safe_path()`: the
  `graph_safe` attribute when set, otherwise automatically on CUDA, so eager and captured CUDA
  calls run the same code and agree bit for bit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import dynamic_addressing as dynamic
from models.decoder import input_checks as checks
from models.decoder.attention import AttentionPath, LayerCache, write_kv
from models.decoder.attention_layout import GROUP_COST_KEYS
from models.decoder.bound_cache import BoundCache
from models.decoder.config import DecoderArgs
from models.decoder.graph_safe import static_decode, static_prefill, stream_capturing
from models.decoder.kernel_hooks import KernelPlanHooks
from models.decoder.kernels import SPREAD, packed_bytes, release_packed
from models.decoder.layers import DecoderLayer, Projection, rope_tables
from models.decoder.residency import forget_block_descriptors, reload_pairs, weight_tensors
from models.decoder.weight_names import EMBED, FINAL_NORM, LM_HEAD, layer_name
from models.decoder.weights import WeightValue, validate_state_dict
from models.families import family_for_args
from runtime.backends.base import DeviceTensor
from runtime.backends.heap import release_free_heap
from runtime.model_contract import AttentionMetadata, KVCache, PagedAttentionConfig
from runtime.quant.matrix import QuantizedMatrix
from runtime.sampling.sampler import DeviceSampler
from runtime.weight_reload import ReloadPair

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


class DecoderModel(KernelPlanHooks, nn.Module):
    """A pre-norm rotary decoder (Llama, Qwen3, ...) over a caller-owned paged KV cache.

    A family's differences are in its arguments (`qk_norm`, head and rope geometry) and, for
    a different MLP block, in `layer_class` (a `DecoderLayer` subclass) of a subclass of
    this model that the family registers (`models.families.Family.model`).

    With a tied head there is one matrix, stored in the head's layout (`lm_head`); token
    embeddings are looked up in its `[vocab, dim]` view.

    `graph_safe`: None (default) picks the graph-safe decode/prefill on CUDA and the dynamic
    one elsewhere; True or False forces one (tests force True on CPU).

    `decode_attention`: how the dynamic decode attends: "paged_inplace" or
    "paged_inplace_spread" (a native kernel reads K/V pages where they are, prefetching the
    next page during each page's read pass or through its math), "gather" (pages copied into
    a workspace, then SDPA), or None (default): in place when the native kernel is
    available. The kernel plan chosen at warmup sets it (`choose_kernels`).
    """

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    graph_safe: bool | None
    # Dynamic decode: cost of one more attention group, in row-key units (`plan_key_groups`).
    group_cost: int = GROUP_COST_KEYS

    def __init__(
        self,
        args: DecoderArgs,
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
        self.embed_tokens: nn.Embedding | None = None
        if not args.tie_word_embeddings:
            self.embed_tokens = nn.Embedding(
                args.vocab_size, args.dim, dtype=dtype, device=self.device
            )
        self.layers = nn.ModuleList(
            self.layer_class(args, dtype, self.device) for _ in range(args.n_layers)
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps, dtype=dtype, device=self.device)
        self.lm_head = Projection(args.dim, args.vocab_size, dtype=dtype, device=self.device)
        self.requires_grad_(False)
        self._init_kernel_state()
        cos, sin = rope_tables(args, dtype)
        self._rope_cos = cos.to(self.device)
        self._rope_sin = sin.to(self.device)
        self._paged: PagedAttentionConfig | None = None
        self._kv_cache: tuple[LayerCache, ...] | None = None
        # Reused K/V gather buffers of the dynamic decode (see `attention.GroupedDecode`).
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # Optional device-sampling module a family executor attaches (the runtime reads it).
        self.sampling: DeviceSampler | None = None
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
        args: DecoderArgs,
        state_dict: Mapping[str, WeightValue],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        paged_attention: PagedAttentionConfig | None = None,
        consume: bool = False,
    ) -> DecoderModel:
        """Build a model from canonical (HF-named) tensors; validates names and shapes.

        Parameters may share storage with `state_dict` where no conversion is needed. With
        `consume=True` (the caller hands the dict over) entries are released as they are
        used, so re-laying out the weights never holds two copies of all of them at once, and
        the C heap hands freed pages back after each layer (`release_free_heap`): without it
        the parts a fused projection replaced stay resident (SmolLM2 float32: +70 MB).
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

        def get(name: str) -> WeightValue:
            value = tensors.pop(name) if consume else tensors[name]
            if isinstance(value, QuantizedMatrix):
                if model.device.type != "cpu":
                    return value.dequantize().to(device=model.device, dtype=dtype)
                return value
            return value.to(device=model.device, dtype=dtype)

        if model.embed_tokens is not None:
            embed = _dense(get(EMBED), dtype).contiguous()
            model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
            model.lm_head.load(_projection_weight(get(LM_HEAD)))
        else:
            model.lm_head.load(_projection_weight(get(EMBED)))
        norm = _dense(get(FINAL_NORM), dtype).contiguous()
        model.norm.weight = nn.Parameter(norm, requires_grad=False)
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            layer.load_canonical(functools.partial(_layer_tensor, get, i))
            if consume:  # the parts just joined: their heap pages go, not only the tensors
                release_free_heap()
        if paged_attention is not None:
            model.configure_paged_attention(
                block_size=paged_attention.block_size,
                max_num_blocks=paged_attention.max_num_blocks,
            )
        return model

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary `cos` and signed `sin` tables `[max_seq_len, head_dim]` (`rope_tables`)."""
        return self._rope_cos, self._rope_sin

    @property
    def head_projection(self) -> Projection:
        """The LM head (the fused stack runs it as its last stage for a few rows)."""
        return self.lm_head

    @property
    def final_norm_weight(self) -> torch.Tensor:
        """The final RMSNorm's weight `[dim]` (the fused stack applies it in its own call)."""
        weight: torch.Tensor = self.norm.weight
        return weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[*tokens.shape, dim]` (rows of the head's weight when tied,
        dequantized row by row when it is held in blocks)."""
        if self.embed_tokens is not None:
            return F.embedding(tokens, self.embed_tokens.weight)
        return self.lm_head.embed_rows(tokens, self.dtype)

    def embedding_matrix(self) -> torch.Tensor:
        """The `[vocab, dim]` token embeddings (a view of the head's matrix when tied)."""
        if self.embed_tokens is not None:
            return self.embed_tokens.weight.detach()
        return self.lm_head.hf_weight()

    def weight_bytes(self) -> int:
        """Resident bytes of every weight (block weights at their packed size)."""
        total = sum(
            module.resident_bytes for module in self.modules() if isinstance(module, Projection)
        )
        norms = [p for n, p in self.named_parameters() if "norm" in n]
        total += sum(p.numel() * p.element_size() for p in norms)
        if self.embed_tokens is not None:
            total += self.embed_tokens.weight.numel() * self.embed_tokens.weight.element_size()
        return total

    def workspace_bytes(self) -> int:
        """Bytes of the reused scratch buffers (decode K/V gather, block-weight tiles)."""
        from models.decoder.block_forms import tile_buffer_bytes

        held = (
            0
            if self._workspace is None
            else sum(t.numel() * t.element_size() for t in self._workspace)
        )
        return held + tile_buffer_bytes()

    def packed_weight_bytes(self) -> int:
        """Bytes of oneDNN's packed copies of this model's weights (the `onednn` form keeps
        one beside each weight it computes)."""
        return packed_bytes(self.resident_weights().values())

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under canonical (HF) names as views, split back from the fused ones."""
        out = {EMBED: self.embedding_matrix(), FINAL_NORM: self.norm.weight.detach()}
        if not self.args.tie_word_embeddings:
            out[LM_HEAD] = self.lm_head.hf_weight()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            for suffix, tensor in layer.canonical_tensors().items():
                out[layer_name(i, suffix)] = tensor
        return out

    # ------------------------------------------------------------- residency (sleep/wake)
    def resident_weights(self) -> dict[str, torch.Tensor]:
        """Every weight tensor as stored, by module name (what sleep moves)."""
        return weight_tensors(self, oriented=False)

    def resident_buffers(self) -> dict[str, torch.Tensor]:
        """The non-weight tensors the forward reads: the rotary tables."""
        return {"rope.cos": self._rope_cos, "rope.sin": self._rope_sin}

    def reload_pairs(self, source: object) -> tuple[ReloadPair, ...]:
        """This model's weights paired with `source`'s (another `DecoderModel`) for an in-place
        reload; `WeightMismatchError` names the first tensor that differs."""
        if not isinstance(source, DecoderModel):
            raise TypeError(
                f"source must be a DecoderModel (or, through DecoderExecutor.reload_weights, a "
                f"model name, path or state dict), got {type(source).__name__}"
            )
        return reload_pairs(self, source)

    def fused_decode_unsupported(self) -> str | None:
        """Why the fused native decode stack cannot run this model's family, or None (the
        family's answer, `Family.fused_decode_unsupported`; the stack knows the dense layer
        without q/k norms only)."""
        family = family_for_args(self.args)
        if family.fused_decode_unsupported is not None:
            return f"model family {family.name!r}: {family.fused_decode_unsupported}"
        if self.args.qk_norm:
            return "the fused decode stack has no per-head q/k norm (qk_norm)"
        if self.layer_class is not DecoderLayer:
            return f"the fused decode stack runs the dense DecoderLayer, not {self.layer_class}"
        return None

    def weights_moved(self) -> None:
        """Forget cached weight addresses and the gather workspace (sleep, wake, reload)."""
        forget_block_descriptors(self)
        release_packed(self.resident_weights().values())  # oneDNN copies of moved weights
        if self.fused_decode is not None:
            self.fused_decode.forget_addresses()
        self._workspace = None

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
        checks.check_paged_geometry(block_size, max_num_blocks)
        if self._kv_cache is not None:
            bound_blocks, _, bound_block_size, _ = self._kv_cache[0][0].shape
            if bound_block_size != block_size or bound_blocks > max_num_blocks:
                raise RuntimeError(
                    f"configure_paged_attention(block_size={block_size}, max_num_blocks="
                    f"{max_num_blocks}) conflicts with the bound cache (block_size "
                    f"{bound_block_size}, {bound_blocks} blocks): call set_kv_cache(None) first"
                )
        self._paged = PagedAttentionConfig(block_size=block_size, max_num_blocks=max_num_blocks)

    def set_kv_cache(self, cache: Sequence[Sequence[DeviceTensor]] | None) -> None:
        """Bind (or with None unbind) the per-layer K/V tensors; all-or-nothing.

        Every layer's K and V must be `[num_blocks, n_kv_heads, block_size, head_dim]`, the
        model dtype and device, and contiguous; nothing changes unless all of them are.
        """
        if cache is None:
            self._kv_cache = None
            return
        paged = self._require_paged("set_kv_cache")
        args = self.args
        bound = checks.check_kv_cache(
            cache,
            paged,
            n_layers=args.n_layers,
            n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._kv_cache = bound
        logger.debug("bound KV cache: %d layers x %s blocks", len(bound), bound[0][0].shape[0])

    def iter_executor_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
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

    def _require_cache(self, caller: str) -> tuple[LayerCache, ...]:
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

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.args.head_dim // 2
        return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)

    def _attention(
        self,
        layer: DecoderLayer,
        cache: LayerCache,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        path: AttentionPath,
    ) -> torch.Tensor:
        """One layer's attention for `h` `[..., dim]`: project, store K/V, attend, project."""
        n_q, n_kv, hd = self.args.n_heads, self.args.n_kv_heads, self.args.head_dim
        qkv = layer.wqkv(h).view(*h.shape[:-1], n_q + 2 * n_kv, hd)
        v = qkv[..., n_q + n_kv :, :]
        if layer.q_norm is None:  # q and k rotate together
            qk = self._rope(qkv[..., : n_q + n_kv, :], *rope)
            q, k = qk[..., :n_q, :], qk[..., n_q:, :]
        else:  # per-head norms first (qk_norm), then rotary
            q, k = layer.norm_qk(qkv[..., :n_q, :], qkv[..., n_q : n_q + n_kv, :])
            q, k = self._rope(q, *rope), self._rope(k, *rope)
        write_kv(cache, k, v, path.writes)
        return layer.attention_out(path.attend(q, k, v, cache))

    def _run_layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[LayerCache, ...],
        path: AttentionPath,
    ) -> torch.Tensor:
        """The decoder stack over `path`. The final layer takes `path.last_layer()`: for a
        packed prefill it writes every token's K/V but attends, projects and runs its MLP for
        each row's last token alone (returns `[B, dim]`; no later layer needs the others)."""
        x = self.embed(tokens)
        rope = (self._rope_cos[positions].unsqueeze(-2), self._rope_sin[positions].unsqueeze(-2))
        final = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            assert isinstance(layer, DecoderLayer)
            layer_path = path.last_layer() if i == final else path
            attended = self._attention(
                layer, layer_cache, layer.input_layernorm(x), rope, layer_path
            )
            x = layer_path.residual(x) + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits.float()

    def _zero_logits(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=self.device)

    def _bound_cache(self, caller: str) -> BoundCache:
        """The bound cache and its block size, or why `caller` cannot run yet."""
        layers = self._require_cache(caller)
        return BoundCache(layers, self._require_paged(caller).block_size)

    def _geometry(self, cache: BoundCache) -> dict[str, int]:
        """The cache geometry the addressing planners need."""
        return {"n_kv_heads": self.args.n_kv_heads, "block_size": cache.block_size}

    def _static_limits(self, cache: BoundCache) -> dict[str, int]:
        """The geometry and ranges the graph-safe planners clamp against."""
        return {
            **self._geometry(cache),
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
        }

    def _long_inputs(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(value.to(device=self.device, dtype=torch.long) for value in values)

    # ---------------------------------------------------------------- contract: prefill
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
        cache = self._bound_cache("prefill")
        checks.check_prefill_shapes(tokens, page_table, prompt_lens, chunk_start)
        tokens, pages, lens, start = self._long_inputs(tokens, page_table, prompt_lens, chunk_start)
        graph_safe = self.uses_graph_safe_path()
        if graph_safe and stream_capturing(self.device):
            return self._prefill_static(cache, tokens, pages, lens, start)
        batch, seq = tokens.shape
        checks.check_page_table(pages, batch, cache.num_blocks)
        real, row_start = checks.prefill_extent(
            lens,
            start,
            seq=seq,
            block_size=cache.block_size,
            width=pages.shape[1],
            max_seq_len=self.max_seq_len,
        )
        if graph_safe:
            return self._prefill_static(cache, tokens, pages, lens, start)
        start = row_start
        live = real > 0
        if bool(live.all()):
            return self._prefill_packed(cache, tokens, pages, real, start)
        out = self._zero_logits(batch)
        if bool(live.any()):
            rows = live.nonzero().squeeze(1)
            out[rows] = self._prefill_packed(
                cache, tokens[rows], pages[rows], real[rows], start[rows]
            )
        return out

    def _entering_path(self, graph_safe: bool) -> None:
        """Called as a forward enters the graph-safe (static) or the dynamic path. A family
        whose layers pick their kernels by it (Qwen3-MoE's experts) overrides this."""

    def _prefill_packed(
        self,
        cache: BoundCache,
        tokens: torch.Tensor,
        pages: torch.Tensor,
        real: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        """Dynamic prefill of rows that each have `real` (>= 1) tokens from `start`."""
        self._entering_path(graph_safe=False)
        token_ids, token_pos, path = dynamic.packed_prefill(
            tokens, pages, real, start, **self._geometry(cache)
        )
        return self._logits(self._run_layers(token_ids, token_pos, cache.layers, path))

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
        cache = self._bound_cache("prefill_graph_safe")
        checks.check_prefill_shapes(tokens, page_table, prompt_lens, chunk_start)
        inputs = self._long_inputs(tokens, page_table, prompt_lens, chunk_start)
        return self._prefill_static(cache, *inputs)

    def _prefill_static(
        self,
        cache: BoundCache,
        tokens: torch.Tensor,
        pages: torch.Tensor,
        lens: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        self._entering_path(graph_safe=True)
        batch = tokens.shape[0]
        if pages.shape[1] == 0:
            raise ValueError("page_table has 0 columns: the graph-safe prefill needs W >= 1")
        plan = static_prefill(tokens, pages, lens, start, **self._static_limits(cache))
        hidden = self._run_layers(plan.tokens, plan.positions, cache.layers, plan.attention)
        last_hidden = hidden[torch.arange(batch, device=tokens.device), plan.last]
        logits = self._logits(last_hidden)
        return logits.masked_fill((~plan.has_tokens).unsqueeze(1), 0.0)

    # ----------------------------------------------------------------- contract: decode
    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        """One token per row at `positions` (negative = inactive); logits `[B, V]`.

        Inactive rows read zero logits and write nothing. With `uses_graph_safe_path()` the
        inputs are validated on the host (skipped while a CUDA graph is being captured) and
        `decode_graph_safe` computes.
        """
        cache = self._bound_cache("decode")
        checks.check_decode_shapes(tokens, positions, page_table)
        tokens, pos, pages = self._long_inputs(tokens, positions, page_table)
        graph_safe = self.uses_graph_safe_path()
        if graph_safe and stream_capturing(self.device):
            return self._decode_static(cache, tokens, pos, pages)
        batch = tokens.shape[0]
        checks.check_page_table(pages, batch, cache.num_blocks)
        extent = {
            "width": pages.shape[1],
            "block_size": cache.block_size,
            "max_seq_len": self.max_seq_len,
        }
        # One host read of the few positions, then list arithmetic: each torch op on them
        # costs microseconds at batch 1, where the whole step is a few milliseconds.
        placed = [p for p in pos.tolist() if p >= 0]
        if placed:
            checks.decode_extent(placed, **extent)
        if graph_safe:
            return self._decode_static(cache, tokens, pos, pages)
        if not placed:
            return self._zero_logits(batch)
        if len(placed) == batch:
            return self.decode_rows(cache, tokens, pos, pages)
        rows = (pos >= 0).nonzero().squeeze(1)
        out = self._zero_logits(batch)
        out[rows] = self.decode_rows(cache, tokens[rows], pos[rows], pages[rows])
        return out

    def decode_rows(
        self, cache: BoundCache, tokens: torch.Tensor, pos: torch.Tensor, pages: torch.Tensor
    ) -> torch.Tensor:
        """Every row's decode, all rows active and checked by the caller (`decode`, and
        warmup's timing of the fused stack in `fused_choice`): attention reads K/V pages in
        place (the native kernel) or, rows sorted by position (undone on the last hidden
        state), gathers key tiles per group of rows."""
        self._entering_path(graph_safe=False)
        # Fused decode stack (`models.decoder.fused_decode`): chosen per row bucket at warmup.
        fused = self.fused_decode
        if fused is not None and fused.runs(tokens.shape[0]):
            return fused.logits(cache.layers, cache.block_size, tokens, pos, pages)
        order: torch.Tensor | None = None
        path: AttentionPath
        if self._decodes_in_place():
            spread = self.decode_attention == SPREAD
            path = dynamic.paged_decode(pages, pos, spread=spread, **self._geometry(cache))
        else:
            order = dynamic.position_order(pos)
            if order is not None:
                tokens, pos, pages = tokens[order], pos[order], pages[order]
            path = dynamic.grouped_decode(
                pages,
                pos,
                self._workspace_of,
                **self._geometry(cache),
                head_dim=self.args.head_dim,
                group_cost=self.group_cost,
            )
        last = self._run_layers(tokens.unsqueeze(1), pos.unsqueeze(1), cache.layers, path)[:, 0]
        if order is not None:
            last = torch.empty_like(last).index_copy_(0, order, last)
        return self._logits(last)

    def _workspace_of(self, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat K and V gather buffers, grown (never shrunk) to `elements` values each."""
        if self._workspace is None or self._workspace[0].shape[0] < elements:
            self._workspace = (
                torch.empty(elements, dtype=self.dtype, device=self.device),
                torch.empty(elements, dtype=self.dtype, device=self.device),
            )
        return self._workspace

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
        cache = self._bound_cache("decode_graph_safe")
        checks.check_decode_shapes(tokens, positions, page_table)
        return self._decode_static(cache, *self._long_inputs(tokens, positions, page_table))

    def _decode_static(
        self, cache: BoundCache, tokens: torch.Tensor, pos: torch.Tensor, pages: torch.Tensor
    ) -> torch.Tensor:
        self._entering_path(graph_safe=True)
        if pages.shape[1] == 0:
            # A static fact: no row can hold a token, so every row must be inactive.
            return self._zero_logits(tokens.shape[0])
        plan = static_decode(tokens, pos, pages, **self._static_limits(cache))
        hidden = self._run_layers(
            plan.tokens.unsqueeze(1), plan.positions.unsqueeze(1), cache.layers, plan.attention
        )
        logits = self._logits(hidden[:, 0])
        return logits.masked_fill((~plan.active).unsqueeze(1), 0.0)


def _dense(value: WeightValue, dtype: torch.dtype) -> torch.Tensor:
    """A weight that is read whole (an untied embedding is looked up, so not kept in blocks)."""
    return value.dequantize().to(dtype) if isinstance(value, QuantizedMatrix) else value


def _projection_weight(value: WeightValue) -> torch.Tensor | list[QuantizedMatrix]:
    """What `Projection.load` takes: a float matrix, or block parts (here one)."""
    return [value] if isinstance(value, QuantizedMatrix) else value


def _layer_tensor(get: Callable[[str], WeightValue], index: int, suffix: str) -> WeightValue:
    """Layer `index`'s canonical tensor `suffix`, through `get` (which takes full names)."""
    return get(layer_name(index, suffix))

"""Qwen3-MoE routing and experts against transformers' sparse MoE block, same random weights.

The oracle is `Qwen3MoeSparseMoeBlock` (transformers 5), fed the same router and expert
weights; ours is loaded through the checkpoint name map (`stack_hf_experts`), so the map is
exercised by every comparison. Tolerance (fp32): |ours - transformers| <= 1e-5 + 1e-5 * |ref|;
outputs are O(1), and the only differences are the order of float sums (expert grouping).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeSparseMoeBlock,
)

from models.qwen3_moe import (
    DEFAULT_PER_ROW_MAX_ROWS,
    EXPERT_PATHS,
    SYNC_FREE_PATHS,
    ExpertPathPlan,
    ExpertShapeError,
    ExpertShapes,
    ExpertWeightsError,
    MoEArgs,
    MoEBlock,
    MoEConfigError,
    Routes,
    RoutingError,
    TopKRouting,
    gguf_expert_names,
    stack_gguf_experts,
    stack_hf_experts,
)
from models.qwen3_moe import experts as experts_module
from models.qwen3_moe.expert_weights import DOWN, GATE_UP, ROUTER

ATOL = 1e-5
RTOL = 1e-5
LAYER = 3  # a layer index other than 0, so a wrong prefix cannot pass by accident


def _config(
    *, experts: int, top_k: int, norm: bool, hidden: int = 16, inter: int = 8
) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )


def _reference(config: Qwen3MoeConfig, seed: int) -> Qwen3MoeSparseMoeBlock:
    """transformers' block with seeded random weights (std picked so outputs are O(1))."""
    block = Qwen3MoeSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(block.named_parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)
    return block


def _hf_checkpoint(reference: Qwen3MoeSparseMoeBlock, layer: int) -> dict[str, torch.Tensor]:
    """The reference weights under the per-expert names transformers writes to disk."""
    state = reference.state_dict()
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    inter = down.shape[2]
    prefix = f"model.layers.{layer}.mlp."
    tensors = {f"{prefix}gate.weight": state["gate.weight"].clone()}
    for expert in range(gate_up.shape[0]):
        base = f"{prefix}experts.{expert}."
        tensors[f"{base}gate_proj.weight"] = gate_up[expert, :inter].clone()
        tensors[f"{base}up_proj.weight"] = gate_up[expert, inter:].clone()
        tensors[f"{base}down_proj.weight"] = down[expert].clone()
    return tensors


def _ours(config: Qwen3MoeConfig, reference: Qwen3MoeSparseMoeBlock) -> MoEBlock:
    args = MoEArgs.from_hf_config(config.to_dict())
    block = MoEBlock(args)
    block.load_layer(stack_hf_experts(_hf_checkpoint(reference, LAYER), LAYER, args.shapes))
    return block


def _pair(
    *, experts: int, top_k: int, norm: bool, hidden: int = 16, inter: int = 8, seed: int = 0
) -> tuple[Qwen3MoeSparseMoeBlock, MoEBlock]:
    config = _config(experts=experts, top_k=top_k, norm=norm, hidden=hidden, inter=inter)
    reference = _reference(config, seed)
    return reference, _ours(config, reference)


def _assert_all_paths_match(
    reference: Qwen3MoeSparseMoeBlock, ours: MoEBlock, x: torch.Tensor
) -> None:
    with torch.no_grad():
        expected = reference(x.reshape(1, -1, x.shape[-1])).reshape(x.shape)
        for path in EXPERT_PATHS:
            ours.expert_path = path
            torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=RTOL, msg=path)


def _force_routes(
    block: MoEBlock, reference: Qwen3MoeSparseMoeBlock, wanted: list[list[int]]
) -> torch.Tensor:
    """Router weights and inputs such that row r picks experts `wanted[r]`, in that order.

    Row r is (mostly) the unit vector e_r; the router weight gives the wanted experts large,
    falling logits on that coordinate, so top-k is exactly `wanted[r]`.
    """
    experts, hidden = block.gate.weight.shape
    generator = torch.Generator().manual_seed(7)
    router = torch.randn(experts, hidden, generator=generator) * 0.05
    for row, chosen in enumerate(wanted):
        for rank, expert in enumerate(chosen):
            router[expert, row] = 6.0 - rank
    x = torch.randn(len(wanted), hidden, generator=generator) * 0.05
    x[range(len(wanted)), range(len(wanted))] = 2.0
    with torch.no_grad():
        block.gate.weight.copy_(router)
        reference.gate.weight.copy_(router)
    return x


# --- against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
def test_random_rows_match_transformers_on_every_path(top_k: int, norm: bool) -> None:
    reference, ours = _pair(experts=6, top_k=top_k, norm=norm, seed=top_k)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        for path in EXPERT_PATHS:
            ours.expert_path = path
            got = ours(x)
            assert got.shape == x.shape
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=path)


def test_disjoint_and_shared_experts_in_one_batch() -> None:
    reference, ours = _pair(experts=8, top_k=2, norm=True)
    # Rows 0-1 disjoint; rows 2-4 share experts {4, 5} (in both orders); row 5 overlaps row 0.
    wanted = [[0, 1], [2, 3], [4, 5], [5, 4], [4, 5], [1, 6]]
    x = _force_routes(ours, reference, wanted)
    routes = ours.route(x)
    assert routes.expert_ids.tolist() == wanted
    _assert_all_paths_match(reference, ours, x)


@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_gets_every_row(top_k: int) -> None:
    reference, ours = _pair(experts=4, top_k=top_k, norm=False)
    wanted = [[3, row % 3][:top_k] for row in range(12)]
    x = _force_routes(ours, reference, wanted)
    routes = ours.route(x)
    counts = torch.bincount(routes.expert_ids.reshape(-1), minlength=4)
    assert counts[3].item() == 12
    _assert_all_paths_match(reference, ours, x)


@given(
    rows=st.integers(1, 33),
    experts=st.integers(2, 8),
    data=st.data(),
    hidden=st.sampled_from([8, 16, 24]),
    inter=st.sampled_from([4, 8, 12]),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_every_path_matches_transformers(
    rows: int,
    experts: int,
    data: st.DataObject,
    hidden: int,
    inter: int,
    norm: bool,
    seed: int,
) -> None:
    top_k = data.draw(st.integers(1, min(experts, 4)), label="top_k")
    reference, ours = _pair(
        experts=experts, top_k=top_k, norm=norm, hidden=hidden, inter=inter, seed=seed
    )
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed + 1))
    _assert_all_paths_match(reference, ours, x)


def test_bfloat16_block_follows_transformers_routing() -> None:
    """Routing runs its softmax in fp32 and returns weights in the hidden dtype, as HF does."""
    reference, ours = _pair(experts=8, top_k=2, norm=True)
    reference, ours = reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        _, ref_weights, ref_ids = reference.gate(x)
        routes = ours.route(x)
    assert routes.weights.dtype == torch.bfloat16
    assert torch.equal(routes.expert_ids, ref_ids)
    assert torch.equal(routes.weights, ref_weights)


# --- routing ----------------------------------------------------------------------------


def test_norm_topk_prob_renormalises_only_when_set() -> None:
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    plain = TopKRouting(num_experts=6, top_k=3, norm_topk_prob=False)(logits)
    normed = TopKRouting(num_experts=6, top_k=3, norm_topk_prob=True)(logits)
    assert torch.equal(plain.expert_ids, normed.expert_ids)
    torch.testing.assert_close(plain.weights, probs.gather(1, plain.expert_ids))
    assert (plain.weights.sum(-1) < 1 - 1e-3).all()
    torch.testing.assert_close(normed.weights.sum(-1), torch.ones(7))
    # Columns fall in probability.
    assert (plain.weights[:, :-1] >= plain.weights[:, 1:]).all()


@pytest.mark.parametrize("top_k", [0, 5, -1, True, 2.0])
def test_routing_refuses_top_k_outside_one_to_num_experts(top_k: object) -> None:
    with pytest.raises(RoutingError, match=r"num_experts_per_tok=.*1\.\.num_experts \(4\)"):
        TopKRouting(num_experts=4, top_k=top_k, norm_topk_prob=True)  # type: ignore[arg-type]


def test_routing_refuses_bad_expert_count_norm_flag_and_logit_width() -> None:
    with pytest.raises(RoutingError, match="num_experts=0 is invalid"):
        TopKRouting(num_experts=0, top_k=1, norm_topk_prob=True)
    with pytest.raises(RoutingError, match="norm_topk_prob='yes' is invalid"):
        TopKRouting(num_experts=4, top_k=1, norm_topk_prob="yes")  # type: ignore[arg-type]
    with pytest.raises(RoutingError, match=r"shape \(2, 5\).*\[rows, 4\]"):
        TopKRouting(num_experts=4, top_k=1, norm_topk_prob=True)(torch.zeros(2, 5))


# --- config -----------------------------------------------------------------------------


def test_config_reads_transformers_and_qwen_key_spellings() -> None:
    written = _config(experts=6, top_k=2, norm=True).to_dict()
    assert "num_local_experts" in written  # transformers 5 writes this spelling
    args = MoEArgs.from_hf_config(written)
    assert args.shapes == ExpertShapes(num_experts=6, hidden_size=16, intermediate_size=8)
    assert args.routing == TopKRouting(num_experts=6, top_k=2, norm_topk_prob=True)
    qwen = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 6}
    assert MoEArgs.from_hf_config(qwen) == args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 is invalid"),
        ({"num_experts": 7}, r"expert counts disagree"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported: allowed are \('silu',\)"),
        ({"moe_intermediate_size": None}, r"config has no 'moe_intermediate_size'"),
        ({"norm_topk_prob": 1}, r"norm_topk_prob=1 is invalid"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 is invalid"),
    ],
)
def test_config_refuses_unusable_values_naming_the_key(
    change: dict[str, object], message: str
) -> None:
    config = _config(experts=6, top_k=2, norm=True).to_dict() | change
    with pytest.raises(ValueError, match=message):
        MoEArgs.from_hf_config(config)


def test_sparse_layers_follow_transformers() -> None:
    config = _config(experts=4, top_k=2, norm=True)
    config.decoder_sparse_step = 2
    config.mlp_only_layers = [3]
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 8
    args = MoEArgs.from_hf_config(config.to_dict())
    for layer in range(6):
        hf_sparse = isinstance(Qwen3MoeDecoderLayer(config, layer).mlp, Qwen3MoeSparseMoeBlock)
        assert args.is_sparse(layer) == hf_sparse, layer
    expected = [False, True, False, False, False, True]
    assert [args.is_sparse(layer) for layer in range(6)] == expected


def test_gguf_metadata_reads_expert_keys_and_defaults_to_renormalising() -> None:
    metadata: dict[str, object] = {
        "qwen3moe.expert_count": np.uint32(8),
        "qwen3moe.expert_used_count": np.uint32(2),
        "qwen3moe.embedding_length": 16,
        "qwen3moe.expert_feed_forward_length": 8,
    }
    args = MoEArgs.from_gguf_metadata(metadata)
    assert args.routing == TopKRouting(num_experts=8, top_k=2, norm_topk_prob=True)
    assert args.shapes == ExpertShapes(num_experts=8, hidden_size=16, intermediate_size=8)
    metadata["qwen3moe.expert_weights_norm"] = False
    assert not MoEArgs.from_gguf_metadata(metadata).routing.norm_topk_prob
    del metadata["qwen3moe.expert_used_count"]
    with pytest.raises(MoEConfigError, match=r"no 'qwen3moe\.expert_used_count'"):
        MoEArgs.from_gguf_metadata(metadata)


# --- weight names -----------------------------------------------------------------------


def test_hf_names_match_what_transformers_saves(tmp_path: Path) -> None:
    """The per-expert names and split are those of a real `save_pretrained` folder."""
    config = _config(experts=4, top_k=2, norm=True)
    config.num_hidden_layers, config.vocab_size = 2, 32
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 8
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk
    args = MoEArgs.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    in_memory = model.state_dict()
    for layer in range(2):
        stacked = stack_hf_experts(on_disk, layer, args.shapes)
        for name in (ROUTER, GATE_UP, DOWN):
            assert torch.equal(stacked[name], in_memory[f"model.layers.{layer}.{name}"]), name


def test_hf_stacked_names_are_accepted_as_is() -> None:
    reference, _ = _pair(experts=4, top_k=2, norm=True)
    state = {f"model.layers.{LAYER}.mlp.{k}": v for k, v in reference.state_dict().items()}
    shapes = ExpertShapes(num_experts=4, hidden_size=16, intermediate_size=8)
    stacked = stack_hf_experts(state, LAYER, shapes)
    assert torch.equal(stacked[GATE_UP], reference.experts.gate_up_proj)


def test_hf_missing_and_misshaped_expert_tensors_are_named() -> None:
    reference, _ = _pair(experts=4, top_k=2, norm=True)
    shapes = ExpertShapes(num_experts=4, hidden_size=16, intermediate_size=8)
    tensors = _hf_checkpoint(reference, LAYER)
    missing = dict(tensors)
    del missing[f"model.layers.{LAYER}.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ExpertWeightsError, match=r"experts\.2\.down_proj\.weight"):
        stack_hf_experts(missing, LAYER, shapes)
    bad = dict(tensors)
    bad[f"model.layers.{LAYER}.mlp.experts.1.up_proj.weight"] = torch.zeros(8, 15)
    with pytest.raises(
        ExpertShapeError, match=r"experts\.1\.up_proj\.weight.*\(8, 15\).*\(8, 16\)"
    ):
        stack_hf_experts(bad, LAYER, shapes)


def _gguf_tensors(reference: Qwen3MoeSparseMoeBlock, layer: int) -> dict[str, torch.Tensor]:
    """The reference weights as GGUF names in torch (reversed ggml) shapes."""
    state = reference.state_dict()
    inter = state["experts.down_proj"].shape[2]
    router, gate, up, down = gguf_expert_names(layer)
    return {
        router: state["gate.weight"],
        gate: state["experts.gate_up_proj"][:, :inter].contiguous(),
        up: state["experts.gate_up_proj"][:, inter:].contiguous(),
        down: state["experts.down_proj"],
    }


def test_gguf_names_load_into_the_same_block() -> None:
    config = _config(experts=5, top_k=2, norm=True)
    reference = _reference(config, seed=4)
    args = MoEArgs.from_hf_config(config.to_dict())
    block = MoEBlock(args)
    assert gguf_expert_names(LAYER) == (
        f"blk.{LAYER}.ffn_gate_inp.weight",
        f"blk.{LAYER}.ffn_gate_exps.weight",
        f"blk.{LAYER}.ffn_up_exps.weight",
        f"blk.{LAYER}.ffn_down_exps.weight",
    )
    block.load_layer(stack_gguf_experts(_gguf_tensors(reference, LAYER), LAYER, args.shapes))
    _assert_all_paths_match(reference, block, torch.randn(6, 16))


def test_gguf_misshaped_and_missing_tensors_are_named() -> None:
    reference, _ = _pair(experts=4, top_k=2, norm=True)
    shapes = ExpertShapes(num_experts=4, hidden_size=16, intermediate_size=8)
    tensors = _gguf_tensors(reference, LAYER)
    bad = dict(tensors)
    bad[f"blk.{LAYER}.ffn_up_exps.weight"] = torch.zeros(4, 16, 8)  # ggml order, not reversed
    with pytest.raises(ExpertShapeError, match=r"ffn_up_exps\.weight has shape \(4, 16, 8\)"):
        stack_gguf_experts(bad, LAYER, shapes)
    del tensors[f"blk.{LAYER}.ffn_gate_inp.weight"]
    with pytest.raises(ExpertWeightsError, match=r"ffn_gate_inp\.weight"):
        stack_gguf_experts(tensors, LAYER, shapes)


def test_block_stores_experts_once_in_the_stacked_layout() -> None:
    _, ours = _pair(experts=4, top_k=2, norm=True)
    names = {name: tuple(p.shape) for name, p in ours.named_parameters()}
    assert names == {
        "gate.weight": (4, 16),
        "experts.gate_up": (4, 16, 16),
        "experts.down": (4, 16, 8),
    }
    with pytest.raises(ExpertShapeError, match=r"experts\.down has shape"):
        ours.experts.load(ours.experts.gate_up, torch.zeros(4, 8, 16))


# --- path choice ------------------------------------------------------------------------


def test_auto_path_by_rows_then_plan_then_forced() -> None:
    _, ours = _pair(experts=4, top_k=2, norm=True)
    assert ours.path_for(DEFAULT_PER_ROW_MAX_ROWS) == "per_row"
    assert ours.path_for(DEFAULT_PER_ROW_MAX_ROWS + 1) == "batched"
    ours.path_plan = ExpertPathPlan(
        timings=(
            (1, (("batched", 5.0), ("per_row", 2.0), ("gathered", 3.0))),
            (8, (("batched", 4.0), ("per_row", 9.0), ("gathered", 4.0))),
        )
    )
    assert [ours.path_for(rows) for rows in (1, 2, 8, 100)] == [
        "per_row",
        "batched",  # a tie goes to the earlier of EXPERT_PATHS
        "batched",
        "batched",  # past the largest bucket: the largest bucket's choice
    ]
    ours.expert_path = "gathered"
    assert ours.path_for(1) == "gathered"
    with pytest.raises(ValueError, match=r"expert_path='dense' is invalid: allowed are"):
        ours.expert_path = "dense"  # type: ignore[assignment]


def test_graph_safe_takes_only_sync_free_paths() -> None:
    _, ours = _pair(experts=4, top_k=2, norm=True)
    ours.graph_safe = True
    assert {ours.path_for(rows) for rows in (1, 3, 64)} == set(SYNC_FREE_PATHS)
    ours.expert_path = "batched"
    with pytest.raises(ValueError, match="graph_safe=True forbids"):
        ours.path_for(1)
    ours.expert_path = None
    plan = ours.measure_paths([1, 4], rounds=1)
    assert {path for times in plan.microseconds.values() for path in times} == set(SYNC_FREE_PATHS)


def test_forward_runs_the_chosen_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ours = _pair(experts=4, top_k=2, norm=True)
    taken: list[tuple[str, int]] = []
    original = dict(experts_module._PATH_FUNCTIONS)

    def recording(path: str) -> Callable[..., torch.Tensor]:
        def run(
            x: torch.Tensor, routes: Routes, gate_up: torch.Tensor, down: torch.Tensor
        ) -> torch.Tensor:
            taken.append((path, x.shape[0]))
            return original[path](x, routes, gate_up, down)

        return run

    for path in original:
        monkeypatch.setitem(experts_module._PATH_FUNCTIONS, path, recording(path))
    with torch.no_grad():
        ours(torch.randn(1, 1, 16))
        ours(torch.randn(2, 5, 16))
    assert taken == [("per_row", 1), ("batched", 10)]


def test_measure_paths_times_every_path_per_bucket_and_keeps_the_fastest() -> None:
    _, ours = _pair(experts=4, top_k=2, norm=True)
    plan = ours.measure_paths([4, 1, 16], rounds=1)
    assert sorted(plan.paths) == [1, 4, 16]
    for bucket, times in plan.microseconds.items():
        assert set(times) == set(EXPERT_PATHS)
        assert all(us > 0 for us in times.values())
        assert times[plan.paths[bucket]] == min(times.values())
    encoded = json.loads(json.dumps(plan.to_json()))
    assert [bucket for bucket, _ in encoded["paths"]] == [1, 4, 16]


def test_plan_refuses_unordered_buckets_and_unknown_paths() -> None:
    with pytest.raises(ValueError, match=r"buckets .* are invalid"):
        ExpertPathPlan(timings=((4, (("batched", 1.0),)), (2, (("batched", 1.0),))))
    with pytest.raises(ValueError, match=r"bucket 1 times .* are invalid"):
        ExpertPathPlan(timings=((1, (("dense", 1.0),)),))  # type: ignore[arg-type]

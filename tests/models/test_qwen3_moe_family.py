"""The Qwen3-MoE family's model pieces: config reading and refusals, experts stored once, the
graph-safe path, batches whose rows share or split experts, the path plan's record, and the
expert weights in sleep, reload and byte counts.

End-to-end runs against transformers are in `tests/integration/test_qwen3_moe_family.py`.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from models.decoder import random_state_dict
from models.decoder.reference import allocate_kv_cache
from models.families import family_for_architectures, family_for_gguf, family_for_hf_config
from models.qwen3_moe import TINY_PRESETS, ExpertPathPlan, MoEConfigError, Qwen3MoeArgs
from models.qwen3_moe.model import Qwen3MoeModel

BLOCK = 8


def _model(preset: str = "qwen3-moe", seed: int = 3) -> Qwen3MoeModel:
    args = TINY_PRESETS[preset]
    model = Qwen3MoeModel.from_state_dict(args, random_state_dict(args, seed=seed))
    assert isinstance(model, Qwen3MoeModel)
    return model


def _hf_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = dict(TINY_PRESETS["qwen3-moe"].to_hf_config())
    config.update(overrides)
    return config


def test_the_registry_finds_the_family_by_every_key() -> None:
    assert family_for_hf_config(_hf_config()).name == "qwen3_moe"
    assert family_for_architectures(["Qwen3MoeForCausalLM"]).name == "qwen3_moe"
    assert family_for_gguf("qwen3moe").name == "qwen3_moe"


def test_hf_config_round_trips_with_the_moe_fields() -> None:
    args = TINY_PRESETS["qwen3-moe-top1"]
    read = Qwen3MoeArgs.from_hf_config(dict(args.to_hf_config()))
    assert read == attrs.evolve(args, name="qwen3_moe")
    # transformers 5 spells the expert count num_local_experts; both are read.
    config = _hf_config(num_local_experts=8)
    del config["num_experts"]
    assert Qwen3MoeArgs.from_hf_config(config).num_experts == 8


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mlp_only_layers", [1], "mlp_only_layers=[1] is not supported: allowed is []"),
        ("decoder_sparse_step", 2, "decoder_sparse_step=2 is not supported: allowed is 1"),
        ("use_sliding_window", True, "use_sliding_window=True is not supported"),
        ("num_experts_per_tok", 9, "num_experts_per_tok=9 is invalid: allowed is an integer in"),
        ("norm_topk_prob", "yes", "norm_topk_prob='yes' is invalid"),
    ],
)
def test_unusable_configs_are_refused_naming_the_key(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        Qwen3MoeArgs.from_hf_config(_hf_config(**{key: value}))
    assert message in str(caught.value)


def test_a_config_without_an_expert_count_is_refused() -> None:
    config = _hf_config()
    del config["num_experts"]
    with pytest.raises(MoEConfigError, match="num_experts"):
        Qwen3MoeArgs.from_hf_config(config)


def test_qk_norm_is_required() -> None:
    with pytest.raises(ValueError, match=r"qk_norm=False is invalid: allowed is True"):
        attrs.evolve(TINY_PRESETS["qwen3-moe"], qk_norm=False)


def test_parameter_counts_cover_every_expert_and_the_active_ones() -> None:
    args = TINY_PRESETS["qwen3-moe"]
    model = _model()
    assert args.parameter_count() == sum(p.numel() for p in model.parameters())
    per_expert = 3 * args.dim * args.moe_ffn_dim
    unused = args.n_layers * (args.num_experts - args.top_k) * per_expert
    assert args.active_parameter_count() == args.parameter_count() - unused
    assert model.weight_bytes() == 4 * args.parameter_count()  # float32, experts included


def test_experts_are_stored_once_and_exported_as_views() -> None:
    model = _model()
    layer_params = dict(model.layers[0].named_parameters())
    assert not any(".experts.0" in name for name in layer_params)  # no per-expert copies
    gate_up = layer_params["moe.experts.gate_up"]
    assert tuple(gate_up.shape) == TINY_PRESETS["qwen3-moe"].moe.shapes.gate_up
    state = model.canonical_state_dict()
    view = state["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    # The views reload into an equal model (the loader stacks them again).
    again = Qwen3MoeModel.from_state_dict(model.args, {k: v.clone() for k, v in state.items()})
    assert torch.equal(dict(again.layers[0].named_parameters())["moe.experts.gate_up"], gate_up)


def _inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts `[rows, 11]` and one next token per row."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 256, (rows, 11), generator=generator)
    return prompts, torch.randint(0, 256, (rows,), generator=generator)


def _decode(
    model: Qwen3MoeModel, rows: int, seed: int = 0, *, only: int | None = None
) -> torch.Tensor:
    """Logits of one decode step after a prefill of each row's prompt (`only`: that row of
    the `rows` drawn, alone in a batch of one)."""
    prompts, step = _inputs(rows, seed)
    if only is not None:
        prompts, step = prompts[only : only + 1], step[only : only + 1]
    batch, prompt_len = prompts.shape
    per_row = -(-(prompt_len + 1) // BLOCK)
    blocks = batch * per_row
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=BLOCK, max_num_blocks=blocks)
    model.set_kv_cache(allocate_kv_cache(model, blocks))
    table = torch.arange(blocks, dtype=torch.int32).view(batch, per_row)
    model.prefill(
        prompts,
        page_table=table,
        prompt_lens=torch.full((batch,), prompt_len),
        chunk_start=torch.zeros(batch, dtype=torch.long),
    )
    positions = torch.full((batch,), prompt_len)
    return model.decode(step, positions=positions, page_table=table)


def test_graph_safe_decode_takes_the_sync_free_path_and_agrees() -> None:
    model = _model()
    dynamic = _decode(model, 3)
    assert not any(block.graph_safe for block in model.moe_blocks())
    model.graph_safe = True
    static = _decode(model, 3)
    assert all(block.graph_safe for block in model.moe_blocks())
    assert {block.path_for(3) for block in model.moe_blocks()} == {"gathered"}
    torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=1e-5)
    model.graph_safe = None
    _decode(model, 1)
    assert not any(block.graph_safe for block in model.moe_blocks())


def test_rows_sharing_and_splitting_experts_decode_as_they_do_alone() -> None:
    """A batch of 6 rows over 8 experts, top-2, in which some rows share an expert and some
    share none: each row's logits equal its own single-row run, on both paths."""
    model = _model()
    reference = None
    for path in ("batched", "per_row"):
        for block in model.moe_blocks():
            block.expert_path = path
        batch = _decode(model, 6)
        alone = torch.cat([_decode(model, 6, only=row) for row in range(6)])
        torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)
        if reference is not None:
            torch.testing.assert_close(batch, reference, atol=1e-5, rtol=1e-5)
        reference = batch
    # Layer 0's router on the step tokens' (normed) embeddings: shared and disjoint pairs.
    _, step = _inputs(6)
    layer = model.layers[0]
    hidden = layer.post_attention_layernorm(model.embed(step))
    experts = [set(row) for row in model.moe_blocks()[0].route(hidden).expert_ids.tolist()]
    pairs = [(a, b) for i, a in enumerate(experts) for b in experts[i + 1 :]]
    assert any(a & b for a, b in pairs) and any(not a & b for a, b in pairs)


def test_norm_topk_prob_changes_what_the_model_computes() -> None:
    model = _model()
    args = model.args
    assert isinstance(args, Qwen3MoeArgs)
    state = {k: v.clone() for k, v in model.canonical_state_dict().items()}
    other = Qwen3MoeModel.from_state_dict(attrs.evolve(args, norm_topk_prob=False), state)
    assert not torch.allclose(_decode(model, 2), _decode(other, 2), atol=1e-3)


def test_the_expert_path_record_round_trips_and_keeps_its_choice() -> None:
    plan = ExpertPathPlan(
        timings=(
            (1, (("batched", 10.04), ("per_row", 10.01))),
            (8, (("batched", 5.0), ("per_row", 9.0))),
        )
    )
    assert plan.paths == {1: "per_row", 8: "batched"}
    replayed = ExpertPathPlan.from_json(plan.to_json(), where="plan.json")
    # Rounded to 0.1 us the bucket-1 times tie; the recorded choice still holds.
    assert replayed.microseconds[1] == {"batched": 10.0, "per_row": 10.0}
    assert replayed.paths == plan.paths
    with pytest.raises(ValueError, match=r"plan\.json: expert paths .* are invalid"):
        ExpertPathPlan.from_json({"paths": []}, where="plan.json")
    with pytest.raises(ValueError, match="expert path 'fast' is unknown"):
        ExpertPathPlan.from_json(
            {"paths": [[1, "fast"]], "microseconds": [{"bucket": 1, "batched": 1.0}]},
            where="plan.json",
        )
    with pytest.raises(ValueError, match=r"choice .* is invalid"):
        ExpertPathPlan(timings=((1, (("batched", 1.0),)),), chosen=((1, "per_row"),))


def test_sleep_and_reload_cover_the_expert_weights() -> None:
    model = _model(seed=3)
    resident = model.resident_weights()
    for layer in range(model.n_layers):
        for name in ("moe.gate.weight", "moe.experts.gate_up", "moe.experts.down"):
            assert f"layers.{layer}.{name}" in resident
    source = _model(seed=4)
    pairs = model.reload_pairs(source)
    names = {pair.name for pair in pairs}
    assert "layers.1.moe.experts.down" in names
    for pair in pairs:
        with torch.no_grad():
            pair.target.copy_(pair.source)
    state = model.canonical_state_dict()
    for name, tensor in source.canonical_state_dict().items():
        assert torch.equal(state[name], tensor), name

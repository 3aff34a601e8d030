"""The family registry: recognition by HF config, GGUF architecture, preset and vLLM
architecture; refusals that name what was asked and list what is registered."""

from __future__ import annotations

import attrs
import pytest

from models import families as registry
from models.decoder.config import DecoderArgs
from models.families import Family, UnknownArchitectureError
from models.llama import LlamaArgs
from models.qwen3 import Qwen3Args


def test_checkpoints_are_recognised_by_every_key() -> None:
    assert registry.family_for_hf_config({"model_type": "qwen3"}).name == "qwen3"
    assert registry.family_for_hf_config({"model_type": "llama"}).name == "llama"
    by_arch = registry.family_for_hf_config({"architectures": ["Qwen3ForCausalLM"]})
    assert by_arch.name == "qwen3"
    assert registry.family_for_gguf("qwen3").name == "qwen3"
    assert registry.family_for_architectures(["LlamaForCausalLM"]).name == "llama"
    assert registry.family_for_args(Qwen3Args.tiny_random("qwen3")).name == "qwen3"
    assert registry.family_for_args(LlamaArgs.tiny_random("gqa")).name == "llama"
    assert isinstance(registry.tiny_random_args("tiny-random-qwen3-tied"), Qwen3Args)
    assert isinstance(registry.tiny_random_args("tiny-random"), LlamaArgs)
    assert registry.tiny_random_args("./a-folder") is None


def test_a_bare_decoder_args_builds_the_shared_decoder() -> None:
    bare = DecoderArgs(
        **{
            field.name: getattr(LlamaArgs.tiny_random("gqa"), field.name)
            for field in attrs.fields(DecoderArgs)
        }
    )
    assert registry.family_for_args(bare) is registry.DECODER


@pytest.mark.parametrize(
    ("lookup", "named"),
    [
        (lambda: registry.family_for_hf_config({"model_type": "mamba"}), "model_type='mamba'"),
        (lambda: registry.family_for_gguf("gemma3"), "general.architecture='gemma3'"),
        (lambda: registry.family_for_architectures(["FooForCausalLM"]), "FooForCausalLM"),
        (lambda: registry.family("mixtral"), "'mixtral'"),
    ],
)
def test_an_unknown_architecture_is_refused_listing_the_registered(
    lookup: object, named: str
) -> None:
    with pytest.raises(UnknownArchitectureError) as raised:
        lookup()  # type: ignore[operator]
    message = str(raised.value)
    assert named in message
    assert "llama (HF model_type llama, LlamaForCausalLM; GGUF llama)" in message
    assert "qwen3 (HF model_type qwen3, Qwen3ForCausalLM; GGUF qwen3)" in message


def test_an_unknown_preset_lists_every_familys_presets() -> None:
    with pytest.raises(ValueError, match=r"unknown tiny-random preset 'xl'.*tiny-random-qwen3"):
        registry.tiny_random_args("tiny-random-xl")


def test_a_family_claiming_anothers_checkpoints_is_refused() -> None:
    @attrs.frozen
    class Clash(DecoderArgs):
        HF_MODEL_TYPES = ("qwen3", "clash")

    with pytest.raises(ValueError, match=r"claims what family 'qwen3' has registered"):
        registry.register(Family(name="clash", config_class=Clash))
    assert "clash" not in {family.name for family in registry.families()}


def test_a_registered_family_is_found_and_can_leave() -> None:
    @attrs.frozen
    class Toy(DecoderArgs):
        HF_MODEL_TYPES = ("toy",)

    registry.register(Family(name="toy", config_class=Toy))
    try:
        assert registry.family_for_hf_config({"model_type": "toy"}).name == "toy"
    finally:
        registry.unregister("toy")
    with pytest.raises(UnknownArchitectureError):
        registry.family_for_hf_config({"model_type": "toy"})


def test_qwen3_refuses_sliding_windows_and_keeps_its_head_dim() -> None:
    config = {**Qwen3Args.tiny_random("qwen3").to_hf_config(), "use_sliding_window": True}
    with pytest.raises(ValueError, match=r"use_sliding_window=True is not supported"):
        Qwen3Args.from_hf_config(config)
    mixed = {**config, "use_sliding_window": False}
    mixed["layer_types"] = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"layer_types holds \['sliding_attention'\]"):
        Qwen3Args.from_hf_config(mixed)
    args = Qwen3Args.from_hf_config({**config, "use_sliding_window": False})
    assert args.head_dim == 32 and args.qk_norm
    with pytest.raises(ValueError, match=r"Qwen3Args.qk_norm=False is invalid"):
        attrs.evolve(args, qk_norm=False)

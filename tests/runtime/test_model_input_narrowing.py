"""The decode and prefill bodies hand the model torch tensors, and say so for other backends.

Device inputs are typed `DeviceTensor` (a ttnn tensor on ttnn); the model contract computes
with torch, so each body narrows its inputs once with `as_torch`: a foreign tensor fails
there, naming the input and the backend, before the model sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from runtime.decode_staging import DecodeDeviceInputs, run_decode_body
from runtime.prefill.inputs import PrefillDeviceInputs
from runtime.prefill.sequence_runner import run_prefill_body


class ForeignTensor:
    """A device tensor of another backend: it has a shape and nothing torch computes with."""

    @property
    def shape(self) -> Sequence[int]:
        return (2,)


class RecordingModel:
    """Returns fixed logits and remembers what decode and prefill were given."""

    vocab_size = 5

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def decode(
        self, tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append(("decode", (tokens, positions, page_table)))
        return torch.zeros(2, self.vocab_size)

    def prefill(
        self,
        tokens: torch.Tensor,
        *,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        chunk_start: torch.Tensor,
    ) -> torch.Tensor:
        self.calls.append(("prefill", (tokens, page_table, prompt_lens, chunk_start)))
        return torch.zeros(2, self.vocab_size)


def test_decode_body_passes_the_torch_inputs_themselves() -> None:
    model = RecordingModel()
    tokens, positions, table = torch.zeros(2), torch.ones(2), torch.zeros(2, 1)
    inputs = DecodeDeviceInputs(tokens=tokens, positions=positions, page_table=table)
    logits = run_decode_body(model, inputs, None, device_feedback=False, traced=False)
    assert isinstance(logits, torch.Tensor) and tuple(logits.shape) == (2, 5)
    name, given = model.calls[0]
    assert name == "decode"
    assert given[0] is tokens and given[1] is positions and given[2] is table


def test_decode_body_names_a_foreign_input_and_its_backend() -> None:
    model = RecordingModel()
    inputs = DecodeDeviceInputs(
        tokens=torch.zeros(2), positions=ForeignTensor(), page_table=torch.zeros(2, 1)
    )
    with pytest.raises(TypeError, match=r"decode positions must be a torch\.Tensor.*ttnn"):
        run_decode_body(model, inputs, None, device_feedback=False, traced=True)
    assert model.calls == []


def test_prefill_body_names_a_foreign_input_and_its_backend() -> None:
    model = RecordingModel()
    inputs = PrefillDeviceInputs(
        torch.zeros(2, 3), torch.zeros(2, 1), ForeignTensor(), torch.zeros(2)
    )
    with pytest.raises(TypeError, match=r"prefill prompt lengths must be a torch\.Tensor"):
        run_prefill_body(model, inputs)
    assert model.calls == []


def test_prefill_body_passes_the_torch_inputs_themselves() -> None:
    model = RecordingModel()
    values = (torch.zeros(2, 3), torch.zeros(2, 1), torch.ones(2), torch.zeros(2))
    run_prefill_body(model, PrefillDeviceInputs(*values))
    name, given = model.calls[0]
    assert name == "prefill"
    assert all(a is b for a, b in zip(given, values, strict=True))

"""One scheduler step's sampled rows, sorted by the sampler that takes them.

A facade call that got sampling parameters returns token ids; one that did not returns
logits, whose rows go to the runtime's sampler (requests it can sample) or to vLLM's
(the rest). Imports no vLLM, so the main suite tests it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from models.vllm_plugin.device_sampling import FacadeSampling


@attrs.define
class StepSamples:
    """One step's sampled rows: tokens the facade sampled, and host logit rows, split into
    device-samplable requests (the runtime's sampler) and the rest (vLLM's sampler)."""

    device_tokens: dict[str, int] = attrs.field(factory=dict)
    runtime_ids: list[str] = attrs.field(factory=list)
    runtime_logits: list[torch.Tensor] = attrs.field(factory=list)
    vllm_ids: list[str] = attrs.field(factory=list)
    vllm_logits: list[torch.Tensor] = attrs.field(factory=list)

    def collect(
        self,
        output: Any,
        sampling: FacadeSampling | None,
        rows: list[tuple[str, int]],
        on_device: set[str],
    ) -> None:
        """A facade call's sampled `(request, output row)` pairs; `on_device`: the requests
        the device could sample (their host rows go to the runtime's sampler)."""
        if not rows:
            return
        count = 1 + max(row for _, row in rows)
        if sampling is not None:
            tokens = sampled_tokens(output, count)
            self.device_tokens.update((req_id, int(tokens[row])) for req_id, row in rows)
            return
        logits = host_logits(output, count)
        for req_id, row in rows:
            if req_id in on_device:
                self.runtime_ids.append(req_id)
                self.runtime_logits.append(logits[row])
            else:
                self.vllm_ids.append(req_id)
                self.vllm_logits.append(logits[row])


def host_logits(output: Any, count: int) -> torch.Tensor:
    """Host logits as `[rows, vocab]` (the facade may return `[B, 1, V]` or a tuple)."""
    if isinstance(output, tuple):
        output = output[0]
    tensor = torch.as_tensor(output)
    if tensor.dim() == 3:
        tensor = tensor[:, -1, :]
    if tensor.dim() != 2 or tensor.shape[0] < count:
        raise RuntimeError(
            f"the facade returned output of shape {tuple(tensor.shape)}; expected logits "
            f"[>= {count}, vocab] for a call without sampling_params"
        )
    return tensor


def sampled_tokens(output: Any, count: int) -> torch.Tensor:
    """Sampled tokens as `[rows]` (the facade may return `(tokens, log_probs)`)."""
    if isinstance(output, tuple):
        output = output[0]
    tensor = torch.as_tensor(output)
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor[:, 0]
    if tensor.dim() != 1 or tensor.shape[0] < count or tensor.is_floating_point():
        raise RuntimeError(
            f"the facade returned output of shape {tuple(tensor.shape)} ({tensor.dtype}); "
            f"expected sampled token ids [>= {count}] for a call with sampling_params"
        )
    return tensor

"""Top-k expert routing: which experts a row goes to, and with what weight.

Qwen3-MoE routes as its checkpoint says: softmax over every expert's router logit (in
float32, whatever the hidden dtype), keep the `num_experts_per_tok` most probable, and
renormalise those to sum to one only when `norm_topk_prob` is set. The choice is made once
per row here; both expert paths (`experts`) consume the same `Routes`.
"""

from __future__ import annotations

import attrs
import torch


class RoutingError(ValueError):
    """A routing setting or input that cannot be used; the message names it and what is allowed."""


@attrs.frozen
class Routes:
    """Per row: the chosen experts (`[rows, k]`, int64) and their weights (`[rows, k]`).

    Columns are ordered by falling router probability; weights are in the hidden dtype.
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[1])


@attrs.frozen
class TopKRouting:
    """The routing rule of one checkpoint, checked when built so a bad config fails at load."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool

    def __attrs_post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int):
            raise RoutingError(
                f"num_experts={self.num_experts!r} is invalid: allowed is an integer >= 1"
            )
        if self.num_experts < 1:
            raise RoutingError(f"num_experts={self.num_experts} is invalid: allowed is >= 1")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 1 <= self.top_k <= self.num_experts
        ):
            raise RoutingError(
                f"num_experts_per_tok={self.top_k!r} is invalid: allowed is an integer in "
                f"1..num_experts ({self.num_experts})"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise RoutingError(
                f"norm_topk_prob={self.norm_topk_prob!r} is invalid: allowed are True and False"
            )

    def __call__(self, logits: torch.Tensor) -> Routes:
        """Routes for router logits `[rows, num_experts]` (one row per token)."""
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise RoutingError(
                f"router logits of shape {tuple(logits.shape)} are invalid: allowed is "
                f"[rows, {self.num_experts}]"
            )
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routes(expert_ids=expert_ids, weights=weights.to(logits.dtype))

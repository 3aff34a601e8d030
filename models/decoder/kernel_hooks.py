"""The kernel-plan hooks of `DecoderModel`: warmup measures (or replays) a plan and applies it.

Mixed into the model because the runtime calls them on it (`choose_kernels`, `adopt_kernels`)
and the CLI replays a recorded plan through it (`replay_kernels`); how each form is measured
is in `kernels`. A plan also picks how the dynamic decode attends (`decode_attention`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from models.decoder.attention_choice import choose_in_place_attention
from models.decoder.fused_choice import TimedDecoder, choose_fused_decode
from models.decoder.fused_decode import FusedDecodeStack, fused_unsupported_reason
from models.decoder.kernel_measure import fixed_plan, measure_kernel_plan, row_buckets
from models.decoder.kernels import (
    IN_PLACE_ATTENTION,
    READ_PASS,
    SPREAD,
    KernelPlan,
    ProjectionShape,
    check_plan_fits,
    parse_kernel_plan,
)
from models.decoder.layers import DecoderLayer, Projection
from models.progress import ProgressSink
from runtime.backends import native_kernels
from runtime.backends.heap import release_free_heap
from runtime.json_types import JSONObject, JSONValue

logger = logging.getLogger(__name__)


class KernelPlanHooks:
    """Kernel-plan state and hooks over the model's projections (`layers`, `lm_head`)."""

    device: torch.device
    dtype: torch.dtype
    layers: nn.ModuleList
    lm_head: Projection
    decode_attention: str | None
    fused_decode: FusedDecodeStack | None

    def _init_kernel_state(self) -> None:
        """No plan yet: the default forms, decode attention chosen by availability, no
        fused decode stack."""
        self.decode_attention = None
        self.fused_decode = None
        # `--weights stored-int8`: warmup may run block products with int8 activations (not
        # bit-equal to float32 ones, so never chosen unless asked for).
        self.int8_activations: bool = bool(getattr(self, "int8_activations", False))
        self.kernel_plan: KernelPlan | None = None
        self._replay_plan: KernelPlan | None = None

    def projection_groups(self) -> dict[str, list[Projection]]:
        """Every projection by kind (one per layer; `lm_head` once), in a fixed order."""
        groups: dict[str, list[Projection]] = {}
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for name in layer.projection_names():
                groups.setdefault(name, []).append(getattr(layer, name))
        groups["lm_head"] = [self.lm_head]
        return groups

    def projection_shapes(self) -> dict[str, ProjectionShape]:
        """Each projection kind's geometry (what a kernel plan must cover)."""
        return {
            name: ProjectionShape(
                m[0].in_features, m[0].out_features, m[0].parts, len(m), m[0].block_source
            )
            for name, m in self.projection_groups().items()
        }

    def replay_kernels(self, plan: KernelPlan, *, where: str = "kernels") -> None:
        """Use `plan` at warmup instead of measuring; checked against this model now.

        `where` names the plan's origin in errors (the CLI passes `--kernels FILE`).
        """
        check_plan_fits(plan, self.projection_shapes(), where)
        if plan.decode_attention in IN_PLACE_ATTENTION:
            reason = self._inplace_unavailable()
            if reason is not None:
                raise ValueError(
                    f"{where}: decode_attention {plan.decode_attention!r} cannot run here "
                    f"({reason}): allowed here is 'gather'"
                )
        self._check_fused_runs(plan, where)
        self._replay_plan = plan

    def adopt_kernels(self, data: JSONObject) -> None:
        """Replay another lane's kernel plan (its JSON), checked against this model now."""
        self.replay_kernels(parse_kernel_plan(data, where="lane 0's kernel plan"))

    def choose_kernels(
        self, *, decode_rows: int, prefill_rows: int, progress: ProgressSink | None = None
    ) -> dict[str, JSONValue]:
        """Warmup's hook: measure (or replay) the kernel plan, apply it, return its JSON.

        Measures each projection at the row buckets of a lane of `decode_rows` slots and
        prefill chunks of `prefill_rows` tokens (`kernel_measure.measure_kernel_plan`), reporting
        each measurement to `progress`. Once a plan is applied, later calls return it
        unchanged.
        """
        if self.kernel_plan is None:
            buckets = row_buckets(decode_rows, prefill_rows)
            plan = self._resolve_kernel_plan(buckets, progress)
            self.apply_kernel_plan(plan)
            if self._replay_plan is None and self.device.type == "cpu":
                # The fused decode stack is timed against the per-op path as just applied.
                self.apply_kernel_plan(choose_fused_decode(self._model(), plan))
            release_free_heap()  # the layouts tried and dropped (~150 MB for SmolLM2 Q4_1)
        assert self.kernel_plan is not None
        return self.kernel_plan.to_json()

    def _resolve_kernel_plan(
        self, buckets: Sequence[int], progress: ProgressSink | None
    ) -> KernelPlan:
        if self._replay_plan is not None:
            return self._replay_plan
        attention, notes = self._attention_choice()
        if self.device.type != "cpu":
            source = f"fixed ({self.device.type}: F.linear, nothing timed)"
            return fixed_plan(
                self, buckets=buckets, attention=attention, source=source, notes=notes
            )
        return measure_kernel_plan(
            self, buckets=buckets, attention=attention, notes=notes, progress=progress
        )

    def _inplace_unavailable(self) -> str | None:
        """Why the in-place paged decode attention cannot run for this model, or None."""
        if self.device.type != "cpu":
            return f"the native kernel is CPU-only, the model is on {self.device.type}"
        return native_kernels.unavailable_reason()

    def _attention_choice(self) -> tuple[str, tuple[str, ...]]:
        if self.decode_attention is not None:
            return self.decode_attention, ("decode attention set by the caller",)
        reason = self._inplace_unavailable()
        if reason is not None:
            return "gather", (f"in-place paged attention unavailable: {reason}",)
        args = self._model().args
        kind, note = choose_in_place_attention(
            n_kv_heads=args.n_kv_heads,
            group=args.n_heads // args.n_kv_heads,
            head_dim=args.head_dim,
            dtype=self.dtype,
        )
        return kind, (note,)

    def apply_kernel_plan(self, plan: KernelPlan) -> None:
        """Lay every projection out and pick its forms as `plan` says (checked first)."""
        where = f"kernel plan ({plan.source})"
        check_plan_fits(plan, self.projection_shapes(), where)
        self._check_fused_runs(plan, where)
        for name, modules in self.projection_groups().items():
            choice = plan.choice(name)
            for module in modules:
                module.apply_choice(choice)
        self.fused_decode = None
        if plan.fused_decode:
            self.fused_decode = FusedDecodeStack(
                self._model(),
                plan.buckets,
                plan.fused_decode,
                activations=plan.fused_activations,
                spread_attention=plan.decode_attention == SPREAD,
                head_rows=plan.head_in_stack(),
            )
        self.decode_attention = plan.decode_attention
        self.kernel_plan = plan
        logger.info("%s", plan.summary())

    def _decodes_in_place(self) -> bool:
        attention = self.decode_attention
        if attention is None:
            attention = READ_PASS if self._inplace_unavailable() is None else "gather"
        return attention in IN_PLACE_ATTENTION

    # ------------------------------------------------------------ fused decode stack
    def _model(self) -> TimedDecoder:
        """This mixin as the model it is mixed into, seen through what the fused stack needs
        (so the hooks do not import the model that imports them)."""
        return cast(TimedDecoder, self)

    def _check_fused_runs(self, plan: KernelPlan, where: str) -> None:
        """Refuse a plan choosing the fused decode stack where it cannot run (named by
        `where`), before anything changes."""
        if not plan.fused_decode:
            return
        reason = fused_unsupported_reason(self._model())
        if reason is not None:
            raise ValueError(
                f"{where}: fused_decode buckets {list(plan.fused_decode)} cannot run here "
                f"({reason}): allowed here is none"
            )

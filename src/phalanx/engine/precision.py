"""Mixed precision: autocast contexts, dynamic loss scaling for fp16, and the dtype report.

Master weights, gradients and optimizer state stay in the parameters' own dtype (fp32 for a model built
in fp32); autocast runs the forward in the low-precision dtype. fp16 scales the loss so that small
gradients do not underflow, and skips a step whose gradients overflowed, lowering the scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.config.general import PRECISIONS

__all__ = ["Precision", "LossScaling", "loss_scaling", "precision_report"]

_AUTOCAST_DTYPE = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class LossScaling:
    """How fp16's loss scale moves. The defaults are torch's GradScaler; a DeepSpeed ``fp16`` block sets DeepSpeed's
    (window 1000, hysteresis 2, min 1). ``static`` fixes the scale (a step with an overflow is still skipped)."""

    init: float = 65536.0
    window: int = 2000
    hysteresis: int = 1
    min: float | None = None
    static: float | None = None

    @property
    def is_torchs(self) -> bool:
        return self == LossScaling()


def loss_scaling(config: Any) -> LossScaling:
    """The loss-scaling policy of an EngineConfig's ``loss_scale*`` settings."""
    return LossScaling(
        init=config.loss_scale_init,
        window=config.loss_scale_window,
        hysteresis=config.loss_scale_hysteresis,
        min=config.loss_scale_min,
        static=config.loss_scale,
    )


class _ScaleSchedule:
    """DeepSpeed's dynamic loss scale (0.19): halve after ``hysteresis`` overflows (never below ``min``; where
    DeepSpeed stops the run at the minimum, we go on skipping overflowed steps), and double after every ``window``
    clean steps that follow the step after the last overflow, restoring the hysteresis budget too."""

    def __init__(self, policy: LossScaling) -> None:
        self.policy = policy
        self.scale = policy.static or policy.init
        self.hysteresis_left = policy.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def next(self, overflow: bool) -> float:
        p = self.policy
        if p.static is not None:
            return p.static
        if overflow:
            if p.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, p.min or 0.0)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        elif (stable := self.iteration - self.last_overflow - 1) > 0 and stable % p.window == 0:
            self.hysteresis_left = p.hysteresis
            self.scale *= 2.0
        self.iteration += 1
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow": self.last_overflow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.hysteresis_left = float(state["scale"]), int(state["hysteresis_left"])
        self.iteration, self.last_overflow = int(state["iteration"]), int(state["last_overflow"])


class Precision:
    """One precision policy for one Engine. ``name`` is one of :data:`PRECISIONS`."""

    def __init__(self, name: str, device: torch.device, scaling: LossScaling | None = None) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; valid precisions: {', '.join(PRECISIONS)}")
        self.name = name
        self.device = device
        self.compute_dtype = _AUTOCAST_DTYPE[name]
        scaling = scaling or LossScaling()
        # GradScaler supplies the loss-scaling mechanics (scaling, unscaling, inf checks); we decide when it runs.
        # With torch's policy it also moves the scale; otherwise _ScaleSchedule does, DeepSpeed's way.
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=scaling.static or scaling.init, growth_interval=scaling.window)
            if name == "fp16-mixed"
            else None
        )
        self.schedule = None if scaling.is_torchs or self.scaler is None else _ScaleSchedule(scaling)
        self._overflow_in_round = False
        self._unscaled: set[int] = set()
        self._stepped: set[int] = set()
        self.found_inf_group: Any = None
        """Set when gradients are sharded: an overflow on any rank's shard must skip the step on every rank."""
        self.sync_found_inf = False

    def autocast(self) -> ContextManager[Any]:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the (already reduced) gradients by the loss scale, once per step."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer unless fp16 gradients overflowed. Returns True when the step was skipped.

        The loss scale is updated once per round of optimizer steps (see :meth:`update`), not once per
        optimizer: with two optimizers, updating in between would unscale the second one's gradients twice.
        """
        if self.scaler is None:
            optimizer.step()
            return False
        if id(optimizer) in self._stepped:
            self.update()  # this optimizer steps again: the previous round is over
        self.unscale_(optimizer)
        found = self.scaler._found_inf_per_device(optimizer)
        if self.sync_found_inf:
            import torch.distributed as dist

            from phalanx.runtime.collective_log import watched

            for v in found.values():  # GradScaler.step reads these same tensors
                watched(dist.all_reduce, v, op=dist.ReduceOp.MAX, group=self.found_inf_group)
        # One host sync per step: GradScaler records whether this optimizer's gradients held an inf/nan.
        found_inf = sum(v.item() for v in found.values())
        self._overflow_in_round |= found_inf > 0
        self.scaler.step(optimizer)
        self._stepped.add(id(optimizer))
        return found_inf > 0

    def end_round_if_complete(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Update the scale once every optimizer has stepped in this round."""
        if all(id(o) in self._stepped for o in optimizers):
            self.update()

    def update(self) -> None:
        """Grow or back off the loss scale after a round of optimizer steps."""
        if self.scaler is not None and self._stepped:
            if self.schedule is not None:
                self.scaler.update(self.schedule.next(self._overflow_in_round))
            else:
                self.scaler.update()
            self._overflow_in_round = False
            self._stepped.clear()
            self._unscaled.clear()

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "name": self.name,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        if self.schedule is not None:
            state["schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.schedule is not None and state.get("schedule"):
            self.schedule.load_state_dict(state["schedule"])

    def report(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        optimizers: list[torch.optim.Optimizer],
        comm_dtype: torch.dtype | None,
    ) -> dict[str, str]:
        """The dtypes in use (``engine.precision_report``)."""

        def dtypes(tensors: Iterable[torch.Tensor]) -> str:
            found = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
            return ", ".join(found) if found else "none yet"

        state = [
            v
            for opt in optimizers
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return {
            "precision": self.name,
            "params": dtypes(params),
            "grads": dtypes(grads),
            "optimizer_state": dtypes(state),
            "compute": str(self.compute_dtype or dtypes(params)).replace("torch.", ""),
            "communication": str(comm_dtype).replace("torch.", "") if comm_dtype is not None else "none (one replica)",
            "loss_scaling": "none"
            if self.scaler is None
            else ("static" if self.schedule is not None and self.schedule.policy.static else "dynamic"),
        }


def agree_found_inf(precision: Precision, strategy: Any, topology: Any) -> None:
    """Make an fp16 overflow on any rank that holds different gradients skip the step on every rank."""
    from phalanx.runtime.comm import world_size

    shard_group = strategy.grad_shard_group()
    if topology.tp_size > 1 or topology.ep_size > 1:
        # the tp ranks (and the ep ranks, their experts) hold different gradients: an overflow anywhere skips everywhere
        precision.sync_found_inf, precision.found_inf_group = True, None
    elif strategy.shards_gradients and world_size(shard_group) > 1:
        # An fp16 overflow in any rank's share of the gradients must skip the step on every rank.
        precision.sync_found_inf, precision.found_inf_group = True, shard_group


def precision_report(precision: Precision, models: list[Any], optimizers: list[Any], comm_dtype: Any) -> dict[str, str]:
    """``engine.precision_report()``: the dtypes of the prepared models' parameters and gradients, the optimizers'
    state, compute and communication."""
    return precision.report(
        params=[p for m in models for p in m.parameters()],
        grads=[p.grad for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None],
        optimizers=[o.optimizer for o in optimizers],
        comm_dtype=comm_dtype,
    )

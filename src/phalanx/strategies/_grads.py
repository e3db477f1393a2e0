"""Gradients across replicas: the one contract for scaling them, the bucket layout, and the errors.

The gradient scale contract
---------------------------
A reduction *sums* gradients over the data-parallel group. What turns that sum into the gradient the user
meant is one factor per accumulation window, held by a :class:`GradScale` that every strategy owns:

- Whoever drives backward sets the factor before the window's last backward (``strategy.set_grad_scale``):
  - the Engine, for a mean loss, multiplies every micro-batch's loss by ``1/grad_accum_steps`` (as Accelerate
    does) and sets the factor to ``grad_accum_steps / (micro-batches in this window x dp)`` (``1/dp``, except for a
    short last window). The ``1/dp`` stays out of the loss so that a model the engine does not reduce (one that was
    not prepared) gets its plain gradients;
  - the Engine, for ``backward(loss_sum, items=n)``, leaves the loss alone and sets the factor to
    ``1 / (items summed over the window and the data-parallel group)``;
  - the pipeline schedule divides each micro-batch's mean loss by the number of micro-batches and sets the
    factor to ``1/dp`` (or, for summed losses, to ``1 / items over all micro-batches and replicas``).
- Left unset, the factor is ``1/dp``: a plain ``loss.backward()`` through a prepared model averages over the
  replicas, as torch DDP does.
- A strategy applies the factor exactly once per window, then it returns to ``1/dp``:
  - *before* the reduction where the whole window's gradient is in the buffer when the reduction starts
    (ddp, zero1: the bucket is scaled, then all-reduced or reduce-scattered);
  - *after* it where each backward's share is reduced as it comes (zero2, zero3: the shares add up unscaled in
    the reduced fp32 slice, which is multiplied once at the window's end).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.runtime.collective_log import watched
from phalanx.strategies.expert_parallel.params import is_expert

__all__ = ["GradScale", "build_buckets", "clip_to_norm_", "mesh_norm", "tp_replicas", "second_backward_error",
           "unused_parameters_error", "frozen_after_prepare_error"]  # fmt: skip


class GradScale:
    """The factor of the running window (see the module's contract); ``1/dp`` unless a driver set it."""

    __slots__ = ("default", "value")

    def __init__(self, dp_size: int) -> None:
        self.default = 1.0 / dp_size
        self.value: float | torch.Tensor = self.default

    def set(self, value: float | torch.Tensor) -> None:
        self.value = value

    def reset(self) -> None:
        """The window is reduced: the next one starts from the default."""
        self.value = self.default

    @property
    def is_one(self) -> bool:
        return isinstance(self.value, float) and self.value == 1.0

    def apply_(self, tensor: torch.Tensor) -> None:
        """Multiply ``tensor`` by the factor in place (nothing when it is 1)."""
        if self.is_one:
            return
        value = self.value
        tensor.mul_(value.to(tensor.device) if isinstance(value, torch.Tensor) else value)


def tp_replicas(p: torch.Tensor) -> int:
    """How many tensor-parallel ranks hold this same piece of ``p`` (its ``TPParam.replicas``; 1 without tp)."""
    info = getattr(p, "_phalanx_tp", None)
    return 1 if info is None else int(info.replicas)


def mesh_norm(
    pieces: list[tuple[torch.Tensor, int]], norm_type: float, device: torch.device, groups: list[Any]
) -> torch.Tensor:
    """The global ``norm_type`` norm of gradient pieces spread over a mesh: ``pieces`` are (gradient or slice of
    one, how many ranks of the groups hold that same piece); ``groups`` are the process groups over which ranks hold
    different pieces (the sum of powers, or the max, is combined over each). A piece held by r ranks is counted
    1/r times on each, so that a tensor-parallel replicated parameter counts once. In float64 on ``device``."""
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for g, r in pieces:
        if g.numel():
            by_replicas.setdefault(r, []).append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    # Each tensor's norm accumulates in float64 inside the kernel (dtype=): no float64 copy of any gradient, which
    # would be twice the gradients' size (four times in bf16) on every rank at once.
    if math.isinf(norm_type):
        for grads in by_replicas.values():
            norms = torch._foreach_norm(grads, norm_type, dtype=torch.float64)
            total = torch.maximum(total, torch.stack([n.to(device) for n in norms]).max())
        for group in groups:
            watched(dist.all_reduce, total, op=dist.ReduceOp.MAX, group=group)
        return total
    for r, grads in by_replicas.items():
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float64)
        total += (torch.stack([n.to(device) for n in norms]) ** norm_type).sum() / r
    for group in groups:
        watched(dist.all_reduce, total, group=group)
    return total ** (1.0 / norm_type)


def mesh_pieces(
    params: list[Any], grads: list[torch.Tensor], topology: Any, stages: bool = False
) -> tuple[list[tuple[torch.Tensor, int]], list[Any]]:
    """:func:`mesh_norm`'s pieces and groups for whole gradients under tensor and expert parallelism (and, with
    ``stages``, the pipeline): a tp-replicated piece counts once over tp; a dense piece is the same on every ep rank,
    so it counts ``1/ep`` on each, while the ep ranks' experts differ."""
    ep = topology.ep_size
    pieces = [(g, tp_replicas(p) * (1 if is_expert(p) else ep)) for p, g in zip(params, grads)]
    sizes = [(topology.tp_group, topology.tp_size), (topology.ep_group, ep)]
    if stages:
        sizes.insert(0, (topology.pp_group, topology.pp_size))
    return pieces, [g for g, n in sizes if n > 1]


def clip_to_norm_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` by ``max_norm / total`` when ``total`` (their global norm) is above ``max_norm``. A non-finite
    norm leaves them as they are (torch would multiply every gradient by NaN), so that the non-finite guard can
    name the parameters the NaN is in. No host sync."""
    coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


def build_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``bucket_bytes`` each (one parameter may exceed it alone), never
    mixing dtypes or devices: what one collective reduces at once."""
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


def second_backward_error(strategy: str, parameter: str | None = None) -> RuntimeError:
    where = f" (parameter {parameter!r})" if parameter else ""
    return RuntimeError(
        f"a second backward reached gradients that {strategy} already reduced in this step{where}. Step or zero the "
        "optimizer between backwards, put the earlier backwards under engine.no_sync() (or engine.accumulate()), and "
        "use activation checkpointing with use_reentrant=False (reentrant checkpointing runs a nested backward that "
        "would reduce some gradients twice)"
    )


def unused_parameters_error(strategy: str, names: list[str], when: str = "in this backward pass") -> RuntimeError:
    return RuntimeError(
        f"these trainable parameters received no gradient {when}: {', '.join(names)}. {strategy} reduces every "
        "parameter with requires_grad=True on every step. Make sure the forward uses them and the loss depends on "
        "them, freeze them with requires_grad_(False) before engine.prepare, or set find_unused_parameters=True to "
        "reduce them as zeros"
    )


def frozen_after_prepare_error(strategy: str, names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"parameters frozen after engine.prepare: {', '.join(names)}. {strategy} lays out gradient buffers at prepare "
        "time; set requires_grad_(False) before engine.prepare"
    )

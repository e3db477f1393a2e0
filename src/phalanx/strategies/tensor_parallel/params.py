"""Where each parameter of a tensor-parallel model lives: :class:`TPParam`, the local piece of a full tensor and back,
gradient-norm counting and the replicated-gradient check."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.runtime.collective_log import watched

__all__ = [
    "ReplicatedGradError",
    "TPParam",
    "check_replicated_grads",
    "tp_gather_full",
    "tp_grad_norm_sq",
    "tp_param_info",
    "tp_slice_of",
]

ATTR = "_phalanx_tp"


@dataclass(frozen=True)
class TPParam:
    """Where a parameter of a tensor-parallel model lives; ``apply_tp_plan`` sets one on every parameter as
    ``p._phalanx_tp``.

    ``full_shape``: the whole parameter's shape. ``dim``: the dim it is split along, or None when every tp rank holds
    it whole. Along ``dim`` the full tensor is read as ``packed`` equal blocks (1 for a plain weight; 3 for a fused
    ``qkv`` projection whose out dim is ``[q; k; v]``; 2 for transformers' ``packed_colwise`` ``[gate; up]``), each
    block is cut into ``parts`` equal chunks (``torch.chunk`` order), and the local tensor is chunk ``index`` of every
    block, concatenated in block order. With ``packed=1`` that is simply ``full.chunk(parts, dim)[index]``.

    ``replicas``: how many tp ranks hold this same piece. tp rank ``r`` holds chunk ``r // replicas``, so the holders
    of chunk ``i`` are ranks ``i * replicas ... (i + 1) * replicas - 1`` and the first of them writes it to a
    checkpoint (:meth:`writer`). A plainly split parameter has ``parts = tp, replicas = 1``; a replicated one
    ``dim = None, parts = 1, index = 0, replicas = tp``; the key/value projections of grouped-query attention with
    fewer kv heads than tp ranks have ``parts = num_kv_heads, replicas = tp // num_kv_heads``.

    ``grad_sync``: True when the tensor-parallel layers already sum this parameter's gradient over its holders in the
    backward (replicated parameters used on sequence shards, replicated kv heads, ``replicated_with_grad_allreduce``),
    so that afterwards every holder has the same, complete gradient. Replicated parameters with ``grad_sync=False``
    get complete, equal gradients without it (they act on replicated activations).

    ``style``: the plan style that placed it ("" for a parameter no plan entry named).
    """

    full_shape: tuple[int, ...]
    dim: int | None
    index: int
    parts: int
    replicas: int
    grad_sync: bool
    packed: int = 1
    style: str = ""

    def __post_init__(self) -> None:
        if self.dim is None:
            assert self.parts == 1 and self.index == 0 and self.packed == 1, self
        else:
            assert 0 <= self.index < self.parts and self.full_shape[self.dim] % (self.parts * self.packed) == 0, self

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    def writer(self, tp_rank: int) -> bool:
        """Whether ``tp_rank`` is the holder that writes this piece to a checkpoint (the first of its holders)."""
        return tp_rank % self.replicas == 0


def tp_param_info(p: torch.Tensor) -> TPParam | None:
    """The :class:`TPParam` of a parameter of a planned model; None for any other tensor."""
    info = getattr(p, ATTR, None)
    return info if isinstance(info, TPParam) else None


def tp_slice_of(full: torch.Tensor, info: TPParam) -> torch.Tensor:
    """This rank's local piece (as ``info`` describes it) of the full tensor ``full``."""
    if tuple(full.shape) != info.full_shape:
        raise ValueError(f"tp_slice_of: the full tensor has shape {tuple(full.shape)}, the parameter {info.full_shape}")
    if info.dim is None:
        return full
    blocks = full.chunk(info.packed, dim=info.dim)
    pieces = [b.chunk(info.parts, dim=info.dim)[info.index] for b in blocks]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=info.dim)).contiguous()


def tp_gather_full(local: torch.Tensor, info: TPParam, group: Any) -> torch.Tensor:
    """The full tensor from every tp rank's local piece: a collective over the tp ``group`` for split parameters
    (every rank of the group calls it, in the same order), a copy for replicated ones."""
    if info.dim is None:
        return local.detach().clone()
    if tuple(local.shape) != info.local_shape:
        raise ValueError(f"tp_gather_full: the local piece has shape {tuple(local.shape)}, expected {info.local_shape}")
    n = dist.get_world_size(group)
    if n != info.parts * info.replicas:
        raise ValueError(f"tp_gather_full: {info.parts} parts x {info.replicas} replicas do not make tp={n}")
    pieces = [torch.empty_like(local) for _ in range(n)]
    watched(dist.all_gather, pieces, local.detach().contiguous(), group=group, label="tp: gather full parameter")
    holders = [pieces[i * info.replicas] for i in range(info.parts)]  # the first holder of each chunk
    per_block = [h.chunk(info.packed, dim=info.dim) for h in holders]
    blocks = [torch.cat([pb[b] for pb in per_block], dim=info.dim) for b in range(info.packed)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=info.dim)


def tp_grad_norm_sq(params: Iterable[torch.Tensor], group: Any) -> torch.Tensor:
    """The squared 2-norm of the whole model's gradient, each piece counted once: every rank sums its local squares
    divided by the piece's ``replicas``, and the sums are all-reduced over the tp ``group``. Parameters without a
    :class:`TPParam` count as replicated on every tp rank."""
    n = dist.get_world_size(group)
    params = list(params)
    total: torch.Tensor | None = None
    for p in params:
        if p.grad is None:
            continue
        info = tp_param_info(p)
        replicas = info.replicas if info is not None else n
        sq = p.grad.detach().float().pow(2).sum() / replicas
        total = sq if total is None else total + sq
    if total is None:  # on the device all the same: the all-reduce below goes to NCCL there
        total = torch.zeros((), device=params[0].device if params else None)
    total = total.reshape(1).clone()
    watched(dist.all_reduce, total, group=group, label="tp: gradient norm")
    return total[0]


class ReplicatedGradError(RuntimeError):
    """Ranks that hold the same piece of a parameter have different gradients: its gradient is a partial sum that
    nothing reduced. The message names the parameters."""


def check_replicated_grads(model: nn.Module, group: Any, rtol: float = 1e-5) -> None:
    """Debug check (a collective over the tp ``group``): every parameter held by several tp ranks (replicated ones,
    replicated kv heads) must have the same gradient on each of them. Each rank sends two checksums per such
    parameter (the sum and a position-weighted sum of its gradient); the ranks' values are compared and
    :class:`ReplicatedGradError` names every parameter whose holders disagree. Call it once after a backward."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # The checksums stay on the parameters' device: the all-gather goes to NCCL there, which takes no host tensor.
    device = next(model.parameters()).device
    names: list[str] = []
    infos: list[TPParam] = []
    sums: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        info = tp_param_info(p)
        if info is None:
            info = TPParam(tuple(p.shape), None, 0, 1, n, False)
        if info.replicas <= 1:
            continue
        names.append(name)
        infos.append(info)
        if p.grad is None:
            sums.append(torch.tensor([float("nan"), float("nan"), 1.0], dtype=torch.float64, device=device))
            continue
        g = p.grad.detach().double().flatten()
        weights = torch.linspace(1.0, 2.0, g.numel(), dtype=torch.float64, device=g.device)
        sums.append(torch.stack([g.sum(), (g * weights).sum(), g.abs().sum()]).to(device))
    local = torch.stack(sums) if sums else torch.zeros((0, 3), dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(n)]
    watched(dist.all_gather, gathered, local, group=group, label="tp: replicated gradient check")
    gathered = list(torch.stack(gathered).cpu())  # read below value by value: one copy to the host, not one per read
    bad = []
    for k, (name, info) in enumerate(zip(names, infos, strict=True)):
        holders = [r for r in range(n) if r // info.replicas == rank // info.replicas]
        values = torch.stack([gathered[r][k] for r in holders])
        missing = torch.isnan(values).any(dim=1)
        if missing.any():
            if not missing.all():
                with_grad = [holders[i] for i in range(len(holders)) if not missing[i]]
                bad.append(f"{name} (a gradient on tp ranks {with_grad} only)")
            continue
        scale = values[:, 2].abs().max().clamp_min(1e-30)
        spread = (values[:, :2] - values[0, :2]).abs().max() / scale
        if spread > rtol:
            bad.append(f"{name} (sums {[round(float(v), 8) for v in values[:, 0]]} on tp ranks {holders})")
    if bad:
        raise ReplicatedGradError(
            f"{len(bad)} parameter(s) held by several tp ranks have different gradients on them, so their copies "
            f"would drift apart: {'; '.join(bad)}. Their gradients are partial sums: plan them with "
            "'replicated_with_grad_allreduce' (or 'sequence_parallel' for norms on sequence shards)"
        )

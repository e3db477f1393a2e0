"""Where an expert parameter lives under expert parallelism: :class:`EPParam`, and the helpers the data-parallel
strategies use to treat expert parameters apart from the dense ones."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ATTR", "EPParam", "ep_param_info", "expert_report", "is_expert", "kind_runs", "split_dense_experts"]

ATTR = "_phalanx_ep"


@dataclass(frozen=True)
class EPParam:
    """An expert parameter split over the ep ranks along dim 0 (the expert dim): this rank holds experts
    ``[index * local, (index + 1) * local)`` of ``full_shape[0]``, where ``local = full_shape[0] // parts``.

    Dim 0 is the outermost, so the local tensor is one contiguous run of the whole flattened tensor, starting at
    ``index * numel(local)``: a checkpoint needs no chunk layout for it, only an offset (``checkpoint.py``).
    ``full_shape`` is the shape of the tensor the ep split cut (under tensor parallelism, the tp piece)."""

    full_shape: tuple[int, ...]
    parts: int
    index: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.full_shape[0] // self.parts, *self.full_shape[1:])

    @property
    def local_numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    @property
    def offset(self) -> int:
        """Where this rank's run starts in the whole flattened tensor."""
        return self.index * self.local_numel


def ep_param_info(p: Any) -> EPParam | None:
    info = getattr(p, ATTR, None)
    return info if isinstance(info, EPParam) else None


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is one ep rank's experts (reduced over the expert-replica ranks, not every dp rank)."""
    return ep_param_info(p) is not None


def kind_runs(params: Iterable[Any]) -> list[tuple[bool, list[Any]]]:
    """``params`` cut, in order, into runs of experts (True) or dense parameters (False): a gradient bucket or zero
    segment never mixes the two, which reduce over different ranks."""
    runs: list[tuple[bool, list[Any]]] = []
    for p in params:
        kind = is_expert(p)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(p)
        else:
            runs.append((kind, [p]))
    return runs


def split_dense_experts(params: Iterable[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """``params`` in order, as (dense, experts)."""
    dense: list[Any] = []
    experts: list[Any] = []
    for p in params:
        (experts if is_expert(p) else dense).append(p)
    return dense, experts


def expert_report(params: Iterable[Any], topology: Any) -> dict[str, Any]:
    """``memory_report()["experts"]``: the expert elements this rank's experts have against the whole layers' (a
    fraction ``1/ep``), before any zero sharding of them (which the report's held bytes include)."""
    infos = [i for i in (ep_param_info(p) for p in params) if i is not None]
    held = sum(_numel(i.local_shape) for i in infos)
    whole = sum(_numel(i.full_shape) for i in infos)
    return {
        "ep_size": topology.ep_size,
        "expert_dp_size": topology.expert_dp_size,
        "expert_params_held": held,
        "expert_params_whole": whole,
        "fraction": held / whole if whole else 0.0,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

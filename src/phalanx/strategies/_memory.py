"""Memory accounting shared by the strategies' ``memory_report``: bytes held, and the ZeRO paper's prediction."""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["nbytes", "state_tensors", "state_bytes_per_element", "memory_report_dict"]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every non-scalar tensor of the optimizers' state (moments and the like)."""
    return [
        v
        for opt in optimizers
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def state_bytes_per_element(optimizers: list[torch.optim.Optimizer], state: list[torch.Tensor], numel: int) -> float:
    """Optimizer state bytes per parameter element: from the optimizer's kind, else measured."""
    per = []
    for opt in optimizers:
        name, d = type(opt).__name__, opt.defaults
        if name in ("Adam", "AdamW"):
            per.append(4 * (3 if d.get("amsgrad") else 2))
        elif name == "SGD":
            per.append(4 if d.get("momentum", 0) else 0)
    if len(per) == len(optimizers) and len(set(per)) == 1:
        return float(per[0])
    return nbytes(state) / numel if numel else 0.0


def memory_report_dict(
    name: str, psi: int, n: int, p: int, k: float, held: dict[str, int], predicted: dict[str, float], offload: str
) -> dict[str, Any]:
    """The report's shape, for every strategy: ``held`` bytes by kind beside the ``predicted`` ones."""
    return {
        "strategy": name,
        "world_size": n,
        "trainable_params": psi,
        "param_bytes_per_element": p,
        "state_bytes_per_element": k,
        "offload": offload,
        "held": held,
        "held_total": sum(v for key, v in held.items() if key not in ("comm_buffers", "offloaded_to_disk")),
        "predicted": {key: int(v) for key, v in predicted.items()},
        "predicted_total": int(sum(predicted.values())),
    }

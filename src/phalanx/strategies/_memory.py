"""Memory accounting shared by the strategies' ``memory_report``: bytes held, and the ZeRO paper's prediction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "nbytes",
    "state_tensors",
    "state_bytes_per_element",
    "memory_report_dict",
    "segment_grad_bytes",
    "expected_peak",
]


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


def segment_grad_bytes(segments: Iterable[Any]) -> int:
    """Bytes of the zero segments' gradient buffers: whole (zero1) and reduced slices, each counted once."""
    total = 0
    for s in segments:
        if s.grad_full is not None:
            total += s.grad_full.numel() * s.grad_full.element_size()
        if s.master_grad is not None and not (
            s.grad_full is not None and s.master_grad.data_ptr() == s.grad_full[s.lo :].data_ptr()
        ):
            total += s.master_grad.numel() * s.master_grad.element_size()
    return total


def expected_peak(
    report: dict[str, Any],
    optimizers: list[torch.optim.Optimizer],
    largest_piece: int,
    largest_grad: int,
    resident_chunk: int = 0,
) -> dict[str, Any]:
    """Add ``transient`` and ``expected_peak`` to a zero strategy's report.

    ``transient``: what a step allocates and frees beyond the held bytes: autograd's fresh gradient of the largest
    parameter before it is copied into its bucket (``largest_grad``; zero3 counts its units' gradients in its
    communication buffers and passes 0), and Adam's two temporaries of the largest piece it steps
    (``exp_avg_sq.sqrt() / c``: torch's single-tensor Adam on the host; SGD steps in place); and with ``offload:
    disk``, the chunk of offloaded state being stepped (``resident_chunk``: twice ``offload_chunk_mb`` at most, as the
    first step makes a chunk's new state in memory and then copies it into the files). ``expected_peak``: the
    bytes the process should need at its peak beyond the runtime's own baseline and the activations: held in
    memory, the communication buffers, and the transients.
    """
    adam = any(type(o).__name__ in ("Adam", "AdamW") for o in optimizers)
    report["transient"] = largest_grad + (2 * 4 * largest_piece if adam else 0) + resident_chunk
    report["expected_peak"] = report["held_total"] + report["held"]["comm_buffers"] + report["transient"]
    return report

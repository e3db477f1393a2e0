"""Predictions and labels as the evaluation loop carries them: tensors, or tuples, lists and dicts of them.

A model may return several outputs, and batches may differ in length along their second dimension (a sequence). As
in Hugging Face's Trainer, each batch is padded along that dimension with -100 to the longest on any rank before it
is gathered, batches are concatenated padding to the longest so far, and the result reaches ``compute_metrics`` as
numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["PAD_INDEX", "nested_map", "pad_dim1", "concat", "numpify", "first_tensor"]

PAD_INDEX = -100


def nested_map(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` on every tensor of ``x``, keeping its structure (a namedtuple stays one)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return type(x)({k: nested_map(v, fn) for k, v in x.items()})  # type: ignore[call-arg]
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(nested_map(v, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(nested_map(v, fn) for v in x)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    nested_map(x, lambda t: out.append(t))
    return out


def first_tensor(x: Any) -> torch.Tensor | None:
    found = _tensors(x)
    return found[0] if found else None


def pad_dim1(t: torch.Tensor, length: int, value: int = PAD_INDEX) -> torch.Tensor:
    """``t`` padded with ``value`` along its second dimension to ``length`` (a 0-d or 1-d tensor as it is)."""
    if t.dim() < 2 or t.shape[1] >= length:
        return t
    out = t.new_full((t.shape[0], length, *t.shape[2:]), value)
    out[:, : t.shape[1]] = t
    return out


def concat(a: Any, b: Any, value: int = PAD_INDEX) -> Any:
    """``b`` appended to ``a`` along the first dimension, padding the second to the longer of the two."""
    if a is None:
        return b
    if isinstance(a, torch.Tensor):
        if a.dim() >= 2 and b.dim() >= 2 and a.shape[1] != b.shape[1]:
            length = max(a.shape[1], b.shape[1])
            a, b = pad_dim1(a, length, value), pad_dim1(b, length, value)
        return torch.cat([a.reshape(1) if a.dim() == 0 else a, b.reshape(1) if b.dim() == 0 else b])
    if isinstance(a, Mapping):
        return type(a)({k: concat(a[k], b[k], value) for k in a})  # type: ignore[call-arg]
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(concat(x, y, value) for x, y in zip(a, b)))
    return type(a)(concat(x, y, value) for x, y in zip(a, b))


def numpify(x: Any) -> Any:
    """Tensors as numpy arrays (bfloat16 as float32, which numpy lacks); the structure kept."""

    def one(t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    return nested_map(x, one)

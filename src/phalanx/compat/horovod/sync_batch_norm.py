"""``hvd.SyncBatchNorm``: batch normalization with the statistics of the whole batch, every rank's part of it.

In training, each rank sums its count, its values and their squares per channel (in float64), and one all-reduce
gives the whole batch's mean and variance. That all-reduce is ``hvd.allreduce`` with op Sum, whose gradient is the
all-reduce of the gradient, so backward gives every rank the gradient of the whole batch's loss with respect to its
own inputs, as Horovod's hand-written backward does. The running statistics take the unbiased variance of the
whole batch. In evaluation (or on one rank) it is torch's batch norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx.compat.horovod.ops import allreduce
from phalanx.compat.horovod.process_sets import coordinator_of
from phalanx.compat.horovod.world import Sum, current

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats)``, for inputs of shape
    (N, C, ...); ``process_set`` limits the synchronisation to that set's ranks."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"hvd.SyncBatchNorm: expected an input of shape (N, C, ...) with at least 2 dimensions; got shape "
                f"{tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"hvd.SyncBatchNorm: the input has {input.shape[1]} channels (dimension 1) but the layer was built "
                f"for num_features={self.num_features}"
            )
        world = current("hvd.SyncBatchNorm")
        synced = self.training and world.distributed and coordinator_of(self.process_set, "hvd.SyncBatchNorm").size > 1
        if not synced:
            return super().forward(input)
        factor = 0.0
        if self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        wide = input.double()
        count = torch.tensor([input.numel() // channels], dtype=torch.float64, device=input.device)
        local = torch.cat([count, wide.sum(dims), (wide * wide).sum(dims)])
        total = allreduce(local, op=Sum, process_set=self.process_set, name=None)
        n = total[0]
        mean = total[1 : 1 + channels] / n
        var = (total[1 + channels :] / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * n / (n - 1) if n > 1 else var
                self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean.dtype))
                self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var.dtype))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (wide - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

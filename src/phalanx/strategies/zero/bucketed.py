"""zero1 and zero2: parameters stay whole; gradients are reduced bucket by bucket as backward fills them.

- zero1: gradients accumulate in full flat buffers (``param.grad`` is a view, as in ddp). At the end of an
  accumulation window they are reduce-scattered, each rank steps its slice, and the parameters are
  all-gathered back into the flat buffers that the model's parameters view.
- zero2: as zero1, but each bucket is reduce-scattered as soon as backward fills it, and the full gradient
  is dropped: only the rank's fp32 gradient slice persists. This happens on every backward, also inside
  accumulation windows and ``no_sync`` (keeping full gradients until the boundary would be zero1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.strategies._grads import build_buckets
from phalanx.strategies.expert_parallel.params import kind_runs
from phalanx.strategies.zero.base import ModelState, ZeroStrategy
from phalanx.strategies.zero.layout import Segment, padded_empty
from phalanx.strategies.zero.stepping import pipeline_steps

__all__ = ["Zero1Strategy", "Zero2Strategy", "BucketedZero"]


class BucketedZero(ZeroStrategy):
    """zero1 and zero2: the parameters stay whole; gradients are reduced bucket by bucket in backward."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().wrap_optimizer(optimizer)
        if self.world > 1 and self.store.mode != "disk" and self.comm_dtype_ is None:
            self._pipeline_steps(optimizer)
        return optimizer

    def _pipeline_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one bucket at a time, first layers first, and start each bucket's all-gather as soon as its
        slice is updated, so that the gathers overlap the rest of the step."""
        layout, params = self._optimizers[-1][1], self._optimizers[-1][2]
        segments = sorted(
            {seg.index: seg for seg, _ in (self._loc[p] for p in params if p in self._loc)}.values(),
            key=lambda seg: -seg.index,
        )  # buckets are in reverse order: the last one holds the first layers

        def parts() -> list[tuple[Any, list[list[nn.Parameter]]]]:
            groups = [g["params"] for g in optimizer.param_groups]
            return [
                (
                    target,
                    [
                        [piece for piece, (seg, _, _) in zip(ps, pieces) if seg is target]
                        for ps, pieces in zip(groups, layout)
                    ],
                )
                for target in segments
            ]

        def gather(seg: Segment) -> None:
            self._early_gathers[seg.index] = self.comm.gather(seg, async_op=True)

        pipeline_steps(optimizer, parts, gather)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        trainable = [p for p in model.parameters() if p.requires_grad]
        params = self._prepare_common(model, set(trainable))
        segments: list[Segment] = []
        for _, run in kind_runs(trainable[::-1]):  # reverse order, cut where dense parameters meet experts
            for bucket in build_buckets(run, int(self.dp_opts.bucket_mb * 2**20)):
                segments.append(self._segment(bucket, f"{self.name} bucket {len(segments)}"))
                self._add_segments(segments[-1:])
        self._register(model, params, segments)
        for s in segments:
            s.ready = [False] * len(s.params)
            s.pending = len(s.params)
            if self.grads_whole:
                for i, p in enumerate(s.params):
                    p.grad = s.grad_views[i]
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        return model

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        seg, i = self._loc[param]  # type: ignore[index]
        grad = param.grad
        assert grad is not None
        ms = seg.owner
        assert ms is not None
        if self.grads_whole:
            view = seg.grad_views[i]
            if grad is not view:  # gradients were dropped (after a step, or set_to_none): move autograd's tensor in
                view.copy_(grad)
                param.grad = view
            if not self.require_sync:
                self._clean.clear()
                self._window_seen.add(param)  # type: ignore[arg-type]
                return
        else:
            if seg.grad_full is None:
                seg.grad_full = padded_empty(seg, self.comm.pool)
            seg.view_of(i, seg.grad_full).copy_(grad)
            param.grad = None  # only this rank's slice of the reduced gradient is kept
        self._queue_final_callback(ms)
        if not seg.ready[i]:
            seg.ready[i] = True
            seg.pending -= 1
            if seg.pending == 0:
                self._launch_ready(ms)

    def _launch_ready(self, ms: ModelState) -> None:
        # Strictly in segment order, so that every rank issues the same collectives in the same order.
        while ms.next_segment < len(ms.segments) and ms.segments[ms.next_segment].pending == 0:
            seg = ms.segments[ms.next_segment]
            assert seg.grad_full is not None
            if self.grads_whole:
                # The window is complete and its factor known: scale before the reduction, as ddp does, so that
                # an all-reduced buffer holds the mean.
                self.scale.apply_(seg.grad_full)
            self.comm.reduce_scatter(seg, seg.grad_full)
            ms.next_segment += 1
            if self.comm.accumulates:
                self.comm.wait_inflight(keep=1)  # bound the full-size gradient buffers alive at once

    def _finish_backward_reductions(self, ms: ModelState) -> None:
        for s in ms.segments:
            if not s.pending:
                continue
            for i, p in enumerate(s.params):
                if s.ready[i]:
                    continue
                if p.requires_grad:
                    self._missing.append(self._names.get(p, "?"))
                else:
                    self._missing.append(f"{self._names.get(p, '?')} (frozen after engine.prepare: freeze before it)")
                if self.grads_whole:
                    view = s.grad_views[i]
                    if p.grad is not view:
                        view.zero_()
                        p.grad = view
                else:
                    if s.grad_full is None:
                        s.grad_full = padded_empty(s, self.comm.pool)
                    s.view_of(i, s.grad_full).zero_()
            s.pending = 0
        # Launch and wait even when about to raise: peers that did see these gradients wait in the same collectives.
        self._launch_ready(ms)
        for s in ms.segments:
            s.ready = [False] * len(s.params)
            s.pending = len(s.params)
        ms.next_segment = 0

    def reduce_window(self) -> None:
        """zero1 for a driver that ran every backward of the window with ``require_sync`` off (the pipeline
        schedule): the window's gradients are complete in the bucket buffers, so reduce-scatter them all now.
        Ends as the backward of a synced window would: reduced slices in place, unused parameters reported."""
        assert self.grads_whole
        for ms in self._models.values():
            if ms.reduced:
                raise RuntimeError(
                    f"{self.name} already reduced this step's gradients; "
                    "step or zero the optimizer before the next step"
                )
            for s in ms.segments:
                s.ready = [p in self._window_seen for p in s.params]
                s.pending = s.ready.count(False)
            ms.touched = True
        self._window_seen.clear()
        self._finalize_backward()

    def _comm_buffer_bytes(self) -> int:
        if self.grads_whole or not self.segments:
            return 0

        # Up to two buckets are reduced at once (the one in flight and the next): each a full-size gradient buffer
        # and, over several ranks, where the peers' slices land (p2p: one per peer; native: the reduced slice).
        def reducing(seg: Any) -> int:
            comm = self.comm._for(seg) or self.comm
            extra = {"p2p": comm.world - 1, "native": 1}.get(comm.mode, 0) if comm.world > 1 else 0
            return (seg.padded + extra * seg.shard_numel) * seg.full.element_size()

        return sum(sorted((reducing(s) for s in self.segments), reverse=True)[:2])


class Zero1Strategy(BucketedZero):
    """``strategy="zero1"``: optimizer state sharded; gradients reduce-scattered once per optimizer step."""

    name = "zero1"
    stage = 1
    grads_whole = True

    def _predicted(self, p: int, g: int, psi: int, n: int) -> dict[str, float]:
        # Whole gradients in the parameters' dtype, plus fp32 reduced slices for low-precision parameters.
        return {"params": p * psi, "grads": p * psi + (g * psi / n if p < 4 else 0)}


class Zero2Strategy(BucketedZero):
    """``strategy="zero2"``: optimizer state and gradients sharded; buckets reduce-scattered during backward."""

    name = "zero2"
    stage = 2

    def _predicted(self, p: int, g: int, psi: int, n: int) -> dict[str, float]:
        return {"params": p * psi, "grads": g * psi / n}

"""The zero strategies' collectives on flat segments: reduce-scatter of gradients, all-gather of parameters.

``zero_collectives="native"`` uses reduce-scatter and all-gather (the ZeRO traffic: 2Ψ(N-1)/N per step for
zero1/2, 3Ψ(N-1)/N for zero3). On gloo these are about three times slower than an all-reduce of the same buffer
(measured: 78 and 87 ms against 31 ms for 32 MiB on 2 ranks). Two ways round that on gloo:

- ``p2p`` (what ``auto`` picks on gloo): each rank sends each peer the slice that peer needs, with gloo's
  point-to-point sends, all posted at once; a reduce-scatter then adds the N-1 slices it received into its own.
  That is the native traffic, (N-1)/N of the buffer per rank each way, at gloo's point-to-point speed: 15 and 24 ms
  for the 32 MiB above (31 and 43 ms on 4 ranks, where the all-reduce takes 80). zero1, which keeps whole
  gradients, all-reduces them still, so that each ``p.grad`` holds the reduced whole.
- ``allreduce``: reduce-scatter is an all-reduce that keeps the slice; all-gather an all-reduce of a zeroed buffer
  holding the rank's slice. Twice the traffic of ``p2p``, in one collective each.

NCCL's native collectives are the fast ones there: ``auto`` picks them, and ``p2p`` is refused on NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats
from phalanx.strategies.zero.layout import Segment
from phalanx.strategies.zero.pool import BufferPool

__all__ = ["SegmentComm", "Done", "resolve_collectives", "DTYPES", "copy_to_host", "wait_for_device"]

_PIECE_MIN_NUMEL = 1 << 16  # reduce_scatter_pieces: the mean parameter size, in elements, from which it pays
_TAG = 1 << 20  # p2p tags: segment i gathers on _TAG + 2i and reduces on _TAG + 2i + 1, clear of the pipeline's 0

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_collectives(mode: str, group: Any) -> str:
    """``auto`` becomes ``p2p`` on gloo and ``native`` elsewhere; ``p2p`` is refused off gloo."""
    gloo = not dist.is_initialized() or dist.get_backend(group) == "gloo"
    if mode == "auto":
        return "p2p" if gloo else "native"
    if mode == "p2p" and not gloo:
        raise ValueError(
            f"zero_collectives='p2p' is for the gloo backend, and this process group uses {dist.get_backend(group)!r}, "
            "whose native reduce-scatter and all-gather are faster; use zero_collectives='auto' (or 'native')"
        )
    return mode


def wait_for_device(device: torch.device) -> None:
    """Block the host until the work queued so far on ``device``'s current stream has run: an event recorded there
    now, waited for. On the CPU every copy has finished when it returns: nothing to wait for."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None = None) -> None:
    """``dst`` (on the host) = ``src`` (on the device); with ``staging`` (a host buffer of at least ``src``'s size, in
    its dtype), ``dst += src`` instead, ``src`` landing in ``staging`` first. ``dst`` and ``staging`` are pinned on
    CUDA (``StateStore.host_zeros``), so the copy is a DMA issued ``non_blocking``; a dtype change is made on the
    device first, so that it stays one."""
    if staging is not None:
        landing = staging[: src.numel()].view_as(src)
    else:
        landing, src = dst, src.to(dst.dtype)
    landing.copy_(src, non_blocking=True)
    # A non_blocking copy to the host returns before the data has landed: the host reading ``landing`` (the add
    # below, or the optimizer stepping ``dst``) before the device has run it would read the old values, silently.
    wait_for_device(src.device)
    if staging is not None:
        dst.add_(landing)


class _AllDone:
    """Several point-to-point works waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class Done:
    """A collective's handle plus what to do once it has finished."""

    def __init__(self, work: Any, then: Callable[[], Any] | None) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            self.then()
            self.then = None


class SegmentComm:
    """Reduces and gathers segments over one data-parallel group.

    ``accumulates``: each reduced share is *added* to the segment's fp32 gradient slice and the full-size gradient
    is dropped (zero2, zero3: every backward reduces); otherwise the reduced slice replaces it (zero1: one
    reduction per window, of the whole window's gradient).
    """

    def __init__(
        self,
        group: Any,
        world: int,
        mode: str,
        comm_dtype: torch.dtype | None,
        stats: CommStats,
        accumulates: bool,
        replicas: tuple[Any, int] = (None, 1),
    ) -> None:
        """``replicas``: (group, size) of the ranks holding the same shard under hybrid sharding, over which each
        reduced shard is then all-reduced; size 1 for none."""
        self.group, self.world, self.mode, self.comm_dtype = group, world, mode, comm_dtype
        self.rep_group, self.rep_world = replicas
        self.stats, self.accumulates = stats, accumulates
        self.inflight: list[Segment] = []
        self.rank = dist.get_rank(group) if world > 1 else 0
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # where reduced slices land on the host (offload)
        # Per CUDA stream, an event after the latest copy that read a host slice (offload): the stream runs its work in
        # order, so waiting for the latest is waiting for them all, and the dict stays as small as the streams.
        self._host_reads: dict[int, Any] = {}
        # p2p: (group rank, global rank) of every other rank; sends and receives name global ranks.
        self.peers = [
            (j, dist.get_global_rank(group, j) if group is not None else j) for j in range(world) if j != self.rank
        ]
        self.experts: SegmentComm | None = None
        self.pool = BufferPool()  # the flat buffers of gathers and reductions, reused (see pool.py)

    def add_experts(self, group: Any, world: int) -> SegmentComm:
        """A sibling for the expert segments (``seg.expert``; expert parallelism): the same settings over the ranks
        that hold the same experts, one queue of reductions in flight with this one. Every call with an expert
        segment goes to it."""
        sib = SegmentComm(
            group, world, self.mode, self.comm_dtype, self.stats, self.accumulates, (self.rep_group, self.rep_world)
        )
        sib.inflight, sib._staging, sib.pool = self.inflight, self._staging, self.pool
        self.experts = sib
        return sib

    def _for(self, seg: Segment) -> SegmentComm | None:
        return self.experts if seg.expert and self.experts is not None and self.experts is not self else None

    def _exchange(
        self, send: Callable[[int], torch.Tensor], recv: Callable[[int], torch.Tensor], tag: int, label: str
    ) -> _AllDone:
        """Post, at once, a send of ``send(j)`` to and a receive into ``recv(j)`` from every other rank j."""
        works = []
        for j, peer in self.peers:
            works.append(watched(dist.isend, send(j), dst=peer, group=self.group, tag=tag, label=label))
            works.append(watched(dist.irecv, recv(j), src=peer, group=self.group, tag=tag, label=label))
        return _AllDone(works)

    def reduce_scatter(self, seg: Segment, flat: torch.Tensor) -> None:
        """Start summing ``flat`` (the full padded gradient) over ranks; this rank keeps its slice."""
        if (other := self._for(seg)) is not None:
            other.reduce_scatter(seg, flat)
            return
        seg.lent.append(flat)  # given back to the pool (when it came from it) once the reduction is finished
        if self.comm_dtype is not None and flat.dtype != self.comm_dtype:
            flat = flat.to(self.comm_dtype)
        # zero1 keeps whole gradients (each p.grad a view of them): under p2p it still all-reduces them, so that
        # every p.grad holds the reduced whole, as before the step of any stage that keeps them.
        mode = "allreduce" if self.mode == "p2p" and not self.accumulates else self.mode
        if self.world == 1:
            seg.work, seg.work_out = None, flat[seg.lo : seg.hi]
        elif mode == "allreduce":
            self.stats.record("all_reduce", flat, self.world)
            seg.work = watched(
                dist.all_reduce, flat, group=self.group, async_op=True, label=f"gradients of segment {seg.index}"
            )
            seg.work_out = flat[seg.lo : seg.hi]
        elif mode == "p2p":
            # Peer j gets its slice of this rank's gradient; this rank's slice gets the peers' shares added in place.
            n = seg.shard_numel
            got = {j: self.pool.take(n, flat.dtype, flat.device) for j, _ in self.peers}
            seg.lent += got.values()
            self.stats.record("reduce_scatter", flat, self.world)
            mine = flat[seg.lo : seg.hi]

            def add_shares() -> None:
                for j, _ in self.peers:
                    mine.add_(got[j])

            label = f"gradients of segment {seg.index}"
            sent = self._exchange(lambda j: flat[j * n : (j + 1) * n], got.__getitem__, _TAG + 2 * seg.index + 1, label)
            seg.work, seg.work_out = Done(sent, add_shares), mine
        else:
            out = self.pool.take(seg.shard_numel, flat.dtype, flat.device)
            seg.lent.append(out)
            self.stats.record("reduce_scatter", flat, self.world)
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            seg.work = watched(
                fn, out, flat, group=self.group, async_op=True, label=f"gradients of segment {seg.index}"
            )
            seg.work_out = out
        self.inflight.append(seg)

    def sends_pieces(self, seg: Segment) -> bool:
        """Whether :meth:`reduce_scatter_pieces` applies: p2p over several ranks, in the gradients' own dtype, and
        parameters large enough on average that a message per part costs less than copying them all into one buffer
        (a transformer block of biases and norms sends better in one piece)."""
        if (other := self._for(seg)) is not None:
            return other.sends_pieces(seg)
        return (
            self.mode == "p2p"
            and self.accumulates
            and self.world > 1
            and self.comm_dtype in (None, seg.dtype)
            and seg.numel >= _PIECE_MIN_NUMEL * len(seg.params)
        )

    def _pieces(self, seg: Segment, grads: list[torch.Tensor | None], j: int) -> list[torch.Tensor]:
        """The parts of ``grads`` (flat, one per parameter; None: no gradient, zeros) in rank j's slice, padding left
        out."""
        n = seg.shard_numel
        a, b = j * n, min((j + 1) * n, seg.numel)
        out = []
        for i, o in enumerate(seg.offsets):
            lo, hi = max(o, a), min(o + seg.shapes[i].numel(), b)
            if lo < hi:
                g = grads[i]
                out.append(
                    g[lo - o : hi - o] if g is not None else torch.zeros(hi - lo, dtype=seg.dtype, device=seg.device)
                )
        return out

    def reduce_scatter_pieces(self, seg: Segment, grads: list[torch.Tensor | None]) -> None:
        """:meth:`reduce_scatter` of the gradients where autograd left them: each peer is sent its slice's parts
        of them directly, with no copy into a full-size buffer first (p2p only: see :meth:`sends_pieces`)."""
        if (other := self._for(seg)) is not None:
            other.reduce_scatter_pieces(seg, grads)
            return
        n = seg.shard_numel
        mine_parts = self._pieces(seg, grads, self.rank)
        sizes = [t.numel() for t in mine_parts]
        filled = sum(sizes)  # the rest of the slice is padding, which stays zero

        def buffer() -> torch.Tensor:
            t = self.pool.take(n, seg.dtype, seg.device)
            t[filled:].zero_()
            seg.lent.append(t)
            return t

        mine = buffer()
        if mine_parts:
            torch.cat(mine_parts, out=mine[:filled])
        got = {j: buffer() for j, _ in self.peers}
        self.stats.record("reduce_scatter", torch.empty(seg.padded, dtype=seg.dtype, device="meta"), self.world)
        label, tag = f"gradients of segment {seg.index}", _TAG + 2 * seg.index + 1
        works = []
        for j, peer in self.peers:  # parts in parameter order, matched in the order they are posted
            for t in self._pieces(seg, grads, j):
                works.append(watched(dist.isend, t, dst=peer, group=self.group, tag=tag, label=label))
            for into in got[j][:filled].split(sizes):
                works.append(watched(dist.irecv, into, src=peer, group=self.group, tag=tag, label=label))

        def add_shares() -> None:
            grads.clear()  # the sends are done: autograd's gradients may go
            for j, _ in self.peers:
                mine.add_(got[j])

        seg.work, seg.work_out = Done(_AllDone(works), add_shares), mine
        self.inflight.append(seg)

    def finish_reduce(self, seg: Segment) -> None:
        if (other := self._for(seg)) is not None:
            other.finish_reduce(seg)
            return
        if seg.work is not None:
            seg.work.wait()
        out, seg.work, seg.work_out = seg.work_out, None, None
        assert out is not None and seg.master_grad is not None
        if self.rep_world > 1:  # hybrid: this replica's sum, then the sum over replicas of the same shard
            self.stats.record("all_reduce", out, self.rep_world)
            watched(dist.all_reduce, out, group=self.rep_group, label=f"gradients of segment {seg.index} (replicas)")
        if out.device != seg.master_grad.device:  # offloaded: the slice goes to the host
            copy_to_host(seg.master_grad, out, self._staging_for(out) if self.accumulates else None)
        elif out.data_ptr() != seg.master_grad.data_ptr():
            if self.accumulates:  # each backward's share adds up
                seg.master_grad.add_(out.to(dtype=seg.master_grad.dtype))
            else:  # the full buffer already held the whole window
                seg.master_grad.copy_(out)
        if self.accumulates:
            seg.grad_full = None
        for t in seg.lent:
            self.pool.give(t)
        seg.lent = []

    def _staging_for(self, src: torch.Tensor) -> torch.Tensor:
        """A host buffer (pinned on CUDA) that a reduced slice lands in before it is added to the host's; one per
        dtype, reused: each landing is waited for and added before the next copy is issued."""
        buf = self._staging.get(src.dtype)
        if buf is None or buf.numel() < src.numel():
            buf = torch.empty(src.numel(), dtype=src.dtype, pin_memory=src.device.type == "cuda")
            self._staging[src.dtype] = buf
        return buf

    def fence_host_reads(self) -> None:
        """Wait until the device has read every host slice a gather copied from: the host may write them again (the
        optimizer steps the offloaded masters) only then, or a copy still queued would carry the new values."""
        events, self._host_reads = self._host_reads, {}
        for done in events.values():
            done.synchronize()
        if self.experts is not None and self.experts is not self:
            self.experts.fence_host_reads()

    def wait_inflight(self, keep: int = 0) -> None:
        """Finish reductions, oldest first, until at most ``keep`` are in flight."""
        while len(self.inflight) > keep:
            self.finish_reduce(self.inflight.pop(0))

    def gather(self, seg: Segment, async_op: bool = False) -> Done:
        """Fill ``seg.full`` with every rank's slice (this rank's from its at-rest shard or its master)."""
        if (other := self._for(seg)) is not None:
            return other.gather(seg, async_op)
        src = seg.shard_param if seg.shard_param is not None else seg.master
        if src is None:
            src = seg.full[seg.lo : seg.hi]  # frozen: nothing changes, but zero3 still needs the whole unit
        wire = self.comm_dtype or seg.dtype
        full = seg.full if wire == seg.dtype else self.pool.take(seg.padded, wire, seg.device)
        if src.device != seg.device:
            # Offloaded: a DMA from the pinned host slice that the host does not wait for (the device's later work is
            # ordered after it on the stream); the dtype is changed on the device, so that it stays one. The host
            # must not write the slice until the copy has run: see fence_host_reads.
            local = src.to(seg.device, non_blocking=True).to(wire)
            if seg.device.type == "cuda":
                stream, read = torch.cuda.current_stream(seg.device), torch.cuda.Event()
                read.record(stream)
                self._host_reads[stream.cuda_stream] = read
        else:
            local = src.to(dtype=wire)
        if self.world == 1:
            if local.data_ptr() != full.data_ptr():
                full.copy_(local)
            work = None
        elif self.mode == "allreduce":
            full[: seg.lo].zero_()
            full[seg.hi :].zero_()
            if local.data_ptr() != full[seg.lo :].data_ptr():
                full[seg.lo : seg.hi].copy_(local)
            self.stats.record("all_reduce", full, self.world)
            work = watched(
                dist.all_reduce, full, group=self.group, async_op=True, label=f"parameters of segment {seg.index}"
            )
        elif self.mode == "p2p":
            n = seg.shard_numel
            if local.data_ptr() != full[seg.lo :].data_ptr():
                full[seg.lo : seg.hi].copy_(local)
            self.stats.record("all_gather", full, self.world)
            mine = full[seg.lo : seg.hi]
            label = f"parameters of segment {seg.index}"
            work = self._exchange(lambda j: mine, lambda j: full[j * n : (j + 1) * n], _TAG + 2 * seg.index, label)
        else:
            if local.data_ptr() == full[seg.lo :].data_ptr():
                local = local.clone()
            self.stats.record("all_gather", full, self.world)
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = watched(fn, full, local, group=self.group, async_op=True, label=f"parameters of segment {seg.index}")

        def arrived() -> None:  # the wire's dtype: into the segment's, and the wire buffer back to the pool
            seg.full.copy_(full)
            self.pool.give(full)

        done = Done(work, None if full is seg.full else arrived)
        if not async_op:
            done.wait()
        return done

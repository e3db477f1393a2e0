"""Point-to-point for the schedules that run lists of actions (interleaved 1F1B, ZB-H1): messages between chunks.

Chunk c's output goes to chunk c + 1 (``("F", c, i)`` for micro-batch i) and the gradient of its input back to
chunk c - 1 (``("B", c, i)``). Each message travels on one of four lanes, a process group of the pipeline column
each: forward, backward, and, when a rank holds several chunks, forward from the last rank round to rank 0 and
backward from rank 0 round to the last. On every lane a pair of ranks talks in one direction only, so a lane's
sends and receives never wait behind traffic the other way (on NCCL, ops of one communicator run in order).

Every rank knows every rank's action list, so it knows in which order each neighbour sends it messages on each
lane. A receive takes that lane's messages in the sender's order, keeping those that arrive before the one it
needs: the two sides never disagree on which message is which, whatever order the receiver needs them in.
The description of a boundary's tensors (as in ``p2p.py``) goes before its first message for each micro-batch
signature.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats
from phalanx.runtime.nccl_rules import to_wire, wire_dtype
from phalanx.strategies.pipeline.actions import Action
from phalanx.strategies.pipeline.p2p import Meta, _from_meta, decode_meta, describe_meta, encode_meta, meta_of

__all__ = ["ChunkLink", "Message", "build_lanes"]

Message = tuple[str, int, int]
"""("F", chunk, micro-batch): chunk's output, to chunk + 1; ("B", chunk, micro-batch): the gradient of chunk's
input, to chunk - 1."""

LANES = ("fwd", "bwd", "fwd_wrap", "bwd_wrap")


def build_lanes(columns: list[list[int]], my_rank: int, wrap: bool) -> dict[str, Any]:
    """The lane groups of this rank's pipeline column. Collective: every rank creates every column's groups, in
    one order (``columns``: the global ranks of each column, by stage)."""
    mine: dict[str, Any] = {}
    for lane in LANES if wrap else LANES[:2]:
        for ranks in columns:
            group = dist.new_group(ranks)
            if my_rank in ranks:
                mine[lane] = group
    return mine


def _messages(order: list[Action], sender: int, pp: int, chunks: int) -> list[tuple[str, int, Message]]:
    """What ``sender`` sends, in order, as (lane, destination pipeline rank, message)."""
    out = []
    for kind, c, i in order:
        if kind == "F" and c + 1 < chunks and pp > 1:
            out.append(("fwd_wrap" if sender == pp - 1 else "fwd", (c + 1) % pp, ("F", c, i)))
        elif kind in ("B", "BW") and c > 0 and pp > 1:
            out.append(("bwd_wrap" if sender == 0 else "bwd", (c - 1) % pp, ("B", c, i)))
    return out


class ChunkLink:
    """One rank's messages to and from the chunks of its neighbours, for one step's action lists at a time.

    ``ranks``: the global rank of each pipeline stage of this column. ``grads_shape_of(chunk, micro)``: the
    outputs of this rank's chunk for a micro-batch, whose gradients a ``B`` message carries.
    """

    def __init__(
        self,
        stage: int,
        ranks: list[int],
        lanes: dict[str, Any],
        device: torch.device,
        stats: CommStats,
        outputs_of: Callable[[int, int], list[torch.Tensor]],
    ) -> None:
        self.stage, self.ranks, self.pp = stage, ranks, len(ranks)
        self.lanes, self.device, self.stats, self.outputs_of = lanes, device, stats, outputs_of
        self.idle_s = 0.0
        self._sent_meta: dict[Any, Meta] = {}
        self._recv_meta: dict[Any, Meta] = {}
        self._incoming: dict[tuple[str, int], deque[Message]] = {}
        self._lane_of: dict[Message, tuple[str, int]] = {}
        self._arrived: dict[Message, Any] = {}
        self._sends: list[Any] = []
        self._send_bufs: list[torch.Tensor] = []
        self._local: dict[Message, Any] = {}
        self.chunks, self.key = 1, None

    def start(self, orders: list[list[Action]], chunks: int, key: Any) -> None:
        """Learn the step's senders' orders (every lane's messages to this rank, in the order they are sent);
        ``key`` names the micro-batches' signature, for which each boundary's description is sent once."""
        self.chunks, self.key = chunks, key
        self._incoming.clear()
        self._lane_of.clear()
        self._arrived.clear()
        for sender, order in enumerate(orders):
            for lane, dst, msg in _messages(order, sender, self.pp, chunks):
                if dst == self.stage:
                    self._incoming.setdefault((lane, sender), deque()).append(msg)
                    self._lane_of[msg] = (lane, sender)

    # ------------------------------------------------------------------------------------------ sends
    def send_forward(self, chunk: int, micro: int, outputs: list[torch.Tensor], is_tuple: bool) -> None:
        msg = ("F", chunk, micro)
        if self.pp == 1:
            self._local[msg] = (meta_of(outputs, is_tuple), [t.detach() for t in outputs])
            return
        lane = "fwd_wrap" if self.stage == self.pp - 1 else "fwd"
        dst = self.ranks[(chunk + 1) % self.pp]
        meta = meta_of(outputs, is_tuple)
        sends = [to_wire(t.detach()).contiguous() for t in outputs]  # NCCL has no int16
        sent = self._sent_meta.get((self.key, chunk))
        if sent is None:
            self._sent_meta[(self.key, chunk)] = meta
            vec = encode_meta(meta).to(self.device)
            sends = [torch.tensor([len(vec)], dtype=torch.int64, device=self.device), vec, *sends]
        elif sent != meta:
            raise RuntimeError(
                f"chunk {chunk} produced outputs of {describe_meta(meta)} for micro-batches that earlier gave "
                f"{describe_meta(sent)}; the activations crossing a chunk boundary must have the same shapes and "
                "dtypes for the same micro-batch shape"
            )
        self._post_sends(sends, dst, lane)

    def send_backward(self, chunk: int, micro: int, input_grads: list[torch.Tensor]) -> None:
        msg = ("B", chunk, micro)
        if self.pp == 1:
            self._local[msg] = input_grads
            return
        lane = "bwd_wrap" if self.stage == 0 else "bwd"
        self._post_sends([g.contiguous() for g in input_grads], self.ranks[(chunk - 1) % self.pp], lane)

    # --------------------------------------------------------------------------------------- receives
    def recv_forward(self, chunk: int, micro: int) -> Any:
        """The input of ``chunk`` for a micro-batch: chunk - 1's output, requiring grad where it did."""
        msg = ("F", chunk - 1, micro)
        if self.pp == 1:
            meta, tensors = self._local.pop(msg)
            return _from_meta(meta, [t.clone() for t in tensors])
        meta, bufs = self._receive(msg)
        assert meta is not None
        return _from_meta(meta, bufs)

    def recv_backward(self, chunk: int, micro: int) -> list[torch.Tensor]:
        """The gradients of ``chunk``'s outputs for a micro-batch (an empty tensor for those that need none)."""
        msg = ("B", chunk + 1, micro)
        if self.pp == 1:
            grads = iter(self._local.pop(msg))
        else:
            grads = iter(self._receive(msg)[1])
        outputs = self.outputs_of(chunk, micro)
        return [next(grads) if o.requires_grad else torch.empty(0, device=o.device) for o in outputs]

    def wait_sends(self) -> None:
        self._wait(self._sends)
        self._sends.clear()
        self._send_bufs.clear()
        assert not self._local, f"messages sent and never received: {sorted(self._local)}"

    # --------------------------------------------------------------------------------------- internals
    def _receive(self, msg: Message) -> tuple[Meta | None, list[torch.Tensor]]:
        """``msg``'s buffers: the messages its sender sent on its lane before it are received first and kept."""
        if msg not in self._arrived:
            lane, sender = self._lane_of[msg]
            queue = self._incoming[(lane, sender)]
            while msg not in self._arrived:
                nxt = queue.popleft()
                self._arrived[nxt] = self._take(nxt, lane, self.ranks[sender])
        return self._arrived.pop(msg)  # type: ignore[no-any-return]

    def _take(self, msg: Message, lane: str, src: int) -> tuple[Meta | None, list[torch.Tensor]]:
        group = self.lanes[lane]
        kind, chunk, micro = msg
        if kind == "F":
            meta = self._recv_meta.get((self.key, chunk))
            if meta is None:
                length = torch.zeros(1, dtype=torch.int64, device=self.device)
                self._recv(length, src, group)
                vec = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
                self._recv(vec, src, group)
                meta = self._recv_meta[(self.key, chunk)] = decode_meta(vec.cpu())
            bufs = [torch.empty(shape, dtype=wire_dtype(dtype), device=self.device) for dtype, _, shape in meta[1]]
            for b in bufs:
                self._recv(b, src, group)
            return meta, bufs
        # the gradients of this rank's chunk - 1 outputs that require grad
        outputs = [o for o in self.outputs_of(chunk - 1, micro) if o.requires_grad]
        bufs = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in outputs]
        for b in bufs:
            self._recv(b, src, group)
        return None, bufs

    def _recv(self, buf: torch.Tensor, src: int, group: Any) -> None:
        self.stats.record("recv", buf)
        self._wait([watched(dist.irecv, buf, src=src, group=group)])

    def _post_sends(self, tensors: list[torch.Tensor], dst: int, lane: str) -> None:
        group = self.lanes[lane]
        self._send_bufs.extend(tensors)  # alive until wait_sends
        for t in tensors:
            self.stats.record("send", t)
            self._sends.append(watched(dist.isend, t, dst=dst, group=group))

    def _wait(self, works: list[Any]) -> None:
        if works:
            t0 = time.perf_counter()
            for w in works:
                w.wait()
            self.idle_s += time.perf_counter() - t0

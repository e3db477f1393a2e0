"""Point-to-point between neighbouring pipeline stages: activations forward, their gradients backward.

What crosses a boundary is one tensor or a tuple of tensors. Its description (tuple or not, and each tensor's
dtype, requires_grad and shape) is sent once per distinct micro-batch signature, as a length and then an int64
vector, and cached on both sides: after that every micro-batch costs exactly one message per tensor. Gradients
travel only for the tensors that require them, in the shapes the sender already knows.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats
from phalanx.runtime.nccl_rules import from_wire, to_wire, wire_dtype

__all__ = ["StageLink", "Meta", "boundary_tensors", "flat_tensors", "meta_of", "encode_meta", "decode_meta"]

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip

Meta = tuple[bool, list[tuple[torch.dtype, bool, tuple[int, ...]]]]
"""What crosses a boundary: whether it is a tuple, and each tensor's dtype, requires_grad and shape."""


def flat_tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def boundary_tensors(out: Any, stage: int) -> list[torch.Tensor]:
    """The tensors of a stage's output; anything but a tensor or a tuple of tensors is the user's error."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    raise TypeError(
        f"the last block of stage {stage} returned {type(out).__name__}"
        + (f" of {[type(t).__name__ for t in out]}" if isinstance(out, (tuple, list)) else "")
        + "; a stage boundary carries one tensor or a tuple of tensors (return those, and pass other values as tensors)"
    )


def meta_of(tensors: list[torch.Tensor], is_tuple: bool) -> Meta:
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"a stage boundary cannot carry a tensor of dtype {t.dtype}")
    return is_tuple, [(t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors]


def encode_meta(meta: Meta) -> torch.Tensor:
    is_tuple, specs = meta
    vec = [int(is_tuple), len(specs)]
    for dtype, needs_grad, shape in specs:
        vec += [_DTYPES.index(dtype), int(needs_grad), len(shape), *shape]
    return torch.tensor(vec, dtype=torch.int64)


def decode_meta(vec: torch.Tensor) -> Meta:
    v = vec.tolist()
    is_tuple, n, pos, specs = bool(v[0]), v[1], 2, []
    for _ in range(n):
        dtype, needs_grad, ndim = _DTYPES[v[pos]], bool(v[pos + 1]), v[pos + 2]
        specs.append((dtype, needs_grad, tuple(v[pos + 3 : pos + 3 + ndim])))
        pos += 3 + ndim
    return is_tuple, specs


def describe_meta(meta: Meta) -> str:
    return ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, _, s in meta[1])


def _from_meta(meta: Meta, bufs: list[torch.Tensor]) -> Any:
    """Received buffers as the sender's output: a tensor or a tuple, in the sender's dtypes (int16 travels as int32),
    requiring grad where the sender's did."""
    is_tuple, specs = meta
    bufs = [from_wire(b, dtype) for b, (dtype, _, _) in zip(bufs, specs)]
    for b, (_, needs_grad, _) in zip(bufs, specs):
        if needs_grad:
            b.requires_grad_(True)
    return tuple(bufs) if is_tuple else bufs[0]


class StageLink:
    """One stage's connections to the previous and next stage of its data-parallel column.

    Receives are waited for at once (the schedule needs their data); sends are waited for in ``wait_sends``,
    at the end of a step, and their buffers are kept alive until then. ``idle_s`` adds up the time blocked.
    """

    def __init__(
        self, stage: int, prev_rank: int | None, next_rank: int | None, device: torch.device, stats: CommStats
    ) -> None:
        self.stage, self.prev_rank, self.next_rank = stage, prev_rank, next_rank
        self.device, self.stats = device, stats
        self.idle_s = 0.0
        self._recv_meta: dict[Any, Meta] = {}
        self._sent_meta: dict[Any, Meta] = {}
        self._sends: list[Any] = []
        self._send_bufs: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------ forward direction
    def recv_forward(self, key: Any) -> Any:
        """The previous stage's output for one micro-batch (None on the first stage)."""
        if self.prev_rank is None:
            return None
        meta, bufs = self._forward_buffers(key)
        self._post([], [(b, self.prev_rank) for b in bufs])
        return _from_meta(meta, bufs)

    def send_forward(self, outputs: list[torch.Tensor], is_tuple: bool, key: Any) -> None:
        if self.next_rank is not None:
            self._post(self._forward_sends(outputs, is_tuple, key), [])

    # ----------------------------------------------------------------------------- backward direction
    def recv_backward(self, outputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The gradients of this stage's ``outputs`` from the next stage (an empty tensor for those that need
        none); None on the last stage."""
        if self.next_rank is None:
            return None
        bufs = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in outputs if o.requires_grad]
        self._post([], [(b, self.next_rank) for b in bufs])
        return _full_grads(outputs, bufs)

    def send_backward(self, input_grads: list[torch.Tensor]) -> None:
        if self.prev_rank is not None:
            self._post([(g.contiguous(), self.prev_rank) for g in input_grads], [])

    # ------------------------------------------------------------------ both at once (1F1B steady state)
    def send_forward_recv_backward(
        self, outputs: list[torch.Tensor], is_tuple: bool, key: Any, grads_for: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """Send one micro-batch's ``outputs`` and receive the gradients of an earlier one's ``grads_for``."""
        if self.next_rank is None:
            return None
        bufs = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in grads_for if o.requires_grad]
        self._post(self._forward_sends(outputs, is_tuple, key), [(b, self.next_rank) for b in bufs])
        return _full_grads(grads_for, bufs)

    def send_backward_recv_forward(self, input_grads: list[torch.Tensor], key: Any) -> Any:
        if self.prev_rank is None:
            return None
        meta, bufs = self._forward_buffers(key)
        prev = self.prev_rank
        self._post([(g.contiguous(), prev) for g in input_grads], [(b, prev) for b in bufs])
        return _from_meta(meta, bufs)

    def wait_sends(self) -> None:
        self._wait(self._sends)
        self._sends.clear()
        self._send_bufs.clear()

    # ---------------------------------------------------------------------------------------- internals
    def _forward_buffers(self, key: Any) -> tuple[Meta, list[torch.Tensor]]:
        assert self.prev_rank is not None
        if key not in self._recv_meta:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._post([], [(length, self.prev_rank)])
            vec = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
            self._post([], [(vec, self.prev_rank)])
            self._recv_meta[key] = decode_meta(vec.cpu())
        meta = self._recv_meta[key]
        return meta, [torch.empty(shape, dtype=wire_dtype(dtype), device=self.device) for dtype, _, shape in meta[1]]

    def _forward_sends(self, outputs: list[torch.Tensor], is_tuple: bool, key: Any) -> list[tuple[torch.Tensor, int]]:
        """The messages that carry ``outputs`` to the next stage: the first time for ``key``, their description too."""
        assert self.next_rank is not None
        meta = meta_of(outputs, is_tuple)
        msgs = [(to_wire(t.detach()).contiguous(), self.next_rank) for t in outputs]  # NCCL has no int16
        sent = self._sent_meta.get(key)
        if sent is None:
            self._sent_meta[key] = meta
            vec = encode_meta(meta).to(self.device)
            length = torch.tensor([len(vec)], dtype=torch.int64, device=self.device)
            return [(length, self.next_rank), (vec, self.next_rank), *msgs]
        if sent != meta:
            raise RuntimeError(
                f"stage {self.stage} produced outputs of {describe_meta(meta)} for micro-batches that earlier gave "
                f"{describe_meta(sent)}; the activations crossing a stage boundary must have the same shapes and "
                "dtypes for the same micro-batch shape"
            )
        return msgs

    def _post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post sends and receives together; wait for the receives (the sends are waited for at the step's end)."""
        if not sends and not recvs:
            return
        self._send_bufs.extend(t for t, _ in sends)  # alive until wait_sends
        for t, _ in sends:
            self.stats.record("send", t)
        for t, _ in recvs:
            self.stats.record("recv", t)
        if self.device.type == "cuda":
            # One NCCL group: a send and a receive on the same pair of ranks progress together (NCCL may hand
            # back a single work for the whole group, so wait for all of it when something is received).
            ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [
                dist.P2POp(dist.irecv, t, peer) for t, peer in recvs
            ]
            works: list[Any] = list(watched(dist.batch_isend_irecv, ops))
            if recvs:
                self._wait(works)
            else:
                self._sends.extend(works)
            return
        self._sends.extend(watched(dist.isend, t, dst=peer) for t, peer in sends)
        self._wait([watched(dist.irecv, t, src=peer) for t, peer in recvs])

    def _wait(self, works: list[Any]) -> None:
        if works:
            t0 = time.perf_counter()
            for w in works:
                w.wait()
            self.idle_s += time.perf_counter() - t0


def _full_grads(outputs: list[torch.Tensor], bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    it = iter(bufs)
    return [next(it) if o.requires_grad else torch.empty(0, device=o.device) for o in outputs]

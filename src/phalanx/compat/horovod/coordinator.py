"""Horovod's coordinator on c10d: operations are matched across ranks by name, checked, and only then run.

Horovod queues every operation and lets a coordinator start it once every rank has asked for it, matching the ranks'
requests by name (ranks may issue them in different orders) and refusing those whose ranks disagree on the dtype,
the shape, the root rank, the reduce op or the scale factors. c10d does not look: an int32 tensor reduced with a
float32 one returns reinterpreted bits, a broadcast into another shape mixes the two ranks' data, different sizes
abort gloo, and collectives are matched by order only. So here each process set has a :class:`Coordinator`:

- An operation is *submitted* (queued on this rank) and started in a *round*: one small all-gather over the set's
  group in which every rank sends its queue, as (name, description digest, first dimension, kind) rows. The
  operations queued on every rank that has not joined are *ready*; they start in the order of the lowest such
  rank's queue, the same on every rank. A ready operation whose descriptions differ is refused on every rank with
  :class:`HorovodMismatchError`, naming each rank's call, before any of its bytes move.
- A synchronous operation runs rounds until it has started; ``allreduce_async`` and friends only submit, and
  ``synchronize``/``poll`` (or any later synchronous call) run the rounds. So a burst of asynchronous operations
  costs one round, as in Horovod's cycles.
- A rank in ``hvd.join()`` keeps taking part in rounds. For a ready all-reduce it receives the plan (sizes, dtypes)
  from the lowest active rank and contributes zeros; the other operations raise while a rank has joined, as in
  Horovod. ``join`` returns once every rank has joined, with the rank that joined last.
- A round where no operation is ready on every active rank can never make progress (every rank in a round waits
  for one of its own): all ranks raise, naming each rank's queue, instead of hanging.

The response cache: a description (kind, name, dtype, shape, op, root, scales) seen before is looked up, not
rebuilt and hashed again, and identical repeated operations send the same small row. What stays is one round trip
per synchronous operation (Horovod's coordinator pays one per cycle too).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = [
    "HorovodMismatchError", "HorovodInternalError", "JoinedRanksError", "Coordinator", "Op", "describe_tensor",
]  # fmt: skip

CHECKS = True
"""Always on, as in Horovod; benchmarks/bench_horovod_checks.py turns it off to measure what the checks cost (then
operations start at once, matched by order as plain c10d does)."""

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_ROWS = 32  # queued operations one rank sends per round
_HEAD = 3  # state, join sequence, number of rows
_WIDTH = 4  # name key, description digest, first dimension, kind
_ACTIVE, _JOINED = 1, 2
KINDS = (
    "hvd.allreduce", "hvd.allgather", "hvd.broadcast", "hvd.alltoall", "hvd.reducescatter", "hvd.grouped_allreduce",
    "hvd.grouped_allgather", "hvd.grouped_reducescatter", "hvd.barrier", "hvd.broadcast_object",
    "hvd.allgather_object", "hvd.DistributedOptimizer", "hvd.broadcast_parameters",
)  # fmt: skip
_JOIN_OK = {"hvd.allreduce", "hvd.grouped_allreduce", "hvd.barrier", "hvd.DistributedOptimizer"}


class HorovodMismatchError(RuntimeError, ValueError):
    """The ranks called one Horovod operation with different dtypes, shapes, root ranks, ops or scale factors, or
    wait for operations that the others never issue.

    A ``RuntimeError``, as Horovod raises it (and a ``ValueError``, as earlier phalanx versions raised some)."""


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed (a rank died, the network broke); elastic runs restore from the
    last commit on it."""


class JoinedRanksError(RuntimeError):
    """An operation other than an all-reduce (or barrier) while some rank is in ``hvd.join()``, which Horovod
    refuses too."""


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def describe_tensor(tensor: torch.Tensor) -> str:
    return f"dtype {str(tensor.dtype).removeprefix('torch.')}, shape {tuple(tensor.shape)}"


_PENDING, _STARTED, _FAILED, _DONE = range(4)


@dataclass(eq=False)
class Op:
    """One operation on its way: queued, then started in a round, then finished by ``Coordinator.wait``.

    ``launch(sizes)`` starts its collectives (``sizes``: every set rank's first dimension) and returns the
    asynchronous works and a function that gives the result once they are done. ``plan`` lists the all-reduces
    (element count, dtype name, c10d op name) that a joined rank must match with zeros; None when the operation
    cannot run while ranks have joined."""

    kind: str
    name: str
    digest: int
    text: str
    launch: Callable[[list[int]], tuple[list[Any], Callable[[], Any]]]
    first_dim: int = 0
    plan: Callable[[], list[tuple[int, str, str]]] | None = None
    state: int = _PENDING
    sizes: list[int] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    finish: Callable[[], Any] | None = None
    error: BaseException | None = None
    result: Any = None

    @property
    def key(self) -> int:
        return (KINDS.index(self.kind) << 40) | zlib.crc32(self.name.encode())


_CACHE: dict[tuple[Any, ...], tuple[int, str]] = {}


def digest_of(
    kind: str,
    tensors: list[torch.Tensor],
    *,
    root: int | None = None,
    op: Any = None,
    scales: tuple[float, float] = (1.0, 1.0),
    first_dim_may_differ: bool = False,
    extra: Any = None,
) -> tuple[int, str]:
    """The digest every rank compares, and the text an error shows; cached (Horovod's response cache)."""
    shapes = tuple(tuple(t.shape[1:]) if first_dim_may_differ and t.dim() else tuple(t.shape) for t in tensors)
    key = (kind, tuple(t.dtype for t in tensors), shapes, root, getattr(op, "name", op), scales, extra)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    parts = [describe_tensor(t) for t in tensors]
    text = f"{kind} with " + ("; ".join(parts) if parts else "no tensor")
    if op is not None:
        text += f", op {getattr(op, 'name', op)}"
    if root is not None:
        text += f", root rank {root}"
    if scales != (1.0, 1.0):
        text += f", prescale {scales[0]:g}, postscale {scales[1]:g}"
    if extra is not None:
        text += f", {extra}"
    numbers = [_DTYPES.index(d) if d in _DTYPES else str(d) for d in key[1]]
    digest = zlib.crc32(repr((kind, numbers, shapes, root, key[4], tuple(map(_bits, scales)), extra)).encode())
    if len(_CACHE) > 4096:  # names that never repeat (a counter in them) must not grow it without end
        _CACHE.clear()
    _CACHE[key] = (digest, text)
    return digest, text


class Coordinator:
    """One process set's queue, rounds and join state (see the module's docstring)."""

    def __init__(self, group: Any, ranks: list[int], rank: int, device: torch.device | None = None) -> None:
        self.group, self.ranks, self.size = group, ranks, len(ranks)
        self.device = device or torch.device("cpu")  # where collectives take tensors (NCCL: the rank's GPU)
        self.index = ranks.index(rank) if rank in ranks else -1
        self.pending: list[Op] = []
        self.in_flight: dict[str, Op] = {}
        self.rounds = 0
        self._counters: dict[str, int] = {}
        self._joined_at: int | None = None
        self._early: tuple[Any, list[torch.Tensor]] | None = None
        self.joined_ranks: set[int] = set()  # the global ranks in hvd.join() at the last round (global set only)
        self.world: Coordinator | None = None  # the global set's coordinator, for the other sets

    # -- names -------------------------------------------------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        """Horovod names an unnamed operation by a counter; every rank counts the same calls in the same order."""
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, op: Op) -> Op:
        if op.name in self.in_flight:
            raise ValueError(
                f"{op.kind}: an operation named {op.name!r} is already in flight on this rank (synchronize its "
                "handle first, or give each concurrent operation its own name)"
            )
        if not CHECKS or self.size == 1:
            self._start(op, [op.first_dim] * self.size)
        else:
            self.pending.append(op)
        self.in_flight[op.name] = op
        return op

    # -- waiting -----------------------------------------------------------------------------------------------
    def wait(self, op: Op) -> Any:
        """Run rounds until ``op`` has started, then wait for it; its result, or its error on every rank."""
        try:
            while op.state == _PENDING:
                self._round()
            if op.state == _FAILED:
                assert op.error is not None
                raise op.error
            for w in op.works:
                w.wait()
            op.works = []
            if op.state != _DONE:
                assert op.finish is not None
                op.result, op.state, op.finish = op.finish(), _DONE, None
            return op.result
        except (HorovodMismatchError, JoinedRanksError, HorovodInternalError, ValueError, TypeError):
            raise
        except RuntimeError as e:  # c10d's: a peer died or the network broke; elastic runs restore on this
            op.state, op.error = _FAILED, HorovodInternalError(f"{op.kind} ({op.name!r}) failed: {e}")
            raise op.error from e
        finally:
            if op.state in (_FAILED, _DONE):
                self.in_flight.pop(op.name, None)

    def poll(self, op: Op) -> bool:
        """Whether ``op`` is done; runs one round if it has not started (that waits for the other ranks' round)."""
        if op.state == _PENDING:
            self._round(blocking=False)
        return op.state == _FAILED or (op.state != _PENDING and all(w.is_completed() for w in op.works))

    def join(self) -> int:
        """Take part in rounds, standing in for this rank in all-reduces, until every rank has joined; the global
        rank that joined last."""
        if self.pending:
            names = ", ".join(repr(o.name) for o in self.pending)
            raise ValueError(f"hvd.join(): operations {names} are still queued here (synchronize them before joining)")
        if self.size == 1 or not CHECKS:
            return self.ranks[self.index] if self.index >= 0 else 0
        self._joined_at = self.rounds
        try:
            while True:
                last = self._round()
                if last is not None:
                    return last
        finally:
            self._joined_at = None

    # -- one round ---------------------------------------------------------------------------------------------
    def _message(self, blocking: bool) -> torch.Tensor:
        if self._joined_at is not None:
            values = [_JOINED, self._joined_at, 0]
        else:
            queue = self.pending[:_ROWS]
            values = [_ACTIVE, int(blocking), len(queue)]
            for o in queue:
                values += [o.key, o.digest, o.first_dim, KINDS.index(o.kind)]
        values += [0] * (_HEAD + _ROWS * _WIDTH - len(values))
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _check_members_active(self) -> None:
        """A rank in ``hvd.join()`` takes part in the global set's rounds only: a round of another set that holds
        it would wait for it forever. Every rank of this set saw the same global rounds, so all of them raise."""
        joined = sorted(self.world.joined_ranks.intersection(self.ranks)) if self.world is not None else []
        if not joined:
            return
        names = ", ".join(repr(o.name) for o in self.pending)
        error = JoinedRanksError(
            f"process set {self.ranks}: rank(s) {joined} have called hvd.join(), which stands in for them in the "
            f"global set only, so {names or 'this operation'} cannot run on this set (finish the set's operations "
            "before any of its ranks joins)"
        )
        for op in self.pending:
            op.state, op.error = _FAILED, error
            self.in_flight.pop(op.name, None)
        self.pending = []
        raise error

    def begin_round(self) -> None:
        """Start a round's exchange and return at once; the next ``wait``/``poll`` (or any round) finishes it. The
        optimizer starts its step's round this way at the first gradient, so the exchange overlaps backward."""
        if self._early is not None or not CHECKS or self.size == 1:
            return
        self._check_members_active()
        mine = self._message(True)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        work = watched(dist.all_gather, parts, mine, group=self.group, async_op=True, label="hvd coordinator round")
        self._early = (work, parts)

    def _round(self, blocking: bool = True) -> int | None:
        """One round; returns the last-joined global rank when every rank has joined, else None. ``blocking``:
        this rank waits for one of its queued operations (not so in ``poll``)."""
        if self._early is not None:  # begun earlier, with the queue as it was then
            (work, parts), self._early = self._early, None
            work.wait()
        else:
            self._check_members_active()
            mine = self._message(blocking)
            parts = [torch.empty_like(mine) for _ in range(self.size)]
            watched(dist.all_gather, parts, mine, group=self.group, label="hvd coordinator round")
        self.rounds += 1
        table = torch.stack(parts).tolist()  # plain numbers: indexing a tensor costs microseconds a time
        active = [r for r in range(self.size) if table[r][0] == _ACTIVE]
        self.joined_ranks = {self.ranks[r] for r in range(self.size) if r not in active} if active else set()
        if not active:
            seq, last = max((table[r][1], r) for r in range(self.size))
            return self.ranks[last]
        queues: list[dict[int, tuple[int, int, int]]] = [{} for _ in range(self.size)]
        order: list[int] = []
        for r in active:
            flat = table[r][_HEAD : _HEAD + table[r][2] * _WIDTH]
            rows = [flat[i : i + _WIDTH] for i in range(0, len(flat), _WIDTH)]
            queues[r] = {k: (d, f, kind) for k, d, f, kind in rows}
            if r == active[0]:
                order = [row[0] for row in rows]
        ready = [k for k in order if all(k in queues[r] for r in active)]
        if not ready and all(table[r][1] for r in active):
            self._stalled(active)
        joined = len(active) < self.size
        by_key = {o.key: o for o in self.pending}
        for k in ready:
            op = by_key.get(k)
            if op is not None:
                self.pending.remove(op)
            kind = KINDS[queues[active[0]][k][2]]
            if len({queues[r][k][0] for r in active}) > 1:
                self._mismatch(op, kind, active)
            elif joined and kind not in _JOIN_OK:
                if op is not None:
                    ranks = [self.ranks[r] for r in range(self.size) if r not in active]
                    op.state, op.error = (
                        _FAILED,
                        JoinedRanksError(
                            f"{kind} ({op.name!r}): rank(s) {ranks} have called hvd.join(), and Horovod runs only "
                            "all-reduces (and barriers) while ranks have joined (call hvd.join() on every rank after "
                            f"its last {kind})"
                        ),
                    )
            elif joined:
                self._stand_in(op, active)
            elif op is not None:
                self._start(op, [queues[r][k][1] for r in range(self.size)])
        return None

    def _start(self, op: Op, sizes: list[int]) -> None:
        op.sizes = sizes
        op.works, op.finish = op.launch(sizes)
        op.state = _STARTED

    def _stand_in(self, op: Op | None, active: list[int]) -> None:
        """A ready all-reduce while ranks have joined: the lowest active rank sends its plan, and joined ranks
        reduce zeros of those sizes (Average still divides by the set's size, as Horovod does)."""
        box: list[Any] = [op.plan() if op is not None and op.plan is not None and self.index == active[0] else None]
        watched(dist.broadcast_object_list, box, src=self.ranks[active[0]], group=self.group, label="hvd join plan")
        if op is not None:
            self._start(op, [op.first_dim] * self.size)
            return
        for numel, dtype, reduce in box[0] or []:
            zeros = torch.zeros(numel, dtype=getattr(torch, dtype), device=self.device)
            watched(dist.all_reduce, zeros, op=getattr(dist.ReduceOp, reduce), group=self.group, label="hvd join")

    def _mismatch(self, op: Op | None, kind: str, active: list[int]) -> None:
        texts: list[Any] = [None] * self.size
        watched(dist.all_gather_object, texts, op.text if op is not None else None, group=self.group)
        lines = "\n".join(f"  rank {self.ranks[r]}: {texts[r]}" for r in active)
        if op is not None:
            may_differ = kind in ("hvd.allgather", "hvd.alltoall", "hvd.grouped_allgather")
            op.state, op.error = (
                _FAILED,
                HorovodMismatchError(
                    f"{kind} ({op.name!r}): the ranks called it with different arguments, and Horovod refuses that too "
                    f"(nothing was exchanged):\n{lines}\nEvery rank must pass tensors of the same dtype and shape"
                    + (" (the first dimension may differ)" if may_differ else "")
                    + ", the same op and the same root rank"
                ),
            )

    def _stalled(self, active: list[int]) -> None:
        """No operation is queued on every active rank: nobody can move. Every rank raises, naming the queues."""
        names: list[Any] = [None] * self.size
        mine = [o.name for o in self.pending] if self._joined_at is None else ["(in hvd.join())"]
        watched(dist.all_gather_object, names, mine, group=self.group, label="hvd stall")
        lines = "\n".join(f"  rank {self.ranks[r]}: {', '.join(names[r]) or '(nothing)'}" for r in range(self.size))
        error = HorovodMismatchError(
            "the ranks wait for different Horovod operations, and none of them is queued on every rank that has "
            f"not joined, so none can start:\n{lines}\nIssue the same operations (by name) on every rank"
        )
        for op in self.pending:
            op.state, op.error = _FAILED, error
            self.in_flight.pop(op.name, None)
        self.pending = []
        raise error

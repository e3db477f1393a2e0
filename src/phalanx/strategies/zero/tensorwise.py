"""Tensor-wise optimizers under ZeRO: each whole parameter is stepped on one owner rank.

Muon orthogonalises each weight matrix, Adafactor factors each tensor's second moment and scales its step by the
tensor's RMS, LAMB and LARS scale by a trust ratio of whole-tensor norms: the update of one element needs its whole
tensor, so a rank's slice of a flat segment cannot be stepped alone (``optimizers.py`` says which optimizers are
tensor-wise). Instead each trainable parameter of such an optimizer gets an *owner* among the ranks that shard its
segment (the expert shard ranks for experts): the largest parameter first, to the rank with the fewest elements so
far, the same plan on every rank. The optimizer's param groups hold, on each rank, the parameters it owns, whole and
in the masters' dtype (fp32); their state is whole on the owner and absent elsewhere.

A step, segment by segment, one collective each way and none per parameter:

1. at the end of the window (``finish_gradient_sync``) each rank sends each owner the parts of its master and
   reduced-gradient slices that lie in that owner's parameters (``all_to_all_single`` with variable splits); the
   owner's whole parameters and gradients are views of what it received. Clipping, the loss scaler and the
   non-finite check then see the very gradients the optimizer steps with;
2. the user's ``optimizer.step`` steps the owned parameters whole;
3. the reverse exchange writes each rank's part of the new values into its master slice, and the stage publishes
   them as for any optimizer (zero1/2 all-gather them, zero3 keeps its slice). The whole copies are dropped.

Between steps a rank holds its slices and the state of the parameters it owns; during a step, also its owned
parameters' values and gradients, whole (about 8 bytes a parameter over N ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader, keys_by_param, read_optimizer_state, whole_entry
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats
from phalanx.strategies.zero.layout import Segment, merge_runs
from phalanx.strategies.zero.stepping import replace_step

__all__ = ["ShardGroup", "TensorwisePlan", "assign_owners"]


class ShardGroup(NamedTuple):
    """The ranks that shard a segment: its process group, their number, and this rank's place among them."""

    group: Any
    world: int
    rank: int


def assign_owners(sizes: list[int], loads: list[int]) -> list[int]:
    """The owner rank of each of ``sizes``: the largest first, each to the rank with the least so far (the lowest on
    a tie), so that at the end no two ranks' loads differ by more than the largest size. ``loads`` (one per rank,
    counted in the same unit) is updated: the plans of several optimizers balance together."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += sizes[i]
    return owners


class _Exchange:
    """One segment's share of a plan: which runs of this rank's slice go to which owner, and the whole parameters
    this rank owns in the segment.

    Rank j sends owner r the runs of its slice that lie in r's parameters, in segment order. What r receives, source
    by source, is then its parameters laid end to end in segment order: the positions of one source's slice that r
    owns are consecutive among all the positions r owns. So the receive buffer *is* the owner's whole parameters,
    with no copy on that side."""

    def __init__(
        self, seg: Segment, members: list[tuple[int, int]], where: ShardGroup, whole: dict[int, nn.Parameter]
    ) -> None:
        """``members``: (parameter index in ``seg``, owner) of the plan's parameters in it, by index; ``whole``: the
        owned ones' whole parameters, by index."""
        self.seg, self.where = seg, where
        n = seg.shard_numel
        by_owner: list[list[tuple[int, int, int]]] = [[] for _ in range(where.world)]
        self.recv_splits = [0] * where.world
        self.owned: list[tuple[nn.Parameter, int, torch.Size]] = []  # (whole parameter, offset in the buffer, shape)
        total = 0
        for i, owner in members:
            o, shape = seg.offsets[i], seg.shapes[i]
            a, b = max(o, seg.lo), min(o + shape.numel(), seg.hi)
            if a < b:
                by_owner[owner].append((i, a - seg.lo, b - seg.lo))
            if owner == where.rank:
                for j in range(where.world):
                    self.recv_splits[j] += max(0, min(o + shape.numel(), (j + 1) * n) - max(o, j * n))
                self.owned.append((whole[i], total, shape))
                total += shape.numel()
        self.owned_numel = total
        runs = [merge_runs(rs) for rs in by_owner]
        self.runs = [(a, b) for rs in runs for _, a, b in rs]
        self.send_splits = [sum(b - a for _, a, b in rs) for rs in runs]
        self.values: torch.Tensor | None = None  # the owned parameters end to end, during a step
        self.grads: torch.Tensor | None = None
        self.back: torch.Tensor | None = None  # the new values of this rank's runs, as the owners sent them back
        self._in_flight: list[torch.Tensor] = []  # buffers a started exchange reads or fills

    def _send(self, src: torch.Tensor) -> torch.Tensor:
        if len(self.runs) == 1:
            a, b = self.runs[0]
            return src[a:b]
        return torch.cat([src[a:b] for a, b in self.runs]) if self.runs else src.new_empty(0)

    def _exchange(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str, stats: Any
    ) -> Any:
        if self.where.world == 1:
            out.copy_(inp)
            return None
        stats.record("all_to_all", inp)
        self._in_flight += [out, inp]
        # Keyword arguments: the payload differs by rank (variable splits), so debug_collectives compares the op,
        # its label and its place in the sequence, not the sizes.
        return watched(
            dist.all_to_all_single, output=out, input=inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
            group=self.where.group, async_op=True, label=f"{what} of segment {self.seg.index} (tensor-wise owners)",
        )  # fmt: skip

    def to_owners(self, stats: CommStats) -> list[Any]:
        """Start sending the master and gradient slices' runs to their owners, into new whole buffers."""
        seg = self.seg
        assert seg.master is not None and seg.master_grad is not None
        self.values = seg.master.new_empty(self.owned_numel)
        self.grads = seg.master_grad.new_empty(self.owned_numel)
        works = [
            self._exchange(self.values, self._send(seg.master), self.recv_splits, self.send_splits, "values", stats),
            self._exchange(self.grads, self._send(seg.master_grad), self.recv_splits, self.send_splits, "grads", stats),
        ]
        return [w for w in works if w is not None]

    def attach(self) -> None:
        """The owned whole parameters view the received buffers (values and gradients)."""
        assert self.values is not None and self.grads is not None
        self._in_flight = []
        for p, o, shape in self.owned:
            p.data = self.values[o : o + shape.numel()].view(shape)
            p.grad = self.grads[o : o + shape.numel()].view(shape)

    def from_owners(self, stats: CommStats) -> list[Any]:
        """Start sending the owned parameters' new values back to the ranks whose slices hold them."""
        assert self.values is not None and self.seg.master is not None
        self.back = self.values.new_empty(sum(self.send_splits))
        work = self._exchange(self.back, self.values, self.send_splits, self.recv_splits, "new values", stats)
        return [] if work is None else [work]

    def finish_from_owners(self) -> None:
        assert self.seg.master is not None and self.back is not None
        self._in_flight = []
        for (a, b), part in zip(self.runs, self.back.split([b - a for a, b in self.runs])):
            self.seg.master[a:b].copy_(part)
        self.back = None

    def release(self, empty: torch.Tensor) -> None:
        for p, _, _ in self.owned:
            p.data, p.grad = empty, None
        self.values = self.grads = None


class TensorwisePlan:
    """A tensor-wise optimizer under a zero strategy: who owns each parameter, the whole parameters this rank owns
    (what the optimizer's param groups hold), and the exchanges of a step (see the module's docstring).

    ``stale``: the reduced gradient slices changed since the owners last received them (a backward reduced);
    ``live``: the owners hold this step's whole values and gradients (from the gather until the step is over)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[list[nn.Parameter]],
        where: Callable[[nn.Parameter], tuple[Segment, int]],
        shard_group: Callable[[Segment], ShardGroup],
        loads: dict[bool, list[int]],
        stats: CommStats,
    ) -> None:
        """``groups``: each param group's trainable parameters; ``where(p)``: p's segment and index in it;
        ``shard_group(seg)``: the ranks that shard ``seg``; ``loads``: elements owned so far per rank, dense (False)
        and expert (True), shared by the plans of one strategy."""
        self.optimizer, self.stats = optimizer, stats
        params = [p for ps in groups for p in ps]
        self.params = set(params)
        self.owner: dict[nn.Parameter, int] = {}
        for expert in (False, True):
            kind = [p for p in params if where(p)[0].expert == expert]
            if kind:
                ranks = shard_group(where(kind[0])[0])
                load = loads.setdefault(expert, [0] * ranks.world)
                sizes = [where(p)[0].shapes[where(p)[1]].numel() for p in kind]
                self.owner.update(zip(kind, assign_owners(sizes, load)))
        self.whole: dict[nn.Parameter, nn.Parameter] = {}  # owned here: the model's parameter -> its whole copy
        members: dict[int, tuple[Segment, list[tuple[int, int]], dict[int, nn.Parameter]]] = {}
        for p in params:
            seg, i = where(p)
            entry = members.setdefault(seg.index, (seg, [], {}))
            entry[1].append((i, self.owner[p]))
            if self.owner[p] == shard_group(seg).rank:
                assert seg.master is not None
                whole = nn.Parameter(seg.master.new_empty(0))
                self.whole[p] = entry[2][i] = whole
        self.exchanges = [
            _Exchange(seg, sorted(ms), shard_group(seg), whole) for _, (seg, ms, whole) in sorted(members.items())
        ]
        self.groups = [[self.whole[p] for p in ps if p in self.whole] for ps in groups]
        # This rank's slice ranges of the plan's parameters: what a step consumes (zeroes) of the reduced gradients.
        self.local_ranges = [
            (ex.seg, a, b) for ex in self.exchanges for _, a, b in merge_runs(ex.seg.local_runs(self.params))
        ]
        self.stale, self.live = False, False
        self._empty = {ex.seg.index: ex.seg.master.new_empty(0) for ex in self.exchanges if ex.seg.master is not None}
        step = optimizer.step

        def owner_step(*args: Any, **kwargs: Any) -> Any:
            if not self.live:  # a step with no backward since the last one: the owners step zero gradients
                self.gather()
            result = step(*args, **kwargs)
            self.scatter()
            return result

        replace_step(optimizer, owner_step, whole_tensors=True)

    def transient_bytes(self) -> int:
        """What a step allocates and frees: the owned values and gradients, whole, and the runs sent for them."""
        return sum(
            2 * (ex.owned_numel + sum(ex.send_splits)) * ex.seg.master.element_size()
            for ex in self.exchanges
            if ex.seg.master is not None
        )

    # ---------------------------------------------------------------------------- a step
    def gather(self) -> None:
        """Every owner receives its parameters' values and reduced gradients, whole. A collective."""
        works = [w for ex in self.exchanges for w in ex.to_owners(self.stats)]
        for w in works:
            w.wait()
        for ex in self.exchanges:
            ex.attach()
        self.stale, self.live = False, True

    def scatter(self) -> None:
        """The owners' new values back into every rank's master slices. A collective."""
        works = [w for ex in self.exchanges for w in ex.from_owners(self.stats)]
        for w in works:
            w.wait()
        for ex in self.exchanges:
            ex.finish_from_owners()

    def release(self) -> None:
        """Drop the whole copies: the step is over (or was skipped), and its gradients are consumed."""
        if self.live:
            for ex in self.exchanges:
                ex.release(self._empty[ex.seg.index])
        self.live = self.stale = False

    def refresh(self) -> None:
        """The master slices changed under the owners' copies (a checkpoint was loaded): gather again first."""
        if self.live:
            self.release()
            self.stale = True

    def zero_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Zero the owned whole gradients of ``params`` (their slices are being zeroed)."""
        if self.live:
            for p in params:
                whole = self.whole.get(p)
                if whole is not None and whole.grad is not None:
                    whole.grad.zero_()

    def grads(self, wanted: set[Any]) -> list[torch.Tensor]:
        """The whole gradients this rank owns of the parameters in ``wanted`` (after :meth:`gather`)."""
        return [w.grad for p, w in self.whole.items() if p in wanted and w.grad is not None]

    # ---------------------------------------------------------------------------- checkpoints
    def state_entries(self, names: dict[nn.Parameter, str]) -> list[ShardEntry]:
        """The owned parameters' optimizer state, each tensor whole (as ddp saves it) under ``optim/<name>/<state>``:
        it loads on any world size and under any strategy. Only the parameters in ``names`` (one model's)."""
        out = []
        for p, whole in self.whole.items():
            if p in names:
                for k, v in self.optimizer.state.get(whole, {}).items():
                    if isinstance(v, torch.Tensor):
                        out.append(whole_entry(f"optim/{names[p]}/{k}", v))
        return out

    def load_state(self, names: dict[nn.Parameter, str], reader: StateReader) -> None:
        """Each owned parameter's state, read whole, into the optimizer (new memory, never the reader's)."""
        keys = keys_by_param(reader)
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for p, whole in self.whole.items():
            name = names.get(p)
            if name is None or name not in keys:
                continue
            group = group_of[id(whole)]
            # read_optimizer_state places state by the parameter's dtype and device: the masters' (its data is empty).
            self.optimizer.state[whole] = {
                k: read_optimizer_state(reader, f"optim/{name}/{k}", whole, group) for k in keys[name] if k != "master"
            }

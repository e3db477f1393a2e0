"""``on_nonfinite``: a NaN or inf in a loss or a gradient is caught before the optimizer steps, on every rank at once.

    engine = phalanx.Engine(on_nonfinite="raise")   # the default: NonFiniteError naming the step, the ranks, the params
    engine = phalanx.Engine(on_nonfinite="skip")    # the step is not applied (the scheduler does not count it), warned
    engine = phalanx.Engine(on_nonfinite="ignore")  # no check: the optimizer steps into whatever it gets

Under fp16 the loss scaler already skips steps whose gradients overflowed, so the guard stands aside. Otherwise, at the
first ``clip_grad_norm_`` or ``optimizer.step()`` of a step, each rank checks the gradients it holds (its shard under
zero; when the step clips every gradient, the global norm that clipping computed, at no extra pass) and the losses
it backpropagated since the last step; one small all-gather tells every rank which ranks saw a
non-finite value, so that all of them raise, or all of them skip, together. Under ``raise`` a second exchange
names the first parameters whose gradients are non-finite, as each rank holds them. A loss is named on the rank that
computed it; a gradient where it is held after the reduction (on every replica under ddp, on the owner of its shard
under zero), which is why the loss check is there: it names the rank where the NaN came from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx.logging import get_logger
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import all_gather_bytes

__all__ = ["ON_NONFINITE", "NonFiniteError", "NonFiniteGuard"]

ON_NONFINITE = ("raise", "skip", "ignore")
_SHOWN = 4  # parameter names per rank in the error


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN or inf at an optimizer step under ``on_nonfinite='raise'``; nothing was stepped."""


def _all_finite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on ``device``: every element of every tensor is finite. One norm per tensor (grouped by
    device), no host sync."""
    verdicts = []
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        norms = torch._foreach_norm(group) if hasattr(torch, "_foreach_norm") else [t.norm() for t in group]
        verdicts.append(torch.isfinite(torch.stack([n.float() for n in norms])).all().to(device))
    return torch.stack(verdicts).all() if verdicts else torch.ones((), dtype=torch.bool, device=device)


class NonFiniteGuard:
    """One per Engine. ``check`` is a collective: every rank calls it at the same point of the same step."""

    def __init__(self, mode: str, device: torch.device, loss_scaled: bool) -> None:
        self.mode, self.device = mode, device
        self.active = mode != "ignore" and not loss_scaled
        self.skipped = 0
        self.verdict: bool | None = None  # this round's: True when the step must not be applied
        self.local = False
        """Decide from this rank's gradients alone, with no exchange: while finished ranks stand in for the
        reductions of the others (Accelerate's ``join_uneven_inputs``), which hold the same reduced gradients."""
        self._bad_loss: torch.Tensor | None = None

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember (on the device, without a host sync) whether a loss about to be backpropagated is non-finite."""
        if self.active:
            bad = ~torch.isfinite(loss.detach()).all()
            self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def end_round(self) -> None:
        self.verdict = None

    def check(
        self,
        grads: Callable[[], list[torch.Tensor]],
        step: int,
        names: Callable[[], list[str]],
        norm: torch.Tensor | None = None,
    ) -> bool:
        """True when this step must be skipped; raises NonFiniteError under ``raise``. ``grads()`` gives the
        gradients this rank holds, read only when ``norm`` (their global norm, which clipping computed) is not
        given; ``names()`` lists the parameters whose gradients are non-finite (called only then)."""
        if not self.active:
            return False
        if self.verdict is not None:
            return self.verdict
        # Everything stays on the device until the exchange: one host sync per step, after it.
        zero = torch.zeros((), dtype=torch.bool, device=self.device)
        bad_loss = self._bad_loss.to(self.device) if self._bad_loss is not None else zero
        self._bad_loss = None
        finite = torch.isfinite(norm).all().to(self.device) if norm is not None else _all_finite(grads(), self.device)
        mine = torch.stack([bad_loss, ~finite]).float()
        exchange = not self.local and dist.is_initialized() and dist.get_world_size() > 1
        if exchange:
            everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            watched(dist.all_gather, everyone, mine)
            flags = dict(enumerate(torch.stack(everyone).cpu().tolist()))
        else:
            flags = {_rank(): mine.cpu().tolist()}
        bad_ranks = [r for r, (loss_bad, grad_bad) in flags.items() if loss_bad or grad_bad]
        self.verdict = bool(bad_ranks)
        if not bad_ranks:
            return False
        what = []
        for r in bad_ranks:
            kinds = [k for k, flag in zip(("loss", "gradients"), flags[r]) if flag]
            what.append(f"rank {r} ({' and '.join(kinds)})")
        if self.mode == "skip":
            self.skipped += 1
            get_logger().warning(
                "on_nonfinite='skip': optimizer step %d was not applied: non-finite values on %s (%d step(s) skipped "
                "so far; the scheduler does not count them)",
                step,
                ", ".join(what),
                self.skipped,
            )
            return True
        held = names()[:_SHOWN] if flags[_rank()][1] else []
        mine_held = ", ".join(held)
        per_rank = [b.decode() for b in all_gather_bytes(mine_held.encode(), self.device)] if exchange else []
        where = "; ".join(
            f"rank {r}: {n}" for r, n in (enumerate(per_rank) if exchange else [(_rank(), mine_held)]) if n
        )
        raise NonFiniteError(
            f"non-finite values at optimizer step {step} on {', '.join(what)}"
            + (f"; first parameters with non-finite gradients: {where}" if where else "")
            + ". Nothing was stepped, so the weights and the last checkpoint are intact. Look for a log of 0, a "
            "division by a zero count or a too-high learning rate; on_nonfinite='skip' skips such steps instead (the "
            "scheduler does not count them), on_nonfinite='ignore' steps anyway"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0

"""DeepSpeed-Ulysses sequence parallelism: all-to-alls that turn a sequence split into a head split and back.

    out = ulysses_attention(q, k, v, attend, group=sp_group)   # q [b, h, s/P, d] -> out [b, h, s/P, d]

**Layout.** Outside attention, each of the ``P`` ranks of ``group`` holds the contiguous slice ``r`` of the sequence
(``layout.positions("ulysses", P, r, s)``), every head of it: ``[b, h, s/P, d]``. Attention needs the whole
sequence, but each head attends on its own, so one all-to-all per tensor regroups it: :func:`seq_to_heads` makes
``[b, h/P, s, d]``, heads ``r*h/P .. (r+1)*h/P - 1`` over the whole sequence, in order of position (the slice that
came from rank ``i`` lands at positions ``i*s/P ..``). The caller's ``attend`` runs on that, unchanged: causal SDPA,
flash attention, transformers' attention function, with the whole sequence's masks (every rank of the group holds
them). :func:`heads_to_seq` turns its result back. Each is an autograd function whose backward is the reverse
all-to-all, so gradients come back to the rank and the positions they belong to.

**Heads.** ``h`` must be a multiple of ``P`` (each rank takes ``h/P`` query heads). Grouped-query attention (``h_kv``
key/value heads, query head ``i`` reading kv head ``i // (h/h_kv)``): with ``h_kv >= P``, ``h_kv`` must be a multiple
of ``P``, and rank ``r`` gets kv heads ``r*h_kv/P ..``, exactly those its query heads read. With ``h_kv < P``, ``P``
must be a multiple of ``h_kv``: as DeepSpeed does, each kv head is repeated ``P/h_kv`` times before the all-to-all
(``repeat_interleave`` on the head dim), so that rank ``r`` gets one kv head, copy of ``r // (P/h_kv)``, which is the
one its query heads ``r*h/P .. (r+1)*h/P - 1`` read. The gradients of the copies are summed back onto their head by
the backward of ``repeat_interleave``. Anything else raises :class:`ValueError` naming the numbers and the fix.

**Traffic** (:func:`ulysses_traffic_elements`). Per layer, each rank sends ``(P-1)/P`` of each tensor it hands to an
all-to-all (the ``1/P`` for itself stays), forward: q, k, v and the output; backward: the gradients of the same four,
the other way. With ``h_kv' = max(h_kv, P)`` (the kv heads after replication):

    forward = backward = (P-1)/P * b * s_local * d * (2*h + 2*h_kv')

For a fixed sequence ``s = P * s_local`` this is ``(P-1)/P**2 * b*s*d*(2h + 2h_kv')``: it shrinks as ranks are added,
where ring attention sends the whole kv ``P-1`` times. This is why Ulysses is the cheaper of the two on a fast
all-to-all fabric (one node), and why its degree is bounded by the number of heads.

**Devices.** Buffers are made with ``torch.empty_like`` on the input's device, shapes come from the tensors'
metadata, nothing reads a value back to the host; on NCCL each all-to-all is queued on the current stream (the
backward's on autograd's). Every collective goes through ``collective_log.watched`` with labels ``ulysses q`` ...
``ulysses out`` forward and ``... backward`` for their reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = ["heads_to_seq", "seq_to_heads", "ulysses_attention", "ulysses_traffic_elements"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _size(group: Any) -> int:
    """The group's size; one process without a process group counts as a group of one."""
    if group is None and not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))


def _check_4d(x: torch.Tensor, what: str, layout: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what} must be 4-dimensional {layout}, got shape {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------- the all-to-alls
def _a2a(inp: torch.Tensor, group: Any, label: str) -> torch.Tensor:
    """One all-to-all of a contiguous ``[P, ...]`` tensor: block ``j`` goes to rank ``j``, block ``i`` of the result
    came from rank ``i``."""
    out = torch.empty_like(inp, memory_format=torch.contiguous_format)
    watched(dist.all_to_all_single, out, inp, group=group, label=label)
    return out


def _seq_to_heads(x: torch.Tensor, size: int, group: Any, label: str) -> torch.Tensor:
    """``[b, h, s/P, d]`` -> ``[b, h/P, s, d]``: head block ``j`` to rank ``j``; the slice from rank ``i`` lands at
    positions ``i*s/P ..``."""
    b, h, s_local, d = x.shape
    hp = h // size
    # [P, b, h/P, s/P, d]: block j holds the heads rank j takes.
    inp = x.reshape(b, size, hp, s_local, d).transpose(0, 1).contiguous()
    out = _a2a(inp, group, label)  # [P (source rank = sequence slice), b, h/P, s/P, d]
    return out.permute(1, 2, 0, 3, 4).reshape(b, hp, size * s_local, d)


def _heads_to_seq(x: torch.Tensor, size: int, group: Any, label: str) -> torch.Tensor:
    """``[b, h/P, s, d]`` -> ``[b, h, s/P, d]``: sequence slice ``j`` to rank ``j``; the heads from rank ``i`` land at
    heads ``i*h/P ..``."""
    b, hp, s, d = x.shape
    s_local = s // size
    # [P, b, h/P, s/P, d]: block j holds the positions rank j keeps.
    inp = x.reshape(b, hp, size, s_local, d).permute(2, 0, 1, 3, 4).contiguous()
    out = _a2a(inp, group, label)  # [P (source rank = head block), b, h/P, s/P, d]
    return out.transpose(0, 1).reshape(b, size * hp, s_local, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, group: Any, label: str) -> torch.Tensor:
        ctx.size, ctx.group, ctx.label = size, group, label
        return _seq_to_heads(x, size, group, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Through the other Function, so that a double backward (create_graph) goes through the all-to-alls too.
        return _HeadsToSeq.apply(grad, ctx.size, ctx.group, f"{ctx.label} backward"), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, group: Any, label: str) -> torch.Tensor:
        ctx.size, ctx.group, ctx.label = size, group, label
        return _heads_to_seq(x, size, group, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SeqToHeads.apply(grad, ctx.size, ctx.group, f"{ctx.label} backward"), None, None, None


def seq_to_heads(x: torch.Tensor, *, group: Any = None, label: str = "ulysses seq_to_heads") -> torch.Tensor:
    """``[b, h, s/P, d]`` (this rank's slice of the sequence, every head) -> ``[b, h/P, s, d]`` (this rank's heads,
    the whole sequence), by one all-to-all over ``group`` (None: the default group). Differentiable: the backward is
    :func:`heads_to_seq` of the gradient. A group of one returns ``x`` itself."""
    size = _size(group)
    if size == 1:
        return x
    _check_4d(x, "seq_to_heads' input", "[batch, heads, local sequence, head dim]")
    if x.shape[1] % size:
        raise ValueError(
            f"seq_to_heads: {x.shape[1]} heads cannot be split over {size} ranks (the heads must be a multiple of "
            f"the group's size: pick a group size that divides {x.shape[1]})"
        )
    out: torch.Tensor = _SeqToHeads.apply(x, size, group, label)
    return out


def heads_to_seq(x: torch.Tensor, *, group: Any = None, label: str = "ulysses heads_to_seq") -> torch.Tensor:
    """``[b, h/P, s, d]`` -> ``[b, h, s/P, d]``, the inverse of :func:`seq_to_heads` (and its backward)."""
    size = _size(group)
    if size == 1:
        return x
    _check_4d(x, "heads_to_seq's input", "[batch, local heads, sequence, head dim]")
    if x.shape[2] % size:
        raise ValueError(
            f"heads_to_seq: a sequence of {x.shape[2]} cannot be cut into {size} equal slices (pad it to a multiple "
            f"of {size})"
        )
    out: torch.Tensor = _HeadsToSeq.apply(x, size, group, label)
    return out


# ------------------------------------------------------------------------------------------- heads
def _kv_copies(h: int, h_kv: int, size: int) -> int:
    """How many times each kv head is repeated before the all-to-all (1: none); raises on heads that do not fit."""
    if h % size:
        raise ValueError(
            f"Ulysses needs the attention heads to be a multiple of the sequence-parallel size: h={h} heads over "
            f"P={size} ranks. Use an sp size that divides {h} (or ring attention, cp_size, which has no such bound)"
        )
    if h_kv <= 0 or h % h_kv:
        raise ValueError(
            f"grouped-query attention needs the query heads to be a multiple of the key/value heads: h={h}, h_kv={h_kv}"
        )
    if h_kv >= size:
        if h_kv % size:
            raise ValueError(
                f"Ulysses splits the key/value heads over the ranks: h_kv={h_kv} kv heads over P={size} ranks must "
                f"be a multiple of P (or fewer than P, and dividing it, to be replicated). Use an sp size that divides "
                f"{h_kv}"
            )
        return 1
    if size % h_kv:
        raise ValueError(
            f"Ulysses replicates h_kv={h_kv} key/value heads over P={size} ranks: P must be a multiple of h_kv so "
            f"that every rank gets one whole kv head. Use an sp size that is a multiple of {h_kv}, or one that "
            f"divides it"
        )
    return size // h_kv


def ulysses_traffic_elements(b: int, h: int, h_kv: int, s_local: int, d: int, size: int) -> dict[str, Any]:
    """The elements one rank sends per attention layer under Ulysses over ``size`` ranks (the textbook formula).

    Each all-to-all hands over a whole local tensor and sends ``(size-1)/size`` of it (its own block stays). Forward:
    q (``b*h*s_local*d``), k and v (``b*h_kv'*s_local*d`` each), the output (``b*h*s_local*d``); backward: the
    gradients of the same four, the other way. ``h_kv' = h_kv`` when ``h_kv >= size``; when ``h_kv < size`` the kv
    heads are replicated to ``h_kv' = size`` before their all-to-all, which makes k and v ``size/h_kv`` times larger
    on the wire: each rank then receives one kv head over the whole sequence, ``(size-1)*b*s_local*d`` elements, which
    is what it needs anyway (no scheme sends it less), and the backward sends the copies' gradients back the same way.

    Returns ``forward`` and ``backward`` (elements sent), ``total``, and ``calls``: each all-to-all's label and its
    payload (the whole local tensor, as the collective log records it), in the order they run (the backward's in
    autograd's usual order, which the caller should not rely on).
    """
    copies = _kv_copies(h, h_kv, size)
    q = b * h * s_local * d
    kv = b * h_kv * copies * s_local * d
    calls = {"ulysses q": q, "ulysses k": kv, "ulysses v": kv, "ulysses out": q}
    backward_calls = {f"{label} backward": n for label, n in reversed(calls.items())}
    if size == 1:
        return {"forward": 0, "backward": 0, "total": 0, "calls": {}}
    sent = sum(calls.values()) * (size - 1) // size
    return {"forward": sent, "backward": sent, "total": 2 * sent, "calls": {**calls, **backward_calls}}


# ------------------------------------------------------------------------------------------- attention
def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, *, group: Any = None
) -> torch.Tensor:
    """Attention over the whole sequence for this rank's slice of it.

    ``q`` ``[b, h, s_local, d]``, ``k``/``v`` ``[b, h_kv, s_local, d]`` (this rank's contiguous slice of the
    sequence). ``attend(q_heads, k_heads, v_heads)`` gets ``[b, h/P, s, d]`` and ``[b, h_kv/P or 1, s, d]`` (this
    rank's heads over the whole sequence, kv heads grouped as its query heads read them: pass ``enable_gqa=True`` to
    SDPA when they differ) and returns ``[b, h/P, s, d_v]``; the result comes back as ``[b, h, s_local, d_v]``.
    A group of one (or no process group) calls ``attend(q, k, v)`` as it is.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_4d(t, name, "[batch, heads, local sequence, head dim]")
    b, h, s_local, _ = q.shape
    h_kv = k.shape[1]
    if k.shape[:3] != (b, h_kv, s_local) or v.shape[:3] != (b, h_kv, s_local):
        raise ValueError(
            f"k and v must be [batch={b}, kv heads, local sequence={s_local}, head dim] with the same kv heads: got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    size = _size(group)
    copies = _kv_copies(h, h_kv, size)
    if size == 1:
        return attend(q, k, v)
    if copies > 1:  # kv head j becomes heads j*copies .. (j+1)*copies - 1: one per rank, the one it reads
        k = k.repeat_interleave(copies, dim=1)
        v = v.repeat_interleave(copies, dim=1)
    qh = seq_to_heads(q, group=group, label="ulysses q")
    kh = seq_to_heads(k, group=group, label="ulysses k")
    vh = seq_to_heads(v, group=group, label="ulysses v")
    out = attend(qh, kh, vh)
    want = (b, h // size, s_local * size)
    if out.dim() != 4 or tuple(out.shape[:3]) != want:
        raise ValueError(
            f"attend must return [batch, local heads, sequence, head dim] = [{want[0]}, {want[1]}, {want[2]}, d], "
            f"got {tuple(out.shape)} (transformers' attention functions return [b, s, h, d]: transpose(1, 2) it)"
        )
    return heads_to_seq(out, group=group, label="ulysses out")

"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group.

    out = ring_attention(q, k, v, group=cp_group)            # q [b, h, s_local, d]; k, v [b, h_kv, s_local, d]

Layout. With ``size`` ranks the sequence is cut into ``2 * size`` equal chunks of ``n = s_local // 2`` tokens and
rank ``r`` holds chunks ``r`` and ``2 * size - 1 - r`` concatenated (the zig-zag of :mod:`.layout`), one early and
one late, so that every rank has the same number of causal query-key pairs.

Forward. Each rank keeps its queries and passes its keys and values around the ring: at step ``t`` it holds the kv
chunk pair of rank ``(r - t) % size``, sends it on to ``r + 1`` and receives the next from ``r - 1``; after
``size`` steps every query has met every key. Causality is by global position: a query chunk ``a`` attends a key
chunk ``c < a`` fully, ``c == a`` lower-triangularly, and ``c > a`` not at all (the block is not computed). With the
zig-zag, the keys a query chunk attends are a prefix of the pair held (chunk ``j`` before ``2 * size - 1 - j``), so
each step computes, per query chunk, one block against that prefix: on the diagonal step (its own kv) two causal
blocks, on every other step the same ``2 n x n`` query-key pairs, which is what balances the ring. Each block gives a
normalised partial output and the log-sum-exp of its scores; partials are merged with
``lse = logaddexp(lse, lse_blk); out = out * exp(lse_old - lse) + out_blk * exp(lse_blk - lse)``, running in float32
(float64 for float64 inputs), and the result is returned in q's dtype. The transfer of the next kv pair is posted
before the current one is computed on and waited for just before it is needed, so communication overlaps compute.

Grouped-query attention: only the ``h_kv`` heads travel; query head ``i`` uses kv head ``i // (h // h_kv)`` (as
``repeat_interleave`` on the head dimension would give), grouped inside the block computation, never materialised.

A ``key_padding_mask`` (bool ``[b, s_local]``, True for a real token, in the same local order) travels with its kv
pair. A query with no key it may attend gets output 0 and gradient 0 (its lse is ``-inf``; no NaN anywhere).

Backward (:class:`_RingAttention`, our own autograd function). Saved: the local q, k, v, the output, the float32 lse
and the mask, all ``O(s_local)``. Every block is recomputed from the global lse: ``P = exp(S * scale - lse)``,
``D = rowsum(dO * O)``, ``dS = P * (dP - D)`` with ``dP = dO V^T``, ``dQ += dS K * scale``, ``dK += dS^T Q * scale``,
``dV += P^T dO`` (dK, dV summed over the query heads of a kv head). The kv pair rotates again, and with it its dK/dV
accumulator (float32: each hop adds one rank's contribution): at step ``t`` a rank adds its contribution to the
accumulator of the pair it holds and sends it on; after ``size`` hops every accumulator is back with its owner. The
next kv pair is posted before the step's compute; the incoming accumulator is waited for only once the step's own
contribution is computed (it is added then), so both transfers overlap compute.

Traffic per rank per call (elements sent; as many are received), with ``E = 2 * b * h_kv * s_local * d`` (k and v
packed in one message) and ``M = b * s_local`` when a mask travels:

- forward: ``(size - 1) * (E + M)``: the own pair is used first, the last one received is not sent on;
- backward: ``(size - 1) * (E + M)`` for the kv pairs, plus ``size * E`` for the dK/dV accumulators (float32),
  the last hop bringing them home; none at all with ``size == 1``.

:func:`ring_traffic_elements` gives these numbers; the tests compare them with phalanx's collective log. Every
transfer goes through :func:`~phalanx.runtime.collective_log.watched` ("ring attention kv", "ring attention kv
(backward)", "ring attention dkv"): on CUDA as one ``batch_isend_irecv`` group per transfer (NCCL's send and receive
between a pair of ranks progress together), elsewhere as ``isend``/``irecv``. With a subgroup, the peers are global
ranks (``dist.get_global_rank``). Nothing inside the loops syncs with the host: the plan of blocks depends only on
the ranks and the step, and the masks are made on the inputs' device.

The blocks are plain matmuls and a masked softmax, computed in float32: a reference path that runs on any device.
Each block is computed in tiles of query rows (``_TILE_ELEMENTS`` score elements, 16 MiB in fp32) with its softmax
pieces in place, so that the temporaries of a step stay a few tiles whatever the chunk length: at 16,384 tokens
on cp4 an untiled backward block held four 128 MiB score-sized tensors at once.
Attention dropout is refused (the recompute would need the forward's masks): turn it off under context parallelism.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = ["ring_attention", "ring_traffic_elements"]

_LABEL_FWD = "ring attention kv"
_LABEL_BWD = "ring attention kv (backward)"
_LABEL_DKV = "ring attention dkv"


# ---------------------------------------------------------------------------------------------- public API
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence held by ``group`` (see the module docstring).

    ``q``: ``[b, h, s_local, d]``; ``k``, ``v``: ``[b, h_kv, s_local, d]`` with ``h % h_kv == 0``; ``s_local`` is
    this rank's two zig-zag chunks. ``group``: the context-parallel process group (None: the default group, or one
    process when torch.distributed is not initialised). ``scale``: default ``1 / sqrt(d)``. ``key_padding_mask``:
    bool ``[b, s_local]``, True where a key may be attended. Returns ``[b, h, s_local, d]`` in q's dtype.
    """
    _check(q, k, v, key_padding_mask, dropout_p)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring.of(group)
    mask = key_padding_mask.contiguous() if key_padding_mask is not None else None
    out: torch.Tensor = _RingAttention.apply(q, k, v, mask, ring, float(scale))
    return out


def ring_traffic_elements(
    b: int, h_kv: int, s_local: int, d: int, size: int, *, key_padding_mask: bool = False
) -> dict[str, int]:
    """Elements one rank sends per :func:`ring_attention` call (it receives as many), by the formula it implements.

    ``forward``: ``(size - 1)`` kv pairs (k and v: ``2 * b * h_kv * s_local * d``, plus ``b * s_local`` mask
    elements with ``key_padding_mask``). ``backward_kv``: the same again; ``backward_dkv``: ``size`` dK/dV
    accumulators of ``2 * b * h_kv * s_local * d`` float32 elements (none with ``size == 1``). ``backward``: their sum.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1; got {size}")
    kv = 2 * b * h_kv * s_local * d
    mask = b * s_local if key_padding_mask else 0
    forward = (size - 1) * (kv + mask)
    dkv = size * kv if size > 1 else 0
    return {"forward": forward, "backward_kv": forward, "backward_dkv": dkv, "backward": forward + dkv}


# -------------------------------------------------------------------------------------------------- checks
def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None, dropout_p: float
) -> None:
    if dropout_p != 0.0:
        raise ValueError(
            f"ring_attention got dropout_p={dropout_p}; attention dropout is not supported under context parallelism "
            "(the backward recomputes the blocks and would need the forward's masks). Set the model's attention "
            "dropout to 0 (e.g. attention_dropout=0.0 in its config)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"ring_attention needs 4-D {name} of [batch, heads, s_local, head_dim]; got {shape}. Transpose "
                "[batch, seq, heads, dim] inputs with .transpose(1, 2) first"
            )
    if k.shape != v.shape:
        raise ValueError(f"ring_attention needs k and v of one shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    b, h, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"ring_attention needs k and v of [batch, h_kv, s_local, head_dim] matching q {tuple(q.shape)} in "
            f"batch, s_local and head_dim; got {tuple(k.shape)}. Pass this rank's chunks of q, k and v alike"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype or not q.dtype.is_floating_point:
        raise ValueError(
            f"ring_attention needs q, k and v of one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them "
            "to the same dtype"
        )
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"ring_attention needs q, k and v on one device; got {q.device}, {k.device}, {v.device}")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv:
        raise ValueError(
            f"ring_attention needs the query heads to be a multiple of the kv heads (grouped-query attention); got "
            f"h={h} and h_kv={h_kv}. Use h_kv dividing h"
        )
    if s == 0 or s % 2:
        raise ValueError(
            f"ring_attention needs an even, non-zero s_local (two zig-zag chunks per rank); got s_local={s}. Pad "
            "the sequence to a multiple of 2 * cp_size and cut it with layout.positions('ring', ...)"
        )
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (b, s):
            raise ValueError(
                f"ring_attention needs key_padding_mask as a bool [batch, s_local] = [{b}, {s}] tensor (True: a real "
                f"token); got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}. Pass the mask of this "
                "rank's positions, as a bool tensor"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"ring_attention needs key_padding_mask on q's device {q.device}; got {key_padding_mask.device}"
            )


# ---------------------------------------------------------------------------------------------------- ring
class _Ring:
    """This rank's place in the ring: its rank and size in the group, and the global ranks of its neighbours."""

    def __init__(self, group: Any, rank: int, size: int, nxt: int, prv: int) -> None:
        self.group, self.rank, self.size, self.next, self.prev = group, rank, size, nxt, prv

    @classmethod
    def of(cls, group: Any) -> _Ring:
        if group is None and not dist.is_initialized():
            return cls(None, 0, 1, 0, 0)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError(
                f"ring_attention was called on rank {dist.get_rank()} with a group it is not a member of; call it "
                "with this rank's own context-parallel group"
            )
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        if group is not None:  # isend/irecv take global ranks, also within a subgroup
            nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
        return cls(group, rank, size, nxt, prv)

    def post(self, tensors: list[torch.Tensor], label: str) -> tuple[list[torch.Tensor], list[Any]]:
        """Send ``tensors`` to the next rank and receive their like from the previous one; returns the receive
        buffers (filled once the works are waited for) and the works."""
        bufs = [torch.empty_like(t) for t in tensors]
        if tensors[0].is_cuda:
            ops = []
            for t, buf in zip(tensors, bufs):
                ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
                ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group))
            works = list(watched(dist.batch_isend_irecv, ops, label=label))
        else:
            works = []
            for t, buf in zip(tensors, bufs):
                works.append(watched(dist.isend, t, dst=self.next, group=self.group, label=label))
                works.append(watched(dist.irecv, buf, src=self.prev, group=self.group, label=label))
        return bufs, works

    def kv_chunks(self, step: int) -> tuple[int, int]:
        """The global chunk indices of the kv pair held at ``step`` (that of rank ``(rank - step) % size``)."""
        owner = (self.rank - step) % self.size
        return owner, 2 * self.size - 1 - owner

    def plan(self, step: int) -> list[tuple[int, int, bool]]:
        """The blocks of ``step``: ``(query chunk 0/1, number of kv chunks attended, causal)``.

        A query chunk ``a`` attends the kv chunks ``c <= a``. The pair held is ``(j, 2 size - 1 - j)`` with
        ``j < 2 size - 1 - j``, so these are a prefix of it (1 or 2 chunks, or none: no block); only the last chunk
        of the prefix can be ``a`` itself (causal, lower-triangular); the others are attended fully."""
        q_chunks = (self.rank, 2 * self.size - 1 - self.rank)
        kv = self.kv_chunks(step)
        blocks = []
        for i, a in enumerate(q_chunks):
            m = sum(1 for c in kv if c <= a)
            if m:
                blocks.append((i, m, kv[m - 1] == a))
        return blocks


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


# -------------------------------------------------------------------------------------------------- blocks
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _allowed(
    n: int, m: int, causal: bool, mask: torch.Tensor | None, tri: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    """Which keys of a block the queries may attend, broadcastable to ``[b, h_kv, g, n, m * n]``; None for all.

    ``causal``: the last kv chunk of the prefix is the query chunk itself: query ``i`` attends key ``j`` when
    ``j <= i + (m - 1) * n`` (the earlier chunks fully, the last lower-triangularly)."""
    allowed = tri[m] if causal else None
    if mask is not None:
        keys = mask[:, None, None, None, : m * n]
        allowed = keys if allowed is None else keys & allowed
    return allowed


def _causal_masks(n: int, device: torch.device) -> dict[int, torch.Tensor]:
    return {m: torch.ones(n, m * n, dtype=torch.bool, device=device).tril((m - 1) * n) for m in (1, 2)}


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The lse of rows that attend nothing (``-inf``) as 0, so that ``exp(S - lse)`` gives 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


_TILE_ELEMENTS = 1 << 22
"""Score elements of one tile of query rows (16 MiB in fp32): a block is computed tile by tile, so that its
temporaries stay this size whatever the chunk length, instead of growing with the square of it."""


def _tiles(n: int, rows_cost: int) -> list[slice]:
    """Row slices of a chunk of ``n`` query rows, each row costing ``rows_cost`` score elements."""
    step = max(1, min(n, _TILE_ELEMENTS // max(1, rows_cost)))
    return [slice(r, min(r + step, n)) for r in range(0, n, step)]


def _rows_of(allowed: torch.Tensor | None, tile: slice) -> torch.Tensor | None:
    """``allowed`` for the query rows ``tile`` (its row dim is 1 when it does not depend on the row)."""
    return allowed if allowed is None or allowed.shape[-2] == 1 else allowed[..., tile, :]


def _scores(qb: torch.Tensor, kb: torch.Tensor, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``S * scale`` of ``qb`` ``[b, h_kv, g, n, d]`` against ``kb`` ``[b, h_kv, L, d]``, ``-inf`` where masked
    (in place: one score-sized tensor)."""
    s = torch.matmul(qb, kb.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    return s if allowed is None else s.masked_fill_(~allowed, float("-inf"))


def _block_forward(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, allowed: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's normalised output ``[b, h_kv, g, n, d]`` and the log-sum-exp of its scores ``[b, h_kv, g, n]``."""
    s = _scores(qb, kb, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(_finite(lse).unsqueeze(-1)).exp_()
    return torch.matmul(p, vb.unsqueeze(2)), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold a block's partial (``blk_out``, ``blk_lse``) into the running ``out`` and ``lse``, in place."""
    new = torch.logaddexp(lse, blk_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(blk_out * torch.exp(blk_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    dob: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's ``dQ`` ``[b, h_kv, g, n, d]`` and ``dK``, ``dV`` ``[b, h_kv, L, d]``, recomputed from the lse
    (two score-sized tensors at a time)."""
    p = _scores(qb, kb, allowed, scale).sub_(_finite(lse).unsqueeze(-1)).exp_()  # [b, h_kv, g, n, L]
    dp = torch.matmul(dob, vb.unsqueeze(2).transpose(-1, -2))
    ds = dp.sub_(delta.unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, kb.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qb).sum(2) * scale
    dv = torch.matmul(p.transpose(-1, -2), dob).sum(2)
    return dq, dk, dv


def _grouped(t: torch.Tensor, h_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, h, s, ...]`` as ``[b, h_kv, h // h_kv, s, ...]`` in ``dtype`` (query head ``i`` to kv head ``i // g``)."""
    b, h = t.shape[:2]
    return t.to(dtype).reshape(b, h_kv, h // h_kv, *t.shape[2:])


# ------------------------------------------------------------------------------------------------ autograd
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        ring: _Ring,
        scale: float,
    ) -> torch.Tensor:
        b, h, s, d = q.shape
        h_kv, n = k.shape[1], s // 2
        acc = _acc_dtype(q.dtype)
        qg = _grouped(q, h_kv, acc)  # [b, h_kv, g, s, d]
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        tri = _causal_masks(n, q.device)
        kv = torch.stack([k, v])  # one message for both
        held: list[torch.Tensor] = [kv] if mask is None else [kv, mask]
        for step in range(ring.size):
            pending = ring.post(held, _LABEL_FWD) if step + 1 < ring.size else None  # the next pair, posted first
            kv_acc = held[0].to(acc)
            held_mask = held[1] if mask is not None else None
            for i, m, causal in ring.plan(step):
                allowed = _allowed(n, m, causal, held_mask, tri)
                for tile in _tiles(n, b * h * m * n):
                    rows = slice(i * n + tile.start, i * n + tile.stop)
                    blk_out, blk_lse = _block_forward(
                        qg[..., rows, :],
                        kv_acc[0, :, :, : m * n],
                        kv_acc[1, :, :, : m * n],
                        _rows_of(allowed, tile),
                        scale,
                    )
                    _merge(out[..., rows, :], lse[..., rows], blk_out, blk_lse)
            if pending is not None:
                held, works = pending
                _wait(works)  # just before the pair is needed
        result = out.reshape(b, h, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, mask)
        ctx.ring, ctx.scale = ring, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        ring: _Ring = ctx.ring
        scale: float = ctx.scale
        b, h, s, d = q.shape
        h_kv, n = k.shape[1], s // 2
        acc = _acc_dtype(q.dtype)
        qg = _grouped(q, h_kv, acc)
        dog = _grouped(grad_out, h_kv, acc)
        delta = (dog * _grouped(out, h_kv, acc)).sum(-1)  # D = rowsum(dO * O): [b, h_kv, g, s]
        dq = torch.zeros_like(qg)
        tri = _causal_masks(n, q.device)
        kv = torch.stack([k, v])
        held: list[torch.Tensor] = [kv] if mask is None else [kv, mask]
        dkv_pending: tuple[list[torch.Tensor], list[Any]] | None = None
        dkv = kv  # replaced at step 0
        for step in range(ring.size):
            pending = ring.post(held, _LABEL_BWD) if step + 1 < ring.size else None
            kv_acc = held[0].to(acc)
            held_mask = held[1] if mask is not None else None
            contrib = torch.zeros_like(kv_acc)  # this rank's dK, dV for the pair held
            for i, m, causal in ring.plan(step):
                allowed = _allowed(n, m, causal, held_mask, tri)
                for tile in _tiles(n, b * h * m * n):
                    rows = slice(i * n + tile.start, i * n + tile.stop)
                    dq_blk, dk_blk, dv_blk = _block_backward(
                        qg[..., rows, :],
                        kv_acc[0, :, :, : m * n],
                        kv_acc[1, :, :, : m * n],
                        dog[..., rows, :],
                        lse[..., rows],
                        delta[..., rows],
                        _rows_of(allowed, tile),
                        scale,
                    )
                    dq[..., rows, :] += dq_blk
                    contrib[0, :, :, : m * n] += dk_blk
                    contrib[1, :, :, : m * n] += dv_blk
            if dkv_pending is None:
                dkv = contrib
            else:  # the accumulator of this pair, from the previous rank: waited for only now
                bufs, works = dkv_pending
                _wait(works)
                dkv = bufs[0].add_(contrib)
            if ring.size > 1:  # on to the next rank; the last hop brings every accumulator home
                dkv_pending = ring.post([dkv], _LABEL_DKV)
            if pending is not None:
                held, works = pending
                _wait(works)
        if dkv_pending is not None:
            bufs, works = dkv_pending
            _wait(works)
            dkv = bufs[0]
        return (
            dq.reshape(b, h, s, d).to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
            None,
            None,
        )

"""One engine's context parallelism: the batch cut over the cp ranks, and the model's attention routed to them.

The Engine makes one :class:`ContextParallel` when ``cp_size`` or ``sp_size`` is above 1. It does three things, so
that the user's loop (``loss = model(**batch).loss; engine.backward(loss)``) stays as it is:

1. **The batch.** The prepared loader hands every batch to :meth:`ContextParallel.cut` (each rank of a cp group
   gets the same whole batch from the loader, so the cut needs no communication):

   - the sequence length is dim 1 of ``input_ids`` (or of the first tensor of two or more dims); it is padded at
     the end to a multiple of ``2 * cp`` (ring) or ``sp`` (Ulysses), with ignored labels, a 0 attention mask and 0
     tokens; padding at the end cannot change a real token's result under causal attention;
   - ``labels`` are shifted over the whole sequence first and handed over as transformers' ``shift_labels`` (the
     target of position ``i`` is token ``i + 1``, which may sit on another rank), so every target counts once;
   - every tensor whose dim 1 is the sequence length is cut to this rank's positions (:mod:`.layout`), and
     ``position_ids`` (global positions) are added to a dict batch that has none;
   - a 2-D ``attention_mask`` becomes the key padding mask of the attention below; any other mask (4-D, float:
     document masking) is refused, since the ring's chunks would have to follow each document.

2. **The loss.** A model's loss is the mean over this rank's targets. ``engine.backward(loss)`` multiplies it by
   :meth:`weight`, ``cp * (targets here) / (targets in the whole sequence)``, so that the mean over the dp x cp
   ranks in the reduction is the whole sequence's mean, however unevenly padding falls on the chunks. With
   ``backward(loss_sum, items=n)`` the items are summed over dp x cp instead, and no weight is needed.

3. **Attention.** :meth:`adopt` routes the model's attention here: a transformers model through its attention
   registry (``sdpa`` and ``eager`` models; the mask the model would build is not built), any other model by
   catching its calls of ``F.scaled_dot_product_attention`` during forward (as torch's ``context_parallel`` does).
   :meth:`attend` then runs ring attention (``cp_size``) or Ulysses (``sp_size``; the inner attention is SDPA over
   the whole sequence for this rank's heads) with the batch's padding mask.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from phalanx.logging import warn_once
from phalanx.strategies.context_parallel.layout import LayoutError, multiple, positions
from phalanx.strategies.context_parallel.ring import ring_attention
from phalanx.strategies.context_parallel.ulysses import ulysses_attention

__all__ = [
    "ContextParallel",
    "ContextParallelError",
    "ATTN_IMPLEMENTATION",
    "check_even_targets",
    "context_parallel_of",
    "positions_like",
]

ATTN_IMPLEMENTATION = "phalanx_context_parallel"
"""The name phalanx registers in transformers' ``AttentionInterface``."""

IGNORE_INDEX = -100
_LABELS = ("labels", "shift_labels", "targets")


class ContextParallelError(LayoutError):
    """A batch, a model or an attention call that context parallelism cannot run as asked."""


class ContextParallel:
    """The cp group's method (``"ring"`` or ``"ulysses"``), size and this rank's place, and the batch in hand."""

    def __init__(self, kind: str, group: Any, size: int, rank: int) -> None:
        self.kind, self.group, self.size, self.rank = kind, group, size, rank
        self.setting = "cp_size" if kind == "ring" else "sp_size"
        self.seq_len: int | None = None
        """The whole (padded) sequence length of the batch in hand; None before the first cut."""
        self.positions: torch.Tensor | None = None
        self._key_mask: torch.Tensor | None = None  # this rank's positions (ring) or the whole sequence (Ulysses)
        self._weight: torch.Tensor | None = None
        self._cut: set[int] = set()  # ids of the tensors the last cut made: maybe_context_parallel leaves them
        self.in_forward = False  # inside the forward of a model adopted by catching SDPA

    # ------------------------------------------------------------------ the batch
    def cut(self, batch: Any) -> Any:
        """This rank's share of ``batch`` (see the module docstring); remembers its layout for attention."""
        seq = _seq_len(batch)
        if seq is None:
            raise ContextParallelError(
                f"{self.setting}={self.size} splits every sequence over ranks, but this batch has no tensor of two or "
                f"more dimensions to take the sequence length from (got {_describe(batch)}); batches must hold "
                "[batch, sequence, ...] tensors such as input_ids"
            )
        m = multiple(self.kind, self.size)
        padded = -(-seq // m) * m
        if padded != seq:
            warn_once(
                f"{self.setting}={self.size}: sequences of {seq} tokens are padded at the end to {padded}, a multiple "
                f"of {m} (ignored labels, masked keys); batches of a multiple of {m} tokens need no padding"
            )
        device = _first_tensor(batch).device
        pos = positions(self.kind, self.size, self.rank, padded, device)
        self.seq_len, self.positions, self._key_mask, self._cut = padded, pos, None, set()
        _CURRENT[:] = [self]
        out = self._cut_batch(batch, seq, padded, pos)
        return out

    def _cut_batch(self, batch: Any, seq: int, padded: int, pos: torch.Tensor) -> Any:
        targets: torch.Tensor | None = None
        if isinstance(batch, Mapping):
            items = dict(batch)
            mask = items.get("attention_mask")
            if mask is not None:
                self._key_mask = self._padding_mask(mask, seq, padded, pos)
            labels = items.get("labels")
            if isinstance(labels, torch.Tensor) and "shift_labels" not in items and labels.dim() >= 2:
                if labels.shape[1] == seq:
                    ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
                    items["shift_labels"] = torch.cat([labels[:, 1:], ignore], dim=1)
            out: dict[str, Any] = {}
            for key, value in items.items():
                fill = IGNORE_INDEX if key in _LABELS else 0
                out[key] = self._cut_tensor(value, seq, padded, pos, fill) if key != "position_ids" else value
            if "position_ids" in items and isinstance(items["position_ids"], torch.Tensor):
                p = items["position_ids"]
                if p.dim() == 2 and p.shape[1] == seq:
                    extra = torch.arange(seq, padded, device=p.device).expand(p.shape[0], -1)
                    out["position_ids"] = self._take(torch.cat([p, extra.to(p.dtype)], dim=1), pos)
            elif "input_ids" in items or "inputs_embeds" in items:
                rows = _first_tensor(batch).shape[0]
                out["position_ids"] = pos.unsqueeze(0).expand(rows, -1)
            targets = out.get("shift_labels")
            if targets is None and "labels" not in items:
                targets = out.get("targets")
            result: Any = out if isinstance(batch, dict) else type(batch)(out)  # type: ignore[call-arg]
        elif isinstance(batch, (tuple, list)):
            parts = []
            for i, value in enumerate(batch):
                # (inputs, targets): the second is taken to be the targets, already aligned with the inputs
                fill = IGNORE_INDEX if i == 1 and _integer(value) else 0
                parts.append(self._cut_tensor(value, seq, padded, pos, fill))
            if len(parts) == 2 and _integer(parts[1]) and parts[1].dim() >= 2:
                targets = parts[1]
            result = type(batch)(parts) if isinstance(batch, list) else tuple(parts)
        else:
            result = self._cut_tensor(batch, seq, padded, pos, 0)
        self._weight = self._weight_of(targets, batch, seq, padded)
        return result

    def _cut_tensor(self, value: Any, seq: int, padded: int, pos: torch.Tensor, fill: int) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seq:
            return value
        if padded != seq:
            shape = list(value.shape)
            shape[1] = padded - seq
            value = torch.cat([value, torch.full(shape, fill, dtype=value.dtype, device=value.device)], dim=1)
        out = self._take(value, pos)
        self._cut.add(id(out))
        return out

    def _take(self, value: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.kind == "ulysses":  # a contiguous slice
            n = value.shape[1] // self.size
            return value.narrow(1, self.rank * n, n).contiguous()
        return value.index_select(1, pos)

    def _padding_mask(self, mask: Any, seq: int, padded: int, pos: torch.Tensor) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ContextParallelError(
                f"{self.setting}={self.size} takes a padding mask of shape [batch, sequence] (1 for a real token); "
                f"got attention_mask of shape {shape}. Arbitrary masks, such as document masks of packed sequences, "
                "are refused: the chunks each rank holds would have to follow every document's bounds. Pad the "
                "documents apart, or pack them without a mask (they then attend across bounds)"
            )
        full = mask.to(torch.bool)
        if padded != seq:
            full = torch.cat([full, full.new_zeros(full.shape[0], padded - seq)], dim=1)
        return full if self.kind == "ulysses" else full.index_select(1, pos)

    def _weight_of(self, targets: torch.Tensor | None, batch: Any, seq: int, padded: int) -> torch.Tensor | None:
        if targets is None:
            return None  # every chunk holds as many positions: the mean over the ranks is the mean
        here = (targets != IGNORE_INDEX).sum()
        whole = _whole_targets(batch, seq)
        if whole is None:
            return None
        return (self.size * here / whole.clamp(min=1)).to(torch.float32)

    def weight(self) -> torch.Tensor | None:
        """The factor ``engine.backward(mean_loss)`` applies (module docstring), or None: each chunk weighs the same."""
        return self._weight

    # ------------------------------------------------------------------ Accelerate's explicit form
    @contextlib.contextmanager
    def buffers(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's ``maybe_context_parallel``: cut ``buffers`` in place along their sequence dims for the
        block, and restore those not in ``no_restore_buffers`` after it.

        On a batch the prepared loader cut already (the loader cuts every batch under cp), its tensors, and tensors
        made from them at this rank's length, stay as they are; tensors of the batch's whole length are cut as the
        loader cut it; ``position_ids`` made by ``torch.arange`` of the cut length take this rank's global
        positions. Without such a batch, the buffers' own length sets the layout."""
        buffers = list(buffers or [])
        dims = list(buffer_seq_dims) if buffer_seq_dims is not None else [1] * len(buffers)
        if len(dims) != len(buffers):
            raise ContextParallelError(
                f"maybe_context_parallel got {len(buffers)} buffers and {len(dims)} buffer_seq_dims; give one "
                "sequence dim per buffer"
            )
        keep = {id(t) for t in (no_restore_buffers or ())}
        if self.seq_len is not None and any(id(t) in self._cut for t in buffers):
            cuts = self._cuts_beside_the_batch(buffers, dims)
        else:
            cuts = self._cuts_of_a_new_layout(buffers, dims)
        saved = []
        for t, new in cuts:
            saved.append((t, t.data))
            t.data = new.contiguous()
        try:
            yield
        finally:
            for t, data in saved:
                if id(t) not in keep:
                    t.data = data

    def _cuts_of_a_new_layout(
        self, buffers: list[torch.Tensor], dims: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = {t.shape[d] for t, d in zip(buffers, dims)}
        if len(lengths) > 1:
            raise ContextParallelError(
                f"maybe_context_parallel's buffers have different sequence lengths {sorted(lengths)} along their "
                "buffer_seq_dims; give the dims where each holds the sequence"
            )
        if not buffers:
            return []
        seq = lengths.pop()
        m = multiple(self.kind, self.size)
        if seq % m:
            raise ContextParallelError(
                f"maybe_context_parallel: a sequence of {seq} tokens cannot be cut into {m} equal chunks for "
                f"{self.setting}={self.size} (pad the batch to a multiple of {m})"
            )
        pos = positions(self.kind, self.size, self.rank, seq, buffers[0].device)
        self.seq_len, self.positions, self._key_mask, self._weight = seq, pos, None, None
        _CURRENT[:] = [self]
        return [(t, self._take(t.data.movedim(d, 1), pos).movedim(1, d)) for t, d in zip(buffers, dims)]

    def _cuts_beside_the_batch(
        self, buffers: list[torch.Tensor], dims: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.seq_len is not None and self.positions is not None
        local, out = self.seq_len // self.size, []
        for t, d in zip(buffers, dims):
            if id(t) in self._cut:
                continue
            length, last = t.shape[d], t.data.movedim(d, -1)
            if length == self.seq_len:  # the whole batch's length: cut as the loader cut the batch
                out.append((t, self._take(t.data.movedim(d, 1), self.positions).movedim(1, d)))
            elif length != local:
                raise ContextParallelError(
                    f"maybe_context_parallel: a buffer has {length} positions along dim {d}, and the prepared loader "
                    f"cut this batch's {self.seq_len} (padded) positions to {local} on each of the {self.setting}="
                    f"{self.size} ranks; give the batch's tensors, or tensors of its whole length"
                )
            elif not t.is_floating_point() and torch.equal(last, torch.arange(local, device=t.device).expand_as(last)):
                warn_once(
                    "maybe_context_parallel: position_ids made by torch.arange of the cut batch's length would count "
                    "this rank's tokens from 0; they take the global positions of its tokens instead"
                )
                out.append((t, self.positions.to(t.dtype).expand_as(last).movedim(-1, d)))
            # else: made from the cut batch, this rank's share already
        return out

    # ------------------------------------------------------------------ attention
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """Attention of this rank's queries ``[b, h, s_local, d]`` over the whole sequence; ``k``, ``v`` may have
        fewer (kv) heads. Returns ``[b, h, s_local, d]``."""
        self._check_layout(q)
        if torch.is_autocast_enabled(q.device.type):  # as autocast runs SDPA: in its lower dtype
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.kind == "ring":
            if not causal:
                raise ContextParallelError(
                    f"cp_size={self.size} (ring attention) is causal only, and this attention is not causal; use "
                    f"sp_size={self.size} (Ulysses attends over the whole sequence in any pattern)"
                )
            mask = _rows(self._key_mask, q.shape[0], self.setting) if self._key_mask is not None else None
            return ring_attention(q, k, v, group=self.group, scale=scale, key_padding_mask=mask, dropout_p=dropout_p)
        full_mask = self._key_mask

        def attend_heads(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            gqa = kh.shape[1] != qh.shape[1]
            if full_mask is None:
                return F.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=causal, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
                )
            s = qh.shape[2]
            allowed = _rows(full_mask, qh.shape[0], self.setting)[:, None, None, :]
            if causal:
                allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=qh.device).tril()
            # A query with no key to attend (left padding) attends itself: finite, and its target is ignored.
            allowed = allowed | torch.eye(s, dtype=torch.bool, device=qh.device)
            return F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=allowed, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
            )

        return ulysses_attention(q, k, v, attend_heads, group=self.group)

    def _check_layout(self, q: torch.Tensor) -> None:
        if self.seq_len is None:
            raise ContextParallelError(
                f"{self.setting}={self.size}: the model's attention ran before any batch was cut over the "
                "context-parallel ranks. Take batches from a loader prepared by engine.prepare (it cuts each "
                "sequence), or cut them yourself inside accelerator.maybe_context_parallel(buffers=[...])"
            )
        local = self.seq_len // self.size
        if q.shape[2] != local:
            raise ContextParallelError(
                f"{self.setting}={self.size}: the attention got {q.shape[2]} positions, but this rank holds {local} of "
                f"the batch's {self.seq_len}; every rank must run the model on the batch its prepared loader cut "
                "(a whole sequence fed to the model would be attended as chunks: a wrong result)"
            )

    # ------------------------------------------------------------------ the model
    def adopt(self, model: nn.Module) -> None:
        """Route ``model``'s attention through :meth:`attend` (module docstring)."""
        config = getattr(model, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and hasattr(model, "set_attn_implementation"):
            self._adopt_transformers(model, impl)
            return
        # The model and its children: the pipeline runs a stage's blocks without the model's own forward.
        mode = _CatchSDPA(self)
        for module in (model, *model.children()):
            _catch_in_forward(module, mode)

    def _adopt_transformers(self, model: nn.Module, impl: str) -> None:
        if impl == ATTN_IMPLEMENTATION:
            return
        if impl not in ("sdpa", "eager"):
            raise ContextParallelError(
                f"{self.setting}={self.size} runs attention itself in models whose attn_implementation is 'sdpa' or "
                f"'eager'; this model uses {impl!r}. Load it with attn_implementation='sdpa'"
            )
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, _transformers_attention)
        _OWNERS[id(model.config)] = self  # type: ignore[union-attr]
        model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
        for module in model.modules():  # every attention layer finds this state through its config
            cfg = getattr(module, "config", None)
            if cfg is not None:
                _OWNERS[id(cfg)] = self


def context_parallel_of(topology: Any) -> ContextParallel | None:
    """The state for ``topology``'s cp axis (a :class:`~phalanx.runtime.topology.Topology`); None without one."""
    if topology.cp_size == 1:
        return None
    return ContextParallel(topology.mesh.cp_kind, topology.cp_group, topology.cp_size, topology.cp_rank)


_CURRENT: list[ContextParallel] = []  # the state that cut the last batch in this process


def check_even_targets(what: str) -> None:
    """Raise when the last cut put the batch's targets unevenly on the cp ranks (ignored labels, padding): for
    ``what`` that averages each rank's mean loss with the same weight (the pipeline), which would then be wrong.
    One host sync, only under context parallelism with countable targets."""
    weight = _CURRENT[0].weight() if _CURRENT else None
    if weight is not None and bool((weight - 1).abs() > 1e-6):
        owner = _CURRENT[0]
        raise ContextParallelError(
            f"{owner.setting}={owner.size} under {what}: this batch's targets fall unevenly on the context-parallel "
            "ranks (ignored labels or padding), and a mean loss from loss_fn weighs every rank's mean alike, which "
            "would not be the whole sequence's mean. Return (loss_sum, items) from loss_fn: the sums are exact"
        )


def positions_like(ids: torch.Tensor) -> torch.Tensor:
    """The places in the whole sequence of the tokens of ``ids`` ``[b, t]`` (int64, on its device): inside the
    forward of a model prepared under context parallelism, the positions this rank holds of the last batch cut in
    this process; else ``0 .. t-1``. For models that make their own positions (a learned position embedding, as the
    demo GPT's) when none are passed."""
    t = ids.shape[1]
    inside = _CURRENT and _CURRENT[0].in_forward  # a prepared model's forward: not a plain copy's (sampling)
    if inside and _CURRENT[0].positions is not None and _CURRENT[0].positions.numel() == t:
        return _CURRENT[0].positions.to(ids.device)
    return torch.arange(t, device=ids.device)


def _catch_in_forward(module: nn.Module, mode: _CatchSDPA) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def context_parallel_forward(*args: Any, **kwargs: Any) -> Any:
        if mode.active:  # entered already (a child inside its parent's forward): once is enough
            return forward(*args, **kwargs)
        mode.active = mode.owner.in_forward = True
        try:
            with mode:
                return forward(*args, **kwargs)
        finally:
            mode.active = mode.owner.in_forward = False

    module.forward = context_parallel_forward  # type: ignore[method-assign]


_OWNERS: dict[int, ContextParallel] = {}  # a model config's id -> the state that owns its attention


def _transformers_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[b, h, s, d]`` in, ``([b, s, h, d], None)`` out."""
    owner = _OWNERS.get(id(getattr(module, "config", None)))
    if owner is None:
        raise ContextParallelError(
            f"{ATTN_IMPLEMENTATION} attention was called from a module whose model was not prepared by an engine with "
            "cp_size or sp_size; prepare the model with engine.prepare"
        )
    for key_name in ("sliding_window", "softcap"):
        if kwargs.get(key_name) is not None:
            raise ContextParallelError(
                f"{owner.setting}={owner.size}: this model's attention uses {key_name}={kwargs[key_name]!r}, which "
                "phalanx's context-parallel attention does not do yet; train it without context parallelism"
            )
    out = owner.attend(
        query, key, value, causal=getattr(module, "is_causal", True), scale=scaling, dropout_p=float(dropout)
    )
    return out.transpose(1, 2).contiguous(), None


class _CatchSDPA(TorchFunctionMode):
    """Sends the model's ``F.scaled_dot_product_attention`` calls to :meth:`ContextParallel.attend`."""

    def __init__(self, owner: ContextParallel) -> None:
        super().__init__()
        self.owner = owner
        self.active = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = {**dict(zip(names, rest)), **kwargs}
        if given.get("attn_mask") is not None:
            raise ContextParallelError(
                f"{self.owner.setting}={self.owner.size}: scaled_dot_product_attention was called with an attn_mask; "
                "under context parallelism the mask comes from the batch's attention_mask (padding) and causality "
                "(is_causal=True). Arbitrary masks are refused: call it with is_causal=True and no attn_mask"
            )
        if k.shape[1] != q.shape[1] and not given.get("enable_gqa", False):
            raise ContextParallelError(
                f"scaled_dot_product_attention got {q.shape[1]} query heads and {k.shape[1]} kv heads without "
                "enable_gqa=True"
            )
        return self.owner.attend(
            q,
            k,
            v,
            causal=bool(given.get("is_causal", False)),
            scale=given.get("scale"),
            dropout_p=float(given.get("dropout_p", 0.0)),
        )


# ---------------------------------------------------------------------- helpers
def _tensors(batch: Any) -> Iterable[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from _tensors(v)


def _first_tensor(batch: Any) -> torch.Tensor:
    return next(iter(_tensors(batch)))


def _seq_len(batch: Any) -> int | None:
    if isinstance(batch, Mapping):
        for key in ("input_ids", "inputs_embeds"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return int(value.shape[1])
    for t in _tensors(batch):
        if t.dim() >= 2:
            return int(t.shape[1])
    return None


def _whole_targets(batch: Any, seq: int) -> torch.Tensor | None:
    """The targets of the whole sequence, counted on the batch as the loader gave it (every cp rank has it)."""
    if isinstance(batch, Mapping):
        if isinstance(batch.get("shift_labels"), torch.Tensor):
            return (batch["shift_labels"] != IGNORE_INDEX).sum()
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and labels.shape[1] == seq:
            return (labels[:, 1:] != IGNORE_INDEX).sum()
        targets = batch.get("targets")
        return (targets != IGNORE_INDEX).sum() if isinstance(targets, torch.Tensor) else None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return (batch[1] != IGNORE_INDEX).sum()
    return None


def _integer(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool


def _rows(mask: torch.Tensor, rows: int, setting: str) -> torch.Tensor:
    if mask.shape[0] != rows:
        raise ContextParallelError(
            f"{setting}: the attention got {rows} sequences but the batch's attention_mask has {mask.shape[0]} rows; "
            "run the model on the whole batch the prepared loader gave (micro-batching inside the model, as the "
            "pipeline does, takes no padding mask under context parallelism)"
        )
    return mask


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return (
            "{"
            + ", ".join(
                f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}" for k, v in batch.items()
            )
            + "}"
        )
    return type(batch).__name__

"""What the pipeline schedules handle besides the schedule itself: the stage module that ``loss_fn`` calls, one
micro-batch's bookkeeping, and splitting a batch into micro-batches (``pipeline.py`` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["PipelineStage", "StageDone", "NoBackward", "MicroBatch", "split_batch", "signature", "map_floats"]


class _Runner(Protocol):
    def _model_call(self, stage: PipelineStage, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class StageDone(BaseException):
    """Raised by ``model(...)`` on a stage that is not the last: the rest of ``loss_fn`` is not this stage's work.

    A BaseException, so that a user's ``except Exception`` inside ``loss_fn`` does not swallow it.
    """


class PipelineStage(nn.Module):
    """This rank's blocks of the pipelined model. Parameter and buffer names are those of the whole model, so
    state dicts and checkpoints do not depend on the stage split: ``"4.fc.weight"`` for an ``nn.Sequential``, and
    for a transformers model the model's own (``"model.layers.2.self_attn.q_proj.weight"``, ``"lm_head.weight"``).

    The blocks that run are kept apart from the module tree that names the tensors: each block's modules are
    registered at their places in the model (``homes``: block name -> [(qualified name, module)]; by default a
    block sits under its own name), so that a block wrapping a module of the model adds no level to its names."""

    _runner: _Runner
    _blocks: dict[str, nn.Module]
    _homes: dict[str, list[tuple[str, nn.Module]]]
    chunk_blocks: dict[int, list[str]]
    """Under virtual stages, the block names of each of this rank's chunks (by global chunk index)."""

    def __init__(
        self,
        blocks: list[tuple[str, nn.Module]],
        runner: _Runner,
        homes: dict[str, list[tuple[str, nn.Module]]] | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "chunk_blocks", {})
        object.__setattr__(self, "_blocks", dict(blocks))  # not submodules: the tree below names the tensors
        object.__setattr__(self, "_homes", {n: (homes or {}).get(n, [(n, b)]) for n, b in blocks})
        for name, _ in blocks:
            for path, module in self._homes[name]:
                _place(self, path, module)
        object.__setattr__(self, "_runner", runner)  # not a submodule: no parameters, not in state_dict

    def block(self, name: str) -> nn.Module:
        """The block called ``name`` in the pipelined ``nn.Sequential``."""
        return self._blocks[name]

    def drop_blocks(self, names: list[str]) -> None:
        """Forget the blocks ``names`` (another stage's, once ``pp_partition='time'`` has split the model)."""
        for name in names:
            del self._blocks[name]
            for path, _ in self._homes.pop(name):
                _unplace(self, path)

    def run_blocks(self, *args: Any, **kwargs: Any) -> Any:
        """This stage's blocks in order, as ``nn.Sequential`` runs them (the first may take several arguments)."""
        return _run(list(self._blocks.values()), args, kwargs)

    def run_chunk(self, chunk: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The blocks of one chunk of this stage (virtual stages: a rank holds several), in order."""
        names = self.chunk_blocks.get(chunk)
        if names is None:
            return self.run_blocks(*args, **kwargs)  # one chunk per rank: every block
        return _run([self._blocks[n] for n in names], args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._runner._model_call(self, args, kwargs)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` as ``root``'s submodule at the dotted ``path``, with empty containers on the way."""
    *parents, leaf = path.split(".")
    at = root
    for part in parents:
        child = at._modules.get(part)
        if child is None:
            child = nn.Module()
            at.add_module(part, child)
        at = child
    at.add_module(leaf, module)


def _unplace(root: nn.Module, path: str) -> None:
    """Remove the submodule at ``path``, and the containers it leaves empty."""
    parts = path.split(".")
    chain = [root]
    for part in parts[:-1]:
        chain.append(chain[-1]._modules[part])  # type: ignore[arg-type]
    del chain[-1]._modules[parts[-1]]
    for parent, part, child in reversed(list(zip(chain, parts, chain[1:]))):
        if child._modules or child._parameters or child._buffers:
            break
        del parent._modules[part]


def _run(blocks: list[nn.Module | None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x: Any = None
    for i, block in enumerate(blocks):
        assert block is not None
        x = block(*args, **kwargs) if i == 0 else block(x)
    return x


class NoBackward(torch.autograd.Function):
    """Marks an output of ``model(...)`` called outside ``train_step``: a backward through it would only reach
    the last stage's parameters, so it raises instead."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError(
            "under strategy='pipeline' a backward through model(...) reaches only the last stage; train with "
            "engine.train_step(batch, loss_fn), which runs forward and backward micro-batch by micro-batch "
            "on every stage"
        )


class MicroBatch:
    __slots__ = (
        "index", "chunk", "input", "called", "output", "is_tuple", "inputs_flat", "outputs_flat", "loss", "weights",
    )  # fmt: skip

    def __init__(self, index: int, received: Any, chunk: int = 0) -> None:
        self.index, self.chunk = index, chunk
        self.weights: Any = None  # zero-bubble: the deferred weight-gradient half of the backward
        self.input = received
        self.called = False
        self.output: Any = None
        self.is_tuple = False
        self.inputs_flat: list[torch.Tensor] = []
        self.outputs_flat: list[torch.Tensor] = []
        self.loss: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------- batches
def split_batch(batch: Any, m: int, dp_size: int) -> list[Any]:
    """``m`` micro-batches: every tensor split along dim 0; anything else (and 0-d tensors) given to each."""
    leaves, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError(
            "engine.train_step under strategy='pipeline' needs a batch holding tensors to split into micro-batches"
        )
    for size in sizes:
        if size % m:
            raise ValueError(
                f"a batch of {size} samples does not split into pp_microbatches={m} equal micro-batches (this is the "
                f"batch of one data-parallel replica, dp_size={dp_size}); use a batch size divisible by {m} (and "
                "drop_last=True, so that a DataLoader's last batch is not shorter), or change pp_microbatches"
            )
    parts = [t.split(t.shape[0] // m) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * m for t in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(m)]


def signature(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    sig = [
        (tuple(x.shape), x.dtype)
        if isinstance(x, torch.Tensor)
        else (repr(x) if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__)
        for x in leaves
    ]
    return (str(spec), tuple(sig))


def map_floats(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    leaves, spec = tree_flatten(x)
    return tree_unflatten([fn(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves], spec)

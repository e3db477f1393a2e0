"""The Strategy interface: what ddp, zero and pipeline each implement, and all the Engine calls.

A strategy wraps models and optimizers, decides when and how gradients are reduced, computes the global
gradient norm, and gives the full and sharded state dicts. The Engine never asks which strategy it holds.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader
from phalanx.runtime.comm import CommStats
from phalanx.runtime.placement import place_module

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig
    from phalanx.engine.precision import Precision
    from phalanx.runtime.topology import Topology

__all__ = ["Strategy", "uncompiled", "drop_hooks_of"]


def uncompiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(model)`` wraps (its ``_orig_mod``); any other module as it is."""
    inner = model._modules.get("_orig_mod") if type(model).__name__ == "OptimizedModule" else None
    return inner if inner is not None else model


class Strategy(ABC):
    name: ClassVar[str]
    supports_pipeline: ClassVar[bool] = False
    shards_gradients: ClassVar[bool] = False
    """True when each rank holds only part of the reduced gradients (fp16 overflow checks must then agree)."""
    drives_backward: ClassVar[bool] = False
    """True when the strategy runs forward and backward itself (pipeline): only ``train_step`` trains."""
    materialises_meta: ClassVar[bool] = False
    """True when ``wrap_model`` gives values to a model built on the meta device (pipeline, stage by stage)."""
    defers_init: ClassVar[bool] = False
    """True when ``wrap_model`` runs a meta-built model's ``DeferredInit`` itself, part by part (zero3, unit by unit);
    otherwise the engine initialises the whole model before ``place_model``."""

    def __init__(
        self,
        config: EngineConfig,
        topology: Topology,
        device: torch.device,
        precision: Precision,
        within_stage: bool = False,
    ) -> None:
        """``within_stage``: this strategy reduces one pipeline stage's gradients over the stage's data-parallel
        replicas, for the pipeline that holds it (see ``pipeline/sync.py``)."""
        if topology.pp_size > 1 and not (self.supports_pipeline or within_stage):
            raise ValueError(
                f"strategy {self.name!r} does not split the model into pipeline stages; got pp_size={topology.pp_size} "
                "(use pp_size=1, or a pipeline strategy)"
            )
        self.config = config
        self.topology = topology
        self.device = device
        self.precision = precision
        self.stats = CommStats()
        self.within_stage = within_stage

    def place_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the strategy's device before ``wrap_model`` (pipeline moves only its stage, later; zero3
        only its buffers, and each unit's shard as it lays the unit out). Through the placement ledger, which counts
        what prepare puts on the device (``runtime/placement.py``)."""
        return place_module(model, self.device, what=f"{self.name}:")

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Make ``model`` (already on the device) take part in the strategy; returns what the user trains."""

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    @abstractmethod
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates local gradients; nothing is communicated."""

    @abstractmethod
    def set_grad_scale(self, scale: float | torch.Tensor) -> None:
        """The factor of the running window's reduced gradients: see the contract in ``strategies/_grads.py``."""

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:  # noqa: B027 - optional hook
        """``optimizer`` stepped: the next backward starts a new step (zero strategies gather parameters here)."""

    @abstractmethod
    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction in flight. Idempotent."""

    @abstractmethod
    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None: ...

    @abstractmethod
    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the gradients of ``parameters`` to their global norm across every rank's share; return that norm."""

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole, unsharded state dict of ``model``, on CPU, on every rank."""

    @abstractmethod
    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """Bytes this rank holds in parameters, gradients, optimizer state and communication buffers, and the
        ZeRO paper's prediction of each (see ``engine.memory_report``)."""

    @abstractmethod
    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        """This rank's share of ``model``'s tensors and of the optimizer state of its parameters held by
        ``optimizers`` (None, one optimizer, or a list), as flat slices keyed by parameter name. Together, the
        entries of every rank cover each tensor once. May be a collective: call it on every rank."""

    @abstractmethod
    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        """Load the slices this rank holds from ``reader`` (any saving world size or strategy), and the
        optimizer state of ``model``'s parameters held by ``optimizers``."""

    @abstractmethod
    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Name and whole shape of every model tensor that ``sharded_state`` gives (under pipeline, every
        stage's), so that a checkpoint can be checked against the model before anything is loaded."""

    def state_dict_keys(self, model: nn.Module) -> dict[str, str]:
        """Each key of the whole model's ``state_dict()``, mapped to the name its tensor is saved under (a tied
        weight's second name maps to its first; non-persistent buffers are not keys)."""
        module, first = self.unwrap_model(model), dict[int, str]()
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            first.setdefault(id(t), name)
        return {k: first.get(id(v), k) for k, v in module.state_dict(keep_vars=True).items()}

    def nonfinite_grad_names(self, model: nn.Module, limit: int) -> list[str]:
        """The first ``limit`` parameters of ``model`` whose gradient, as this rank holds it, has a NaN or inf."""
        out = []
        for name, p in model.named_parameters():
            if p.grad is not None and p.grad.numel() and not bool(torch.isfinite(p.grad).all()):
                out.append(name)
                if len(out) >= limit:
                    break
        return out

    def reduced_grad_views(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """Where this rank keeps the reduced gradients of ``params`` (those it holds), as tensors to change in place,
        in an order that is the same on every rank with the same local parameters; None when the strategy cannot
        say (tensor parallelism then sums replicated gradients in the backward instead). Call after
        ``finish_gradient_sync``."""
        return None

    def grad_shard_group(self) -> Any:
        """The process group over which reduced gradients are spread when ``shards_gradients`` (None: the world)."""
        return self.topology.dp_group

    def train_step(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> torch.Tensor:
        """Forward and backward of one batch, for strategies that ``drives_backward``; returns the mean loss."""
        raise NotImplementedError(f"strategy {self.name!r} trains through engine.backward")

    def comm_dtype(self) -> torch.dtype | None:
        """The dtype gradients travel in, or None when nothing is communicated."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name}


def drop_hooks_of(strategy: Any, model: nn.Module) -> None:
    """Remove ``strategy``'s post-accumulate-grad hooks from ``model``'s parameters. torch holds those hooks where the
    garbage collector cannot see them, so that one would keep the strategy, and every model and buffer it holds,
    alive for as long as the process runs."""
    for p in model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        for key in [k for k, hook in hooks.items() if getattr(hook, "__self__", None) is strategy]:
            del hooks[key]

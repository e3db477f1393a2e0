"""The Strategy interface: what ddp, zero and pipeline each implement, and all the Engine calls.

A strategy wraps models and optimizers, decides when and how gradients are reduced, computes the global
gradient norm, and gives the full and sharded state dicts. The Engine never asks which strategy it holds.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, NamedTuple, Protocol

import torch
from torch import nn

from phalanx.comm import CommStats

if TYPE_CHECKING:
    from phalanx.config import EngineConfig
    from phalanx.precision import Precision
    from phalanx.topology import Topology

__all__ = ["Strategy", "ShardEntry", "StateReader", "optimizer_list", "read_into", "read_new", "read_optimizer_state"]


def optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    """``None``, one optimizer or a sequence of them, as a list of the optimizers themselves (unwrapping the
    Engine's ``PreparedOptimizer``)."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    return [getattr(o, "optimizer", o) for o in optimizers]


class ShardEntry(NamedTuple):
    """One rank's slice of one tensor of the training state, in a layout that does not depend on the strategy.

    ``key`` is ``model/<parameter or buffer name>`` or ``optim/<parameter name>/<state name>`` (e.g.
    ``exp_avg``, ``step``); ``data`` holds elements ``[start, stop)`` of the flattened tensor, whose whole
    shape is ``shape``. Together, the entries of every rank cover each tensor exactly once.

    ``data`` may be a view of live training state, on the training device: copy it before the next step
    changes it (a checkpoint writes it out at once, without a copy on the CPU).
    """

    key: str
    shape: tuple[int, ...]
    start: int
    stop: int
    data: torch.Tensor


class StateReader(Protocol):
    """Where ``load_sharded_state`` reads from: a checkpoint on disk, or entries held in memory."""

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key`` (possibly a view of the reader's memory).
        A reader may also have ``read_into(key, start, stop, out)`` and ``dtype(key)``: see :func:`read_into`."""
        ...


def read_into(reader: StateReader, key: str, start: int, stop: int, out: torch.Tensor) -> None:
    """Elements ``[start, stop)`` of ``key`` into the 1-D tensor ``out``: straight into its memory when the reader
    can (a checkpoint reads the file into it), else through ``read``."""
    direct = getattr(reader, "read_into", None)
    if direct is not None:
        direct(key, start, stop, out)
    else:
        out.copy_(reader.read(key, start, stop))


def read_new(reader: StateReader, key: str, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor ``key`` in new memory of its own on ``device`` (never aliasing the reader's), in ``dtype``
    (default: as saved)."""
    shape = tuple(reader.shape(key))
    n = math.prod(shape)
    saved_dtype = getattr(reader, "dtype", None)
    if saved_dtype is None:
        return reader.read(key, 0, n).reshape(shape).to(device=device, dtype=dtype, copy=True)
    out = torch.empty(n, dtype=dtype or saved_dtype(key), device=device)
    read_into(reader, key, 0, n, out)
    return out.view(shape)


def read_optimizer_state(reader: StateReader, key: str, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Optimizer state ``key`` (``optim/<name>/<state>``) for ``param``, placed as torch's ``Optimizer.load_state_dict``
    places it: ``step`` on the CPU (on the parameter's device for fused or capturable optimizers), floating state in
    the parameter's dtype on its device (a zero checkpoint's fp32 moments onto bf16 parameters), the rest on its
    device as saved."""
    if key.rpartition("/")[2] == "step":
        on_device = bool(group.get("fused") or group.get("capturable"))
        return read_new(reader, key, param.device if on_device else torch.device("cpu"))
    saved = getattr(reader, "dtype", None)
    floating = saved(key).is_floating_point if saved is not None else reader.read(key, 0, 0).is_floating_point()
    return read_new(reader, key, param.device, param.dtype if floating else None)


class Strategy(ABC):
    name: ClassVar[str]
    supports_pipeline: ClassVar[bool] = False
    shards_gradients: ClassVar[bool] = False
    """True when each rank holds only part of the reduced gradients (fp16 overflow checks must then agree)."""
    drives_backward: ClassVar[bool] = False
    """True when the strategy runs forward and backward itself (pipeline): only ``train_step`` trains."""

    def __init__(self, config: EngineConfig, topology: Topology, device: torch.device, precision: Precision) -> None:
        if topology.pp_size > 1 and not self.supports_pipeline:
            raise ValueError(
                f"strategy {self.name!r} does not split the model into pipeline stages; got pp_size={topology.pp_size} "
                "(use pp_size=1, or a pipeline strategy)"
            )
        self.config = config
        self.topology = topology
        self.device = device
        self.precision = precision
        self.stats = CommStats()

    @classmethod
    def variant(cls, config: EngineConfig) -> type[Strategy]:
        """The class that runs ``config`` under this strategy's name (pipeline picks how its stages' replicas
        reduce gradients); by default, this one."""
        return cls

    def place_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the strategy's device before ``wrap_model`` (pipeline moves only its stage, later)."""
        return model.to(self.device)

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
        """The factor that the next gradient reduction multiplies by (1/dp for mean losses, 1/items for sums)."""

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
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

"""Deferred initialisation: a model built on the meta device is given its values by ``engine.prepare``.

Build it with ``with torch.device("meta"):`` (or ``phalanx.init_empty_weights()``): nothing is allocated. At
prepare, each module that held meta tensors of its own is given real ones and initialised by its
``reset_parameters()`` (or the user's ``param_init_fn(module)``), on the host, from the CPU generator, one module
after another in post-order: children before their parent, in registration order. That is the order in which
building the model normally initialises it, so the values are those of a normal build at the point where prepare
is called, bitwise (the same seed, and nothing random between building and prepare). Every rank initialises
alike and the strategies then take the first rank's values, as for a normally built model: the result does not
depend on the world size.

- **Tied parameters** keep the values of the first module that initialises them; a later module that shares one
  initialises a scratch copy instead (it draws from the generator as a normal build did, then is dropped).
- **Tensors that are already real** in a partly meta module (buffers under ``init_empty_weights()``) keep their
  values; the module's initialisation writes a scratch copy of them.
- **Part by part**: ``materialise_through(module)`` initialises every pending module up to and including
  ``module``'s subtree. zero3 calls it one unit at a time and shards each unit before the next is built, so no rank
  holds the whole model; ddp and zero1/2 hold it whole anyway and initialise it at once.
- **No initialiser** (no ``reset_parameters`` and no ``param_init_fn``, as a transformers ``Conv1D``): those
  tensors are left zero and the model is marked. A forward before ``engine.load_model``/``engine.load_state``
  fills them is an error naming them, never a silent run on zeros.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "DeferredInit",
    "check_init_fn_applies",
    "has_meta",
    "pending_init",
    "uninitialised",
    "mark_loaded",
    "check_initialised",
]

_PENDING: weakref.WeakKeyDictionary[nn.Module, DeferredInit] = weakref.WeakKeyDictionary()
_UNSET: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def pending_init(model: nn.Module) -> DeferredInit | None:
    """The initialisation a strategy must run part by part while it lays ``model`` out, if any."""
    return _PENDING.get(model)


def uninitialised(model: nn.Module) -> list[str]:
    """Names of ``model``'s tensors that were built on meta and had no initialiser (zero until loaded)."""
    return list(_UNSET.get(model, []))


def mark_loaded(model: nn.Module) -> None:
    """``engine.load_model``/``load_state`` filled every tensor of ``model``."""
    _UNSET.pop(model, None)


def check_initialised(model: nn.Module, what: str) -> None:
    """Refuse to run (or save) a model whose meta-built tensors were never given values."""
    names = _UNSET.get(model)
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise RuntimeError(
            f"{what}: {len(names)} tensor(s) of {type(model).__name__} were built on the meta device and have no "
            f"values yet ({shown}): their modules have no reset_parameters(). Load the weights first with "
            "engine.load_model(path) or engine.load_state(dir), or give engine.prepare(..., param_init_fn=fn), "
            "a function that initialises one module's own tensors in place"
        )


def check_init_fn_applies(models: list[Any], strategy: str, materialises: bool) -> None:
    """``param_init_fn`` is only used on a meta-built model, and not by the pipeline (it initialises its stages
    itself): refuse it where it would be ignored without a word."""
    if materialises:
        raise ValueError(
            f"engine.prepare(..., param_init_fn=...) is not used under strategy={strategy!r}, which initialises a "
            "meta-built model's blocks itself with their reset_parameters(), on the host; drop param_init_fn"
        )
    models = [m for m in models if isinstance(m, nn.Module)] + [
        b for m in models if isinstance(m, (list, tuple)) for b in m
    ]
    if not any(has_meta(m) for m in models):
        raise ValueError(
            "engine.prepare got param_init_fn, but no model passed to it has tensors on the meta device, so there is "
            "nothing for it to initialise. Build the model under `with torch.device('meta'):` (or "
            "phalanx.init_empty_weights()) to have prepare initialise it, or drop param_init_fn"
        )


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for the tensors registered on ``module`` itself."""
    return [(n, p, True) for n, p in module._parameters.items() if p is not None] + [
        (n, b, False) for n, b in module._buffers.items() if b is not None
    ]


def _post_order(model: nn.Module) -> list[nn.Module]:
    seen: set[int] = set()
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            walk(child)
        out.append(m)

    walk(model)
    return out


class DeferredInit:
    """The pending initialisation of one meta-built model; see the module's doc."""

    def __init__(self, model: nn.Module, init_fn: Callable[[nn.Module], Any] | None = None) -> None:
        self.model, self.init_fn = model, init_fn
        self.order = [m for m in _post_order(model) if any(t.is_meta for _, t, _ in _own(m))]
        self.cursor = 0
        self.done: set[int] = set()  # ids of tensors that hold their values
        self.names: dict[int, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.names.setdefault(id(t), name)
        self.position = {id(m): i for i, m in enumerate(self.order)}
        self.unset: list[str] = []

    def attach(self) -> None:
        """Hand the model to the strategy, which materialises it part by part while laying it out."""
        _PENDING[self.model] = self

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.order)

    def materialise_through(self, module: nn.Module | None, device: torch.device) -> None:
        """Initialise, in order, every pending module up to and including ``module``'s subtree (all of them when
        ``module`` is None), then move what was materialised to ``device``."""
        if module is None:
            stop = len(self.order)
        else:
            inside = [self.position[id(m)] for m in module.modules() if id(m) in self.position]
            stop = max(inside) + 1 if inside else self.cursor
        made: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
        while self.cursor < stop:
            made += self._init_one(self.order[self.cursor])
            self.cursor += 1
        if device.type != "cpu":
            for m, name, t, is_param in made:
                if is_param:
                    t.data = t.data.to(device)
                else:
                    m._buffers[name] = t.to(device)
        if self.finished:
            _PENDING.pop(self.model, None)
            if self.unset:
                _UNSET[self.model] = self.unset

    def _init_one(self, module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
        made: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
        scratch: list[tuple[str, torch.Tensor, bool]] = []
        for name, t, is_param in _own(module):
            if t.is_meta and id(t) not in self.done:
                real = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                if is_param:
                    torch.utils.swap_tensors(t, nn.Parameter(real, requires_grad=t.requires_grad))
                    made.append((module, name, t, True))
                else:
                    old = id(t)
                    module._buffers[name] = real
                    self.names.setdefault(id(real), self.names.get(old, name))
                    made.append((module, name, real, False))
            else:  # tied and already initialised, or real from the start: keep its values
                scratch.append((name, t, is_param))
                copy = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                if is_param:
                    module._parameters[name] = nn.Parameter(copy, requires_grad=t.requires_grad)
                else:
                    module._buffers[name] = copy
        init: Any = self.init_fn and functools.partial(self.init_fn, module)
        init = init or getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        with torch.no_grad():
            if callable(init):
                init()
            else:
                for _, _, t, _ in made:
                    t.zero_()
                self.unset += [self._name(module, name, t) for _, name, t, _ in made]
        for name, t, is_param in scratch:
            if is_param:
                module._parameters[name] = t  # type: ignore[assignment]
            else:
                module._buffers[name] = t
        for _, _, t, _ in made:
            self.done.add(id(t))
        return made

    def _name(self, module: nn.Module, name: str, t: torch.Tensor) -> str:
        return self.names.get(id(t)) or next(
            (f"{q}.{name}".lstrip(".") for q, m in self.model.named_modules() if m is module), name
        )

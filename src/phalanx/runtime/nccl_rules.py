"""NCCL's rules, enforced on the CPU: a run on gloo fails wherever the same run on NCCL would.

    PHALANX_NCCL_RULES=1 phalanx launch -n 2 train.py      # or Engine(nccl_rules=True); the test suite's ranks run so

gloo takes host tensors, every dtype, and a collective called by a rank outside its group (c10d only warns and skips
it). NCCL takes none of these: a tensor handed to it must be on the group's GPU, in a dtype NCCL has, and every
member of the group must call. Code that only ever ran on gloo hides these mistakes until a user's first GPU run.

With the rules on, a :class:`~torch.overrides.TorchFunctionMode` marks the tensors that phalanx's own code puts on
the host: ``.cpu()``, ``.to("cpu")``, ``.pin_memory()``, and factories (``torch.tensor``, ``torch.zeros``, ...) called
with no device or with ``"cpu"``; what is computed from host tensors alone is host too, and ``.to(device)`` with a
``torch.device`` (the engine's) clears the mark. Every collective goes through ``collective_log.watched``, which
calls :func:`check` first: a host tensor, a dtype NCCL lacks, or a group this rank is not in stops the run with
:class:`NcclRulesError`, naming where the host tensor was made.

Only phalanx's code is marked (a frame in the package made the tensor): the user's own tensors are taken as placed
where they should be, so a script is never refused for data it builds on the host and hands to the loader. A
``torch.device("cpu")`` object is taken as the engine's device (on CPU the two cannot be told apart): host moves in
phalanx are written ``.cpu()`` or ``"cpu"``. The mode costs a Python call per torch op: a debugging and test mode.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "NCCL_DTYPES_MISSING",
    "NcclRulesError",
    "check",
    "enable",
    "enabled",
    "from_wire",
    "host_group",
    "host_site",
    "to_wire",
    "wire_dtype",
]

NCCL_DTYPES_MISSING = frozenset({torch.int16, torch.uint16, torch.uint32, torch.uint64})
"""Dtypes ProcessGroupNCCL refuses ("Unsupported data type for NCCL process group")."""

_CARRIERS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`to_wire` carries ``dtype`` in."""
    return torch.int64 if dtype == torch.uint64 else _CARRIERS.get(dtype, dtype)


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype every backend carries: int16/uint16 widened to int32, uint32 to int64, uint64 seen as int64
    (the same bits: sums wrap as uint64 arithmetic would; only min/max of values over 2**63 would differ). Done on
    every backend, so that gloo runs take the path NCCL needs."""
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    wide = _CARRIERS.get(t.dtype)
    return t if wide is None else t.to(wide)


def from_wire(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`to_wire`: narrowing wraps, as arithmetic in ``dtype`` would."""
    if wire.dtype == dtype:
        return wire
    return wire.view(dtype) if dtype == torch.uint64 else wire.to(dtype)


_MARK = "_phalanx_host_site"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_SELF = os.path.abspath(__file__).removesuffix("c")


class NcclRulesError(RuntimeError):
    """A collective that NCCL would refuse (or run wrongly), caught on gloo under ``nccl_rules``."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message} [nccl_rules: this gloo run checks NCCL's rules, PHALANX_NCCL_RULES=1]")


def _phalanx_site() -> str | None:
    """``file:line`` of the phalanx frame that called the torch op, or None when the caller is not phalanx."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != _SELF and not filename.startswith(_TORCH):
            if filename.startswith(_PACKAGE):
                return f"{os.path.relpath(filename, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


def _is_host_device(device: Any) -> bool | None:
    """True for a host spelling (``"cpu"``), False for a ``torch.device`` or an index (the engine's), None if none."""
    if device is None:
        return None
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    return False


_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.from_numpy,
    torch.frombuffer,
}
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    """The tensors among ``args`` and in its lists (a batch of point-to-point ops: theirs)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
                elif isinstance(b, dist.P2POp):
                    yield b.tensor


def _in_place(func: Any, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")


class _Rules(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.compiler.is_compiling():  # a graph torch.compile traces: its tensors are not phalanx's code's
            return out
        if not isinstance(out, (torch.Tensor, tuple, list)) or _in_place(func, kwargs):
            return out  # not a tensor; or written in place, where the storage stays where it was
        inputs = list(_tensors(args))
        site = _host_site_of_result(func, args, kwargs, inputs)
        if isinstance(out, torch.Tensor):
            if site != getattr(out, _MARK, None) and any(out is t for t in inputs):
                # On CPU, .cpu() and .to(device) may return the tensor itself; on a GPU they copy: the original keeps
                # its place.
                out = out.view_as(out)
            _set_mark(out, site)
        else:
            for t in out:
                if isinstance(t, torch.Tensor):
                    _set_mark(t, site)
        return out


def _set_mark(t: torch.Tensor, site: str | None) -> None:
    if site is not None or getattr(t, _MARK, None) is not None:
        setattr(t, _MARK, site)


def _host_site_of_result(func: Any, args: Any, kwargs: dict[str, Any], inputs: list[torch.Tensor]) -> str | None:
    """Where the result was put on the host by phalanx's code, or None when it is (taken to be) on the device."""
    if func in _TO_HOST:
        return _described(_phalanx_site(), f".{func.__name__}()")
    if func is torch.Tensor.to:
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device, int, torch.Tensor)):
                target = a
        if isinstance(target, torch.Tensor):
            return getattr(target, _MARK, None)
        if target is None:
            return getattr(args[0], _MARK, None)  # a dtype change keeps the place
        return _described(_phalanx_site(), f".to({target!r})") if _is_host_device(target) else None
    device = kwargs.get("device")
    if device is not None:
        return _described(_phalanx_site(), f"{_name(func)}(device={device!r})") if _is_host_device(device) else None
    if func in _FACTORIES and inputs:  # torch.tensor(t), torch.as_tensor(t): t's place
        return getattr(inputs[0], _MARK, None)
    if not inputs:  # made from nothing, with no device: the host
        return _described(_phalanx_site(), f"{_name(func)}() with no device")
    site = None
    for t in inputs:
        s = getattr(t, _MARK, None)
        if s is None:  # one device operand puts the result on the device (CUDA takes 0-dim host operands)
            return None
        site = site or s
    return site


def _described(site: str | None, how: str) -> str | None:
    return None if site is None else f"{site} ({how})"


def _name(func: Any) -> str:
    return f"torch.{getattr(func, '__name__', func)}"


_MODE: _Rules | None = None


def enable() -> None:
    """Turn the rules on for this process (the thread that calls it, and the collectives of every thread)."""
    global _MODE
    if _MODE is None:
        _MODE = _Rules()
        _MODE.__enter__()


def enabled() -> bool:
    return _MODE is not None


def host_site(t: torch.Tensor) -> str | None:
    """Where phalanx's code put ``t`` on the host, or None when it is taken to be on the device."""
    return getattr(t, _MARK, None)


_HOST_GROUPS: set[int] = set()


def host_group(group: Any) -> Any:
    """Declare ``group`` a gloo group kept for host tensors (the watchdog's mirrors): host tensors belong there."""
    _HOST_GROUPS.add(id(group))
    return group


def check(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, as NCCL would, the collective ``op`` called with ``args`` and ``kwargs``."""
    group = kwargs.get("group")
    if group is not None and dist.get_rank(group) < 0:
        raise NcclRulesError(
            f"{op} on a process group that rank {dist.get_rank()} is not a member of: gloo's c10d warns and skips "
            "it, NCCL's members wait for this rank forever. Call collectives on a group only from its members "
            "(check the rank's mesh coordinates before the call)"
        )
    host_ok = group is not None and id(group) in _HOST_GROUPS
    for t in _tensors([*args, *kwargs.values()]):
        if t.dtype in NCCL_DTYPES_MISSING:
            raise NcclRulesError(
                f"{op} of a {t.dtype} tensor (shape {tuple(t.shape)}): NCCL has no "
                f"{str(t.dtype).removeprefix('torch.')} (it lacks int16, uint16, uint32 and uint64). Widen it first "
                "(int16/uint16 to int32, uint32 to int64) and narrow it after"
            )
        site = getattr(t, _MARK, None)
        if site is not None and not host_ok:
            raise NcclRulesError(
                f"{op} was handed a host tensor (shape {tuple(t.shape)}, {t.dtype}) made at {site}: NCCL takes only "
                "tensors on the group's GPU. Make it on the engine's device (device=..., or .to(device) before the "
                "collective), or send host tensors over a gloo group"
            )

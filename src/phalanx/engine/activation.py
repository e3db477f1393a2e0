"""Activation checkpointing and offloading: what autograd keeps of a forward until its backward.

    engine = phalanx.Engine(strategy="zero3", activation_checkpointing="every:2", activation_offload=True)
    model, optimizer = engine.prepare(model, optimizer)   # every other block now recomputes its forward in backward

**Checkpointing** (``activation_checkpointing``; ``checkpoint_blocks``). The blocks are the modules zero3 gathers
one at a time (``unit_modules_of``): a transformers model's decoder layers (its ``_no_split_modules``), else each
child module with parameters (inside ``ModuleList``/``Sequential``/``ModuleDict``), or, under zero3, the classes
of ``zero3_unit_classes``. ``full`` checkpoints every block, ``every:k`` the blocks 0, k, 2k, ... (counted over the
whole model, so that a pipeline stage checkpoints the same blocks whatever ``pp_size``), and ``selective`` every
block op by op (torchtitan's selective AC): the outputs of matmuls (mm, addmm, bmm, baddbmm, linear) and of
scaled-dot-product attention are kept, everything else (norms, activations, dropout, rotary embeddings, residual
adds, collectives) is recomputed. A chosen block's ``forward`` is wrapped in place (the module stays where it is, so
state-dict keys do not change) by non-reentrant ``torch.utils.checkpoint.checkpoint`` with
``preserve_rng_state=True``.

How it composes, and why it is exact (the tests compare gradients bit for bit with a run without checkpointing):
- The block's own module hooks stay outside the checkpointed forward, as transformers and FSDP2 place them: zero3
  gathers a unit in its pre-forward hook and again when backward reaches the unit's outputs, before the recompute
  needs the parameters; a hook of a module inside the block runs again in the recompute, where zero3's only gathers
  (``_in_backward``). The engine checkpoints after the tensor-parallel split and before the strategy wraps the
  model; the wrapped forward looks the block's class up at each call, so the classes tp swaps in (a forked region,
  a split layer) run inside the checkpoint.
- Dropout: the checkpoint restores torch's default generators before the recompute; tp's RNG tracker draws each
  fork's stream from the default CPU generator (``strategies/tensor_parallel/rng.py``), so the recompute draws the
  forward's masks. Under ``selective`` an op that draws random numbers is always recomputed (an attention with
  ``dropout_p > 0`` is not kept), so that the recompute draws the same numbers in the same order.
- A block called with a KV cache (``use_cache=True``; ``cache``/``past_key_values``/``layer_past``) runs without it
  when checkpointed, as transformers does under its gradient checkpointing: the recompute would write it twice.

A transformers model is checkpointed by this same wrapping of its decoder layers, not by its own
``gradient_checkpointing_enable()``: one mechanism for ``full``, ``every:k`` and ``selective`` on every model, the
same blocks as zero3's units, and the memory model below. A model whose own gradient checkpointing is on as well is
refused (each block would be recomputed twice).

**Offloading** (``activation_offload``; ``offload_activations``): the prepared model's forward runs under
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so that what autograd saves goes to pinned host memory and
comes back in backward. The copies are non-blocking copies to and from pinned memory (``save_on_cpu`` does so when it
pins), so they overlap with compute on the CUDA stream. It wraps the outermost forward (outside zero3's own
saved-tensor hooks, which pass the other tensors on to it). With checkpointing, a recomputed block's inputs are
offloaded too; ``selective``'s kept outputs stay on the device. On a CPU there is no device memory to free: it does
nothing, and says so once.

**Memory** (``measure_block``, ``activation_peak_bytes``): the bytes one block saves for backward, counted from a
forward under ``saved_tensors_hooks`` (each storage once, parameters left out), and what each policy keeps of them;
times the blocks, the most held at once during backward. ``benchmarks/bench_activation.py`` checks the predicted fall
of peak memory against the measured one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from phalanx.config.general import checkpointing_policy
from phalanx.config.options import ConfigError
from phalanx.logging import get_logger, warn_once
from phalanx.strategies.zero.zero3 import unit_modules_of

__all__ = [
    "checkpoint_blocks",
    "offload_activations",
    "kept_by_selective",
    "BlockBytes",
    "measure_block",
    "activation_peak_bytes",
]

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


# ------------------------------------------------------------------------------------------ checkpointing
def checkpoint_blocks(model: nn.Module, policy: str | None, classes: str | None = None) -> nn.Module:
    """Checkpoint ``model``'s blocks as ``policy`` says (``full``, ``every:k``, ``selective``; None: nothing), in
    place; returns ``model``. ``classes``: zero3_unit_classes, the blocks' class names (default: zero3's units)."""
    if policy is None:
        return model
    kind, every = checkpointing_policy(policy)
    own = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if own:
        raise ConfigError(
            f"activation_checkpointing={policy!r}, and the model's own gradient checkpointing is on too "
            f"({own[0] or type(model).__name__}, from gradient_checkpointing_enable()): each block would be recomputed "
            "twice. Use one: model.gradient_checkpointing_disable(), or leave activation_checkpointing unset"
        )
    blocks = unit_modules_of(model, classes)
    if not blocks:
        warn_once(
            f"activation_checkpointing={policy!r}: {type(model).__name__} has no block to checkpoint (no child module "
            "with parameters); nothing is recomputed"
        )
        return model
    chosen = [(name, block) for i, (name, block) in enumerate(blocks) if i % every == 0]
    for _, block in chosen:
        _checkpoint_forward(block, selective=kind == "selective")
    names = ", ".join(n for n, _ in chosen[:4]) + (f", ... ({len(chosen)})" if len(chosen) > 4 else "")
    get_logger().info(f"activation_checkpointing={policy}: {len(chosen)} of {len(blocks)} blocks ({names})")
    return model


def _checkpoint_forward(block: nn.Module, selective: bool) -> None:
    if getattr(block.__dict__.get("forward"), "_phalanx_checkpointed", False):
        return  # prepared before (a model handed to prepare twice)
    own = block.__dict__.get("forward")  # a forward set on the instance (e.g. torch.compile of this unit)

    def run(*args: Any, **kwargs: Any) -> Any:
        # The class is looked up at each call: tp swaps in its layer classes after this wrapping may have run.
        return own(*args, **kwargs) if own is not None else type(block).forward(block, *args, **kwargs)

    context = (
        functools.partial(create_selective_checkpoint_contexts, _selective_policy) if selective else noop_context_fn
    )

    @functools.wraps(own if own is not None else block.forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        # The keywords go in with the function: checkpoint's own keywords (context_fn, debug, ...) cannot catch them.
        call = functools.partial(run, **_without_cache(block, kwargs))
        return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context)

    checkpointed._phalanx_checkpointed = True  # type: ignore[attr-defined]
    checkpointed._phalanx_run = run  # type: ignore[attr-defined]
    block.forward = checkpointed  # type: ignore[method-assign]


def _without_cache(block: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The block's keywords without a KV cache: its recompute would write the cache a second time."""
    dropped = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if getattr(block, "_can_checkpoint_with_cache", False):  # transformers: a layer that only reads the cache
        dropped = []
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    said = ", ".join(dropped) or "use_cache=True"
    warn_once(
        f"activation_checkpointing: {type(block).__name__} was called with a KV cache ({said}); a checkpointed block "
        "runs without it (its recompute would write the cache twice), as transformers does under gradient "
        "checkpointing"
    )
    out = {**kwargs, **dict.fromkeys(dropped)}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _aten(*names: str) -> frozenset[Any]:
    """The default overloads of these aten ops that this build of torch has."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


_KEPT_MATMULS = _aten("mm", "addmm", "bmm", "baddbmm", "linear")
_KEPT_ATTENTION = _aten(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def kept_by_selective(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``selective`` keeps this op's output instead of recomputing it: a matmul, or an attention that drops
    nothing. An attention with dropout draws random numbers, and a kept op would not draw them again in the
    recompute, so that every later random op there would draw other numbers than the forward did."""
    if func in _KEPT_MATMULS:
        return True
    if func in _KEPT_ATTENTION:
        return _dropout_p(func, args, kwargs) == 0.0
    return False


def _dropout_p(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return float(value or 0.0)
    return 0.0


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if kept_by_selective(func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE


# ------------------------------------------------------------------------------------------ offloading
def offload_activations(module: nn.Module, enabled: bool, device: torch.device) -> None:
    """``activation_offload``: run ``module``'s forward (the prepared model's outermost) under
    ``save_on_cpu(pin_memory=True)`` on CUDA; elsewhere a no-op with a one-time note."""
    if not enabled:
        return
    if device.type != "cuda":
        warn_once(
            f"activation_offload=True does nothing on {device.type}: activations are already in host memory, and "
            "there is no device memory to free (it moves saved activations to pinned host memory on CUDA)"
        )
        return
    module.forward = offloaded(module.forward, pin_memory=True)  # type: ignore[method-assign]


def offloaded(forward: Callable[..., Any], pin_memory: bool) -> Callable[..., Any]:
    """``forward`` under ``save_on_cpu``: what autograd saves in it waits in host memory (pinned: non-blocking copies
    both ways, overlapped with compute) until backward."""

    @functools.wraps(forward)
    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
            return forward(*args, **kwargs)

    return offloaded_forward


# ------------------------------------------------------------------------------------------ memory
@dataclass(frozen=True)
class BlockBytes:
    """What one block's forward leaves for its backward under each policy, in bytes (each storage once, parameters
    left out). ``measure_block`` counts them; ``activation_peak_bytes`` puts the blocks together."""

    saved: int
    """Without checkpointing: what the block holds until its backward (every tensor autograd saves in it, and its
    input). A recomputed block holds the same once its recompute has run, at the start of its backward: the recompute
    reuses what the block kept, and a kept output that backward does not read is dropped once the recompute used it."""
    kept_full: int
    """Checkpointed: its inputs that need a gradient (the hidden state), which the checkpoint keeps."""
    kept_selective: int
    """Selective: those inputs and the outputs of the ops it keeps (matmuls, attention)."""
    shared: int = 0
    """Its inputs that need no gradient (masks, rotary tables): every block uses the same, so they are held once."""


def measure_block(block: nn.Module, run: Callable[[], Any]) -> BlockBytes:
    """Count what ``block`` saves: ``run()`` is a forward of a model that calls ``block`` (its first call is taken);
    the block's inputs are copied there, and the block runs once more on them, with gradients, under
    ``saved_tensors_hooks`` and a dispatch mode that sees which outputs ``selective`` keeps. Measure a block that
    is not sharded (before zero3's prepare); a checkpointed one is measured as if it were not."""
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.enable_grad():
            run()
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError(f"measure_block: run() never called the {type(block).__name__} block")
    args, kwargs = _fresh_inputs(captured[0])
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}
    kept = _KeptOutputs(params)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    forward = getattr(block.forward, "_phalanx_run", block.forward)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kept:
        forward(*args, **kwargs)
    inputs = _storages([t for t in leaves if t.requires_grad])
    shared = _storages([t for t in leaves if not t.requires_grad])
    held = {k: n for k, n in {**saved, **inputs}.items() if k not in shared}  # shared: held once, counted apart
    return BlockBytes(
        saved=sum(held.values()),
        kept_full=sum(inputs.values()),
        kept_selective=sum({**kept.storages, **inputs}.values()),
        shared=sum(shared.values()),
    )


def activation_peak_bytes(block: BlockBytes, blocks: int, policy: str | None) -> int:
    """The most bytes of the blocks' activations alive at once in a training step, for ``blocks`` blocks like
    ``block`` under ``policy``. Each block holds what it kept until its backward; backward goes from the last block
    to the first, and a block's backward starts holding ``saved`` (a checkpointed block, once its recompute has run)
    and ends freeing it. What is outside the blocks (embeddings, the head, the loss, gradients) is the same under
    every policy and is not counted: the fall from None to a policy is what checkpointing saves."""
    kind, every = checkpointing_policy(policy) if policy is not None else ("none", 1)
    kept = [
        block.saved if kind == "none" or i % every else block.kept_full if kind == "full" else block.kept_selective
        for i in range(blocks)
    ]
    held = peak = sum(kept)
    for i in reversed(range(blocks)):
        peak = max(peak, held - kept[i] + block.saved)
        held -= kept[i]
    return peak + block.shared


class _Captured(Exception):
    """Ends ``run()`` once the block's inputs are taken."""


def _fresh_inputs(call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The captured inputs as leaves of their own (a float tensor that needed a gradient still does)."""

    def fresh(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad and x.is_floating_point())
        return x

    args, kwargs = call
    return tuple(tree_map(fresh, list(args))), tree_map(fresh, kwargs)


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


class _KeptOutputs(TorchDispatchMode):
    """The storages of the outputs that ``selective`` keeps, as the op runs."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.storages: dict[int, int] = {}
        self.held: list[
            torch.Tensor
        ] = []  # alive until the count ends, as the checkpoint holds them: no address reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kept_by_selective(func, args, kwargs):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.params:
                    self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    self.held.append(t)
        return out

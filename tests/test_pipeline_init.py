"""A meta-built model under the pipeline starts from the weights of the same model built on the CPU from the same
seed, as under ddp and zero3 (issue 36, W2): initialised on the host from the CPU generator, never the device's
(CUDA's generator gives other numbers from the same seed), block after block, one block on the host at a time
beyond the stage's own.

No GPU is needed for the device dimension: a probe block records the device of the tensors its
``reset_parameters()`` fills, with the stage placed on ``torch.device("meta")``. Initialising on the target device
(the code before the fix: ``to_empty(device)`` then ``reset_parameters()``) would show that device there, and on
CUDA draw from CUDA's generator. ``test_on_cuda_the_values_are_the_cpu_build`` checks CUDA itself where there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.strategies.deferred_init import DeferredInit
from phalanx.strategies.pipeline.partition import materialise_stage

SEED = 5
SPLITS = [(0, 7), (0, 3), (3, 7), (2, 5), (6, 7)]


class _Probe(nn.Module):
    """A block with its own parameter and buffer-holding children; its ``reset_parameters()`` records the device it
    ran on and the values it drew, and calls ``on_init`` (the test's check of what the host holds then)."""

    def __init__(self, d: int, log: list[tuple[torch.device, torch.Tensor]]) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)
        self.scale = nn.Parameter(torch.empty(d))
        self.log = log
        self.on_init: Callable[[], None] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)
        if not self.scale.is_meta:
            self.log.append((self.scale.device, self.scale.detach().clone()))
        if self.on_init is not None:
            self.on_init()


def _model(log: list[tuple[torch.device, torch.Tensor]], meta: bool) -> nn.Sequential:
    torch.manual_seed(SEED)

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(6, 16),
            _Probe(16, log),
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)),
            nn.Tanh(),
            nn.MultiheadAttention(16, 2),  # initialised by _reset_parameters, after its out_proj
            _Probe(16, log),
            nn.Linear(16, 3),
        )

    if not meta:
        return build()
    with torch.device("meta"):
        model = build()
    log.clear()
    return model


def _cpu_build() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model built on the CPU from SEED: its values, and the CPU generator's state after the build."""
    model = _model([], meta=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


def _block_of(key: str) -> int:
    return int(key.split(".")[0])


def _real(model: nn.Module) -> bool:
    return any(not t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("lo,hi", SPLITS)
def test_stage_values_are_the_cpu_build_and_deferred_inits(lo, hi):
    expected, rng_after = _cpu_build()
    deferred = _model([], meta=True)
    DeferredInit(deferred).materialise_through(None, torch.device("cpu"))  # zero3's and ddp's path
    assert all(torch.equal(deferred.state_dict()[k], v) for k, v in expected.items())

    log: list[tuple[torch.device, torch.Tensor]] = []
    model = _model(log, meta=True)
    others: list[list[int]] = []
    for probe in (model[1], model[5]):
        probe.on_init = lambda: others.append(  # noqa: B023 - read at once
            [i for i, b in enumerate(model) if not lo <= i < hi and _real(b)]
        )
    held = list(model.parameters())  # as an optimizer built before prepare holds them
    materialise_stage(model, lo, hi, torch.device("cpu"))
    state = model.state_dict()
    for key, value in expected.items():
        if lo <= _block_of(key) < hi:
            assert torch.equal(state[key], value), key
        else:
            assert state[key].is_meta, key  # another stage's block does not stay on this rank
    # Every block drew, so the generator ends where the normal build leaves it, on every stage alike.
    assert torch.equal(torch.get_rng_state(), rng_after)
    # Each probe, of this stage or another, saw at most itself held for another stage.
    assert len(others) == 2 and all(len(blocks) <= 1 for blocks in others), others
    # The parameter objects stay, and those of other stages hold no host memory, however long they are held.
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    on_host = sum(p.numel() for p in held if not p.is_meta)
    assert on_host == sum(p.numel() for b in list(model)[lo:hi] for p in b.parameters())


def test_initialisation_draws_on_the_host_whatever_the_device():
    """The stage goes to the meta device here, standing for a device with a generator of its own: the probes must
    still be filled on the CPU, with the CPU build's values."""
    expected, _ = _cpu_build()
    log: list[tuple[torch.device, torch.Tensor]] = []
    model = _model(log, meta=True)
    materialise_stage(model, 0, len(model), torch.device("meta"))
    assert [d.type for d, _ in log] == ["cpu", "cpu"]
    assert torch.equal(log[0][1], expected["1.scale"]) and torch.equal(log[1][1], expected["5.scale"])
    assert all(t.is_meta for t in model.parameters())  # then placed on the device asked for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_values_are_the_cpu_build():
    expected, rng_after = _cpu_build()
    model = _model([], meta=True)
    cuda = torch.device("cuda", torch.cuda.current_device())
    materialise_stage(model, 0, len(model), cuda)
    assert all(t.device == cuda for t in model.state_dict().values())
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key].cpu(), value), key
    assert torch.equal(torch.get_rng_state(), rng_after)


# ------------------------------------------------------------------------------------------ through the Engine
def _engine_weights(strategy: str, meta: bool, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    engine = phalanx.Engine(strategy=strategy, seed=SEED, **options)
    model = _model([], meta=meta)
    model = engine.prepare(model)
    return engine.get_state_dict(model)


def test_pipeline_meta_build_starts_where_ddp_starts(run_ranks):
    ddp = run_ranks(_engine_weights, 1, "ddp", False, {})[0]
    for pipe in run_ranks(_engine_weights, 2, "pipeline", True, {"pp_size": 2, "pp_partition": "3"}):
        assert pipe.keys() == ddp.keys()
        assert all(torch.equal(pipe[k], v) for k, v in ddp.items())

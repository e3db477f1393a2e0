"""Models built on the meta device, given their values by engine.prepare (phalanx/strategies/deferred_init.py).

A meta-built model must equal the same model built normally under the same seed, bitwise, under ddp and zero1/2/3,
on 1 to 4 ranks: right after prepare and after three AdamW steps, with a tied embedding (TiedNet) and BatchNorm
buffers (BNNet). The reference is plain torch in this process, not phalanx.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import N_FEATURES, BNNet, TiedNet, make_data, make_tokens
from torch import nn

import phalanx


def _build(cls: type[nn.Module], meta: bool) -> nn.Module:
    torch.manual_seed(100)
    if not meta:
        return cls()
    with torch.device("meta"):
        net = cls()
    assert all(p.is_meta for p in net.parameters())
    return net


def _steps(engine: phalanx.Engine, model: nn.Module, optimizer, cls: type[nn.Module]) -> None:  # type: ignore[no-untyped-def]
    if cls is TiedNet:
        x, y = make_tokens(12, 1)
        loss_of = lambda xb, yb: F.cross_entropy(model(xb), yb)  # noqa: E731
    else:
        x, y = make_data(12, 1)
        loss_of = lambda xb, yb: F.mse_loss(model(xb), yb)  # noqa: E731
    for s in range(3):
        engine.backward(loss_of(x[4 * s : 4 * s + 4], y[4 * s : 4 * s + 4]))
        optimizer.step()
        optimizer.zero_grad()


def _ranks_compare(strategy: str, cls_name: str) -> dict[str, object]:
    cls = {"TiedNet": TiedNet, "BNNet": BNNet}[cls_name]
    out: dict[str, object] = {}
    for meta in (False, True):
        engine = phalanx.Engine(strategy=strategy, seed=0)
        net = _build(cls, meta)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        model, optimizer = engine.prepare(net, optimizer)
        inner = engine.unwrap_model(model)
        out[f"tied{meta}"] = cls is not TiedNet or inner.head.weight is inner.emb.weight
        out[f"start{meta}"] = engine.get_state_dict(model)
        _steps(engine, model, optimizer, cls)
        out[f"end{meta}"] = engine.get_state_dict(model)
    return out


def _reference(cls: type[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _build(cls, meta=False).state_dict().items()}


@pytest.mark.parametrize(
    "strategy,world",
    [
        ("ddp", 1),
        ("ddp", 2),
        ("zero1", 3),
        ("zero2", 2),
        ("zero2", 4),
        ("zero3", 1),
        ("zero3", 2),
        ("zero3", 3),
        ("zero3", 4),
    ],
)
@pytest.mark.parametrize("cls", [TiedNet, BNNet])
def test_a_meta_built_model_equals_a_normally_built_one_bitwise(run_ranks, strategy, world, cls):
    results = run_ranks(_ranks_compare, world, strategy, cls.__name__)
    reference = _reference(cls)
    for r in results:
        assert r["tiedTrue"], "the tied weights came apart"
        for when in ("start", "end"):
            normal, meta = r[f"{when}False"], r[f"{when}True"]
            assert sorted(meta) == sorted(normal)
            for k in normal:
                assert torch.equal(meta[k], normal[k]), f"{strategy} x{world}: {k} differs at the {when}"
        # World-size independent: the values at prepare are those of one plain process building it.
        for k, v in reference.items():
            assert torch.equal(r["startTrue"][k], v), f"{k} differs from a plain build"
    ends = [r["endTrue"] for r in results]
    assert all(torch.equal(e[k], ends[0][k]) for e in ends for k in ends[0]), "replicas differ"
    if cls is BNNet:  # the buffers trained too: running statistics moved away from their initial values
        assert not torch.equal(results[0]["endTrue"]["bn.running_mean"], reference["bn.running_mean"])


class RawNet(nn.Module):
    """A parameter made directly (no module's reset_parameters can give it values), beside ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(N_FEATURES))
        self.fc = nn.Linear(N_FEATURES, 5)
        self.blocks = nn.ModuleList([nn.Linear(5, 5) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x * self.gain)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h


def _ranks_load_after_meta(directory: str) -> dict[str, object]:
    """A meta-built RawNet under zero3 refuses to run until it is loaded, then loads the checkpoint (saved by ddp on
    another world size) and equals it."""
    out: dict[str, object] = {}
    torch.manual_seed(7)
    with torch.device("meta"):
        net = RawNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine = phalanx.Engine(strategy="zero3", seed=0)
    model, optimizer = engine.prepare(net, optimizer)
    x, y = make_data(4, 3)
    try:
        model(x)
        out["refused"] = ""
    except RuntimeError as e:
        out["refused"] = str(e)
    if directory.endswith("-model"):
        engine.load_model(directory)  # weights only, each rank reading its own slices of the file
    else:
        engine.load_state(directory)
    out["state"] = engine.get_state_dict(model)
    loss = F.mse_loss(model(x), y[:, :1].expand(4, 5))
    engine.backward(loss)
    optimizer.step()
    out["loss"] = loss.item()
    return out


def _ranks_save_ddp(directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    net = RawNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model, optimizer = engine.prepare(net, optimizer)
    x, y = make_data(8, 3)
    for s in range(2):
        engine.backward(F.mse_loss(model(x[4 * s : 4 * s + 4]), y[4 * s : 4 * s + 4, :1].expand(4, 5)))
        optimizer.step()
        optimizer.zero_grad()
    engine.save_state(directory)
    engine.save_model(directory + "-model")
    return engine.get_state_dict(model)


@pytest.mark.parametrize("what", ["ck", "ck-model"])
def test_a_meta_built_zero3_model_loads_a_ddp_checkpoint_and_refuses_to_run_before(run_ranks, tmp_path, what):
    saved = run_ranks(_ranks_save_ddp, 2, str(tmp_path / "ck"))[0]
    results = run_ranks(_ranks_load_after_meta, 3, str(tmp_path / what))
    for r in results:
        assert "gain" in r["refused"] and "engine.load_model" in r["refused"], r["refused"]
        for k, v in saved.items():
            assert torch.equal(r["state"][k], v), k
    assert len({r["loss"] for r in results}) == 1


def _ranks_init_fn() -> dict[str, torch.Tensor]:
    def init(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            p.fill_(0.25)

    with torch.device("meta"):
        net = RawNet()
    engine = phalanx.Engine(strategy="zero3", seed=0)
    model = engine.prepare(net, param_init_fn=init)
    model(make_data(2)[0])  # runs: every tensor has values
    return engine.get_state_dict(model)


def test_param_init_fn_initialises_what_has_no_reset_parameters(run_ranks):
    for state in run_ranks(_ranks_init_fn, 2):
        assert state and all(torch.all(v == 0.25) for v in state.values())


def test_a_meta_buffer_without_an_initialiser_is_named_at_forward():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.register_buffer("scale", torch.rand(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.scale

    with torch.device("meta"):
        net = WithBuffer()
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = engine.prepare(net)
    with pytest.raises(RuntimeError, match=r"scale.*engine\.load_model"):
        model(torch.ones(2, 3))
    # phalanx.init_empty_weights() keeps buffers real: they keep the values they were built with.
    torch.manual_seed(3)
    with phalanx.init_empty_weights():
        net2 = WithBuffer()
    built = net2.scale.clone()
    model2 = phalanx.Engine(strategy="ddp", seed=0).prepare(net2)
    assert torch.equal(model2.scale, built)
    assert model2(torch.ones(2, 3)).shape == (2, 3)


def test_param_init_fn_where_it_would_be_ignored_is_refused():
    engine = phalanx.Engine(strategy="ddp", seed=0)
    with pytest.raises(ValueError, match=r"no model passed to it has tensors on the meta device"):
        engine.prepare(nn.Linear(3, 3), param_init_fn=lambda m: None)

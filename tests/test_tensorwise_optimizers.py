"""Tensor-wise optimizers under zero1/2/3: torch's Muon and Adafactor, and a LAMB that declares ``tensorwise = True``.
Each whole parameter is stepped on one owner rank (phalanx/strategies/zero/tensorwise.py).

Against one process from the same seed, losses and parameters within 1e-6 (absolute): Muon orthogonalises in bf16,
so a gradient that reached its owner other than whole and reduced would show far above that. The model (TiedNet) has
sizes that divide by neither 2 nor 4 (parameters straddle the ranks' slices), a frozen matrix, and an embedding tied
to the head; Muon takes its trainable matrices and AdamW the rest, the split torch's Muon asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _common import TiedNet, global_order, make_tokens
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.checkpoint.read import Checkpoint

STEPS, GLOBAL_BATCH = 6, 12
TOL = dict(rtol=0.0, atol=1e-6)
KINDS = ("muon", "adafactor")


class Lamb(torch.optim.Optimizer):
    """A small LAMB: Adam's direction plus weight decay, scaled per tensor by the trust ratio |w| / |update|. It
    declares itself tensor-wise, so the zero strategies step each of its tensors whole on one rank."""

    tensorwise = True

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": 1e-6, "weight_decay": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = torch.zeros(()), torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (st["m"] / (1 - b1 ** st["step"])) / ((st["v"] / (1 - b2 ** st["step"])).sqrt() + group["eps"])
                update += group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones(()))
                p.sub_(lr * trust * update)


def _optimizers(kind: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    if kind == "muon":  # torch's Muon takes matrices only: the rest goes to AdamW, as its docs show
        return [torch.optim.Muon(mats, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2)]
    if kind == "muon-one":  # one matrix: on two ranks, one of them owns nothing
        one = model.proj.weight
        return [torch.optim.Muon([one], lr=0.02), torch.optim.AdamW([p for p in model.parameters() if p is not one])]
    if kind == "adafactor":  # two param groups, each with its own lr
        return [torch.optim.Adafactor([{"params": mats}, {"params": rest, "lr": 3e-2}], lr=1e-2)]
    return [Lamb(model.parameters())]


def _reference(kind: str, max_norm: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch: whole global batches in the documented order, on one thread as each rank runs
    (Muon's bf16 matrix products on two threads beside the ranks' processes took 50 times longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(kind, max_norm)
    finally:
        torch.set_num_threads(threads)


def _reference_run(kind: str, max_norm: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(100)
    model = TiedNet()
    opts = _optimizers(kind, model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    order = global_order(len(x), 0, 0)
    losses = []
    for step in range(STEPS):
        idx = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(strategy: str, kind: str, accum: int = 1, save_at: tuple[int, str] | None = None, **options: Any) -> dict:
    """``accum`` micro-batches per step, clipped when ``max_grad_norm`` is given; ``save_at=(step, dir)`` saves the
    state after that step."""
    engine = phalanx.Engine(strategy=strategy, seed=0, grad_accum_steps=accum, **options)
    torch.manual_seed(100 + engine.rank)  # ranks differ on purpose: prepare must start them all from rank 0
    model = TiedNet()
    opts = _optimizers(kind, model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // (accum * engine.world_size), shuffle=True)
    model, *opts, loader = engine.prepare(model, *opts, loader)
    losses, micro = [], []
    for xb, yb in loader:
        with engine.accumulate():
            loss = F.cross_entropy(model(xb), yb)
            engine.backward(loss)
            micro.append(engine.reduce(loss.detach(), "mean"))
            for o in opts:
                o.step()
                o.zero_grad()
        if engine.sync_gradients:
            losses.append(torch.stack(micro).mean().item())
            micro = []
            if save_at is not None and engine.global_step == save_at[0]:
                engine.save_state(save_at[1])
    return {
        "losses": losses,
        "state": engine.get_state_dict(model),
        "desc": engine.strategy.describe(),
        "memory": engine.memory_report(),
        "loss_scale": engine.precision.loss_scale,
    }


def _resume(kind: str, strategy: str, directory: str, again: str) -> dict:
    """Load the checkpoint, save it again at once (to compare bit for bit), then train its remaining steps."""
    engine = phalanx.Engine(strategy=strategy, seed=0)
    torch.manual_seed(7)  # other initial values: all of them must come from the checkpoint
    model = TiedNet()
    opts = _optimizers(kind, model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True)
    model, *opts, loader = engine.prepare(model, *opts, loader)
    engine.load_state(directory)
    engine.save_state(again)
    for xb, yb in loader:  # the loader resumes where the checkpoint was saved
        engine.backward(F.cross_entropy(model(xb), yb))
        for o in opts:
            o.step()
            o.zero_grad()
    return {"state": engine.get_state_dict(model), "steps": engine.global_step}


def _on_two_ranks(tmp: str) -> dict:
    out: dict[Any, Any] = {}
    for stage in ("zero1", "zero2", "zero3"):
        for kind in KINDS:
            out[stage, kind] = _train(stage, kind)
    out["zero3", "lamb"] = _train("zero3", "lamb")
    # Clipping to the global norm, over two micro-batches: the owners' whole gradients count, each once.
    out["clip", "adafactor"] = _train("zero2", "adafactor", accum=2, max_grad_norm=0.05)
    out["clip", "muon"] = _train("zero3", "muon", accum=2, max_grad_norm=0.05)
    # fp16 with its loss scaler (an overflow anywhere skips the step everywhere), against ddp's whole-state step; the
    # rank that owns none of the Muon's one matrix steps a placeholder, so that the overflow checks pair up.
    for strategy in ("ddp", "zero2"):
        out["fp16", strategy] = _train(
            strategy, "muon-one", precision="fp16-mixed", loss_scale_init=1024.0, max_grad_norm=1.0
        )
    # Checkpoints: saved after step 3, reloaded (same world size, and by the caller on one process), the rest trained.
    for stage, kind in (("zero2", "muon"), ("zero3", "adafactor")):
        out["full", kind] = _train(stage, kind, save_at=(3, f"{tmp}/{kind}"))
        out["resumed", kind] = _resume(kind, stage, f"{tmp}/{kind}", f"{tmp}/{kind}-again")
    return out


def _saved(path: Path) -> dict[str, torch.Tensor]:
    reader = Checkpoint(path).reader(0)
    out = {}
    for key in reader.keys():
        n = 1
        for s in reader.shape(key):
            n *= s
        out[key] = reader.read(key, 0, n).clone().view(reader.shape(key))
    return out


def _close(res: dict, ref: tuple[list[float], dict[str, torch.Tensor]], where: str) -> float:
    """Losses and every tensor of the state within 1e-6; the largest parameter difference."""
    ref_losses, ref_state = ref
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"losses, {where}")
    assert set(res["state"]) == set(ref_state), where
    for k in ref_state:
        torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, {where}")
    return max(float((res["state"][k] - ref_state[k]).abs().max()) for k in ref_state)


@pytest.mark.filterwarnings("ignore:strategy .* shards nothing")
def test_muon_adafactor_and_lamb_under_zero_match_one_process_on_two_ranks(run_ranks, tmp_path, monkeypatch):
    refs = {kind: _reference(kind) for kind in (*KINDS, "lamb")}
    results = run_ranks(_on_two_ranks, 2, str(tmp_path))
    for rank, res in enumerate(results):
        for stage in ("zero1", "zero2", "zero3"):
            for kind in KINDS:
                _close(res[stage, kind], refs[kind], f"{stage}/{kind}, rank {rank}")
        _close(res["zero3", "lamb"], refs["lamb"], f"zero3/lamb, rank {rank}")
        for kind in KINDS:
            _close(res["clip", kind], _reference(kind, max_norm=0.05), f"clipped {kind}, rank {rank}")
        _close(res["fp16", "zero2"], (res["fp16", "ddp"]["losses"], res["fp16", "ddp"]["state"]), f"fp16, rank {rank}")
        assert res["fp16", "zero2"]["loss_scale"] == 1024.0  # no overflow: every step was taken
        # Resumed from the checkpoint of step 3: the same parameters, bit for bit, as training straight through.
        for kind in KINDS:
            full, resumed = res["full", kind]["state"], res["resumed", kind]["state"]
            assert resumed.keys() == full.keys() and res["resumed", kind]["steps"] == STEPS
            for k in full:
                assert torch.equal(resumed[k], full[k]), f"{kind} resumed: {k}"
    res = results[0]
    # Balance: the owners' elements differ by at most the largest tensor (TiedNet's 13 x 13 blocks).
    for stage in ("zero2", "zero3"):
        loads = res[stage, "muon"]["desc"]["tensorwise_owner_numel"]["dense"]
        assert len(loads) == 2 and max(loads) - min(loads) <= 13 * 13 and sum(loads) == 2 * 169 + 2 * 91 + 77
    # memory_report: the owners' whole copies are a step's transient; the state held is what the optimizers hold.
    memory = res["zero2", "muon"]["memory"]
    assert memory["transient"] >= 8 * min(res["zero2", "muon"]["desc"]["tensorwise_owner_numel"]["dense"])
    # The checkpoints: the reloaded state saved again is the saved one, bit for bit (optimizer state included, Muon's
    # momentum and Adafactor's factored statistics whole under their parameter's name) ...
    for kind in KINDS:
        saved, again = _saved(tmp_path / kind), _saved(tmp_path / f"{kind}-again")
        assert set(again) == set(saved)
        assert any(k.endswith("/momentum_buffer" if kind == "muon" else "/row_var") for k in saved)
        for k in saved:
            assert torch.equal(again[k], saved[k]), f"{kind}: {k}"
    # ... and one process loads it, under ddp (whole state) and under zero3 (one owner of everything), and saves the
    # same tensors.
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    for kind in KINDS:
        saved = _saved(tmp_path / kind)
        for strategy in ("ddp", "zero3"):
            engine = phalanx.Engine(strategy=strategy, seed=0)
            model = TiedNet()
            loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH, shuffle=True)
            model, *_ = engine.prepare(model, *_optimizers(kind, model), loader)
            engine.load_state(tmp_path / kind)
            engine.save_state(tmp_path / f"{kind}-{strategy}")
            one = _saved(tmp_path / f"{kind}-{strategy}")
            assert set(one) == set(saved)
            for k in saved:
                assert torch.equal(one[k], saved[k]), f"{kind} on one process under {strategy}: {k}"


def _on_four_ranks() -> dict:
    from _moe_common import BATCH, batches, moe_model

    out: dict[Any, Any] = {(stage, kind): _train(stage, kind) for stage in ("zero2", "zero3") for kind in KINDS}
    # Expert parallelism (ep_size=2: experts shard over 2 of the 4 ranks): the experts' owners are among those
    # ranks. Against ddp under the same ep (whole state, the same reductions).
    samples = [{"input_ids": row, "labels": row} for ids in batches() for row in ids]
    for strategy in ("ddp", "zero3"):
        engine = phalanx.Engine(strategy=strategy, seed=0, ep_size=2, max_grad_norm=0.5)
        model = moe_model("demo")
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        loader = DataLoader(samples, batch_size=BATCH // engine.topology.data_size)  # type: ignore[arg-type]
        model, opt, loader = engine.prepare(model, opt, loader)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        out["ep", strategy] = {"losses": losses, "state": engine.get_state_dict(model)}
        out["ep", strategy]["desc"] = engine.strategy.describe()
    return out


def test_muon_and_adafactor_on_four_ranks_experts_included(run_ranks):
    refs = {kind: _reference(kind) for kind in KINDS}
    results = run_ranks(_on_four_ranks, 4)
    for rank, res in enumerate(results):
        for stage in ("zero2", "zero3"):
            for kind in KINDS:
                _close(res[stage, kind], refs[kind], f"{stage}/{kind}, rank {rank} of 4")
        ddp = res["ep", "ddp"]
        _close(res["ep", "zero3"], (ddp["losses"], ddp["state"]), f"zero3 ep2 against ddp ep2, rank {rank}")
    loads = results[0]["ep", "zero3"]["desc"]["tensorwise_owner_numel"]
    assert len(loads["experts"]) == 2 and len(loads["dense"]) == 4  # experts: owners among the 2 expert shard ranks


def test_owners_are_balanced_by_size():
    from phalanx.strategies.zero.tensorwise import assign_owners

    g = torch.Generator().manual_seed(0)
    for world in (2, 3, 4, 8):
        sizes = [int(s) for s in torch.randint(1, 10_000, (37,), generator=g)]
        loads = [0] * world
        owners = assign_owners(sizes, loads)
        assert loads == [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(sizes)
        assert assign_owners(sizes, [0] * world) == owners  # the same plan on every rank


@pytest.mark.filterwarnings("ignore:strategy .* shards nothing")
def test_optimizers_that_are_neither_elementwise_nor_tensorwise_are_refused(monkeypatch):
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")

    class LAMB(torch.optim.SGD):  # a trust-ratio optimizer by name, that did not declare itself
        pass

    class Mine(torch.optim.SGD):
        pass

    for cls, words in ((LAMB, ("trust ratio", "tensorwise = True")), (Mine, ("zero_allow_untested_optimizer",))):
        engine = phalanx.Engine(strategy="zero2")
        model = TiedNet()
        with pytest.raises(ValueError, match=cls.__name__) as e:
            engine.prepare(model, cls(model.parameters(), lr=0.1))
        assert all(w in str(e.value) for w in (*words, "strategy='ddp'")), str(e.value)
    engine = phalanx.Engine(strategy="zero2", offload="cpu")
    model = TiedNet()
    with pytest.raises(ValueError, match="Adafactor with offload='cpu' is not supported"):
        engine.prepare(model, torch.optim.Adafactor(model.parameters()))
    # LBFGS stays refused, with its reason.
    engine = phalanx.Engine(strategy="zero2")
    model = TiedNet()
    with pytest.raises(ValueError, match="line search"):
        engine.prepare(model, torch.optim.LBFGS(model.parameters()))

"""zero3 under torch.compile: a compiled model trains as the uncompiled one, on 2 gloo ranks.

Compiled four ways, as FSDP2 users do: the whole model after engine.prepare (``torch.compile(model)``), each unit on
its own (``block.compile()``, or its forward with ``fullgraph=True``), and the whole model before engine.prepare.
Each is compared with the uncompiled zero3 run in the same processes and with the single-process reference: losses
and parameters within rtol = atol = 1e-5 after 3 AdamW steps, with offload none (inductor) and cpu (aot_eager,
which skips inductor's C++ build). ``fullgraph=True`` on the whole model is refused with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _common import TiedNet, grouped_optimizer, make_tokens, tied_reference_run
from torch.utils.data import DataLoader, TensorDataset

import phalanx

STEPS, GLOBAL_BATCH = 3, 12
TOL = dict(rtol=1e-5, atol=1e-5)


def _compile(engine: phalanx.Engine, model: torch.nn.Module, how: str, backend: str) -> torch.nn.Module:
    if how == "whole":
        return torch.compile(model, backend=backend)
    for unit in engine.strategy.units:
        if unit.is_root:
            continue
        if how == "units":
            unit.module.compile(backend=backend)
        else:  # "unit_forward": each unit's forward is one graph; the hooks around it stay eager
            unit.module.forward = torch.compile(unit.module.forward, backend=backend, fullgraph=True)
    return model


def _train(how: str | None, offload: str, backend: str) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = phalanx.Engine(strategy="zero3", seed=0, offload=offload)
    torch.manual_seed(100 + engine.rank)  # ranks differ on purpose: prepare starts them all from rank 0
    model = TiedNet()
    if how == "before":
        model = torch.compile(model, backend=backend)
    optimizer = grouped_optimizer("adamw", model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    prepared = model
    if how not in (None, "before"):
        model = _compile(engine, model, how, backend)
    assert engine.unwrap_model(model) is engine.unwrap_model(prepared)
    losses = []
    for xb, yb in loader:
        with engine.accumulate(model):  # the compiled model stands for the prepared one
            loss = F.cross_entropy(model(xb), yb)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    state = {k.removeprefix("_orig_mod."): v for k, v in engine.get_state_dict(model).items()}
    return {"losses": losses, "state": state, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def _fullgraph_refusal() -> str:
    engine = phalanx.Engine(strategy="zero3", seed=0)
    model = engine.prepare(TiedNet())
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(make_tokens(4)[0])
    except Exception as e:  # noqa: BLE001 - dynamo's own error type; its message is what the user reads
        return str(e)
    return "no error"


def _ranks(runs: list[tuple[str | None, str, str]], refusal: bool) -> dict[Any, Any]:
    out: dict[Any, Any] = {run: _train(*run) for run in runs}
    if refusal:
        out["refusal"] = _fullgraph_refusal()
    return out


def _check(results: list[dict[Any, Any]], offload: str) -> None:
    ref_losses, ref_state = tied_reference_run(STEPS, GLOBAL_BATCH, "adamw")
    for rank, per_rank in enumerate(results):
        eager = per_rank[(None, offload, "eager")]
        assert eager["graphs"] == 0
        for run, res in per_rank.items():
            if run == "refusal":
                continue
            where = f"{run}, rank {rank}"
            if run[0] is not None:
                assert res["graphs"] >= 2, f"{where}: dynamo captured {res['graphs']} graphs; the model ran eagerly"
            assert set(res["state"]) == set(ref_state), where
            others = (("uncompiled", eager["losses"], eager["state"]), ("reference", ref_losses, ref_state))
            for other, losses, state in others:
                got = torch.tensor(res["losses"])
                torch.testing.assert_close(got, torch.tensor(losses), **TOL, msg=f"losses, {where} vs {other}")
                for k in state:
                    torch.testing.assert_close(res["state"][k], state[k], **TOL, msg=f"{k}, {where} vs {other}")


def test_zero3_compiled_with_inductor_matches_uncompiled(run_ranks):
    runs = [(None, "none", "eager"), ("whole", "none", "inductor")]
    results = run_ranks(_ranks, 2, runs, False, timeout=600)
    _check(results, "none")


def test_zero3_compiled_whole_or_by_unit_with_cpu_offload_matches_uncompiled(run_ranks):
    runs = [(None, "cpu", "eager")] + [
        (how, "cpu", "aot_eager") for how in ("whole", "units", "unit_forward", "before")
    ]
    results = run_ranks(_ranks, 2, runs, True, timeout=600)
    _check(results, "cpu")
    for per_rank in results:
        assert "phalanx zero3 gathers each unit's parameters" in per_rank["refusal"]
        assert "Compile with fullgraph=False" in per_rank["refusal"]

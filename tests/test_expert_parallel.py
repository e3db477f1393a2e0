"""Expert parallelism through the Engine against one process from the same init (fp32, aux loss off, 1e-5):
transformers' Qwen3-MoE and Mixtral, and the demo's MoE GPT (phalanx demo --moe), 8 experts, top-2, three SGD
steps with momentum (tests/_moe_common.py says why not Adam) and the gradient norm clipped below its value at every
step (so the norm must count each expert once). Layouts: ep2 on 2 ranks, ep4 on 4; ep2 x zero2, ep2 x zero3,
(Qwen3-MoE also ep2 x zero1, ep2 under hybrid zero2, ep2 x cp2 with ring attention), ep2 x tp2 (each model's
own tp plan: every expert split by moe_tp_experts) and ep2 x pp2 (the models as the
pipeline's blocks) on 4. A checkpoint saved at ep2 x zero2 loads on one process bit for bit, and the reverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.checkpoint.read import Checkpoint
from tests._moe_common import (
    moe_model,
    pipeline_reference,
    reference,
    train_many,
    train_pipeline,
    train_ranks,
)

TOL = 1e-5
KINDS = ("qwen3", "mixtral", "demo")  # the demo: phalanx demo --moe's model
_REFS: dict[tuple[str, str], Any] = {}


def _reference(kind: str, form: str = "model") -> Any:
    if (kind, form) not in _REFS:
        _REFS[kind, form] = reference(kind) if form == "model" else pipeline_reference(kind)
    return _REFS[kind, form]


def _close(per_rank: list[dict[str, Any]], ref: tuple[list[float], dict[str, torch.Tensor]], what: str) -> None:
    ref_losses, ref_state = ref
    for r, res in enumerate(per_rank):
        assert res["losses"] == pytest.approx(ref_losses, abs=TOL), (what, r, res["losses"], ref_losses)
    state = per_rank[0]["state"]
    assert set(state) == set(ref_state), what
    for k in ref_state:
        assert state[k].shape == ref_state[k].shape, (what, k)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < TOL, (what, worst)


def _whole_experts(kind: str) -> int:
    return sum(p.numel() for n, p in moe_model(kind).named_parameters() if ".experts." in n)


def test_ep2_on_two_ranks_and_the_global_aux_loss(run_ranks: Any) -> None:
    runs = [(kind, {"strategy": "ddp", "ep_size": 2}) for kind in KINDS]
    # The load-balancing loss on: over every rank's tokens (moe_aux_loss="global") it is one process's on the whole
    # batch, loss and gradients; per rank (the default, the model's own code) it is each rank's own statistic.
    aux = [("qwen3+aux", {"strategy": "ddp", "ep_size": 2, "moe_aux_loss": "global"}), ("qwen3+aux", {"ep_size": 2})]
    results = run_ranks(train_many, 2, runs + aux)
    for i, (kind, options) in enumerate(runs + aux[:1]):
        _close([r[i] for r in results], _reference(kind), f"{kind} {options}")
    for i, (kind, _) in enumerate(runs):
        assert all(r[i]["expert_numel"] * 2 == _whole_experts(kind) for r in results)  # 1/ep of the experts
    per_rank = results[0][len(runs) + 1]["losses"]
    assert abs(per_rank[0] - _reference("qwen3+aux")[0][0]) > 1e-4  # the mean of per-rank statistics differs


def test_ep4_and_ep2_under_zero_and_context_parallelism_on_four_ranks(run_ranks: Any) -> None:
    runs = [
        (kind, options)
        for kind in KINDS
        for options in (
            {"strategy": "ddp", "ep_size": 4},
            {"strategy": "zero2", "ep_size": 2},
            {"strategy": "zero3", "ep_size": 2},
        )
    ]
    runs += [
        ("qwen3", {"strategy": "zero1", "ep_size": 2}),
        ("qwen3", {"strategy": "zero2", "ep_size": 2, "dp_replicate_size": 2}),  # hybrid: ep within a replica
        ("qwen3", {"strategy": "ddp", "ep_size": 2, "cp_size": 2}),  # ring attention; ep over dp x cp
    ]
    results = run_ranks(train_many, 4, runs)
    for i, (kind, options) in enumerate(runs):
        _close([r[i] for r in results], _reference(kind), f"{kind} {options}")


def _tp_and_pipeline(kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    out = [train_ranks(kind, {"strategy": "ddp", "ep_size": 2, "tp_size": 2}) for kind in kinds]
    return out + [train_pipeline(kind, {"pp_size": 2, "ep_size": 2, "pp_microbatches": 2}) for kind in kinds]


def test_ep2_by_tp2_and_by_pp2_on_four_ranks(run_ranks: Any) -> None:
    results = run_ranks(_tp_and_pipeline, 4, KINDS)
    for i, kind in enumerate(KINDS):
        _close([r[i] for r in results], _reference(kind), f"{kind} ep2 x tp2")
        _close([r[len(KINDS) + i] for r in results], _reference(kind, "pipeline"), f"{kind} ep2 x pp2")


# ------------------------------------------------------------------------------------------- checkpoints
def _saved(path: Path) -> dict[str, torch.Tensor]:
    reader = Checkpoint(path).reader(0)
    out = {}
    for key in reader.keys():
        n = 1
        for s in reader.shape(key):
            n *= s
        out[key] = reader.read(key, 0, n).clone().view(reader.shape(key))
    return out


def _save_load(save: str | None, load: str | None) -> dict[str, Any]:
    import phalanx

    eng = phalanx.Engine(strategy="zero2", ep_size=2, seed=0)
    model = moe_model("qwen3")
    model, opt = eng.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if load is not None:
        eng.load_state(load)
    else:
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(eng.topology.data_rank))
        eng.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    if save is not None:
        eng.save_state(save)
        eng.save_model(model, save + "-hf")  # whole experts, in transformers' own files
    state = eng.get_state_dict(model)  # a collective: every rank
    return {"state": state if eng.rank == 0 else None}


def test_checkpoint_at_ep2_zero2_loads_on_one_process_bit_for_bit_and_back(run_ranks: Any, tmp_path: Path) -> None:
    import phalanx

    trained = run_ranks(_save_load, 2, str(tmp_path / "ep"), None)[0]["state"]
    saved = _saved(tmp_path / "ep")
    assert any("experts" in k for k in saved)
    # save_model's directory loads with from_pretrained, every expert in place.
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ep-hf").state_dict()
    assert set(hf) == set(trained) and all(torch.equal(hf[k], trained[k]) for k in trained)
    assert hf["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    # One process loads it whole and saves it again: the same tensors, bit for bit (optimizer moments included).
    eng = phalanx.Engine(seed=0)
    model = moe_model("qwen3", seed=1)  # other values: all of them must come from the checkpoint
    model, opt = eng.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    eng.load_state(tmp_path / "ep")
    eng.save_state(tmp_path / "one")
    again = _saved(tmp_path / "one")
    assert set(again) == set(saved)
    for k in saved:
        assert torch.equal(again[k], saved[k]), k
    # ... and the reverse: ep2 x zero2 loads the one-process checkpoint and gives back the same whole model.
    back = run_ranks(_save_load, 2, str(tmp_path / "back"), str(tmp_path / "one"))[0]["state"]
    reloaded = _saved(tmp_path / "back")
    for k in saved:
        assert torch.equal(reloaded[k], saved[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k


def test_zero3_gathers_a_transformers_model_layer_by_layer_by_default() -> None:
    # Its _no_split_modules, as Accelerate's transformer-based wrap: not the whole base model (every expert) at once.
    from phalanx.strategies.zero.zero3 import unit_modules_of

    for kind in ("qwen3", "mixtral"):
        names = [name for name, _ in unit_modules_of(moe_model(kind), None)]
        assert names == ["model.layers.0", "model.layers.1"], names
    assert [n for n, _ in unit_modules_of(moe_model("qwen3"), "Qwen3MoeSparseMoeBlock")] == [
        "model.layers.0.mlp",
        "model.layers.1.mlp",
    ]

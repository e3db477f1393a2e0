"""Other tools' runs, continued: a torch DCP checkpoint written by FSDP2, DeepSpeed ZeRO-1/2/3 checkpoints, an
Accelerate ``save_state`` folder, and transformers ``checkpoint-N/`` folders holding DeepSpeed's ``global_stepN/`` or
FSDP's ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` resume in phalanx on 1, 2 and 4 ranks under ddp, zero1, zero2
and zero3, and the next 3 steps equal the writer's own resumed steps (the same tool loading its own checkpoint and
taking 3 steps) within atol 1e-6, losses and final weights.

FSDP2 (torch's ``fully_shard`` on the CPU over gloo) and Accelerate (one process) write theirs live here. DeepSpeed is
not installed in CI: its checkpoints and its own resumed steps were written by DeepSpeed 0.19.8 (torch 2.13.0, 2 gloo
ranks on the CPU, fp32, torch AdamW) with tests/data/foreign/make_deepspeed.py, which also defines the model, the data
and the optimizer both sides use; they are committed under tests/data/foreign/ (a few KB each).

Pickles are read only with ``torch.load(weights_only=True)`` or an unpickler that allows DCP's metadata classes:
payloads that would run a command are refused, and the command does not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import phalanx
from phalanx.checkpoint import CheckpointError
from phalanx.checkpoint.foreign import detect
from phalanx.checkpoint.foreign.unpickle import load_pickle, load_torch_file

DATA = Path(__file__).resolve().parent / "data" / "foreign"
_spec = importlib.util.spec_from_file_location("phalanx_foreign_tiny", DATA / "make_deepspeed.py")
assert _spec is not None and _spec.loader is not None
tiny = sys.modules.setdefault("phalanx_foreign_tiny", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(tiny)

ATOL = 1e-6  # the next 3 steps against the writer's own resumed steps: losses and every weight
DEEPSPEED = ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")


def _init_gloo() -> None:
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo",
            init_method=os.environ["PHALANX_INIT_METHOD"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )


def _mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return float(t) / torch.distributed.get_world_size()


# ------------------------------------------------------------------------------------------------- writers
def _write_fsdp2(root: str, accelerate_root: str) -> dict | None:
    """FSDP2 on 2 ranks: 2 steps, ``dcp.save`` of the model and optimizer state dicts; then FSDP2 resuming its own
    checkpoint (a fresh model and optimizer, ``dcp.load``) and taking 3 steps: the anchor. Then rank 0 writes the
    Accelerate folder and its anchor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    _init_gloo()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def build():  # type: ignore[no-untyped-def]
        model = tiny.tiny_model()
        fully_shard(model.fc1)
        fully_shard(model)
        return model, tiny.adamw(model.parameters())

    def step(model, opt, s: int) -> float:  # type: ignore[no-untyped-def]
        loss = tiny.loss_fn(model, s, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return _mean(loss)

    model, opt = build()
    for s in range(tiny.SAVED_AT):
        step(model, opt, s)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=root)
    # The same state as Accelerate's save_state writes it under FSDP's sharded state dict, in a transformers
    # Trainer's checkpoint-2/: a DCP directory for the model, another for the optimizer, beside trainer_state.json.
    hf = Path(accelerate_root).parent / "hf_fsdp" / "checkpoint-2"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=hf / "pytorch_model_fsdp_0")
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=hf / "optimizer_0")
    if rank == 0:
        (hf / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    model, opt = build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [step(model, opt, s) for s in range(tiny.SAVED_AT, tiny.SAVED_AT + tiny.RESUMED)]
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0's
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    anchor = {"losses": losses, "params": {n: full[n].clone() for n, _ in tiny.tiny_model().named_parameters()}}
    return {"fsdp2": anchor, "accelerate": _write_accelerate(accelerate_root)}  # the same process: one spawn less


def _write_accelerate(root: str) -> dict:
    """Accelerate on one process: 2 steps, ``save_state``; then Accelerate loading its own folder into a fresh
    model and optimizer and taking 3 steps: the anchor."""
    from accelerate import Accelerator

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # one plain process, as a user's script runs
        os.environ.pop(var, None)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*(lambda m: (m, tiny.adamw(m.parameters())))(tiny.tiny_model()))
    for s in range(tiny.SAVED_AT):
        accelerator.backward(tiny.loss_fn(model, s))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(root)
    accelerator = Accelerator(cpu=True)  # a new script's: it prepares one model, as the saving one did
    fresh = tiny.tiny_model()
    model, opt = accelerator.prepare(fresh, tiny.adamw(fresh.parameters()))
    accelerator.load_state(root)
    losses = []
    for s in range(tiny.SAVED_AT, tiny.SAVED_AT + tiny.RESUMED):
        loss = tiny.loss_fn(model, s)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _hf_checkpoint(root: Path) -> Path:
    """A transformers Trainer's ``checkpoint-2/`` as written under DeepSpeed: DeepSpeed's ``latest`` and
    ``global_step2/`` beside ``trainer_state.json``."""
    out = root / "checkpoint-2"
    shutil.copytree(DATA / "deepspeed_zero2", out)
    state = {"global_step": 2, "epoch": 0.5, "max_steps": 4, "log_history": [], "best_metric": None}
    (out / "trainer_state.json").write_text(json.dumps(state))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Every foreign checkpoint, and the anchor its writer resumed from it."""
    root = tmp_path_factory.mktemp("foreign")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHALANX_DEVICE", "cpu")
        args = (str(root / "fsdp2"), str(root / "accelerate"))
        anchors = phalanx.spawn(_write_fsdp2, nprocs=2, args=args, threads_per_proc=1, timeout=240)[0]
    out = {name: (root / name, anchors[name]) for name in ("fsdp2", "accelerate")}
    out["hf_fsdp"] = (root / "hf_fsdp" / "checkpoint-2", anchors["fsdp2"])  # the same state as FSDP2's own
    for name in DEEPSPEED:
        anchor = json.loads((DATA / f"{name}.anchor" / "anchor.json").read_text())
        anchor["params"] = load_file(str(DATA / f"{name}.anchor" / "params.safetensors"))
        out[name] = (DATA / name, anchor)
    out["hf_deepspeed"] = (_hf_checkpoint(root), out["deepspeed_zero2"][1])
    return out


# ------------------------------------------------------------------------------------------------ phalanx
def _resume_and_step(path: str, strategy: str) -> dict:
    """phalanx loads ``path`` under ``strategy`` and takes the 3 steps the anchor took."""
    engine = phalanx.Engine(strategy=strategy, seed=0)
    model = tiny.tiny_model()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    engine.load_state(path)
    step = engine.global_step
    losses = []
    for s in range(tiny.SAVED_AT, tiny.SAVED_AT + tiny.RESUMED):
        loss = tiny.loss_fn(model, s, engine.rank, engine.world_size)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(engine.reduce(loss.detach(), "mean")))
    params = engine.get_state_dict(model)
    return {"step": step, "losses": losses, "params": {n: params[n] for n in params if n != "scale"}}


def _resume_all(jobs: list[tuple[str, str, str]]) -> dict[str, dict]:
    return {name: _resume_and_step(path, strategy) for name, path, strategy in jobs}


# Each world size takes FSDP2's and DeepSpeed ZeRO-2's and ZeRO-3's checkpoints, under layouts other than the
# writer's; the others (ZeRO-1, Accelerate, the transformers checkpoint) on 1 and 2 ranks.
LAYOUTS = {
    1: {"fsdp2": "ddp", "deepspeed_zero2": "ddp", "deepspeed_zero3": "ddp", "deepspeed_zero1": "ddp",
        "accelerate": "ddp", "hf_deepspeed": "ddp", "hf_fsdp": "ddp"},
    2: {"fsdp2": "zero3", "deepspeed_zero2": "zero1", "deepspeed_zero3": "zero3", "deepspeed_zero1": "zero2",
        "accelerate": "zero3", "hf_deepspeed": "zero2", "hf_fsdp": "zero1"},
    4: {"fsdp2": "zero2", "deepspeed_zero2": "zero3", "deepspeed_zero3": "zero2"},
}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_foreign_checkpoints_continue_as_their_writer_did(run_ranks, written, world):
    jobs = [(name, str(written[name][0]), strategy) for name, strategy in LAYOUTS[world].items()]
    got = _resume_all(jobs) if world == 1 else run_ranks(_resume_all, world, jobs)[0]  # one rank: in this process
    for name, strategy in LAYOUTS[world].items():
        anchor, mine = written[name][1], got[name]
        where = f"{name} resumed under {strategy} on {world} rank(s)"
        assert mine["step"] == tiny.SAVED_AT, where
        torch.testing.assert_close(
            torch.tensor(mine["losses"]), torch.tensor(anchor["losses"]), rtol=0, atol=ATOL, msg=where
        )
        assert set(mine["params"]) == set(anchor["params"]), where
        for n, value in anchor["params"].items():
            torch.testing.assert_close(mine["params"][n], value, rtol=0, atol=ATOL, msg=f"{where}: {n}")


def test_each_kind_is_detected(written):
    assert detect(written["fsdp2"][0]) == "dcp"
    assert detect(written["accelerate"][0]) == "accelerate"
    assert {detect(DATA / name) for name in DEEPSPEED} == {"deepspeed"}
    assert detect(DATA / "deepspeed_zero2" / "global_step2") == "deepspeed"  # one tag, passed itself
    assert detect(written["hf_deepspeed"][0]) == "deepspeed"
    assert detect(written["hf_fsdp"][0]) == "accelerate"  # its pytorch_model_fsdp_0/ and optimizer_0/
    assert detect(DATA) is None


# ------------------------------------------------------------------------------------- the Trainer, in process
def _trainer(out: Path) -> phalanx.Trainer:
    from torch.utils.data import TensorDataset

    x = torch.cat([tiny.batch(s)[0] for s in range(4)])
    y = torch.cat([tiny.batch(s)[1] for s in range(4)])
    args = phalanx.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=tiny.GLOBAL_BATCH, max_steps=tiny.SAVED_AT + 1,
        learning_rate=tiny.LR, lr_scheduler_type="constant", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, report_to=[], seed=0,
    )  # fmt: skip
    return phalanx.Trainer(
        tiny.tiny_model(), args, train_dataset=TensorDataset(x, y),
        compute_loss_func=lambda out, labels, num_items_in_batch=None: torch.nn.functional.mse_loss(out, labels),
    )  # fmt: skip


def test_trainer_resumes_a_transformers_checkpoint_written_under_deepspeed(written, tmp_path):
    trainer = _trainer(tmp_path / "out")
    seen: dict = {}

    class AtResume(phalanx.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            seen["step"] = state.global_step
            seen["weights"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            seen["optim"] = {
                n: {k: v.clone() for k, v in trainer.optimizer.state[p].items()}
                for n, p in trainer.model.named_parameters()
            }

    trainer.add_callback(AtResume)
    trainer.train(resume_from_checkpoint=str(written["hf_deepspeed"][0]))
    assert seen["step"] == tiny.SAVED_AT
    saved = load_file(str(DATA / "deepspeed_zero2.anchor" / "saved_params.safetensors"))  # DeepSpeed's own, gathered
    for n, value in saved.items():
        torch.testing.assert_close(seen["weights"][n], value, rtol=0, atol=0, msg=n)
    # the moments came along: the same as a direct engine.load_state of DeepSpeed's folder gives
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = tiny.tiny_model()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    engine.load_state(DATA / "deepspeed_zero2")
    for n, p in model.named_parameters():
        mine, theirs = opt.state[p], seen["optim"][n]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}, n
        for k in mine:
            torch.testing.assert_close(theirs[k], mine[k], rtol=0, atol=0, msg=f"{n} {k}")


def test_trainer_resumes_a_bare_deepspeed_folder_at_its_step(tmp_path):
    trainer = _trainer(tmp_path / "out")
    trainer.train(resume_from_checkpoint=str(DATA / "deepspeed_zero3"))  # no trainer_state.json: the step from it
    assert trainer.state.global_step == tiny.SAVED_AT + 1  # resumed at 2, then one step to max_steps
    assert trainer._train_loader.state_dict()["samples_done"] == (tiny.SAVED_AT + 1) * tiny.GLOBAL_BATCH


# ----------------------------------------------------------------------------------------- what is said once
def test_what_is_not_carried_over_is_said_once_with_the_fix(capfd):
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = tiny.tiny_model()
    opt = tiny.adamw(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = engine.prepare(model, opt, sched)
    capfd.readouterr()
    engine.load_state(DATA / "deepspeed_zero3")
    said = [line for line in capfd.readouterr().err.splitlines() if "Not carried over" in line]
    assert len(said) == 1, said
    assert "DeepSpeed saves no random generator state" in said[0]
    assert "LR scheduler" in said[0] and "last_epoch" in said[0]  # the schedule: what happens, and the fix
    assert engine.global_step == tiny.SAVED_AT


# -------------------------------------------------------------------------------------------------- mismatch
class _Wider(tiny.TinyNet):  # type: ignore[name-defined, misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 11)
        self.fc2 = torch.nn.Linear(11, 3)
        self.register_buffer("scale", torch.ones(11))


class _Renamed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)
        self.register_buffer("scale", torch.ones(10))


@pytest.mark.parametrize(
    ("model_cls", "named"),
    [(_Wider, "fc1.weight: shape [10, 6] in the checkpoint, [11, 6] in the model"),
     (_Renamed, "first.weight: not in the checkpoint")],
)  # fmt: skip
@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_a_checkpoint_that_does_not_match_names_the_parameter(model_cls, named, name):
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = model_cls()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="does not match") as e:
        engine.load_state(DATA / name)
    assert named in str(e.value)
    for n, p in model.named_parameters():  # checked before anything is loaded
        assert torch.equal(p, before[n]), n


def test_a_deepspeed_checkpoint_missing_a_rank_s_file_is_named(tmp_path):
    broken = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed_zero2", broken)
    (broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = tiny.tiny_model()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    with pytest.raises(CheckpointError, match="saved on 2 data-parallel ranks and holds 1 optimizer file"):
        engine.load_state(broken)


# --------------------------------------------------------------------------------------------------- payloads
class _Payload:
    """Unpickling this runs ``touch <marker>``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_a_dcp_metadata_payload_is_refused_and_does_not_run(written, tmp_path):
    marker = tmp_path / "ran"
    target = tmp_path / "dcp"
    shutil.copytree(written["fsdp2"][0], target)
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"refused: it names (posix|os|nt)\.system"):
        load_pickle(target / ".metadata")
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = tiny.tiny_model()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    with pytest.raises(CheckpointError, match="not one of the metadata classes"):
        engine.load_state(target)
    assert not marker.exists()
    # the genuine file is read by the same unpickler
    assert "model.fc1.weight" in load_pickle(written["fsdp2"][0] / ".metadata").state_dict_metadata


def test_a_deepspeed_file_payload_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    target = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed_zero2", target)
    bad = target / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match=r"weights_only=True.*refused|refused.*weights_only=True"):
        load_torch_file(bad)
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = tiny.tiny_model()
    model, opt = engine.prepare(model, tiny.adamw(model.parameters()))
    with pytest.raises(CheckpointError, match="was refused"):
        engine.load_state(target)
    assert not marker.exists()

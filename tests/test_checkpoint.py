"""Checkpoints: exact resume on the same world size, resharding across strategies and world sizes, crash safety,
no unpickling, consolidation, and clear errors for damaged or mismatched checkpoints.

Exact resume is bitwise (torch.equal) in fp32 and bf16 on the CPU; resharded runs continue within
rtol = atol = 1e-5 of the straight run, and their global sample order exactly.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _common import VOCAB, TiedNet, grouped_optimizer, make_data, make_tokens, pipe_loss, pipe_model
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
import phalanx.launch.cli
from phalanx.checkpoint import Checkpoint, CheckpointError, latest_checkpoint
from phalanx.launch import SpawnError

TOL = dict(rtol=1e-5, atol=1e-5)


class DropNet(TiedNet):
    """TiedNet (tied embedding, frozen layer, ModuleList) with dropout: resuming must restore every rank's RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.tanh(self.fc1(self.emb(tokens).mean(1))))
        x = self.frozen(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.proj(x))


class Indexed(Dataset):
    """Token windows that also yield their own index, so a run can record its global sample order."""

    def __init__(self, n: int) -> None:
        self.x, self.y = make_tokens(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Tally:
    """A user object registered for checkpointing: an int and a tensor in its state."""

    def __init__(self) -> None:
        self.count, self.hist = 0, torch.zeros(VOCAB)

    def update(self, y: torch.Tensor) -> None:
        self.count += 1
        self.hist += torch.bincount(y.cpu(), minlength=VOCAB).float()

    def state_dict(self) -> dict:
        return {"count": self.count, "hist": self.hist}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.hist = state["count"], state["hist"].clone()


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _setup(strategy: str, global_batch: int, n_samples: int, model_cls=DropNet, seed: int = 3, **options):
    engine = phalanx.Engine(strategy=strategy, seed=seed, **options)
    torch.manual_seed(100)
    model = model_cls()
    optimizer = grouped_optimizer("adamw", model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    loader = DataLoader(Indexed(n_samples), batch_size=global_batch // engine.world_size, shuffle=True)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    tally = Tally()
    engine.register_for_checkpointing(tally)
    return engine, model, loader, tally


def _train_until(
    engine, model, loader, tally, until: int, save_at: int | None = None, root: str = ""
) -> tuple[list[float], list[int]]:
    """Train until ``engine.global_step == until`` (stopping mid-epoch; a pass begun again would start the epoch
    over, so a run that goes on after saving saves inside the loop); losses and global sample ids."""
    losses, ids = [], []
    while engine.global_step < until:
        for idx, x, y in loader:
            loss = engine.train_step((x, y), _loss)
            tally.update(y)
            if engine.sync_gradients:
                losses.append(engine.reduce(loss, "mean").item())
            ids += engine.gather_for_metrics(idx).tolist()
            if engine.sync_gradients and engine.global_step == save_at:
                engine.save_state(root)
            if engine.global_step >= until:
                break
    return losses, ids


# ------------------------------------------------------------------------------- exact resume, same world
EXACT = [("ddp", {}), ("zero1", {}), ("zero2", {"precision": "bf16-mixed"}), ("zero3", {"grad_accum_steps": 2})]


def _straight_and_saved(root: str) -> dict:
    out = {}
    for strategy, options in EXACT:
        engine, model, loader, tally = _setup(strategy, 8, 44, **options)
        losses, ids = _train_until(engine, model, loader, tally, 20)
        out[strategy] = {"losses": losses, "ids": ids, "state": engine.get_state_dict(model), "count": tally.count}
        # Separately: 10 steps, then save (the process group ends with this process).
        engine, model, loader, tally = _setup(strategy, 8, 44, **options)
        _train_until(engine, model, loader, tally, 10)
        engine.save_state(f"{root}/{strategy}")
    return out


def _resumed(root: str) -> dict:
    out = {}
    for strategy, options in EXACT:
        engine, model, loader, tally = _setup(strategy, 8, 44, **options)
        engine.load_state(f"{root}/{strategy}")
        assert engine.global_step == 10
        losses, ids = _train_until(engine, model, loader, tally, 20)
        out[strategy] = {"losses": losses, "ids": ids, "state": engine.get_state_dict(model), "count": tally.count}
    return out


def test_resume_on_the_same_world_size_is_bitwise(run_ranks, tmp_path):
    """20 steps straight == 10 steps, save, a new process group, load, 10 more: parameters bitwise equal, for ddp
    and each zero stage (with dropout, a shuffled loader crossing an epoch, a scheduler, bf16, accumulation)."""
    straight = run_ranks(_straight_and_saved, 2, str(tmp_path))
    resumed = run_ranks(_resumed, 2, str(tmp_path))
    for rank in range(2):
        for strategy, _ in EXACT:
            a, b = straight[rank][strategy], resumed[rank][strategy]
            assert b["losses"] == a["losses"][10:], strategy
            assert b["ids"] == a["ids"][len(a["ids"]) - len(b["ids"]) :], strategy
            assert b["count"] == a["count"], strategy
            for k, v in a["state"].items():
                assert torch.equal(b["state"][k], v), f"{strategy}: {k} differs after resume"
    m = json.loads((tmp_path / "zero3" / "manifest.json").read_text())
    assert (m["world_size"], m["strategy"], m["counters"]["global_step"]) == (2, "zero3", 10)
    assert len(m["files"]) == 2  # each rank wrote its own shards


# ------------------------------------------------------------------------- resharding across world sizes
GLOBAL, SAMPLES = 12, 84  # 7 steps an epoch: the save at step 5 is mid-epoch, and the run crosses an epoch
BIG_SEED = 1_795_432_132  # a time.time() seed: the RNG reseeded on another mesh must not overflow


def _reshard_save(root: str) -> dict:
    engine, model, loader, tally = _setup("zero3", GLOBAL, SAMPLES, model_cls=TiedNet, seed=BIG_SEED)
    losses, ids = _train_until(engine, model, loader, tally, 10, save_at=5, root=root)
    return {"losses": losses, "ids": ids}


def _reshard_resume(root: str, strategy: str) -> dict:
    engine, model, loader, tally = _setup(strategy, GLOBAL, SAMPLES, model_cls=TiedNet, seed=BIG_SEED)
    engine.load_state(root)
    losses, ids = _train_until(engine, model, loader, tally, 10)
    return {"losses": losses, "ids": ids, "count": tally.count}


def test_resharding_zero3_on_4_ranks_to_ddp_zero2_zero1(run_ranks, tmp_path):
    straight = run_ranks(_reshard_save, 4, str(tmp_path / "ck"))[0]
    for strategy, world in (("ddp", 1), ("zero2", 3), ("zero1", 2)):
        res = run_ranks(_reshard_resume, world, str(tmp_path / "ck"), strategy)[0]
        torch.testing.assert_close(
            torch.tensor(res["losses"]),
            torch.tensor(straight["losses"][5:]),
            **TOL,
            msg=lambda m: f"{strategy} on {world}: {m}",  # noqa: B023 - called in this iteration
        )
        assert res["ids"] == straight["ids"][5 * GLOBAL :], f"{strategy} on {world}: the sample order did not continue"
        assert res["count"] == 10  # the registered object counted every step of the whole run


def _pipe_run(root: str, save: bool, strategy: str, options: dict) -> list[float]:
    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(100)
    model = pipe_model()
    optimizer = grouped_optimizer("adamw", model)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = make_data(10 * 8)
    if not save:
        engine.load_state(root)
    losses = []
    for step in range(engine.global_step, 10):
        loss = engine.train_step((x[step * 8 : (step + 1) * 8], y[step * 8 : (step + 1) * 8]), pipe_loss)
        losses.append(loss.item())
        if save and step == 4:
            engine.save_state(root)
    return losses


def test_pipeline_checkpoint_loads_under_other_splits_and_ddp(run_ranks, tmp_path):
    root = str(tmp_path / "pp")
    straight = run_ranks(_pipe_run, 2, root, True, "pipeline", {"pp_partition": "3", "pp_microbatches": 4})[0]
    zero1 = {"pp_size": 2, "pp_zero_stage": 1, "pp_microbatches": 4}
    for world, strategy, options in (
        (3, "pipeline", {"pp_partition": "2,6", "pp_microbatches": 2}),
        (1, "ddp", {}),
        (2, "zero2", {}),
        (4, "pipeline", {**zero1, "pp_partition": "5"}),  # each stage's optimizer state sharded over 2 replicas
    ):
        for res in run_ranks(_pipe_run, world, root, False, strategy, options):
            torch.testing.assert_close(
                torch.tensor(res),
                torch.tensor(straight[5:]),
                **TOL,
                msg=lambda m: f"{strategy} {options}: {m}",  # noqa: B023 - called in this iteration
            )
    # And the other way: saved with sharded stage optimizers, resumed with whole ones on another split.
    root = str(tmp_path / "pp-zero1")
    sharded = run_ranks(_pipe_run, 4, root, True, "pipeline", zero1)[0]
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(straight), **TOL)
    for res in run_ranks(_pipe_run, 3, root, False, "pipeline", {"pp_partition": "2,6", "pp_microbatches": 2}):
        torch.testing.assert_close(torch.tensor(res), torch.tensor(straight[5:]), **TOL)


# ------------------------------------------------------------------------------------- crash during a save
def _save_then_crash(root: str) -> None:
    import safetensors.torch

    engine, model, loader, tally = _setup("zero2", 8, 44)
    _train_until(engine, model, loader, tally, 3)
    engine.save_state(f"{root}/latest")
    engine.save_state(f"{root}/step-3")
    torch.save(engine.get_state_dict(model), f"{root}/expected-rank{engine.rank}.pt")  # the test's own file
    _train_until(engine, model, loader, tally, 5)  # (a new pass: it starts the epoch over, which does not matter here)
    if engine.rank == 1:
        real = safetensors.torch.save_file

        def dies_halfway(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
            real(tensors, filename, metadata)
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            os._exit(17)  # killed in the middle of the save

        safetensors.torch.save_file = dies_halfway
    engine.save_state(f"{root}/latest")  # over the good one
    engine.save_state(f"{root}/step-5")


def _load_after_crash(root: str) -> dict:
    engine, model, loader, tally = _setup("zero2", 8, 44)
    engine.load_state(f"{root}/latest")
    out = {"step": engine.global_step, "state": engine.get_state_dict(model)}
    try:
        engine.load_state(f"{root}/step-5")
        out["step5"] = "loaded"
    except CheckpointError as e:
        out["step5"] = str(e)
    return out


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(run_ranks, tmp_path):
    with pytest.raises(SpawnError, match="rank 1"):
        run_ranks(_save_then_crash, 2, str(tmp_path), timeout=120)
    # The interrupted save left only its staging directory, which is not a checkpoint.
    assert (tmp_path / ".latest.partial").exists() and not (tmp_path / ".latest.partial" / "manifest.json").exists()
    assert not (tmp_path / "step-5").exists()
    assert latest_checkpoint(tmp_path).name in ("latest", "step-3")
    for rank, res in enumerate(run_ranks(_load_after_crash, 2, str(tmp_path))):
        assert res["step"] == 3
        expected = torch.load(tmp_path / f"expected-rank{rank}.pt", weights_only=True)
        for k, v in expected.items():
            assert torch.equal(res["state"][k], v), k
        assert "does not exist" in res["step5"]
    (tmp_path / ".step-9.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"a save there did not finish \(.*\.step-9\.partial"):
        Checkpoint(tmp_path / "step-9")


# ------------------------------------------------------------------------------------------------ security
class _Payload:
    """Unpickling this writes a marker file: if the marker exists, a checkpoint load ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _save_small(root: str) -> None:
    engine, model, loader, tally = _setup("ddp", 8, 44)
    _train_until(engine, model, loader, tally, 2)
    engine.save_state(root)


def _load_small(root: str) -> str:
    engine, model, loader, tally = _setup("ddp", 8, 44)
    before = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    try:
        engine.load_state(root)
        return "loaded"
    except CheckpointError as e:
        after = engine.get_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed the model"
        return str(e)


def test_a_malicious_pickle_in_the_checkpoint_is_never_executed(run_ranks, tmp_path):
    root, marker = tmp_path / "ck", tmp_path / "marker"
    run_ranks(_save_small, 1, str(root))
    payload = pickle.dumps(_Payload(str(marker)))
    # Beside the real files (as pytorch_model.bin, optimizer.pt): ignored. In place of a shard: refused by its bytes.
    for name in ("pytorch_model.bin", "optimizer.pt", "rng_state.pth"):
        (root / name).write_bytes(payload)
    assert run_ranks(_load_small, 1, str(root))[0] == "loaded"
    shard = next(root.glob("shard-*.safetensors"))
    shard.write_bytes(payload)
    message = run_ranks(_load_small, 1, str(root))[0]
    assert "is a pickle" in message and shard.name in message
    torch.save({"x": torch.zeros(2)}, shard)  # a torch.save zip in its place
    assert "zip archive" in run_ranks(_load_small, 1, str(root))[0]
    for cmd in (["info", str(root)], ["consolidate", str(root), str(tmp_path / "out.safetensors")]):
        assert phalanx.launch.cli.main(["checkpoint", *cmd]) != 0  # the CLI refuses it too
    assert not marker.exists(), "unpickling ran the payload"


# --------------------------------------------------------------------------------------------- round trip
def _save_tied(root: str, model_dir: str) -> dict:
    engine, model, loader, tally = _setup("zero3", 8, 44)
    _train_until(engine, model, loader, tally, 3)
    engine.save_state(root)
    engine.save_model(model_dir)
    return engine.get_state_dict(model)


def test_consolidate_round_trips_against_the_unwrapped_state_dict(run_ranks, tmp_path, capsys):
    from safetensors.torch import load_file

    root, out = tmp_path / "ck", tmp_path / "model.safetensors"
    expected = run_ranks(_save_tied, 2, str(root), str(tmp_path / "export"))[0]
    assert phalanx.launch.cli.main(["checkpoint", "consolidate", str(root), str(out)]) == 0
    for path in (out, tmp_path / "export" / "model.safetensors"):
        model = DropNet()
        model.load_state_dict(load_file(path))  # strict: exactly the state_dict keys, the tied head included
        assert set(model.state_dict()) == set(expected) and "head.weight" in expected
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[k]), (path.name, k)
    assert phalanx.launch.cli.main(["checkpoint", "info", str(root)]) == 0
    info = capsys.readouterr().out
    assert "zero3 on world size 2" in info and "global_step=3" in info and "AdamW" in info


# ---------------------------------------------------------------------------------------------- bad input
def test_damaged_and_mismatched_checkpoints_get_clear_errors(run_ranks, tmp_path):
    import shutil

    root = tmp_path / "ck"
    run_ranks(_save_small, 2, str(root))
    files = sorted(root.glob("shard-*.safetensors"))
    assert len(files) == 2

    def damaged(change) -> str:  # type: ignore[no-untyped-def]
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root, copy)
        change(copy)
        return run_ranks(_load_small, 2, str(copy))[0]

    msg = damaged(lambda d: (d / files[1].name).unlink())
    assert files[1].name in msg and "is missing" in msg

    def flip(d: Path) -> None:
        data = bytearray((d / files[0].name).read_bytes())
        data[-5] ^= 0xFF  # inside the last tensor's bytes: the size is unchanged
        (d / files[0].name).write_bytes(bytes(data))

    msg = damaged(flip)
    assert "checksum mismatch" in msg and files[0].name in msg

    def version(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["version"] = 99
        (d / "manifest.json").write_text(json.dumps(m))

    msg = damaged(version)
    assert "format version 99" in msg and "manifest.json" in msg
    assert "is not a phalanx checkpoint" in run_ranks(_load_small, 1, str(tmp_path))[0]  # the parent directory
    assert "ck" in run_ranks(_load_small, 1, str(tmp_path))[0]  # ... and it names the checkpoints inside


def _load_into_other_model(root: str) -> str:
    class Wider(DropNet):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(7, 14)
            self.blocks[0] = nn.Linear(14, 13)
            self.extra = nn.Linear(2, 2)

    engine, model, loader, tally = _setup("zero1", 8, 44, model_cls=Wider)
    try:
        engine.load_state(root)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _save_inside_window() -> str:
    engine, model, loader, tally = _setup("ddp", 8, 44, grad_accum_steps=2)
    idx, x, y = next(iter(loader))
    engine.train_step((x, y), _loss)
    try:
        engine.save_state("/nonexistent/never-written")
    except RuntimeError as e:
        return str(e)
    return "saved"


def test_model_mismatch_and_misuse(run_ranks, tmp_path):
    root = tmp_path / "ck"
    run_ranks(_save_small, 2, str(root))
    msg = run_ranks(_load_into_other_model, 2, str(root))[0]
    assert "does not match" in msg
    assert "fc1.weight: shape [13, 7] in the checkpoint, [14, 7] in the model" in msg
    assert "extra.weight: missing from the checkpoint" in msg
    assert "inside an accumulation window" in run_ranks(_save_inside_window, 1)[0]
    with pytest.raises(SpawnError, match="register_for_checkpointing needs objects with state_dict"):
        run_ranks(_register_bad, 1)
    with pytest.raises(SpawnError, match="keep_last must be >= 1"):
        run_ranks(_keep_zero, 1, str(tmp_path / "k"))


def _register_bad() -> None:
    phalanx.Engine().register_for_checkpointing(object())


def _keep_zero(root: str) -> None:
    engine, model, loader, tally = _setup("ddp", 8, 44)
    engine.save_state(root, keep_last=0)


def _rotation(root: str) -> list[str]:
    engine, model, loader, tally = _setup("ddp", 8, 44)
    for step in range(1, 5):
        _train_until(engine, model, loader, tally, step)
        engine.save_state(f"{root}/step-{step}", keep_last=2)
    return sorted(os.listdir(root))


def test_keep_last_rotates_old_checkpoints(run_ranks, tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    run_ranks(_save_small, 1, str(tmp_path / "best"))  # a checkpoint named otherwise: not rotated either
    assert run_ranks(_rotation, 2, str(tmp_path))[0] == ["best", "notes", "step-3", "step-4"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(SpawnError, match="exists and is not a phalanx checkpoint"):
        run_ranks(_save_small, 1, str(tmp_path / "notes"))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# --------------------------------------------------------------- state that changes dtype or is shared
def _bf16_zero2_save(root: str) -> None:
    engine = phalanx.Engine(strategy="zero2", seed=0)
    torch.manual_seed(100)
    model = TiedNet().to(torch.bfloat16)
    model, optimizer = engine.prepare(model, grouped_optimizer("adamw", model))
    x, y = make_tokens(16)
    for _ in range(2):
        engine.backward(_loss(model, (x, y)))
        optimizer.step()
        optimizer.zero_grad()
    engine.save_state(root)


def _bf16_ddp_resume(root: str) -> dict:
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = TiedNet().to(torch.bfloat16)
    model, optimizer = engine.prepare(model, grouped_optimizer("adamw", model))
    engine.load_state(root)
    x, y = make_tokens(16)
    engine.backward(_loss(model, (x, y)))
    optimizer.step()  # fp32 moments from zero's masters must have become bf16, as the parameters
    state = optimizer.state[model.fc1.weight]
    return {"dtypes": sorted({str(v.dtype) for v in state.values()}), "step": float(state["step"])}


def test_zero_bf16_checkpoint_trains_on_under_ddp(run_ranks, tmp_path):
    run_ranks(_bf16_zero2_save, 2, str(tmp_path / "ck"))
    res = run_ranks(_bf16_ddp_resume, 1, str(tmp_path / "ck"))[0]
    assert res == {"dtypes": ["torch.bfloat16", "torch.float32"], "step": 3.0}  # moments bf16, step fp32


class _TiedPipe(nn.Sequential):
    """Blocks 0 and 2 share a weight (in one stage): it is saved once, and the state dict keeps both names."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 13), nn.Linear(13, 3))
        self[2].weight = self[0].weight


def _tied_pipe(root: str, load: bool) -> dict:
    engine = phalanx.Engine(strategy="pipeline", pp_partition="3", pp_microbatches=2, seed=0)
    torch.manual_seed(100 if not load else 5)
    model, optimizer = engine.prepare(_TiedPipe(), torch.optim.SGD(_TiedPipe().parameters(), lr=0.1))
    if load:
        engine.load_state(root)
    else:
        x, y = make_data(8)
        engine.train_step((x, y), pipe_loss)
        engine.save_state(root)
    return engine.get_state_dict(model)


def test_pipeline_stage_with_a_tied_weight_round_trips(run_ranks, tmp_path, capsys):
    from safetensors.torch import load_file

    saved = run_ranks(_tied_pipe, 2, str(tmp_path / "ck"), False)[0]
    loaded = run_ranks(_tied_pipe, 2, str(tmp_path / "ck"), True)[0]
    assert set(saved) == set(loaded) == {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert (
        phalanx.launch.cli.main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")])
        == 0
    )
    model = _TiedPipe()
    model.load_state_dict(load_file(tmp_path / "m.safetensors"))
    assert torch.equal(model[2].weight, saved["0.weight"])


def test_latest_checkpoint_sees_a_save_interrupted_between_its_renames(tmp_path):
    """Between the two renames of a save over an older checkpoint, only .NAME.old holds a complete checkpoint."""
    for name, saved_at in (("step-1", 1.0), (".step-2.old", 2.0), (".step-3.partial", 3.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(
            json.dumps({"format": "phalanx-checkpoint", "saved_at": saved_at})
        )
    assert latest_checkpoint(tmp_path) == tmp_path / ".step-2.old"  # never the staging directory
    with pytest.raises(CheckpointError, match=r"interrupted and the previous checkpoint is at .*\.step-2\.old"):
        Checkpoint(tmp_path / "step-2")
    (tmp_path / "step-2").mkdir()  # once NAME exists again, .NAME.old is a leftover and does not count
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"

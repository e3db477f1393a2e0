"""Nothing silent at the door: when two sources of a setting disagree, or a call cannot do what the user meant, phalanx
says so once, with the fix (issue: the front door). Each test is one row of what a new user ran into."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from _common import OddNet, make_data
from torch import nn

import phalanx
from phalanx.config.settings import ENV_CONFIG_JSON, resolve_config
from phalanx.launch import SpawnError


def test_an_engine_argument_overriding_the_launcher_is_reported():
    handed = json.dumps({"values": {"strategy": "zero3", "seed": 5}, "origins": {"strategy": "cli", "seed": "cli"}})
    env = {ENV_CONFIG_JSON: handed}
    cfg = resolve_config(env=env, cli={"strategy": "ddp", "seed": 5}, cli_origin="argument")
    assert cfg.engine.strategy == "ddp"  # the argument still wins, as documented
    assert len(cfg.overrides) == 1, cfg.overrides  # seed agrees: only strategy is reported
    line = cfg.overrides[0]
    assert "Engine(strategy='ddp')" in line and "strategy='zero3'" in line and "command line" in line

    file_cfg = resolve_config(env={"PHALANX_GRAD_ACCUM_STEPS": "4"}, cli={"grad_accum_steps": 2}, cli_origin="argument")
    assert any("PHALANX_GRAD_ACCUM_STEPS" in o for o in file_cfg.overrides)
    same = resolve_config(env=env, cli={"strategy": "zero3"}, cli_origin="argument")
    assert same.overrides == []


def test_the_engine_warns_once_about_the_override(monkeypatch, capsys):
    monkeypatch.setenv(ENV_CONFIG_JSON, json.dumps({"values": {"strategy": "zero2"}, "origins": {"strategy": "cli"}}))
    phalanx.Engine(strategy="ddp")
    err = capsys.readouterr().err
    assert err.count("overrides strategy='zero2'") == 1, err


def test_accumulation_setting_without_accumulate_warns(capsys):
    engine = phalanx.Engine(grad_accum_steps=2)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(3):
        engine.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    err = capsys.readouterr().err
    assert err.count("grad_accum_steps=2 (from argument) has no effect") == 1, err
    assert "engine.accumulate()" in err

    engine = phalanx.Engine(grad_accum_steps=2)  # the same loop inside accumulate(): no warning
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(4):
        with engine.accumulate():
            engine.backward(model(torch.randn(8, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    assert "has no effect" not in capsys.readouterr().err


def _backward_without_prepare() -> str:
    engine = phalanx.Engine()
    model = OddNet()
    x, y = make_data(8)
    try:
        engine.backward(F.mse_loss(model(x), y))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _backward_beside_an_unprepared_model(strategy: str, accum: int) -> tuple[float, float]:
    # Accelerate's test_sync: engine.backward on a prepared model and on a plain one, each rank with its own data.
    engine = phalanx.Engine(strategy=strategy, grad_accum_steps=accum)
    rank, world = engine.process_index, engine.num_processes
    torch.manual_seed(0)
    plain = OddNet()
    prepared, reference, everyone = (copy.deepcopy(plain) for _ in range(3))
    prepared, _ = engine.prepare(prepared, torch.optim.SGD(prepared.parameters(), lr=0.1))
    x, y = make_data(8 * world)
    mine = slice(8 * rank, 8 * rank + 8)
    for _ in range(accum):
        with engine.accumulate(prepared):
            engine.backward(F.mse_loss(plain(x[mine]), y[mine]))
            engine.backward(F.mse_loss(prepared(x[mine]), y[mine]))
    F.mse_loss(reference(x[mine]), y[mine]).backward()  # this rank's data, once
    F.mse_loss(everyone(x), y).backward()  # every rank's data
    # The plain model keeps its own gradients (the window's micro-batches add up to one batch's, as in Accelerate);
    # the prepared one holds the mean over the ranks.
    off_plain = max((p.grad - r.grad).abs().max().item() for p, r in zip(plain.parameters(), reference.parameters()))
    mean = [p.grad for p in everyone.parameters()]
    off_mean = max((p.grad - m).abs().max().item() for p, m in zip(engine.unwrap_model(prepared).parameters(), mean))
    return off_plain, off_mean


@pytest.mark.parametrize("accum", [1, 2])
def test_backward_on_a_model_that_was_not_prepared_gives_its_plain_gradients(run_ranks, accum):
    for off_plain, off_mean in run_ranks(_backward_beside_an_unprepared_model, 2, "ddp", accum):
        assert off_plain < 1e-6, off_plain  # it used to be divided by the world size (2)
        assert off_mean < 1e-6, off_mean


def test_backward_on_an_unprepared_model_on_two_ranks_is_refused(run_ranks):
    for message in run_ranks(_backward_without_prepare, 2):
        assert "no model was passed to engine.prepare" in message and "diverge" in message, message


def test_backward_on_one_process_without_prepare_still_works():
    engine = phalanx.Engine()
    model = nn.Linear(3, 1)
    engine.backward(model(torch.ones(2, 3)).sum())
    assert model.weight.grad is not None


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_meta_built_model_is_initialised_by_prepare_and_its_optimizer_steps_it(strategy):
    """Once refused with an error; now prepare gives a meta-built model the values of a normal build (see
    tests/test_deferred_init.py), and an optimizer built on the meta parameters steps the real ones."""
    runs = []
    for meta in (True, False):
        engine = phalanx.Engine(strategy=strategy)
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        start = engine.get_state_dict(model)
        engine.backward(model(torch.ones(3, 4)).square().sum())
        optimizer.step()
        runs.append((start, engine.get_state_dict(model)))
    (meta_start, meta_end), (start, end) = runs
    assert all(torch.equal(meta_start[k], start[k]) for k in start)
    assert all(torch.equal(meta_end[k], end[k]) for k in end)
    assert not torch.equal(meta_end["0.weight"], meta_start["0.weight"])


def _scheduler_before_prepare(strategy: str) -> dict:
    engine = phalanx.Engine(strategy=strategy)
    torch.manual_seed(0)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # built before prepare
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    x, y = make_data(8, seed=engine.rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            engine.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return {"warnings": [str(w.message) for w in caught], "lr": optimizer.param_groups[0]["lr"]}


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_no_spurious_scheduler_warning_from_our_optimizer_wrapping(run_ranks, strategy):
    for out in run_ranks(_scheduler_before_prepare, 2, strategy):
        assert not [w for w in out["warnings"] if "has been overridden" in w], out["warnings"]
        assert out["lr"] == pytest.approx(1.0 * 0.5**3)  # the scheduler still counts each real step


def test_spawn_names_the_rank_that_died(run_ranks):
    with pytest.raises(SpawnError, match="rank 1 exited with code 3"):
        run_ranks(_die_on_rank_1, 2)


def _die_on_rank_1() -> None:
    import os
    import time

    engine = phalanx.Engine()
    if engine.rank == 1:
        os._exit(3)
    time.sleep(0.5)
    engine.wait()  # rank 0 fails here once rank 1 is gone; rank 1 is the one to name


# ------------------------------------------------------------------------------ saving a zero3 model, and save_model
def _zero3_saves(root: str) -> dict:
    import os

    from _common import TiedNet, grouped_optimizer, make_tokens

    engine = phalanx.Engine(strategy="zero3")
    torch.manual_seed(100)
    model = TiedNet()
    model, optimizer = engine.prepare(model, grouped_optimizer("adamw", model))
    x, y = make_tokens(8, seed=engine.rank)
    engine.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    unwrapped = engine.unwrap_model(model)
    out: dict = {"refused": []}
    for what in (unwrapped, unwrapped.blocks[0]):  # the model, and a module inside it
        try:
            what.state_dict()
        except RuntimeError as e:
            out["refused"].append(str(e))
    if engine.is_main_process:  # as a save on the main process alone would: refused, without a hang
        try:
            torch.save(unwrapped.state_dict(), os.path.join(root, "main-only.pt"))
        except RuntimeError as e:
            out["main_only"] = str(e)
    out["full"] = engine.get_state_dict(model)  # these still work, on every rank
    engine.save_state(os.path.join(root, "ck"))
    engine.load_state(os.path.join(root, "ck"))
    engine.save_model(model, os.path.join(root, "export"))
    return out


def test_zero3_state_dict_of_the_unwrapped_model_is_refused_with_the_fix(run_ranks, tmp_path):
    from _common import TiedNet
    from safetensors.torch import load_file

    results = run_ranks(_zero3_saves, 2, str(tmp_path))
    shapes = {k: v.shape for k, v in TiedNet().state_dict().items()}
    exported = load_file(tmp_path / "export" / "model.safetensors")
    for rank, out in enumerate(results):
        assert len(out["refused"]) == 2, out["refused"]
        for message in out["refused"]:
            assert "strategy='zero3' would hold empty tensors" in message
            assert "engine.save_model(model, save_directory)" in message and "engine.get_state_dict(model)" in message
        assert "TiedNet.state_dict()" in out["refused"][0] and "Linear.state_dict()" in out["refused"][1]
        assert ("main_only" in out) == (rank == 0)
        assert {k: v.shape for k, v in out["full"].items()} == shapes  # whole tensors, every key
        for k, v in exported.items():
            torch.testing.assert_close(v, out["full"][k])
    assert not (tmp_path / "main-only.pt").exists()


class _Config:
    """A config object as transformers' PretrainedConfig is one, for a model that is not a transformers model."""

    def __init__(self, width: int) -> None:
        self.width = width

    def save_pretrained(self, directory) -> None:  # type: ignore[no-untyped-def]
        (directory / "config.json").write_text(json.dumps({"width": self.width}))


def _save_model_dir(strategy: str, root: str, with_config: bool) -> dict:
    from pathlib import Path

    from _common import TiedNet, make_tokens

    engine = phalanx.Engine(strategy=strategy)
    torch.manual_seed(100)
    model = TiedNet()
    if with_config:
        model.config = _Config(7)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_tokens(8, seed=engine.rank)
    engine.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    path = engine.save_model(Path(root), metadata={"note": "trained"})
    return {"path": str(path), "full": engine.get_state_dict(model)}


@pytest.mark.parametrize("strategy,with_config", [("ddp", True), ("zero3", True), ("zero3", False)])
def test_save_model_writes_a_directory_that_loads_back(run_ranks, tmp_path, strategy, with_config):
    from _common import TiedNet
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = run_ranks(_save_model_dir, 2, strategy, str(tmp_path), with_config)[0]
    assert out["path"] == str(tmp_path / "model.safetensors")
    with safe_open(out["path"], "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "trained"}
    full = out["full"]
    assert full["head.weight"].data_ptr() == full["emb.weight"].data_ptr()  # tied keys share one tensor
    model = TiedNet()
    model.load_state_dict(load_file(out["path"]))  # strict: every state_dict key, the tied head included
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, out["full"][k])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"][not with_config :]
    if with_config:
        assert json.loads((tmp_path / "config.json").read_text()) == {"width": 7}


# --------------------------------------------------------------------- transformers (when importable)
def _gpt2_saves(strategy: str, root: str) -> dict:
    from pathlib import Path

    from transformers import GPT2Config, GPT2LMHeadModel

    engine = phalanx.Engine(strategy=strategy)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16))
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(engine.rank))
    engine.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    unwrapped, out = engine.unwrap_model(model), {"refused": None}
    if engine.is_main_process:  # typical HF code: save_pretrained on the main process only
        try:
            unwrapped.save_pretrained(Path(root, "main-only"))
        except RuntimeError as e:
            out["refused"] = str(e)
    engine.save_model(model, Path(root, "ours"))
    out["state"] = state = engine.get_state_dict(model)
    # Accelerate's documented way, which works under every strategy: the gathered state dict, on every rank.
    unwrapped.save_pretrained(Path(root, "hf-way"), state_dict=dict(state), is_main_process=engine.is_main_process)
    engine.wait_for_everyone()
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_save_model_of_a_transformers_model_is_what_from_pretrained_expects(run_ranks, tmp_path, strategy):
    pytest.importorskip("transformers", reason="transformers is not installed (the check runs where it is)")
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    out = run_ranks(_gpt2_saves, 2, strategy, str(tmp_path))[0]
    # The oracle: transformers' own save_pretrained of the same weights, in one process.
    reference = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16))
    reference.load_state_dict(out["state"])
    reference.save_pretrained(tmp_path / "reference")
    reference.eval()  # no dropout: the logits below are compared

    def contents(directory) -> tuple:  # type: ignore[no-untyped-def]
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open handle, not a dict
            metadata = f.metadata()
        return sorted(p.name for p in directory.iterdir()), metadata, tensors

    files, metadata, tensors = contents(tmp_path / "reference")
    assert "lm_head.weight" not in tensors and "transformer.wte.weight" in tensors  # the tied head is dropped
    for name in ("ours", "hf-way"):
        ours_files, ours_metadata, ours_tensors = contents(tmp_path / name)
        assert (ours_files, ours_metadata) == (files, metadata), name
        assert ours_tensors.keys() == tensors.keys(), name
        torch.testing.assert_close(ours_tensors, tensors, rtol=0, atol=0)
        loaded, info = GPT2LMHeadModel.from_pretrained(tmp_path / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        ids = torch.arange(8).reshape(1, 8)
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)
    if strategy == "zero3":
        assert "engine.save_model(model, save_directory)" in out["refused"], out["refused"]
        assert not (tmp_path / "main-only" / "model.safetensors").exists()
    else:
        assert out["refused"] is None


def _clipped_run(max_grad_norm: float | None, clip_by_hand: float | None) -> dict[str, torch.Tensor]:
    engine = phalanx.Engine(max_grad_norm=max_grad_norm)
    torch.manual_seed(0)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = make_data(16)
    for _ in range(3):
        engine.backward(F.mse_loss(model(x), y) * 100)  # large gradients, so that clipping matters
        if clip_by_hand is not None:
            engine.clip_grad_norm_(clip_by_hand)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in engine.get_state_dict(model).items()}


def test_max_grad_norm_is_honoured_in_a_hand_written_loop():
    # DeepSpeed's gradient_clipping maps to max_grad_norm; a loop that never calls clip_grad_norm_ must still clip.
    by_setting = _clipped_run(max_grad_norm=0.1, clip_by_hand=None)
    by_hand = _clipped_run(max_grad_norm=None, clip_by_hand=0.1)
    unclipped = _clipped_run(max_grad_norm=None, clip_by_hand=None)
    assert all(torch.equal(by_setting[k], by_hand[k]) for k in by_hand)
    assert any(not torch.equal(by_setting[k], unclipped[k]) for k in by_hand)
    # A script that clips itself is not clipped twice: its own (larger) bound is the one applied.
    both = _clipped_run(max_grad_norm=0.1, clip_by_hand=5.0)
    own = _clipped_run(max_grad_norm=None, clip_by_hand=5.0)
    assert all(torch.equal(both[k], own[k]) for k in own)
    assert any(not torch.equal(both[k], by_hand[k]) for k in own)


def _leave_quietly_on_rank_1() -> int:
    import os

    if int(os.environ["RANK"]) == 1:
        os._exit(0)  # a clean exit code, but no result
    return 0


def test_spawn_names_a_rank_that_exits_cleanly_without_a_result(run_ranks):
    with pytest.raises(SpawnError, match="rank 1 exited with code 0 before returning a result"):
        run_ranks(_leave_quietly_on_rank_1, 2)

"""engine.load_model: weights only, from a phalanx checkpoint, a .safetensors file or a save_model /
save_pretrained directory, into a prepared model under ddp, zero3 and pipeline; the optimizer, the scheduler and
the counters stay as they are. Compared exactly (bitwise) with the saved weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from _common import TiedNet, make_tokens, pipe_model

import phalanx
from phalanx.checkpoint.format import CheckpointError


def _train(engine: phalanx.Engine, model, optimizer, steps: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    x, y = make_tokens(4 * steps, seed)
    for s in range(steps):
        xb, yb = x[4 * s : 4 * s + 4], y[4 * s : 4 * s + 4]
        engine.backward(F.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()


def _ranks_load(strategy: str, source: str, directory: str) -> tuple[bool, bool, int, float]:
    """Train 3 steps, save (as a checkpoint or as weights), train 3 more, load the weights back."""
    engine = phalanx.Engine(strategy=strategy, seed=0)
    torch.manual_seed(100)
    net = TiedNet()
    model, optimizer = engine.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    _train(engine, model, optimizer, 3, seed=1)
    saved = engine.get_state_dict(model)
    target = Path(directory)
    if source == "checkpoint":
        engine.save_state(target / "ck")
        path = target / "ck"
    else:
        engine.save_model(target / "model")
        path = target / "model" if source == "directory" else target / "model" / "model.safetensors"
    _train(engine, model, optimizer, 3, seed=2)
    moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    engine.load_model(path)
    loaded = engine.get_state_dict(model)
    same = all(torch.equal(loaded[k], v) for k, v in saved.items())
    kept = all(torch.equal(optimizer.state_dict()["state"][k]["exp_avg"], v) for k, v in moments.items())
    # Training goes on from the loaded weights (the tied head included).
    _train(engine, model, optimizer, 1, seed=3)
    return same, kept, engine.global_step, float(loaded["head.weight"].sum())


@pytest.mark.parametrize("strategy,world", [("ddp", 2), ("zero3", 2), ("zero2", 3)])
@pytest.mark.parametrize("source", ["checkpoint", "directory", "file"])
def test_load_model_restores_weights_only(run_ranks, tmp_path, strategy, world, source):
    results = run_ranks(_ranks_load, world, strategy, source, str(tmp_path))
    for same, kept, step, _ in results:
        assert same, "the loaded weights differ from the saved ones"
        assert kept, "load_model touched the optimizer state"
        assert step == 7  # 3 + 3 + 1 optimizer steps: the counter is not rewound
    assert len({r[3] for r in results}) == 1


def _ranks_pipeline_load(path: str) -> bool:
    engine = phalanx.Engine(strategy="pipeline", pp_size=2, seed=0)
    torch.manual_seed(7)
    model = engine.prepare(pipe_model())
    engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.load_model(path)
    got = engine.get_state_dict(model)
    want = safetensors.torch.load_file(path)
    return all(torch.equal(got[k], v) for k, v in want.items()) and set(got) == set(want)


def test_load_model_under_pipeline_from_a_safetensors_file(run_ranks, tmp_path):
    torch.manual_seed(11)
    source = pipe_model()
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    assert all(run_ranks(_ranks_pipeline_load, 2, str(path)))


def test_a_tied_weight_may_be_stored_under_its_second_name(tmp_path):
    """transformers keeps one name of a tied pair (the head's, for some models): either name fills both."""
    torch.manual_seed(3)
    source = TiedNet()
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "emb.weight"}
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    engine = phalanx.Engine(seed=0)
    torch.manual_seed(4)
    model = engine.prepare(TiedNet())
    engine.load_model(tmp_path)
    assert torch.equal(model.emb.weight, source.emb.weight)
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta-built"])
def test_load_model_of_a_transformers_directory_under_zero3(run_ranks, tmp_path, meta):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    results = run_ranks(_ranks_hf_load, 2, str(tmp_path / "hf"), meta)
    assert all(results)


def _ranks_hf_load(path: str, meta: bool) -> bool:
    import transformers

    want = transformers.GPT2LMHeadModel.from_pretrained(path)
    engine = phalanx.Engine(strategy="zero3", seed=0)
    torch.manual_seed(6)
    if meta:  # nothing allocated until zero3 lays each unit out; Conv1D has no reset_parameters: loaded below
        with phalanx.init_empty_weights():
            net = transformers.GPT2LMHeadModel(want.config)
    else:
        net = transformers.GPT2LMHeadModel(want.config)
    model = engine.prepare(net)
    engine.prepare(torch.optim.AdamW(model.parameters()))
    engine.load_model(path)
    got = engine.get_state_dict(model)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        same_logits = torch.equal(model(ids).logits, want(ids).logits)
    return same_logits and all(torch.equal(got[k], v) for k, v in want.state_dict().items())


def test_mismatches_and_pickles_are_refused_before_anything_is_loaded(tmp_path):
    engine = phalanx.Engine(seed=0)
    torch.manual_seed(8)
    model = engine.prepare(TiedNet())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["proj.bias"] = torch.zeros(5)
    bad["extra.weight"] = torch.zeros(2)
    safetensors.torch.save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError) as err:
        engine.load_model(tmp_path / "bad.safetensors")
    msg = str(err.value)
    assert "proj.bias: shape [5] in the file" in msg and "extra.weight: in the file, not in the model" in msg
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin, a pickle .* never loads"):
        engine.load_model(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_model(tmp_path / "nowhere")
    partial = {k: v for k, v in bad.items() if k.startswith("blocks")}
    safetensors.torch.save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match="emb.weight: not in the file"):
        engine.load_model(tmp_path / "partial.safetensors")

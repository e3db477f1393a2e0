"""README promises that the rest of the suite did not hold: each test here failed when the promise was broken
in the code (a mutation review found green runs hiding real bugs), and passes on correct code.

- ``engine.backward(loss_sum, items=n)`` outside an accumulation window divides by the item count over all ranks,
  under every strategy (zero2/zero3 apply that factor after the reduce-scatter, not to the loss).
- fp16: an overflow in ONE element of ONE rank's gradient skips the step on every rank, with zero sharding
  (the element lies in one rank's slice only) and with pipeline stages (each stage holds its own gradients).
- ``load_state(verify=True)`` checks every file's checksums, the ranks sharing the reading: damage in the last
  shard file is an error on every rank, and nothing is loaded.
- The global sample order comes from ``seed + epoch`` only, for every epoch: the expected order is written out
  here with torch primitives, not taken from phalanx's sampler.

Only the public API is used (phalanx.Engine, spawn, checkpoint; engine.precision.loss_scale as test_zero.py and
test_pipeline.py read it) and tests/_common.py, so that the tests survive modules moving inside phalanx.
Tolerance: parameters within rtol = atol = 1e-5 of plain single-process torch in fp32 (as in test_zero.py).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _common import OddNet, make_data, make_optimizer
from torch.utils.data import DataLoader, TensorDataset

import phalanx

TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- summed loss outside a window
SPLITS = [(3, 7), (8, 1), (2, 5), (6, 6)]  # rows of rank 0 and rank 1 at each step: the item counts differ


def _sum_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()


def _summed_loss_runs(strategies: tuple[str, ...]) -> dict:
    x_all, y_all = make_data(sum(a + b for a, b in SPLITS))
    out = {}
    for strategy in strategies:
        engine = phalanx.Engine(strategy=strategy, seed=0)  # grad_accum_steps=1: no accumulation window
        torch.manual_seed(100)
        model = OddNet()
        optimizer = make_optimizer("sgd", model.parameters())
        model, optimizer = engine.prepare(model, optimizer)
        start = 0
        for split in SPLITS:
            lo = start + sum(split[: engine.rank])
            n_local = split[engine.rank]
            x, y = x_all[lo : lo + n_local], y_all[lo : lo + n_local]
            engine.backward(_sum_loss(model, x, y), items=n_local)
            optimizer.step()
            optimizer.zero_grad()
            start += sum(split)
        out[strategy] = engine.get_state_dict(model)
    return out


def _summed_loss_reference() -> dict:
    """Plain torch on the whole batch of each step: loss = the sum over every row / the number of rows."""
    x_all, y_all = make_data(sum(a + b for a, b in SPLITS))
    torch.manual_seed(100)
    model = OddNet()
    optimizer = make_optimizer("sgd", model.parameters())
    start = 0
    for split in SPLITS:
        n = sum(split)
        loss = _sum_loss(model, x_all[start : start + n], y_all[start : start + n]) / n
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        start += n
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_summed_loss_with_items_outside_a_window_matches_single_process(run_ranks):
    """2 ranks with different item counts, backward(loss_sum, items=n_local) without accumulate, SGD: after each
    step the parameters are those of torch on the full batch with loss = total sum / total items."""
    strategies = ("ddp", "zero1", "zero2", "zero3")
    ref = _summed_loss_reference()
    wrong = []
    for rank, per_rank in enumerate(run_ranks(_summed_loss_runs, 2, strategies)):
        for strategy, state in per_rank.items():
            bad = []
            for k in ref:
                try:
                    torch.testing.assert_close(state[k], ref[k], **TOL)
                except AssertionError:
                    bad.append(((state[k] - ref[k]).abs().max().item(), k))
            if bad:
                diff, k = max(bad)
                wrong.append(f"{strategy} rank {rank}: {len(bad)} tensors, max |diff| {diff:.3g} in {k}")
    assert not wrong, "parameters differ from torch on the whole batch: " + "; ".join(wrong)


# ------------------------------------------------------------------------ fp16: one inf on one rank
def _poison_hook(flag: dict, index: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not flag["armed"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad

    return hook


def _fp16_zero_one_inf(strategy: str, index: int) -> dict:
    """One parameter only, so that its flat segment is it plus padding at the end: element 0 lies in rank 0's
    slice of the reduced gradient, element -1 in the last rank's. Only rank 1 poisons its local gradient."""
    engine = phalanx.Engine(strategy=strategy, precision="fp16-mixed", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4, bias=False)
    flag = {"armed": False}
    if engine.rank == 1:
        model.weight.register_hook(_poison_hook(flag, index))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    x = torch.linspace(-0.1, 0.1, 3 * 6).reshape(3, 6) + 0.01 * engine.rank
    y = torch.zeros(3, 4)

    def step() -> None:
        engine.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    return _clean_then_poisoned(engine, model, flag, step)


def _fp16_pipeline_one_inf(poisoned_rank: int, index: int) -> dict:
    """Two stages (block 0 on rank 0, blocks 1-2 on rank 1); one element of one gradient of one stage is inf."""
    engine = phalanx.Engine(strategy="pipeline", precision="fp16-mixed", pp_partition="1", pp_microbatches=2, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    flag = {"armed": False}
    target = model[0].weight if poisoned_rank == 0 else model[2].weight  # a parameter of that rank's own stage
    if engine.rank == poisoned_rank:
        target.register_hook(_poison_hook(flag, index))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    batch = (torch.linspace(-0.1, 0.1, 4 * 6).reshape(4, 6), torch.zeros(4, 4))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    return _clean_then_poisoned(engine, model, flag, lambda: engine.train_step(batch, loss_fn))


def _clean_then_poisoned(engine, model, flag: dict, step) -> dict:  # type: ignore[no-untyped-def]
    """A clean step (it must really step, so that the skip after it is the poison's doing), then a poisoned one."""
    step()
    clean_skipped = engine.step_was_skipped
    before, scale_before = engine.get_state_dict(model), engine.precision.loss_scale
    flag["armed"] = True
    step()
    after = engine.get_state_dict(model)
    return {
        "clean_skipped": clean_skipped,
        "skipped": engine.step_was_skipped,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scale_before": scale_before,
        "scale_after": engine.precision.loss_scale,
    }


def _skip_problems(results: list[dict], where: str) -> list[str]:
    """What went wrong in one case (empty: every rank skipped, kept its parameters and halved its loss scale)."""
    problems = []
    for rank, res in enumerate(results):
        if res["clean_skipped"]:
            problems.append(f"{where}: the clean step was skipped on rank {rank} (the case proves nothing)")
        if not res["skipped"]:
            problems.append(f"{where}: rank {rank} did not skip the step")
        if not res["unchanged"]:
            problems.append(f"{where}: parameters changed (seen on rank {rank})")
        if res["scale_after"] != res["scale_before"] / 2:
            problems.append(f"{where}: rank {rank}'s loss scale went {res['scale_before']} -> {res['scale_after']}")
    if len({res["scale_after"] for res in results}) != 1:
        problems.append(f"{where}: the ranks' loss scales differ")
    return problems


ZERO_CASES = [(s, index) for s in ("zero2", "zero3") for index in (0, -1)]  # -1: in rank 1's slice


def _fp16_cases() -> dict:
    out = {}
    for strategy, index in ZERO_CASES:
        out[f"{strategy}, inf in rank {index % 2}'s slice"] = _fp16_zero_one_inf(strategy, index)
    for poisoned in (0, 1):
        out[f"pipeline, inf in stage {poisoned}"] = _fp16_pipeline_one_inf(poisoned, 3)
    return out


def test_fp16_inf_in_one_element_on_one_rank_skips_every_rank(run_ranks):
    """2 ranks. zero2 and zero3: rank 1 alone puts an inf in its gradient, at an element that the reduce-scatter
    gives to rank 0's slice, then at one in rank 1's slice. pipeline (2 stages): one element of one parameter's
    gradient is inf on stage 0, then on stage 1. (The cases share one spawn to keep the file fast.)"""
    results = run_ranks(_fp16_cases, 2, timeout=120)
    assert len(results[0]) == 6
    problems = [p for case in results[0] for p in _skip_problems([res[case] for res in results], case)]
    assert not problems, "an inf in one rank's gradient must skip the step on every rank: " + "; ".join(problems)


# ------------------------------------------------------------------ checksums of the last shard file
def _ckpt_setup(seed: int):
    engine = phalanx.Engine(strategy="zero2", seed=0)
    torch.manual_seed(seed)
    model = OddNet()
    optimizer = make_optimizer("adamw", model.parameters())
    model, optimizer = engine.prepare(model, optimizer)
    return engine, model, optimizer


def _ckpt_save_damage_load(root: str) -> dict:
    engine, model, optimizer = _ckpt_setup(100)
    x, y = make_data(12)
    for _ in range(2):
        engine.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    engine.save_state(root)
    files = sorted(Path(root).glob("shard-*.safetensors"))
    if engine.rank == 0:
        _flip_a_byte_inside_a_tensor(files[-1])
    engine.wait()
    return {"files": [f.name for f in files], **_ckpt_load(root)}


def _ckpt_load(root: str) -> dict:
    engine, model, _ = _ckpt_setup(5)  # not the saved weights: a load that went through would change them
    before = engine.get_state_dict(model)
    try:
        engine.load_state(root)
        error = None
    except phalanx.checkpoint.CheckpointError as e:
        error = str(e)
    after = engine.get_state_dict(model)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def _flip_a_byte_inside_a_tensor(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor's data (read from the safetensors header): same size."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    a, b = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda ab: ab[1] - ab[0])
    assert b > a
    data[8 + header_len + (a + b) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damage_in_the_last_shard_file_fails_the_load_on_every_rank(run_ranks, tmp_path):
    """Saved by zero2 on 2 ranks (2 shard files), then a byte inside a tensor of the last file flipped, and loaded
    on 2 ranks, each verifying its share (rank 1 the last file): every rank raises, naming the file and the
    checksum, and no rank's model changed."""
    results = run_ranks(_ckpt_save_damage_load, 2, str(tmp_path / "ck"), timeout=90)
    files = results[0]["files"]
    assert len(files) == 2
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank}: a checkpoint with a damaged {files[-1]} loaded"
        assert files[-1] in res["error"] and "checksum" in res["error"], f"rank {rank}: {res['error']}"
        assert res["unchanged"], f"rank {rank}: the failed load changed the model"


# ---------------------------------------------------------------------------------- data order per epoch
N_SAMPLES, GLOBAL_BATCH, SEED, EPOCHS = 23, 6, 7, 3


def _ids_per_epoch() -> list[list[list[int]]]:
    engine = phalanx.Engine(strategy="ddp", seed=SEED)
    ids = TensorDataset(torch.arange(N_SAMPLES))
    loader = engine.prepare(DataLoader(ids, batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True))
    return [[ids.tolist() for (ids,) in loader] for _ in range(EPOCHS)]  # set_epoch happens by itself


def _expected_global_batches(epoch: int, world: int) -> list[list[int]]:
    """The README's rule, written out: a permutation drawn from a generator seeded with seed + epoch; global batch
    b is order[b*G:(b+1)*G]; a short last batch is padded to a multiple of the world size from the order's start."""
    order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    batches = []
    for b in range(math.ceil(N_SAMPLES / GLOBAL_BATCH)):
        chunk = order[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH]
        need = -len(chunk) % world
        batches.append(chunk + order[:need])
    return batches


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_epoch_order_comes_from_seed_plus_epoch(run_ranks, world_size):
    per_rank = run_ranks(_ids_per_epoch, world_size)
    for epoch in range(EPOCHS):
        got = [sum((per_rank[r][epoch][b] for r in range(world_size)), []) for b in range(len(per_rank[0][epoch]))]
        assert got == _expected_global_batches(epoch, world_size), f"epoch {epoch} on {world_size} rank(s)"
    assert _expected_global_batches(1, 1) != _expected_global_batches(0, 1)  # epochs really differ

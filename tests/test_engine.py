"""Engine semantics across world sizes: accumulation, token normalisation, scheduler, metrics, sampler, fp16."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _common import Indices, OddNet, global_order, make_data, reference_run
from torch.utils.data import DataLoader, TensorDataset

import phalanx

TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- accumulation
def _accumulate(accum: int, micro_batch: int, steps: int) -> dict:
    engine = phalanx.Engine(grad_accum_steps=accum, seed=3)
    torch.manual_seed(100)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(steps * micro_batch * accum * engine.world_size)
    loader = DataLoader(TensorDataset(x, y), batch_size=micro_batch, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    optimizer_steps = 0
    for xb, yb in loader:
        with engine.accumulate():
            engine.backward(F.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            optimizer_steps += engine.sync_gradients
    return {"state": engine.get_state_dict(model), "steps": optimizer_steps}


def test_accumulation_split_does_not_change_the_result(run_ranks):
    """Global batch 16 per optimizer step as accum 4 x 1 rank, accum 2 x 2 ranks, accum 1 x 4 ranks.

    Each split matches the others, and every one matches plain single-process torch taking the 6 global
    batches of 16 whole, in the documented order of seed 3 (rtol = atol = 1e-5). Without the torch reference a
    fault common to all three (accum 4 x 1 rank is phalanx too) would pass."""
    runs = {(accum, world): run_ranks(_accumulate, world, accum, 4, 6) for accum, world in [(4, 1), (2, 2), (1, 4)]}
    _, ref_state = reference_run(OddNet, steps=6, global_batch=16, opt="sgd", init_seed=100, data_seed=3)
    base = runs[(4, 1)][0]
    assert base["steps"] == 6
    for key, results in runs.items():
        for res in results:
            assert res["steps"] == 6, key
            for k in base["state"]:
                torch.testing.assert_close(res["state"][k], base["state"][k], **TOL, msg=f"{k} for accum,world={key}")
            assert set(res["state"]) == set(ref_state)
            for k in ref_state:
                torch.testing.assert_close(
                    res["state"][k], ref_state[k], **TOL, msg=f"{k} for accum,world={key} vs torch"
                )


# ------------------------------------------------------------------------- token normalisation
VOCAB, DIM = 11, 8


class _TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))


def _sequences() -> list[torch.Tensor]:
    """Eight sequences of very different lengths, so per-sequence means differ from the token mean."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 17, 5, 30, 2, 9, 21, 4)]


def _token_loss_sum(model: torch.nn.Module, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    loss = sum(F.cross_entropy(model(s[:-1]), s[1:], reduction="sum") for s in seqs)
    return loss, sum(len(s) - 1 for s in seqs)  # type: ignore[return-value]


def _token_grads(use_items: bool) -> dict:
    """2 ranks x 2 micro-batches: rank r takes sequences [4r, 4r+4), two per micro-batch."""
    engine = phalanx.Engine(grad_accum_steps=2)
    torch.manual_seed(5)
    model = _TokenModel()
    model = engine.prepare(model)
    mine = _sequences()[4 * engine.rank : 4 * engine.rank + 4]
    for micro in range(2):
        with engine.accumulate():
            seqs = mine[2 * micro : 2 * micro + 2]
            loss_sum, n = _token_loss_sum(model, seqs)
            if use_items:
                engine.backward(loss_sum, items=n)
            else:
                engine.backward(loss_sum / n)  # the common mistake: mean per micro-batch, then average
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_token_normalised_backward_equals_full_batch(run_ranks):
    torch.manual_seed(5)
    ref = _TokenModel()
    loss_sum, n = _token_loss_sum(ref, _sequences())
    (loss_sum / n).backward()
    expected = {name: p.grad for name, p in ref.named_parameters()}
    with_items = run_ranks(_token_grads, 2, True)
    for grads in with_items:
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], **TOL, msg=name)
    # The same window with per-micro-batch means is measurably different: the test can tell them apart.
    naive = run_ranks(_token_grads, 2, False)[0]
    assert not torch.allclose(naive["head.weight"], expected["head.weight"], rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------- scheduler
def _lr_trace(accum: int, batches: int) -> list[float]:
    engine = phalanx.Engine(grad_accum_steps=accum)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    lrs = []
    for _ in range(batches):
        with engine.accumulate():
            engine.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_scheduler_counts_optimizer_steps_whatever_the_world_size(run_ranks):
    traces = {world: run_ranks(_lr_trace, world, 2, 8) for world in (1, 2, 4)}
    expected = [0.5**k for k in range(1, 5)]  # 8 micro-batches, accum 2: 4 optimizer steps
    for world, per_rank in traces.items():
        for trace in per_rank:
            assert trace == expected, f"world size {world}"


# ------------------------------------------------------------------------ metrics and sampler
def _gather_pass(n: int, per_rank_batch: int, shuffle: bool, epochs: int) -> dict:
    engine = phalanx.Engine(seed=11)
    loader = engine.prepare(DataLoader(Indices(n), batch_size=per_rank_batch, shuffle=shuffle))
    out = {"epochs": [], "batches": []}
    for _ in range(epochs):  # no set_epoch call: the loader advances its epoch by itself
        seen, batches = [], []
        for batch in loader:
            gathered = engine.gather_for_metrics(batch)
            seen += gathered.tolist()
            batches.append(gathered.tolist())
        out["epochs"].append(seen)
        out["batches"].append(batches)
    return out


def _gather_cases(cases: list[tuple[int, bool]]) -> list[list[int]]:
    return [_gather_pass(n, 8, shuffle, 1)["epochs"][0] for n, shuffle in cases]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_for_metrics_returns_each_sample_once(run_ranks, world):
    cases = [(n, shuffle) for n in (97, 101) for shuffle in (False, True)]
    for per_rank in run_ranks(_gather_cases, world, cases):
        for (n, shuffle), seen in zip(cases, per_rank):
            assert len(seen) == n, (n, shuffle)
            assert sorted(seen) == list(range(n)), (n, shuffle)


def test_global_batches_are_the_same_for_every_world_size(run_ranks):
    """Global batch 8 as 8x1, 4x2 and 2x4; 64 samples so no padding; two epochs that must differ."""
    runs = {world: run_ranks(_gather_pass, world, 64, 8 // world, True, 2)[0] for world in (1, 2, 4)}
    base = runs[1]["batches"]
    assert base[0] != base[1], "epoch 1 must be shuffled differently from epoch 0"
    assert all(len(b) == 8 for b in base[0])
    # Not only the same on every world size: the documented order, a torch.randperm from seed + epoch.
    for epoch in range(2):
        order = global_order(64, 11, epoch).tolist()
        assert base[epoch] == [order[i : i + 8] for i in range(0, 64, 8)], f"epoch {epoch}"
    for world, res in runs.items():
        assert res["batches"] == base, f"world size {world}"


def _uneven_training(n: int) -> int:
    """Training over a dataset whose tail does not fill a global batch must not hang."""
    engine = phalanx.Engine(grad_accum_steps=3)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(TensorDataset(x, x), batch_size=4))
    steps = 0
    for _epoch in range(2):
        for xb, yb in loader:
            with engine.accumulate():
                engine.backward(F.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
                steps += engine.sync_gradients
    return steps


def test_uneven_tail_trains_without_hanging(run_ranks):
    # 97 samples, batch 4 x 3 ranks: 9 batches per epoch, windows of 3 -> 3 optimizer steps per epoch.
    assert run_ranks(_uneven_training, 3, 97, timeout=120) == [6, 6, 6]


# ------------------------------------------------------------------------------------- fp16
def _fp16_overflow() -> dict:
    engine = phalanx.Engine(precision="fp16-mixed")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    before = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    scale_before = engine.precision.loss_scale
    x = torch.full((3, 4), 0.1)
    # An overflow on rank 1 only, injected during backward: the all-reduce must carry it to every rank.
    poison = float("inf") if engine.rank == 1 else 1.0
    engine.backward(model(x).mean() * poison)
    optimizer.step()
    scheduler.step()
    skipped = engine.step_was_skipped
    after = engine.get_state_dict(model)
    optimizer.zero_grad()
    # A clean step afterwards goes through.
    engine.backward(model(x).mean())
    optimizer.step()
    scheduler.step()
    return {
        "skipped": skipped,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scale": (scale_before, engine.precision.loss_scale),
        "lr_after_skip_then_step": scheduler.get_last_lr()[0],
        "second_skipped": engine.step_was_skipped,
        "report": engine.precision_report(),
    }


def test_fp16_inf_gradient_skips_step_and_lowers_scale(run_ranks):
    for res in run_ranks(_fp16_overflow, 2):
        assert res["skipped"] and res["unchanged"]
        assert res["scale"][1] < res["scale"][0]
        assert not res["second_skipped"]
        assert res["lr_after_skip_then_step"] == pytest.approx(0.05)  # one real step, not two
        assert res["report"]["compute"] == "float16" and res["report"]["loss_scaling"] == "dynamic"
        assert res["report"]["params"] == "float32" and res["report"]["communication"] == "float32"


# --------------------------------------------------------------------------- clip and collectives
def _clip_and_collectives() -> dict:
    engine = phalanx.Engine()
    torch.manual_seed(0)
    model = engine.prepare(OddNet())
    x, y = make_data(8)
    rows = slice(4 * engine.rank, 4 * engine.rank + 4)
    engine.backward(F.mse_loss(model(x[rows]), y[rows]))
    norm = engine.clip_grad_norm_(0.01)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return {
        "norm": norm.item(),
        "clipped": clipped.item(),
        "sum": engine.reduce(torch.tensor(engine.rank + 1.0), "sum").item(),
        "max": engine.reduce(torch.tensor(engine.rank + 1.0), "max").item(),
        "mean": engine.reduce(engine.rank + 1, "mean").item(),
    }


def test_clip_returns_global_norm_and_reduce_ops(run_ranks):
    torch.manual_seed(0)
    ref = OddNet()
    x, y = make_data(8)
    F.mse_loss(ref(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01).item()
    for res in run_ranks(_clip_and_collectives, 2):
        assert res["norm"] == pytest.approx(expected, rel=1e-5)
        assert res["clipped"] == pytest.approx(0.01, rel=1e-4)
        assert (res["sum"], res["max"], res["mean"]) == (3.0, 2.0, 1.5)


def test_single_process_engine_needs_no_launcher():
    """A plain `python train.py`: world size 1, no process group, the same API."""
    engine = phalanx.Engine(precision="bf16-mixed")
    assert (engine.world_size, engine.rank, engine.is_main_process) == (1, 0, True)
    model = engine.prepare(torch.nn.Linear(3, 2))
    out = model(torch.ones(4, 3))
    assert out.dtype == torch.float32  # autocast inside, fp32 handed back for the loss
    engine.backward(out.sum())
    assert engine.precision_report()["compute"] == "bfloat16"
    assert engine.gather_for_metrics(torch.arange(5)).tolist() == list(range(5))
    assert engine.unwrap_model(model) is model


# ------------------------------------------------------------------------------- train_step
def _train_step_run(use_items: bool, steps: int) -> dict:
    engine = phalanx.Engine(grad_accum_steps=2, max_grad_norm=0.5, seed=3)
    torch.manual_seed(100)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    x, y = make_data(steps * 2 * 4 * engine.world_size)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)

    def mean_loss(m, batch):
        return F.mse_loss(m(batch[0]), batch[1])

    def summed_loss(m, batch):
        return F.mse_loss(m(batch[0]), batch[1], reduction="sum"), batch[1].numel()

    losses = [engine.train_step(batch, summed_loss if use_items else mean_loss).item() for batch in loader]
    return {"state": engine.get_state_dict(model), "lr": scheduler.get_last_lr()[0], "losses": losses}


def test_train_step_equals_the_hand_written_loop(run_ranks):
    """train_step (accum 2, clip 0.5, scheduler) on 2 ranks against the same recipe in plain torch."""
    steps = 5
    res_mean, res_items = run_ranks(_train_step_run, 2, False, steps)[0], run_ranks(_train_step_run, 2, True, steps)[0]
    torch.manual_seed(100)
    ref = OddNet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    x, y = make_data(steps * 16)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(3))
    for step in range(steps):  # each optimizer step sees 2 micro-batches x 2 ranks x 4 samples
        idx = order[step * 16 : (step + 1) * 16]
        F.mse_loss(ref(x[idx]), y[idx]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    for res in (res_mean, res_items):  # equal-sized micro-batches: mean and item-normalised agree
        assert res["lr"] == pytest.approx(0.05 * 0.9**steps)
        assert len(res["losses"]) == 2 * steps
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, **TOL, msg=k)


# ------------------------------------------------------------------------ sampler state, helpers
def test_sampler_resumes_mid_epoch_on_another_world_size():
    """Position is kept in samples: saved after 3 global batches, it resumes the same global sequence whether
    the loader then runs on 1, 2 or 4 ranks (the samplers of each rank are built here side by side)."""
    from phalanx.engine.data import GlobalBatchSampler

    def global_batches(world: int, start: int = 0, epoch: int = 1) -> list[list[int]]:
        samplers = [GlobalBatchSampler(96, 8 // world, r, world, True, 5, False) for r in range(world)]
        for s in samplers:
            s.epoch, s.start_batch = epoch, start
        per_rank = [list(s) for s in samplers]
        return [sum((p[b] for p in per_rank), []) for b in range(len(per_rank[0]))]

    straight = global_batches(1)
    assert len(straight) == 12
    engine = phalanx.Engine(seed=5)
    loader = engine.prepare(DataLoader(Indices(96), batch_size=8, shuffle=True))
    loader.set_epoch(1)
    it = iter(loader)
    consumed = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 1, "samples_done": 24, "seed": 5}
    assert consumed == straight[:3]
    for world in (1, 2, 4):
        assert global_batches(world, start=state["samples_done"] // 8) == straight[3:], world
    resumed = engine.prepare(DataLoader(Indices(96), batch_size=8, shuffle=True))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # saving again before the first batch keeps the position
    assert [b.tolist() for b in resumed] == straight[3:]
    assert [b.tolist() for b in resumed] == global_batches(1, epoch=2)  # the next pass is a fresh epoch


def _main_process_first(path: str) -> bool:
    import os

    engine = phalanx.Engine()
    with engine.main_process_first():
        if engine.is_main_process:
            with open(path, "w") as f:
                f.write("ready")
        seen = os.path.exists(path)
    engine.wait()
    return seen


def test_main_process_first_runs_rank_0_before_the_others(run_ranks, tmp_path):
    assert run_ranks(_main_process_first, 3, str(tmp_path / "cache")) == [True, True, True]


def _gather_after_a_padded_pass() -> dict:
    engine = phalanx.Engine()
    loader = engine.prepare(DataLoader(Indices(3), batch_size=1))  # 3 samples on 2 ranks: the tail is padded
    inside = [engine.gather_for_metrics(batch).tolist() for batch in loader]
    after = engine.gather_for_metrics(torch.tensor([float(engine.rank)])).tolist()
    return {"inside": inside, "after": after}


def test_gather_after_the_loop_is_not_trimmed(run_ranks):
    for res in run_ranks(_gather_after_a_padded_pass, 2):
        assert res["inside"] == [[0, 1], [2]]
        assert res["after"] == [0.0, 1.0]  # a per-rank value gathered once the pass is over keeps both ranks


# ------------------------------------------------------------------- review regressions
def _items_inside_no_sync() -> float:
    engine = phalanx.Engine()
    model = engine.prepare(torch.nn.Linear(1, 1, bias=False))
    torch.nn.init.ones_(model.weight)
    with engine.no_sync():
        engine.backward(model(torch.ones(3, 1)).sum(), items=3)
    engine.backward(model(torch.ones(1, 1)).sum(), items=1)
    return model.weight.grad.item()


def _two_optimizers_fp16_clip() -> dict:
    # At the default scale of 65536 the bias gradient (1 x 65536) overflows fp16 and the step is skipped.
    engine = phalanx.Engine(precision="fp16-mixed", loss_scale_init=4096.0)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 1, gamma=0.5)
    a, b, opt_a, opt_b, sched_a, sched_b = engine.prepare(a, b, opt_a, opt_b, sched_a, sched_b)
    scale0 = engine.precision.loss_scale
    x = torch.full((2, 4), 0.01)
    engine.backward(b(a(x)).mean())
    engine.clip_grad_norm_(100.0)
    grad_b = b.bias.grad.clone()
    for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
        opt.step()
        sched.step()
        opt.zero_grad()
    return {
        "grad_b": grad_b.item(),
        "lrs": [sched_a.get_last_lr()[0], sched_b.get_last_lr()[0]],
        "scale": (scale0, engine.precision.loss_scale),
        "skipped": engine.step_was_skipped,
    }


def _existing_process_group() -> tuple[int, int, float]:
    import os

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = os.environ.pop("PHALANX_INIT_METHOD")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # as after mp.spawn: nothing in the environment
        os.environ.pop(var)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    engine = phalanx.Engine()
    model = engine.prepare(torch.nn.Linear(1, 1, bias=False))
    engine.backward(model(torch.full((1, 1), float(rank + 1))).sum())
    grad = model.weight.grad.item()
    dist.destroy_process_group()
    return engine.rank, engine.world_size, grad


def test_review_regressions(run_ranks):
    # items= inside no_sync: normalised by all 4 items of the window, not by the last micro-batch's 1
    assert run_ranks(_items_inside_no_sync, 1) == [1.0]
    # two optimizers: each scheduler counts its own step; fp16 unscales each optimizer once
    for res in run_ranks(_two_optimizers_fp16_clip, 2):
        assert res["lrs"] == [0.05, 0.05]
        assert res["grad_b"] == pytest.approx(1.0, rel=1e-3)  # d mean / d bias = 1, unscaled once
        assert not res["skipped"] and res["scale"][1] == res["scale"][0]
    # a process group the script made itself is the world
    assert run_ranks(_existing_process_group, 2) == [(0, 2, 1.5), (1, 2, 1.5)]


def test_a_scheduler_built_on_the_prepared_optimizer_counts_its_steps():
    """Accelerate users often build the scheduler after prepare(optimizer): it must step once per optimizer step (it
    silently never stepped: the prepared scheduler compared it with the optimizer inside)."""
    engine = phalanx.Engine(grad_accum_steps=2)
    net = torch.nn.Linear(3, 1)
    model, opt = engine.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
    sched = engine.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s))
    for _ in range(6):
        with engine.accumulate(model):
            engine.backward(model(torch.ones(2, 3)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
    assert sched.scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.125


def test_memory_report_has_the_peak_measured_from_the_process():
    engine = phalanx.Engine()
    engine.prepare(torch.nn.Linear(4, 2))
    if os.path.exists("/proc/self/clear_refs"):  # Linux: the high-water mark back to the current size (earlier
        with open("/proc/self/clear_refs", "w") as f:  # tests in this process may have set it higher)
            f.write("5")
    before = engine.memory_report()["peak"]["rss"]
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = engine.memory_report()["peak"]["rss"]
    del big
    assert before > 0 and after - before >= 60 * 2**20, (before, after)
    # A high-water mark: freeing the tensor leaves it where it was (the kernel's per-thread counters lag by a few
    # hundred KiB, so "where it was" is read with 1 MiB of slack).
    assert engine.memory_report()["peak"]["rss"] >= after - 2**20


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.arange(self.n, dtype=torch.float32).unsqueeze(1))


def _stream_batches(n: int) -> dict:
    engine = phalanx.Engine(seed=0)
    loader = engine.prepare(DataLoader(_Stream(n), batch_size=2))
    first = [b.flatten().tolist() for b in loader]
    gathered = []
    for b in loader:
        gathered.append(engine.gather_for_metrics(b).flatten().tolist())
    # Resume after the first global batch: a fresh loader skips what was read.
    state = {"epoch": 0, "samples_done": 2 * engine.world_size, "seed": 0}
    again = engine.prepare(DataLoader(_Stream(n), batch_size=2))
    again.load_state_dict(state)
    return {
        "first": first,
        "gathered": gathered,
        "resumed": [b.flatten().tolist() for b in again],
        "epoch": engine.epoch,
    }


def test_an_iterable_dataset_is_split_by_global_batch_and_resumes(run_ranks):
    # 9 values, global batches of 4 on 2 ranks: [0 1 | 2 3], [4 5 | 6 7], then 8 padded with the epoch's first value.
    ranks = run_ranks(_stream_batches, 2, 9)
    assert ranks[0]["first"] == [[0, 1], [4, 5], [8]] and ranks[1]["first"] == [[2, 3], [6, 7], [0]]
    assert ranks[0]["gathered"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]  # gather_for_metrics drops the padding
    assert ranks[0]["resumed"] == [[4, 5], [8]] and ranks[1]["resumed"] == [[6, 7], [0]]
    assert ranks[0]["epoch"] == 2  # two passes over the first prepared loader

"""``phalanx.accelerate``: a script written for Accelerate runs with the import changed, with Accelerate's semantics
where the Engine's differ (issue 29). Each test names the Accelerate behaviour it reproduces."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from _common import OddNet, make_data
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

import phalanx
from phalanx.accelerate import Accelerator, DummyOptim, DummyScheduler, find_executable_batch_size, get_logger
from phalanx.accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
    gather_object,
    pad_across_processes,
    release_memory,
    send_to_device,
    set_seed,
    skip_first_batches,
)
from phalanx.config.settings import ConfigError


def _lr_after_four_steps(front: str, accum: int) -> tuple[float, int]:
    # Accelerate's examples size a schedule from the unsharded loader: 16 steps here, for a run whose 2 processes
    # take 8 optimizer steps each. Accelerate steps the scheduler once per process for each optimizer step.
    engine = (
        Accelerator(gradient_accumulation_steps=accum)
        if front == "accelerate"
        else phalanx.Engine(grad_accum_steps=accum)
    )
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 16)
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    x, y = make_data(4)
    for _ in range(4 * accum):
        with engine.accumulate(model):
            engine.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    inner = scheduler.scheduler
    return optimizer.param_groups[0]["lr"], inner._step_count


@pytest.mark.parametrize("accum", [1, 2])
def test_the_scheduler_steps_once_per_process_as_in_accelerate(run_ranks, accum):
    for lr, count in run_ranks(_lr_after_four_steps, 2, "accelerate", accum):
        assert lr == pytest.approx(1 - 8 / 16)  # 4 optimizer steps x 2 processes
        # adjust_scheduler: the accumulating micro-batches move _step_count too (Accelerate's bookkeeping)
        assert count == 1 + 8 + 4 * (accum - 1)
    for lr, _ in run_ranks(_lr_after_four_steps, 2, "engine", accum):
        assert lr == pytest.approx(1 - 4 / 16)  # the Engine keeps its own pace: once per optimizer step


def _dummy_total(path: str) -> list[float]:
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path))
    model = OddNet()
    optimizer = DummyOptim(model.parameters(), lr=0.1, weight_decay=0.0)
    scheduler = DummyScheduler(optimizer, total_num_steps=8, warmup_num_steps=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.strategy.name == "zero1"
    x, y = make_data(4)
    lrs = []
    for _ in range(4):
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_a_dummy_scheduler_s_total_is_divided_by_the_processes(run_ranks, tmp_path):
    ds = {
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    }  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for lrs in run_ranks(_dummy_total, 2, str(path)):
        # total_num_steps 8 on 2 processes is 4, as Accelerate divides it. After DeepSpeed's 2-step warmup floor,
        # WarmupDecayLR gives 0.1 x (total - 3) / (total - 2) at the 4th step: 0.05 with 4 (0.083 with 8, undivided).
        assert lrs[-1] == pytest.approx(0.1 * (4 - 3) / (4 - 2))


def _order(seed: int | None, config_seed: int | None = None) -> list[int]:
    config = DataLoaderConfiguration(data_seed=config_seed, use_seedable_sampler=config_seed is not None)
    accelerator = Accelerator(dataloader_config=config)
    if seed is not None:
        set_seed(seed)
    loader = DataLoader(TensorDataset(torch.arange(32)), batch_size=4, shuffle=True)
    loader = accelerator.prepare(loader)
    return [int(v) for (batch,) in loader for v in batch]


def test_set_seed_reaches_the_data_order_and_making_an_accelerator_does_not_seed():
    assert _order(1) == _order(1) != _order(2)
    # use_seedable_sampler: Accelerate's SeedableRandomSampler, whose epoch e is drawn from data_seed + e
    g = torch.Generator()
    g.manual_seed(5)
    assert _order(None, config_seed=5) == torch.randperm(32, generator=g).tolist() != _order(None, config_seed=6)
    set_seed(7)
    expected = torch.rand(3)
    set_seed(7)
    Accelerator()  # Accelerate's Accelerator() leaves the global RNG alone: a set_seed before it holds
    assert torch.equal(torch.rand(3), expected)


def test_on_one_process_a_shuffled_loader_is_torch_s_as_under_accelerate():
    # With one process Accelerate leaves the DataLoader as torch has it: each pass draws its order from the global RNG,
    # and the short last batch stays short.
    dataset = TensorDataset(torch.arange(20))
    set_seed(11)
    theirs = [b.tolist() for _ in range(2) for (b,) in DataLoader(dataset, batch_size=3, shuffle=True)]
    rng_after = torch.rand(2)
    accelerator = Accelerator()
    set_seed(11)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=3, shuffle=True))
    assert [b.tolist() for _ in range(2) for (b,) in loader] == theirs and torch.equal(torch.rand(2), rng_after)
    # A resume mid-epoch gives the rest of that epoch's order (the seed its pass drew is in the loader's state)
    batches = iter(loader)
    next(batches), next(batches)
    state, rest = loader.state_dict(), [b.tolist() for (b,) in batches]
    loader.load_state_dict(state)
    assert [b.tolist() for (b,) in loader] == rest


def test_skip_first_batches_skips_one_pass_without_loading():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(32)), batch_size=4))
    skipped = skip_first_batches(loader, 3)
    assert [int(b[0][0]) for b in skipped] == [12, 16, 20, 24, 28]  # starts at the 4th batch
    assert [int(b[0][0]) for b in loader] == [0, 4, 8, 12, 16, 20, 24, 28]  # the next pass starts at 0
    assert accelerator.skip_first_batches(loader, 7) is loader
    with pytest.raises(TypeError, match="takes a DataLoader that accelerator.prepare returned"):
        skip_first_batches(DataLoader(TensorDataset(torch.arange(4))), 1)
    stream = accelerator.prepare(DataLoader(_Stream(), batch_size=2))  # its position is load_state's, by seeking
    with pytest.raises(TypeError, match="does not take a prepared stream.*num_batches=1.*call load_state"):
        skip_first_batches(stream, 1)


def test_accelerate_s_names_and_arguments():
    accelerator = Accelerator(
        mixed_precision="bf16", gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3), cpu=True
    )
    assert accelerator.mixed_precision == "bf16" and accelerator.config.precision == "bf16-mixed"
    assert accelerator.gradient_accumulation_steps == 3 and accelerator.gradient_state.num_steps == 3
    assert accelerator.distributed_type == DistributedType.NO and not accelerator.use_distributed
    assert accelerator.state.num_processes == 1 and accelerator.state.process_index == 0
    assert accelerator.state.deepspeed_plugin is None  # scripts test it before reading DeepSpeed's config
    assert "Num processes: 1" in repr(accelerator.state) and "Mixed precision type: bf16" in repr(accelerator.state)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = make_data(4)
    with accelerator.accumulate(model):
        assert not accelerator.gradient_state.sync_gradients  # the first of 3 micro-batches
        with accelerator.trigger_sync_in_backward(model):
            assert accelerator.sync_gradients
        with accelerator.no_sync(model):  # Accelerate's form takes the model
            accelerator.backward(F.mse_loss(model(x), y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: nothing to join, and Accelerate says nothing either
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
    accelerator.state.distributed_type = DistributedType.FSDP  # as Accelerate's test_distributed_data_loop does
    assert accelerator.distributed_type == DistributedType.FSDP
    with pytest.warns(UserWarning, match="only supported for multi-GPU"), accelerator.join_uneven_inputs([model]):
        pass
    accelerator.end_training()
    with pytest.raises(ConfigError, match="split_batches=True.*divide your DataLoader's batch_size"):
        Accelerator(split_batches=True)
    with pytest.raises(TypeError, match=r"Accelerator\(megatron_lm_plugin=...\)"):
        Accelerator(megatron_lm_plugin=object())
    with pytest.raises(ConfigError, match="fp8"):
        Accelerator(mixed_precision="fp8")


def _each_batch_synced() -> list[tuple[list[bool], list[torch.Tensor]]]:
    return [_accumulated(sync_each_batch) for sync_each_batch in (True, False)]


def _accumulated(sync_each_batch: bool) -> tuple[list[bool], list[torch.Tensor]]:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    same = []
    for i in range(2):
        x = torch.full((3, 4), float(accelerator.process_index + i + 1))
        with accelerator.accumulate(model):
            accelerator.backward(model(x).square().mean())
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        everyone = accelerator.gather(grads[None])
        same.append(bool(torch.equal(everyone[0], everyone[1])))
    return same, [p.grad.clone() for p in model.parameters()]


def test_sync_each_batch_reduces_every_micro_batch_to_the_same_sum(run_ranks):
    for (each, each_grads), (once, once_grads) in run_ranks(_each_batch_synced, 2):
        assert each == [True, True] and once == [False, True]  # reduced at the first micro-batch too, or not
        torch.testing.assert_close(each_grads, once_grads)


def _forwards_under_no_sync() -> list[bool]:
    # torch DDP's rule, which Accelerate scripts rely on (its test_sync.py): a forward run under no_sync(model) leaves
    # its backward unreduced wherever that backward runs; trigger_sync_in_backward makes the next one reduce.
    accelerator = Accelerator()
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    mine = slice(4 * rank, 4 * rank + 4)
    losses = []
    for _ in range(3):
        with accelerator.no_sync(model):
            losses.append(F.mse_loss(model(x[mine]), y[mine]))
    same = []
    for i, loss in enumerate(losses):
        if i < 2:
            accelerator.backward(loss)
        else:
            with accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        everyone = accelerator.gather(grads[None])
        same.append(bool(torch.allclose(everyone[0], everyone[1])))
    return same


def test_no_sync_follows_the_forward_and_trigger_sync_reduces(run_ranks):
    for same in run_ranks(_forwards_under_no_sync, 2):
        assert same == [False, False, True]  # local until the triggered backward, then equal on both ranks


def _short_last_window(front: str) -> float:
    # 3 micro-batches with accumulation 2: the last window has one. Accelerate divides its loss by 2 all the same;
    # the Engine averages over the micro-batches the window had.
    engine = Accelerator(gradient_accumulation_steps=2) if front == "accelerate" else phalanx.Engine(grad_accum_steps=2)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model = engine.prepare(model)
    loader = engine.prepare(DataLoader(TensorDataset(torch.ones(3, 1)), batch_size=1))
    for (x,) in loader:
        with engine.accumulate(model):
            if not engine.sync_gradients or engine.end_of_dataloader:
                model.zero_grad() if engine.end_of_dataloader else None
            engine.backward(model(x).sum())
    return float(model.weight.grad)


def test_a_short_last_window_is_divided_as_in_accelerate():
    assert _short_last_window("accelerate") == pytest.approx(0.5)  # d(x w)/dw = 1, divided by 2
    assert _short_last_window("engine") == pytest.approx(1.0)


def test_prepare_returns_a_prepared_loader_as_it_is_and_saves_into_an_empty_folder(tmp_path):
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    assert accelerator.prepare(loader) is loader  # Accelerate's helpers prepare what they were given
    (tmp_path / "empty").mkdir()
    accelerator.save_state(str(tmp_path / "empty"))  # as into a fresh TemporaryDirectory
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="exists and is not a phalanx checkpoint"):
        accelerator.save_state(str(tmp_path / "full"))
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    # The Engine's async_save is taken through Accelerate's save_state (it used to be warned about and dropped).
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    saving = accelerator.save_state(str(tmp_path / "async"), async_save=True)
    assert saving.result() == tmp_path / "async" and accelerator.wait_for_checkpoint() == tmp_path / "async"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(tmp_path / "async"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _ByBatch(torch.utils.data.Dataset):
    """Indexed by a whole batch of indices, as DataLoader(sampler=BatchSampler(...), batch_size=None) indexes it."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        assert isinstance(idx, list), idx  # never one index at a time
        return torch.tensor(idx)


def _batch_sampler_as_sampler() -> list[list[int]]:
    from torch.utils.data import BatchSampler, SequentialSampler

    accelerator = Accelerator()
    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    loader = accelerator.prepare(DataLoader(_ByBatch(), sampler=sampler, batch_size=None, collate_fn=lambda b: b))
    return [b.tolist() for b in loader]


def test_a_batch_sampler_given_as_sampler_is_prepared(run_ranks):
    # Accelerate's test_distributed_data_loop prepares such a loader; each global batch (2 x 2 ranks) is split.
    # The last batch is padded to batch_size on every rank from the epoch's start, as Accelerate pads it.
    first, second = run_ranks(_batch_sampler_as_sampler, 2)
    assert first == [[0, 1], [4, 5], [8, 9]] and second == [[2, 3], [6, 7], [0, 1]]


def _accelerate_s_batches(n: int, batch_size: int, rank: int, even: bool, seed: int | None) -> tuple[list, int]:
    # The oracle: Accelerate's own BatchSamplerShard over a RandomSampler given a generator as Accelerate's prepare
    # gives it one (seeded with a draw from the global RNG), two epochs.
    from accelerate.data_loader import BatchSamplerShard

    sampler: torch.utils.data.Sampler[int] = SequentialSampler(range(n))
    if seed is not None:
        set_seed(seed)
        g = torch.Generator()
        g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler = RandomSampler(range(n), generator=g)
    shard = BatchSamplerShard(BatchSampler(sampler, batch_size, False), 2, rank, even_batches=even)
    return [list(b) for _ in range(2) for b in shard], len(shard)


def _our_batches(accelerator: Accelerator, n: int, batch_size: int, seed: int | None) -> tuple[list, int]:
    if seed is not None:
        set_seed(seed)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=seed is not None)
    loader = accelerator.prepare(loader)
    return [b.tolist() for _ in range(2) for (b,) in loader], len(loader)


def _uneven_inputs_joined(tmp: str) -> dict:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    import phalanx.logging as plog

    logged: list[str] = []
    plog._WARNED.clear()
    plog.get_logger().warning = lambda msg, *a: logged.append(msg % a if a else msg)  # type: ignore[method-assign]
    out: dict = {"batches": [], "warned": logged}
    for even in (True, False):
        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even))
        rank = accelerator.process_index
        for n, batch_size, seed in ((7, 2, None), (3, 1, None), (23, 4, None), (23, 4, 3)):
            ours = _our_batches(accelerator, n, batch_size, seed)
            out["batches"].append((ours, _accelerate_s_batches(n, batch_size, rank, even, seed)))
    # The global RNG moves as under Accelerate: one draw at prepare (the order's seed), one per pass (torch's).
    set_seed(4)
    for _ in accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True)):
        pass
    after_ours = torch.rand(2)
    set_seed(4)
    torch.empty((), dtype=torch.int64).random_()
    for _ in DataLoader(TensorDataset(torch.arange(8)), batch_size=2):  # its sampler has a generator: no draw
        pass
    out["rng"] = (after_ours, torch.rand(2))

    # join_uneven_inputs, against torch DDP under torch's Join on the same batches: rank 0 has 2, rank 1 has 1.
    def train(model, optimizer, batches, context):  # type: ignore[no-untyped-def]
        grads = []
        with context:
            for x in batches:
                model(x).sum().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                optimizer.step()
                optimizer.zero_grad()
        return grads, [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(1.0, 4.0)[:, None]), batch_size=1))
    batches = [x for (x,) in loader]
    out["ours"] = train(model, optimizer, batches, accelerator.join_uneven_inputs([model, optimizer]))
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(1, 1))
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out["torch"] = train(ddp, sgd, batches, Join([ddp]))

    def twice(m):  # type: ignore[no-untyped-def]
        # Backward twice without zero_grad (nlp_example accumulates so): torch DDP reduces both, and so does the front
        m.zero_grad()
        for _ in range(2):
            m(torch.full((1, 1), float(accelerator.process_index + 1))).sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    out["twice"] = (twice(model), twice(ddp))
    # even_batches overrides the map-style loaders for the block, and says that an iterable one keeps its own
    accelerator.prepare(DataLoader(_Stream(), batch_size=1))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=True):
            out["inside"] = len(loader)
    out["said"] = [str(w.message) for w in said]
    out["after"] = len(loader)
    with pytest.raises(TypeError, match="takes the models .* that accelerator.prepare returned"):
        with accelerator.join_uneven_inputs([torch.nn.Linear(1, 1)]):
            pass
    # Accelerate's operations across processes
    rank = accelerator.process_index
    padded = accelerator.pad_across_processes({"ids": torch.ones(2, rank + 1, dtype=torch.long)}, dim=1, pad_index=-1)
    out["padded"] = accelerator.gather(padded["ids"]).tolist()
    out["pad_first"] = pad_across_processes(torch.ones(rank + 1), pad_first=True).tolist()
    out["objects"] = gather_object([f"rank {rank}", {"n": rank}])
    one = torch.tensor([float(rank + 1)])
    out["reduce"] = [accelerator.reduce(one).item(), accelerator.reduce({"x": one}, "mean")["x"].item()]
    metrics = accelerator.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    with accelerator.join_uneven_inputs([model], even_batches=True):  # every process gathers at every batch
        out["as_objects"] = [
            accelerator.gather_for_metrics([int(v) for v in batch], use_gather_object=True) for (batch,) in metrics
        ]
    out["broadcast"] = broadcast_object_list([rank, "from 1" if rank == 1 else None], from_process=1)
    ran: list[str] = []
    accelerator.on_main_process(lambda: ran.append("main"))()
    accelerator.on_last_process(lambda: ran.append("last"))()
    accelerator.on_process(process_index=1)(lambda: ran.append("1"))()
    out["ran"] = ran
    # A checkpoint is one folder: per-process folders (Accelerate's test makes them) are refused before any write
    with pytest.raises(ValueError, match="the processes name different folders .*process 1: .*rank1"):
        accelerator.save_state(f"{tmp}/rank{rank}")
    # Pickled (e.g. with a collate_fn into a DataLoader worker), a copy tells who and how, and trains nothing
    copy = pickle.loads(pickle.dumps(accelerator))
    out["pickled"] = (copy.state.__dict__ == accelerator.state.__dict__, copy.mixed_precision, copy.num_processes)
    with pytest.raises(AttributeError, match="was unpickled"):
        copy.prepare(torch.nn.Linear(1, 1))
    return out


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from torch.arange(4)


def test_uneven_batches_and_join_as_accelerate_and_torch_join(run_ranks, tmp_path):
    for rank, out in enumerate(run_ranks(_uneven_inputs_joined, 2, str(tmp_path))):
        for ours, theirs in out["batches"]:  # batches (two epochs) and length as Accelerate's BatchSamplerShard
            assert ours == theirs
        if rank == 0:  # an uneven loader is said to need join_uneven_inputs around collectives (once)
            uneven = [m for m in out["warned"] if "must run inside accelerator.join_uneven_inputs" in m]
            assert len(uneven) == 2 and "(3 samples, batch_size 1)" in uneven[0]  # 3 and 5 samples; 7 and 23 are even
        assert torch.equal(*out["rng"])
        (our_grads, our_params), (torch_grads, torch_params) = out["ours"], out["torch"]
        assert len(our_grads) == 2 - rank  # rank 1 ran out first; it stood in for rank 0's second step
        for ours, theirs in zip(our_grads, torch_grads):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # the finished rank's zero, divided by 2
        torch.testing.assert_close(our_params, torch_params, rtol=0, atol=0)  # the last to finish's replica
        torch.testing.assert_close(*out["twice"], rtol=0, atol=0)
        assert out["inside"] == 2 and out["after"] == 2 - rank
        assert any("only supported for map-style datasets" in m for m in out["said"])
        assert out["pickled"] == (True, "no", 2)
        assert out["padded"] == [[1, -1], [1, -1], [1, 1], [1, 1]]
        assert out["pad_first"] == ([0.0, 1.0] if rank == 0 else [1.0, 1.0])
        assert out["objects"] == ["rank 0", {"n": 0}, "rank 1", {"n": 1}]
        assert out["broadcast"] == [1, "from 1"]
        assert out["reduce"] == [3.0, 1.5]  # Accelerate's reduce sums by default (the Engine's averages)
        assert out["as_objects"] == [[0, 1, 2, 3], [4]]  # as objects, and without the last batch's padding
        assert out["ran"] == (["main"] if rank == 0 else ["last", "1"])
    assert not list(tmp_path.iterdir())


def test_automatic_checkpoint_naming_as_accelerate_s(tmp_path):
    from phalanx.accelerate.utils import ProjectConfiguration

    def accelerator() -> tuple[Accelerator, torch.nn.Module]:
        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
        acc = Accelerator(project_config=config)
        return acc, acc.prepare(torch.nn.Linear(2, 2))

    first, model = accelerator()
    for _ in range(3):
        first.save_state()
    assert sorted(d.name for d in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert first.save_iteration == 3 and first.project_dir == str(tmp_path)
    assert pickle.loads(pickle.dumps(first)).project_dir == str(tmp_path)
    second, _ = accelerator()
    second.load_state()  # the newest; the next save goes on after it
    assert second.save_state().name == "checkpoint_3"
    with pytest.raises(ValueError, match=r"save_state\(\) needs a folder: pass one, or .*automatic_checkpoint_naming"):
        Accelerator().save_state()


def test_accelerate_s_helpers_on_one_process(caplog):
    import datetime

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=90))])
    assert accelerator.config.timeout_s == 90
    model, optimizer = accelerator.prepare(OddNet(), torch.optim.SGD(OddNet().parameters(), lr=0.1))
    x, y = make_data(4)
    accelerator.backward(F.mse_loss(model(x), y) * 1000)
    accelerator.unscale_gradients()
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(float(p.grad.abs().max()) for p in model.parameters()) == pytest.approx(0.01)
    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped
    # Trackers: none runs here, and the calls a script makes do nothing, as with Accelerate without log_with
    accelerator.init_trackers("project", config={"lr": 0.1})
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.get_tracker("wandb").log_images({})
    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > 5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == 5 and calls == [8, 7, 6, 5]  # 90% of the size after each out-of-memory error
    assert accelerator.unwrap_model(model, keep_fp32_wrapper=False) is model
    assert set(accelerator.get_state_dict(model, unwrap=True)) == set(model.state_dict())
    with accelerator.autocast():
        pass
    evaluated = accelerator.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)  # placed, not spread
    assert evaluated not in accelerator._models and evaluated(torch.ones(1, 2)).shape == (1, 2)
    a, b = release_memory(model, optimizer)
    assert a is None and b is None
    moved = send_to_device({"x": torch.ones(1), "keep": torch.ones(1)}, "meta", skip_keys="keep")
    assert moved["x"].device.type == "meta" and moved["keep"].device.type == "cpu"
    logger = get_logger("ported.script", log_level="INFO")
    with caplog.at_level("INFO", logger="ported.script"):
        logger.info("said once, on the main process", main_process_only=True)
        logger.warning_once("only once")
        logger.warning_once("only once")
    assert [r.getMessage() for r in caplog.records] == ["said once, on the main process", "only once"]
    assert pickle.loads(pickle.dumps(accelerator)).is_main_process


def test_a_deepspeed_plugin_clips_as_accelerate_fills_its_clipping(monkeypatch, tmp_path):
    from phalanx.compat.accelerate.accelerator import _plugin_options

    monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING", raising=False)
    # Accelerate builds the config with gradient_clipping "auto" and fills it with 1.0.
    assert _plugin_options(DeepSpeedPlugin(zero_stage=2), None)["max_grad_norm"] == 1.0
    assert _plugin_options(DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.5), None)["max_grad_norm"] == 0.5
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "2.0")  # accelerate launch --gradient_clipping 2.0
    assert _plugin_options(DeepSpeedPlugin(zero_stage=2), None)["max_grad_norm"] == 2.0
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1}}')
    assert "max_grad_norm" not in _plugin_options(DeepSpeedPlugin(hf_ds_config=str(path)), None)  # the file says

"""ddp against a single-process reference and against torch's DistributedDataParallel (gloo, 1-4 ranks).

Tolerance: losses and parameters within rtol = atol = 1e-5 in fp32 after 20 steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import BNNet, OddNet, make_data, make_optimizer, reference_run
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.launch import SpawnError

STEPS, GLOBAL_BATCH = 20, 12  # 12 splits evenly over 1, 2, 3 and 4 ranks
TOL = dict(rtol=1e-5, atol=1e-5)


def _train_ddp(model_name: str, opt: str, steps: int, global_batch: int, options: dict) -> dict:
    engine = phalanx.Engine(strategy="ddp", seed=0, **options)
    # Each rank initialises differently on purpose: ddp must start every replica from rank 0's weights.
    torch.manual_seed(100 + engine.rank)
    model = {"odd": OddNet, "bn": BNNet}[model_name]()
    optimizer = make_optimizer(opt, model.parameters())
    x, y = make_data(steps * global_batch)
    loader = DataLoader(TensorDataset(x, y), batch_size=global_batch // engine.world_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses = []
    flats = {b.flat.untyped_storage().data_ptr() for r in engine.strategy.reducers for b in r.buckets}
    grad_is_view = True
    for xb, yb in loader:
        with engine.accumulate():
            loss = F.mse_loss(model(xb), yb)
            engine.backward(loss)
            grad_is_view &= all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach(), "mean").item())
    return {
        "losses": losses,
        "state": engine.get_state_dict(model),
        "desc": engine.strategy.describe(),
        "views": grad_is_view,
    }


# SGD with momentum is sensitive to the gradient's scale; Adam is nearly blind to it, so it runs once too.
@pytest.mark.parametrize("world_size,opt", [(2, "sgd"), (3, "sgd"), (4, "sgd"), (4, "adamw")])
def test_ddp_matches_single_process(run_ranks, world_size, opt):
    ref_losses, ref_state = reference_run(OddNet, STEPS, GLOBAL_BATCH, opt)
    results = run_ranks(_train_ddp, world_size, "odd", opt, STEPS, GLOBAL_BATCH, {})
    for rank, res in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"losses, rank {rank}"
        )
        for k in ref_state:
            torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, rank {rank}")


def test_ddp_many_small_buckets_match_single_process(run_ranks):
    """A tiny bucket size forces one bucket per parameter: launch order and views must still be right."""
    ref_losses, ref_state = reference_run(OddNet, STEPS, GLOBAL_BATCH, "sgd")
    results = run_ranks(_train_ddp, 2, "odd", "sgd", STEPS, GLOBAL_BATCH, {"bucket_mb": 1e-6})
    assert results[0]["desc"]["buckets"] == len(ref_state) - 1  # every parameter, not the buffer
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL)
        for k in ref_state:
            torch.testing.assert_close(res["state"][k], ref_state[k], **TOL)


def test_single_bucket_in_reverse_order_and_grads_are_views(run_ranks):
    res = run_ranks(_train_ddp, 2, "odd", "sgd", 2, GLOBAL_BATCH, {})[0]
    assert res["desc"]["buckets"] == 1
    assert res["views"]


def _train_with_torch_ddp(model_name: str, steps: int, global_batch: int) -> dict:
    """Our run and torch DDP's, in the same processes and on the same data shards."""
    ours = _train_ddp(model_name, "sgd", steps, global_batch, {})
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    model = DistributedDataParallel({"odd": OddNet, "bn": BNNet}[model_name]())
    optimizer = make_optimizer("sgd", model.parameters())
    x, y = make_data(steps * global_batch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    per_rank = global_batch // world
    losses = []
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch][rank * per_rank : (rank + 1) * per_rank]
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append((t / world).item())
    theirs = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"ours": ours, "theirs": {"losses": losses, "state": theirs}}


@pytest.mark.parametrize("model_name", ["odd", "bn"])
def test_ddp_matches_torch_ddp(run_ranks, model_name):
    for res in run_ranks(_train_with_torch_ddp, 2, model_name, STEPS, GLOBAL_BATCH):
        ours, theirs = res["ours"], res["theirs"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), **TOL)
        assert ours["state"].keys() == theirs["state"].keys()
        for k in theirs["state"]:
            torch.testing.assert_close(ours["state"][k], theirs["state"][k], **TOL, msg=k)


class _PartlyUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_parameter(find_unused: bool) -> str:
    engine = phalanx.Engine(find_unused_parameters=find_unused)
    model = _PartlyUsed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    try:
        engine.backward(model(torch.ones(3, 4)).sum())
    except RuntimeError as e:
        return str(e)
    optimizer.step()
    return "ok" if torch.count_nonzero(model.unused.weight.grad) == 0 else "nonzero grad"


def test_unused_parameter_error_names_it(run_ranks):
    for message in run_ranks(_unused_parameter, 2, False):
        assert "unused.weight" in message and "unused.bias" in message
        assert "find_unused_parameters=True" in message


def test_find_unused_parameters_reduces_zeros(run_ranks):
    assert run_ranks(_unused_parameter, 2, True) == ["ok", "ok"]


def _set_to_none_then_train(steps: int) -> dict:
    """model.zero_grad() drops the bucket views; the reducer must move fresh grads back into its buckets."""
    engine = phalanx.Engine()
    torch.manual_seed(100)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = make_data(steps * GLOBAL_BATCH)
    per = GLOBAL_BATCH // engine.world_size
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH + engine.rank * per, step * GLOBAL_BATCH + (engine.rank + 1) * per)
        engine.backward(F.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return engine.get_state_dict(model)


def test_zero_grad_set_to_none_keeps_reduction_right(run_ranks):
    torch.manual_seed(100)
    ref = OddNet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(5 * GLOBAL_BATCH)
    for step in range(5):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        F.mse_loss(ref(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    for state in run_ranks(_set_to_none_then_train, 2, 5):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, **TOL)


def _mismatched_models() -> str:
    engine = phalanx.Engine()
    model = torch.nn.Linear(4, 2 + engine.rank)
    try:
        engine.prepare(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_models_that_differ_between_ranks_are_refused(run_ranks):
    for message in run_ranks(_mismatched_models, 2):
        assert "differs between ranks" in message


def _bytes_per_window(accum: int) -> dict:
    engine = phalanx.Engine(grad_accum_steps=accum)
    model = engine.prepare(OddNet())
    x, y = make_data(4 * accum)
    seen = []
    for micro in range(accum):
        with engine.accumulate():
            before = engine.strategy.stats.bytes["all_reduce"]
            rows = slice(4 * micro, 4 * micro + 4)
            engine.backward(F.mse_loss(model(x[rows]), y[rows]))
            seen.append(engine.strategy.stats.bytes["all_reduce"] - before)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return {"per_micro": seen, "grad_bytes": grad_bytes}


def test_accumulation_window_communicates_only_at_its_end(run_ranks):
    for res in run_ranks(_bytes_per_window, 2, 4):
        assert res["per_micro"] == [0, 0, 0, res["grad_bytes"]]


def _launch_order() -> dict:
    """Record each bucket's all-reduce: its size, and how many gradients had landed when it started."""
    import phalanx.strategies.ddp as ddp_module

    engine = phalanx.Engine(bucket_mb=1e-6)  # one bucket per parameter
    model = engine.prepare(OddNet())
    landed, launches = [0], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: landed.__setitem__(0, landed[0] + 1))
    real_all_reduce = ddp_module.dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        launches.append((tensor.numel(), landed[0]))
        return real_all_reduce(tensor, *args, **kwargs)

    ddp_module.dist.all_reduce = recording_all_reduce
    x, y = make_data(4)
    engine.backward(F.mse_loss(model(x), y))
    ddp_module.dist.all_reduce = real_all_reduce
    return {"launches": launches, "numels": [p.numel() for p in model.parameters()]}


def test_buckets_launch_in_reverse_parameter_order_during_backward(run_ranks):
    for res in run_ranks(_launch_order, 2):
        sizes = [n for n, _ in res["launches"]]
        assert sizes == res["numels"][::-1]
        # Our hook runs before the counting hook, so bucket k starts after k gradients were counted:
        # the first all-reduces start while backward is still producing the other gradients.
        assert [at for _, at in res["launches"]] == list(range(len(sizes)))


def _unused_on_rank_1_only() -> None:
    engine = phalanx.Engine()
    model = engine.prepare(_PartlyUsed())
    x = torch.ones(3, 4)
    out = model.used(x) + (model.unused(x) if engine.rank == 0 else 0)
    engine.backward(out.sum())


def test_parameter_unused_on_one_rank_fails_without_hanging(run_ranks):
    with pytest.raises(SpawnError) as info:
        run_ranks(_unused_on_rank_1_only, 2, timeout=60)
    assert info.value.rank == 1 and "unused.weight" in str(info.value)


def _reentrant_checkpoint() -> str:
    from torch.utils.checkpoint import checkpoint

    engine = phalanx.Engine(find_unused_parameters=True)
    model = engine.prepare(OddNet())
    x, y = make_data(4)
    try:
        hidden = torch.tanh(model.fc1(x)) * model.scale
        # The last layers are checkpointed: their backward runs as a nested backward inside the outer one.
        out = checkpoint(lambda h: model.out(torch.relu(model.fc2(h))), hidden, use_reentrant=True)
        engine.backward(F.mse_loss(out, y))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_reentrant_checkpoint_is_refused_rather_than_reducing_twice(run_ranks):
    for message in run_ranks(_reentrant_checkpoint, 2):
        assert "use_reentrant=False" in message


def _plain_backward_after_engine_backward() -> list[float]:
    engine = phalanx.Engine()
    model = engine.prepare(torch.nn.Linear(1, 1, bias=False))
    x = torch.full((1, 1), float(engine.rank + 1))
    grads = []
    for use_engine in (True, False):
        if use_engine:
            engine.backward(model(x).sum())
        else:
            model(x).sum().backward()  # a user who calls backward directly still gets the mean over ranks
        grads.append(model.weight.grad.item())
        model.zero_grad()
    return grads


def test_plain_backward_still_averages_after_engine_backward(run_ranks):
    assert run_ranks(_plain_backward_after_engine_backward, 2) == [[1.5, 1.5], [1.5, 1.5]]

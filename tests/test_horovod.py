"""``phalanx.horovod``: Horovod's PyTorch API on phalanx, against a single-process reference (gloo, 1-3 ranks).

Tolerances: fp32 training matches single-process training within rtol = atol = 1e-5 (losses and parameters);
with fp16 gradient compression, within rtol = atol = 2e-3 (each gradient is rounded to fp16 once per step).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _common import OddNet, global_order, make_data, make_optimizer, reference_run

import phalanx.horovod as hvd

STEPS, GLOBAL_BATCH = 6, 12  # 12 splits evenly over 1, 2, 3 and 4 ranks
TOL = dict(rtol=1e-5, atol=1e-5)
FP16_TOL = dict(rtol=2e-3, atol=2e-3)
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_hvd.py"


def _train(opt: str, steps: int, global_batch: int, passes: int = 1, op: str = "average", fp16: bool = False) -> dict:
    """A Horovod-style loop: each rank takes its contiguous share of every global batch (``passes`` micro-batches)."""
    hvd.init()
    hvd.init()  # idempotent
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(100 + rank)  # differs by rank on purpose: broadcast_parameters must make the replicas equal
    model = OddNet()
    optimizer = make_optimizer(opt, model.parameters())
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        op=hvd.Sum if op == "sum" else hvd.Average,
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x_all, y_all = make_data(steps * global_batch)
    order = global_order(len(x_all), 0, 0)
    micro = global_batch // (size * passes)
    # Horovod sums over the passes and (op=Average) averages over the ranks; these factors make that the mean.
    loss_factor = 1.0 / passes / (size if op == "sum" else 1)
    losses, fp16_exact, differs_before_last_pass = [], True, False
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch].view(passes, size, micro)
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for k in range(passes):
            batch = idx[k, rank]
            loss = F.mse_loss(model(x_all[batch]), y_all[batch])
            (loss * loss_factor).backward()
            step_loss += loss.detach() / passes
            if k < passes - 1:  # not reduced yet: each rank still holds its own sum
                grads = hvd.allgather(model.fc1.weight.grad.reshape(1, -1))
                differs_before_last_pass |= not torch.equal(grads[0], grads[1])
        if fp16:
            optimizer.synchronize()
            # The wire carried fp16: the sum of two ranks is an fp16 value, and the average is half of it.
            fp16_exact &= all(torch.equal(p.grad * size, (p.grad * size).half().float()) for p in model.parameters())
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        losses.append(hvd.allreduce(step_loss).item())
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "fp16_exact": fp16_exact,
        "differs": differs_before_last_pass,
        "size": hvd.size(),
    }


def _check_against_reference(results: list[dict], opt: str, tol: dict) -> None:
    ref_losses, ref_state = reference_run(OddNet, STEPS, GLOBAL_BATCH, opt)
    for rank, res in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref_losses), **tol, msg=f"losses, rank {rank}"
        )
        for k in ref_state:
            torch.testing.assert_close(res["state"][k], ref_state[k], **tol, msg=f"{k}, rank {rank}")


# AdamW(weight_decay=0.1) also guards the broadcast_optimizer_state trap: a zero-gradient step would decay the weights.
@pytest.mark.parametrize("world_size,opt", [(2, "adamw"), (2, "sgd"), (3, "adamw")])
def test_training_matches_single_process(run_ranks, world_size, opt):
    results = run_ranks(_train, world_size, opt, STEPS, GLOBAL_BATCH)
    assert [r["size"] for r in results] == [world_size] * world_size
    _check_against_reference(results, opt, TOL)


def test_backward_passes_per_step_sums_locally_then_reduces(run_ranks):
    # SGD is sensitive to the gradient's scale, so dividing by the number of passes (which Horovod does not) would show.
    results = run_ranks(_train, 2, "sgd", STEPS, GLOBAL_BATCH, 2)
    assert all(r["differs"] for r in results), "gradients were reduced before the last backward pass of the step"
    _check_against_reference(results, "sgd", TOL)


def test_op_sum_adds_the_ranks_gradients(run_ranks):
    results = run_ranks(_train, 2, "sgd", STEPS, GLOBAL_BATCH, 1, "sum")
    _check_against_reference(results, "sgd", TOL)


def test_fp16_compression_is_close_and_travels_as_fp16(run_ranks):
    results = run_ranks(_train, 2, "adamw", STEPS, GLOBAL_BATCH, 1, "average", True)
    assert all(r["fp16_exact"] for r in results)
    _check_against_reference(results, "adamw", FP16_TOL)


def _collectives() -> dict:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    value = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    out = {
        "average": hvd.allreduce(value),
        "sum": hvd.allreduce(value, op=hvd.Sum),
        "old_sum": hvd.allreduce(value, average=False),
        "min": hvd.allreduce(value, op=hvd.Min),
        "max": hvd.allreduce(value, op=hvd.Max),
        "product": hvd.allreduce(value, op=hvd.Product),
        "input_kept": value.clone(),
        "scaled": hvd.allreduce(value, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        "int_average": hvd.allreduce(torch.tensor([rank + 1, 2 * rank + 1])),
        "fp16": hvd.allreduce(value, compression=hvd.Compression.fp16),
    }
    in_place = value.clone()
    out["in_place_is_same"] = hvd.allreduce_(in_place, op=hvd.Sum) is in_place
    out["in_place"] = in_place
    out["gather"] = hvd.allgather(torch.full((rank + 1, 2), float(rank)))  # uneven first dimensions
    out["broadcast"] = hvd.broadcast(torch.tensor([rank, rank]), root_rank=1)
    mine = torch.tensor([rank * 1.0])
    hvd.broadcast_(mine, root_rank=size - 1)
    out["broadcast_"] = mine
    out["object"] = hvd.broadcast_object({"from": rank, "items": [rank] * 3} if rank == 2 else None, root_rank=2)
    out["objects"] = hvd.allgather_object(f"rank{rank}")
    # Gradients flow through the collectives as in Horovod.
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    hvd.allreduce(x * (rank + 1), op=hvd.Sum).sum().backward()
    out["grad_allreduce"] = x.grad
    y = torch.ones(rank + 1, requires_grad=True)
    weights = torch.arange(1.0, 7.0)  # the same on every rank; 6 = 1 + 2 + 3 rows
    (hvd.allgather(y) * weights).sum().backward()
    out["grad_allgather"] = y.grad
    z = torch.ones(2, requires_grad=True)
    (hvd.broadcast(z, root_rank=0) * (rank + 1)).sum().backward()
    out["grad_broadcast"] = z.grad
    out["last_joined"] = hvd.join()
    return out


def test_collectives_values_and_gradients(run_ranks):
    results = run_ranks(_collectives, 3)
    for rank, res in enumerate(results):
        assert torch.equal(res["average"], torch.tensor([2.0, 20.0]))
        assert torch.equal(res["sum"], torch.tensor([6.0, 60.0]))
        assert torch.equal(res["old_sum"], torch.tensor([6.0, 60.0]))
        assert torch.equal(res["min"], torch.tensor([1.0, 10.0]))
        assert torch.equal(res["max"], torch.tensor([3.0, 30.0]))
        assert torch.equal(res["product"], torch.tensor([6.0, 6000.0]))
        assert torch.equal(res["input_kept"], torch.tensor([rank + 1.0, 10.0 * (rank + 1)]))
        assert torch.equal(res["scaled"], torch.tensor([6.0, 60.0]))
        # Integers average as Horovod does: the sum scaled and truncated toward zero (6/3 = 2, 9/3 = 3).
        assert torch.equal(res["int_average"], torch.tensor([2, 3]))
        assert res["fp16"].dtype == torch.float32 and torch.equal(res["fp16"], torch.tensor([2.0, 20.0]))
        assert res["in_place_is_same"] and torch.equal(res["in_place"], torch.tensor([6.0, 60.0]))
        assert torch.equal(
            res["gather"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]])
        )
        assert torch.equal(res["broadcast"], torch.tensor([1, 1]))
        assert torch.equal(res["broadcast_"], torch.tensor([2.0]))
        assert res["object"] == {"from": 2, "items": [2, 2, 2]}
        assert res["objects"] == ["rank0", "rank1", "rank2"]
        # Every rank's loss depends on this rank's x * (rank + 1): the output's gradient is summed over the 3 ranks.
        assert torch.equal(res["grad_allreduce"], torch.full((2,), 3.0 * (rank + 1)))
        # This rank's rows of the weights (the gradient is averaged over ranks, and the ranks agree).
        start = sum(range(1, rank + 1))
        assert torch.equal(res["grad_allgather"], torch.arange(1.0, 7.0)[start : start + rank + 1])
        # Only the root's input gets the (averaged) gradient: (1 + 2 + 3) / 3.
        assert torch.equal(res["grad_broadcast"], torch.full((2,), 2.0 if rank == 0 else 0.0))
        assert res["last_joined"] == results[0]["last_joined"] and 0 <= res["last_joined"] < 3


def _mismatches() -> dict:
    # Each call below differs between the ranks; Horovod's coordinator refuses each, on every rank.
    hvd.init()
    rank = hvd.rank()
    calls = {
        "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if rank == 0 else torch.float32)),
        "same_numel": lambda: hvd.allreduce(torch.ones((2, 3) if rank == 0 else (3, 2))),
        "size": lambda: hvd.allreduce(torch.ones(3 + rank)),  # gloo used to abort the process
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=rank),  # used to hang until the watchdog
        "broadcast_shape": lambda: hvd.broadcast_(torch.ones(2 + rank), root_rank=0),
        "gather_trailing": lambda: hvd.allgather(torch.ones(2, 2 + rank)),
        "op": lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if rank == 0 else hvd.Max),
    }
    out: dict = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except RuntimeError as e:  # Horovod's error type
            out[name] = str(e)
    wide = hvd.allreduce(torch.tensor([30000, -3], dtype=torch.int16), op=hvd.Sum)  # gloo has no int16
    out["int16"] = (wide.dtype, wide.tolist())
    out["after"] = hvd.allreduce(torch.tensor([1.0])).item()  # the world still works after the refusals
    return out


def test_mismatched_calls_raise_on_every_rank_as_horovod_does(run_ranks):
    for out in run_ranks(_mismatches, 2):
        assert "rank 0: hvd.allreduce with dtype int32, shape (3,)" in out["dtype"], out["dtype"]
        assert "rank 1: hvd.allreduce with dtype float32, shape (3,)" in out["dtype"]
        assert "shape (2, 3)" in out["same_numel"] and "shape (3, 2)" in out["same_numel"]
        assert "shape (3,)" in out["size"] and "shape (4,)" in out["size"]
        assert "root rank 0" in out["root"] and "root rank 1" in out["root"]
        assert "shape (2,), root rank 0" in out["broadcast_shape"] and "shape (3,)" in out["broadcast_shape"]
        assert "shape (2, 2)" in out["gather_trailing"] and "first dimension may differ" in out["gather_trailing"]
        assert "op Sum" in out["op"] and "op Max" in out["op"]
        # 30000 + 30000 wraps in int16, as Horovod's int16 sum does
        assert out["int16"] == (torch.int16, [torch.tensor(60000).to(torch.int16).item(), -6])
        assert out["after"] == 1.0


def _more_operations() -> dict:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict = {}
    hvd.barrier()
    # alltoall: rank r sends rows [r*10 + j] to rank j, equal parts, then uneven splits
    out["alltoall"] = hvd.alltoall(torch.tensor([[rank * 10.0 + j] for j in range(size)])).reshape(-1).tolist()
    sent = torch.arange(3.0) + 100 * rank  # rank 0 keeps 1 row and sends 2; rank 1 keeps 2 and sends 1
    got, counts = hvd.alltoall(sent, splits=[1, 2] if rank == 0 else [1, 2])
    out["alltoall_splits"] = (got.tolist(), counts.tolist())
    # reducescatter of 5 rows over 2 ranks: rank 0 gets rows 0-2, rank 1 rows 3-4 (the first ranks one more)
    rows = torch.arange(5.0)[:, None] * (rank + 1)
    out["reducescatter"] = hvd.reducescatter(rows, op=hvd.Sum).reshape(-1).tolist()
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(1)], op=hvd.Sum)]
    handle = hvd.allreduce_async(torch.tensor([float(rank)]), op=hvd.Sum)
    out["async"] = (hvd.poll(handle), hvd.synchronize(handle).tolist())
    out["built"] = (hvd.ccl_built(), hvd.ddl_built())
    # SyncBatchNorm over the ranks' halves of one batch, against torch's BatchNorm1d on the whole batch.
    torch.manual_seed(3)
    batch = torch.randn(6, 4, 3) * 3 + 1
    mine = batch[rank * 3 : rank * 3 + 3].clone().requires_grad_()
    sync_bn = hvd.SyncBatchNorm(4)
    y = sync_bn(mine)
    (y * torch.arange(1.0, 4.0)).sum().backward()  # every rank's loss; their sum is the whole batch's
    out["sync_bn"] = {
        "y": y.detach(),
        "grad": mine.grad,
        "running": (sync_bn.running_mean.clone(), sync_bn.running_var.clone()),
        "weight_grad": hvd.allreduce(sync_bn.weight.grad, op=hvd.Sum),
        "eval": sync_bn.eval()(mine.detach()),
    }
    return out


def test_horovod_s_other_operations(run_ranks):
    first, second = run_ranks(_more_operations, 2)
    assert first["alltoall"] == [0.0, 10.0] and second["alltoall"] == [1.0, 11.0]
    assert first["alltoall_splits"] == ([0.0, 100.0], [1, 1])
    assert second["alltoall_splits"] == ([1.0, 2.0, 101.0, 102.0], [2, 2])
    assert first["reducescatter"] == [0.0, 3.0, 6.0] and second["reducescatter"] == [9.0, 12.0]
    assert first["grouped"] == [[1.0, 1.0], [2.0]]
    assert first["async"][1] == [1.0] and first["built"] == (False, False)
    torch.manual_seed(3)
    batch = torch.randn(6, 4, 3) * 3 + 1
    whole = batch.clone().requires_grad_()
    bn = torch.nn.BatchNorm1d(4)
    y = bn(whole)
    (y * torch.arange(1.0, 4.0)).sum().backward()
    for rank, res in enumerate((first, second)):
        got, rows = res["sync_bn"], slice(rank * 3, rank * 3 + 3)
        torch.testing.assert_close(got["y"], y.detach()[rows], **TOL)
        torch.testing.assert_close(got["grad"], whole.grad[rows], **TOL)
        torch.testing.assert_close(got["running"][0], bn.running_mean, **TOL)
        torch.testing.assert_close(got["running"][1], bn.running_var, **TOL)
        torch.testing.assert_close(got["weight_grad"], bn.weight.grad, **TOL)
        torch.testing.assert_close(got["eval"], bn.eval()(batch[rows]), **TOL)


def _adasum() -> dict:
    hvd.init()
    rank = hvd.rank()
    out = {
        # Adasum's rule: orthogonal gradients add; parallel ones average, whatever their scale
        "orthogonal": hvd.allreduce(torch.eye(2)[rank], op=hvd.Adasum).tolist(),
        "equal": hvd.allreduce(torch.tensor([2.0, 4.0]), op=hvd.Adasum).tolist(),
        "scaled": hvd.allreduce(torch.tensor([1.0, 0.0]) * (1 + 9 * rank), op=hvd.Adasum).tolist(),
    }
    # The optimizer combines the ranks' steps: SGD with lr 1 on orthogonal gradients steps by their sum.
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], op=hvd.Adasum)
    (w * -torch.eye(2)[rank]).sum().backward()
    optimizer.step()
    out["optimizer"] = w.detach().tolist()
    return out


def test_adasum_adds_orthogonal_and_averages_equal_gradients(run_ranks):
    for out in run_ranks(_adasum, 2):
        assert out["orthogonal"] == pytest.approx([1.0, 1.0])
        assert out["equal"] == pytest.approx([2.0, 4.0])
        # parallel vectors of norms 1 and 10: (1 - 10/2)*1 + (1 - 10/200)*10 = -4 + 9.5 = 5.5, their mean
        assert out["scaled"] == pytest.approx([5.5, 0.0])
        assert out["optimizer"] == pytest.approx([1.0, 1.0])


def test_adasum_tree_pairs_neighbours_in_rank_order():
    from phalanx.compat.horovod.adasum import adasum_pair, adasum_tree

    vectors = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 2.0])]
    expected = adasum_pair(adasum_pair(vectors[0], vectors[1]), vectors[2])  # the third has no partner at level 1
    assert torch.equal(adasum_tree(vectors), expected) and expected.tolist() == [1.0, 1.0, 2.0]
    assert torch.equal(adasum_pair(torch.zeros(3), vectors[2]), vectors[2])  # a zero vector leaves the other


def _optimizer_state_broadcast() -> dict:
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = OddNet()  # the same weights on every rank
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2 if rank == 0 else 0.5, weight_decay=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    out: dict = {
        "untouched": all(torch.equal(before[k], v) for k, v in model.state_dict().items()),
        "fresh_state": len(fresh.state),
        "lr": fresh.param_groups[0]["lr"],
        # Horovod leaves zero gradients behind on a fresh optimizer's parameters, and scripts read them.
        "zero_grads": all(p.grad is not None and not p.grad.any() for p in model.parameters()),
    }
    # Now only the root has state (a local step), the others are fresh: they receive the root's tensors as they are.
    stepped = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if rank == 0:
        F.mse_loss(model(torch.ones(4, 13)), torch.zeros(4, 3)).backward()
        stepped.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_optimizer_state(stepped, root_rank=0)
    out["untouched_after_state"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out["state"] = {i: {k: v.clone() for k, v in stepped.state[p].items()} for i, p in enumerate(model.parameters())}
    # A root without state clears the others' state.
    other = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 1:
        other.state[model.fc1.weight]["momentum_buffer"] = torch.ones_like(model.fc1.weight)
    hvd.broadcast_optimizer_state(other, root_rank=0)
    out["cleared"] = len(other.state)
    return out


def test_broadcast_optimizer_state_leaves_parameters_untouched(run_ranks):
    results = run_ranks(_optimizer_state_broadcast, 2)
    for res in results:
        # A fresh AdamW(weight_decay=0.1): no zero-gradient step (Horovod takes one, which decays the weights).
        assert res["untouched"] and res["untouched_after_state"]
        assert res["fresh_state"] == 0 and res["lr"] == 1e-2  # the root's hyperparameters, no state created
        assert res["zero_grads"]
        assert res["cleared"] == 0
    root, other = results[0]["state"], results[1]["state"]
    assert set(root) == set(other) and len(root) == 6
    for i in root:
        assert set(root[i]) == {"step", "exp_avg", "exp_avg_sq"}
        for k in root[i]:
            assert torch.equal(root[i][k], other[i][k]), (i, k)
    assert float(other[0]["step"]) == 1.0 and other[0]["exp_avg"].abs().sum() > 0


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.a, self.b = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 1, bias=False)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _optimizer_protocol() -> dict:
    hvd.init()
    rank, out = hvd.rank(), {}
    x = torch.full((2, 3), rank + 1.0)
    model = _TwoLayers()  # a new model for each optimizer: each one hooks its parameters
    # op=Sum, then step() after synchronize() outside skip_synchronize(): the gradients are reduced once.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Sum)
    model.a(x).sum().backward()  # rank r: d/dw of sum(a(x)) = 2 * (r + 1) everywhere; b gets no gradient
    opt.synchronize()
    out["synchronized"] = model.a.weight.grad.clone()
    out["unused_grad"] = model.b.weight.grad.clone()  # Horovod reduces a parameter with no gradient as zeros
    opt.step()
    out["after_step"] = model.a.weight.grad.clone()
    opt.zero_grad()
    # gradient_predivide_factor moves part of the division before the sum: the average is the same.
    model = _TwoLayers()
    pre = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gradient_predivide_factor=4.0)
    model.a(x).sum().backward()
    pre.synchronize()
    out["predivided"] = model.a.weight.grad.clone()
    # A parameter used on one rank only: the other contributes zeros, and the average halves it.
    model = _TwoLayers()
    avg = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(x, use_b=rank == 0).sum().backward()
    out["b_grad"] = model.b.weight.grad.clone()
    plain = _TwoLayers()  # rank 0's local gradient of b, computed without any reduction
    plain(torch.ones(2, 3)).sum().backward()
    out["b_grad_rank0"] = plain.b.weight.grad
    avg.step()
    avg.zero_grad()
    # zero_grad() inside a window, and more backward passes than declared, are errors.
    model = _TwoLayers()
    acc = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
    model(x).sum().backward()
    try:
        acc.zero_grad()
        out["zero_grad"] = "no error"
    except RuntimeError as e:
        out["zero_grad"] = str(e)
    model(x).sum().backward()
    try:
        model(x).sum().backward()
        out["too_many"] = "no error"
    except RuntimeError as e:
        out["too_many"] = str(e)
    # Sparse gradients (an Embedding(sparse=True) under SparseAdam): reduced as sparse tensors, or densified.
    for dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        sparse_opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), emb.named_parameters(), sparse_as_dense=dense
        )
        emb(torch.tensor([[0, 2], [2, 5]]) if rank == 0 else torch.tensor([[1, 2]])).sum().backward()
        sparse_opt.synchronize()
        out[f"sparse_grad_{dense}"] = (emb.weight.grad.is_sparse, emb.weight.grad.to_dense())
        with sparse_opt.skip_synchronize():
            sparse_opt.step()
    return out


def test_optimizer_protocol(run_ranks):
    results = run_ranks(_optimizer_protocol, 2)
    for res in results:
        assert torch.equal(res["synchronized"], torch.full((3, 3), 2.0 + 4.0))  # summed over the ranks
        assert torch.equal(res["after_step"], res["synchronized"])  # not reduced a second time
        assert torch.equal(res["unused_grad"], torch.zeros(1, 3))
        assert torch.equal(res["predivided"], torch.full((3, 3), 3.0))  # (2 + 4) / 2
        assert torch.equal(res["b_grad"], res["b_grad_rank0"] / 2)
        assert res["b_grad"].abs().sum() > 0
        assert "zero_grad() after 1 backward pass" in res["zero_grad"]
        assert "backward ran 3 times" in res["too_many"] and "backward_passes_per_step=2" in res["too_many"]
        # rows used: rank 0 rows 0, 2, 2, 5; rank 1 rows 1, 2; averaged over the 2 ranks
        expected = torch.tensor([1.0, 1.0, 3.0, 0.0, 0.0, 1.0])[:, None].expand(6, 2) / 2
        for dense in (False, True):
            is_sparse, grad = res[f"sparse_grad_{dense}"]
            assert is_sparse and torch.equal(grad, expected), (dense, grad)


def test_bad_input_gets_clear_errors():
    hvd.shutdown()
    model = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match=r"hvd.init\(\) has not been called"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"hvd.init\(\) has not been called"):
        hvd.rank()
    hvd.init()  # one process: no process group
    try:
        assert hvd.is_initialized() and (hvd.size(), hvd.rank(), hvd.local_rank(), hvd.local_size()) == (1, 0, 0, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"op=hvd.Adasum takes no compression"):
            hvd.DistributedOptimizer(sgd, op=hvd.Adasum, compression=hvd.Compression.fp16)
        with pytest.raises(ValueError, match=r"these appear more than once: w"):
            hvd.DistributedOptimizer(sgd, named_parameters=[("w", model.weight), ("w", model.bias)])
        with pytest.raises(ValueError, match=r"missing: group 0 parameter 1 \(shape \(2,\)\)"):
            hvd.DistributedOptimizer(sgd, named_parameters=[("weight", model.weight)])
        with pytest.raises(ValueError, match=r"\(name, parameter\) pairs"):
            hvd.DistributedOptimizer(sgd, named_parameters=list(model.parameters()))
        with pytest.raises(ValueError, match=r"backward_passes_per_step=0 must be a positive integer"):
            hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
        with pytest.raises(ValueError, match=r"op=7 is not a reduction"):
            hvd.DistributedOptimizer(sgd, op=7)
        with pytest.raises(ValueError, match=r"gradient_predivide_factor=2.0 splits an average, but op=hvd.Sum"):
            hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
        with pytest.raises(TypeError, match=r"compression='fp16' has no compress/decompress"):
            hvd.DistributedOptimizer(sgd, compression="fp16")
        with pytest.raises(ValueError, match=r"both op=.* and average=True"):
            hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
        with pytest.raises(ValueError, match=r"root_rank=1 is not a rank of this world \(use 0 to 0\)"):
            hvd.broadcast_parameters(model.state_dict(), root_rank=1)
        with pytest.raises(ValueError, match=r"entry 'x' is a str, not a tensor"):
            hvd.broadcast_parameters({"x": "not a tensor"}, root_rank=0)
        with pytest.raises(ValueError, match=r"op=hvd.Max has no gradient"):
            hvd.allreduce(torch.ones(2, requires_grad=True), op=hvd.Max)
        with pytest.raises(ValueError, match=r"comm="):
            hvd.init(comm=[0, 1])
        wrapped = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        assert isinstance(wrapped, torch.optim.SGD) and wrapped.state is sgd.state
        with pytest.raises(ValueError, match=r"already a DistributedOptimizer"):
            hvd.DistributedOptimizer(wrapped)
        # One process: the optimizer steps as the original would.
        model(torch.ones(1, 3)).sum().backward()
        before = model.weight.detach().clone()
        wrapped.step()
        torch.testing.assert_close(model.weight.detach(), before - 0.1 * torch.ones(2, 3))
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PHALANX_DEVICE": "cpu", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240, env=full_env)


def _finals(stdout: str) -> dict[int, tuple[float, float]]:
    # Ranks print concurrently, and an unbuffered print writes the line and its newline separately: match numbers only.
    found = re.findall(r"final rank (\d+) of \d+ loss (-?[0-9.]+) checksum (-?[0-9.]+)", stdout)
    return {int(r): (float(loss), float(cs)) for r, loss, cs in found}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[tuple[float, float], dict]:
    """The example run as a plain one-process script: the reference for the launched runs."""
    tmp = tmp_path_factory.mktemp("one")
    proc = _run([sys.executable, str(EXAMPLE), "--save", str(tmp / "one.pt")], tmp)
    assert proc.returncode == 0, proc.stderr
    finals = _finals(proc.stdout)
    assert set(finals) == {0}, proc.stdout
    return finals[0], torch.load(tmp / "one.pt")


LAUNCHERS = {
    "phalanx": [sys.executable, "-m", "phalanx", "launch", "-n", "2"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_example_on_two_ranks_matches_one_process(one_process, launcher, tmp_path):
    proc = _run([*LAUNCHERS[launcher], str(EXAMPLE), "--save", str(tmp_path / "two.pt")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ranks = _finals(proc.stdout)
    assert set(ranks) == {0, 1}, proc.stdout
    assert ranks[0] == ranks[1], "the ranks disagree on the final loss or weights"
    (single, ref) = one_process
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(single), **TOL)
    got = torch.load(tmp_path / "two.pt")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=k)


def _horovod_python() -> str | None:
    """An interpreter that imports Horovod: this one, or HOROVOD_PYTHON (Horovod 0.28 needs patches to build)."""
    for python in (sys.executable, os.environ.get("HOROVOD_PYTHON")):
        if python and subprocess.run([python, "-c", "import horovod.torch"], capture_output=True).returncode == 0:
            return python
    return None


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_example_against_real_horovod(opt, tmp_path):
    python = _horovod_python()
    if python is None:
        pytest.skip("horovod is not importable (build it into a venv and point HOROVOD_PYTHON at its python)")
    args = ["--optimizer", opt]
    ours = _run([*LAUNCHERS["phalanx"], str(EXAMPLE), *args, "--save", str(tmp_path / "ours.pt")], tmp_path)
    assert ours.returncode == 0, ours.stderr
    runner = [python, "-m", "horovod.runner.launch", "-np", "2", "-H", "localhost:2", "--gloo"]
    real = _run([*runner, python, str(EXAMPLE), *args, "--real-horovod", "--save", str(tmp_path / "real.pt")], tmp_path)
    assert real.returncode == 0, real.stderr + real.stdout
    ref, got = torch.load(tmp_path / "real.pt"), torch.load(tmp_path / "ours.pt")
    if opt == "sgd":
        # Horovod's zero-gradient step in broadcast_optimizer_state leaves SGD without weight decay as it was.
        torch.testing.assert_close(torch.tensor(_finals(ours.stdout)[0]), torch.tensor(_finals(real.stdout)[0]), **TOL)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], **TOL, msg=k)
    else:
        # With AdamW(weight_decay=0.1) that step decays the weights and counts an Adam step: Horovod drifts from
        # single-process training, which we match (test_example_on_two_ranks_matches_one_process).
        drift = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert drift > 1e-3, f"real Horovod matched us within {drift}: has its broadcast_optimizer_state changed?"


def test_a_call_before_init_is_a_value_error_as_in_horovod(monkeypatch):
    from phalanx.compat.horovod import world

    monkeypatch.setattr(world, "_WORLD", None)
    with pytest.raises(ValueError, match=r"hvd.allreduce needs the world, but hvd.init\(\) has not been called"):
        hvd.allreduce(torch.ones(1))


def _process_sets_join_and_matching() -> dict:
    # Three ranks: process sets (rank 1 outside the set [0, 2]), join standing in for a finished rank, operations
    # matched by name across ranks, and init -> shutdown -> init.
    hvd.init()
    rank, out = hvd.rank(), {}
    even = hvd.add_process_set([2, 0])  # sorted, as Horovod sorts it
    alone = hvd.add_process_set(hvd.ProcessSet([1]))
    pair = hvd.add_process_set([0, 1])
    out["sets"] = (even.ranks, even.size(), even.rank(), even.included(), hvd.global_process_set.size())
    try:
        hvd.add_process_set([0, 2])
    except ValueError as e:
        out["duplicate"] = str(e)
    value = torch.tensor([float(rank + 1)])
    if rank in (0, 2):
        out["set_sum"] = hvd.allreduce(value, op=hvd.Sum, process_set=even).item()  # 1 + 3
        out["set_gather"] = hvd.allgather(value, process_set=even).tolist()
        out["set_bcast"] = hvd.broadcast(value, root_rank=2, process_set=even).item()
        out["set_objects"] = hvd.allgather_object(rank, process_set=even)
    else:
        out["alone_sum"] = hvd.allreduce(value, op=hvd.Sum, process_set=alone).item()
        try:
            hvd.allreduce(value, process_set=even)
        except ValueError as e:
            out["outside"] = str(e)
    # DistributedOptimizer over [0, 2]: those two average their gradients, rank 1 steps on its own.
    w = torch.nn.Parameter(torch.zeros(1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], process_set=even)
    (w * (rank + 1) ** 2).sum().backward()  # local gradients 1, 4, 9
    opt.step()
    out["set_step"] = w.item()  # -(1 + 9) / 2 on ranks 0 and 2, -4 on rank 1
    out["removed"] = (hvd.remove_process_set(even), hvd.remove_process_set(hvd.global_process_set))
    try:
        hvd.barrier(process_set=even)
    except ValueError as e:
        out["after_remove"] = str(e)

    # Ranks issue two named operations in different orders: Horovod matches them by name, so must we.
    if rank == 0:
        first = hvd.allreduce_async(torch.tensor([1.0]), name="a", op=hvd.Sum)
        second = hvd.allreduce_async(torch.tensor([10.0]), name="b", op=hvd.Sum)
    else:
        second = hvd.allreduce_async(torch.tensor([10.0]), name="b", op=hvd.Sum)
        first = hvd.allreduce_async(torch.tensor([1.0]), name="a", op=hvd.Sum)
    try:
        hvd.allreduce_async(torch.tensor([1.0]), name="a")
    except ValueError as e:
        out["in_flight"] = str(e)
    out["by_name"] = (hvd.synchronize(first).item(), hvd.synchronize(second).item())
    # Ranks that wait for different operations raise, all of them, instead of hanging.
    try:
        if rank == 0:
            hvd.allreduce(torch.ones(1), name="x")
        else:
            hvd.broadcast(torch.ones(1), root_rank=0, name="y")
    except RuntimeError as e:
        out["stall"] = str(e)

    # join: rank 0 has finished; ranks 1 and 2 keep reducing, rank 0 standing in with zeros.
    if rank == 0:
        out["last"] = hvd.join()
    else:
        out["joined_avg"] = hvd.allreduce(value).item()  # (0 + 2 + 3) / 3: Horovod still divides by 3
        out["joined_grouped"] = [t.item() for t in hvd.grouped_allreduce([value, value * 10], op=hvd.Sum)]
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        model(torch.full((1, 2), float(rank))).sum().backward()  # gradients 1 and 2
        opt.step()
        out["joined_step"] = model.weight.detach().tolist()  # -(0 + 1 + 2) / 3
        try:
            hvd.allgather(value)
        except hvd.JoinedRanksError as e:
            out["joined_gather"] = str(e)
        if rank == 1:  # a set holding the joined rank 0: it stands in on the global set only, so this raises
            try:
                hvd.allreduce(value, process_set=pair)
            except hvd.JoinedRanksError as e:
                out["joined_set"] = str(e)
        out["last"] = hvd.join()

    hvd.shutdown()
    hvd.init()
    out["reinit"] = (hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())
    return out


def test_process_sets_join_and_name_matching(run_ranks):
    results = run_ranks(_process_sets_join_and_matching, 3)
    for rank, out in enumerate(results):
        assert out["sets"] == ([0, 2], 2, {0: 0, 1: None, 2: 1}[rank], rank != 1, 3)
        assert "a process set with ranks [0, 2] exists already" in out["duplicate"]
        if rank != 1:
            assert out["set_sum"] == 4.0 and out["set_gather"] == [1.0, 3.0] and out["set_bcast"] == 3.0
            assert out["set_objects"] == [0, 2] and out["set_step"] == -5.0
        else:
            assert out["alone_sum"] == 2.0 and out["set_step"] == -4.0
            assert "this rank (1) is not in process set 1 (ranks [0, 2])" in out["outside"]
        assert out["removed"] == (True, False) and "is not registered" in out["after_remove"]
        assert "'a' is already in flight" in out["in_flight"] and out["by_name"] == (3.0, 30.0)
        assert "wait for different Horovod operations" in out["stall"], out["stall"]
        assert "rank 0: x" in out["stall"] and "rank 2: y" in out["stall"]
        if rank:
            assert out["joined_avg"] == pytest.approx(5 / 3)
            assert out["joined_grouped"] == [5.0, 50.0]
            assert out["joined_step"] == [[-1.0, -1.0]]
            assert "rank(s) [0] have called hvd.join()" in out["joined_gather"]
        if rank == 1:
            assert "process set [0, 1]: rank(s) [0] have called hvd.join()" in out["joined_set"]
        assert out["last"] == 2  # ranks 1 and 2 joined in the same round: the higher rank counts as last
        assert out["reinit"] == (rank, 3, 3.0)


ELASTIC_SCRIPT = """
import os
import sys

import torch

import phalanx.horovod as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0, seen=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


@hvd.elastic.run
def train(state):
    while state.step < 8:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(state.step * 10 + hvd.rank()))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        state.step += 1
        state.seen.append(state.step)
        if state.step % 2 == 0:
            state.commit()
        if sys.argv[1] == "kill" and hvd.rank() == 1 and state.step == 5 and restart == "0":
            os._exit(3)  # a rank lost after step 5: the others are in step 6, the last commit is step 4


train(state)
w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
print(f"final rank {hvd.rank()} restart {restart} resets {resets} seen {state.seen} sum {w.sum().item():.12f} "
      f"sq {w.square().sum().item():.12f}", flush=True)
"""


def _elastic_reference() -> torch.Tensor:
    """ELASTIC_SCRIPT's training in one process: each step averages the two ranks' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(8):
        grads = []
        for rank in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            model.zero_grad()
            model(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) * 0.5
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def test_elastic_run_restores_the_last_commit_after_a_rank_is_lost(tmp_path):
    script = tmp_path / "elastic_train.py"
    script.write_text(ELASTIC_SCRIPT)
    launch = [*LAUNCHERS["phalanx"], "--max-restarts", "1", "--resume-from", str(tmp_path / "commits")]
    proc = _run([*launch, str(script), "kill"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"final rank (\d) restart (\d) resets (\[.*?\]) seen (\[.*?\]) sum (\S+) sq (\S+)", proc.stdout)
    assert sorted(f[0] for f in found) == ["0", "1"], proc.stdout
    for _, restart, resets, seen, *_ in found:
        assert restart == "1" and resets == "[2]"  # restarted once; the reset callbacks ran, on 2 ranks
        assert seen == str(list(range(1, 9)))  # the objects rolled back to the step-4 commit, then went on
    assert found[0][4:] == found[1][4:], found  # identical replicas
    ref = _elastic_reference()
    got = torch.tensor([float(found[0][4]), float(found[0][5])], dtype=torch.float64)
    torch.testing.assert_close(got, torch.stack([ref.sum(), ref.square().sum()]), **TOL)  # steps 5, 6 done again

"""Pipeline parallelism (GPipe and 1F1B, alone and with data parallelism) against a single-process reference,
and against torch.distributed.pipelining.

Tolerance: losses and parameters within rtol = atol = 1e-5 in fp32 after 10 steps. The model (pipe_model in
_common.py) has 8 blocks of odd sizes, a parameter-free block, stage boundaries that carry a tuple of three
tensors (one of them a bool mask), residual blocks, and two param groups with their own lr and weight decay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import (
    Residual,
    grouped_optimizer,
    make_data,
    pipe_loss,
    pipe_loss_sum,
    pipe_model,
    pipe_reference_run,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.config.settings import ConfigError, EngineConfig
from phalanx.config.strategy_options import parse_partition
from phalanx.launch import SpawnError
from phalanx.strategies.pipeline.partition import partition_blocks

STEPS, GLOBAL_BATCH = 10, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _in_order_reference(steps: int, frozen_blocks: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch on pipe_model(): global batches of make_data taken in row order (as the
    tests that call train_step on slices do), the first ``frozen_blocks`` blocks frozen."""
    torch.manual_seed(100)
    model = pipe_model()
    for block in list(model)[:frozen_blocks]:
        block.requires_grad_(False)
    optimizer = grouped_optimizer("adamw", model)
    x, y = make_data(steps * GLOBAL_BATCH)
    losses = []
    for i in range(steps):
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        loss = pipe_loss(model, (x[rows], y[rows]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(steps: int = STEPS, opt: str = "adamw", loss_fn=pipe_loss, model_fn=pipe_model, **options) -> dict:
    engine = phalanx.Engine(strategy="pipeline", seed=0, **options)
    torch.manual_seed(100)
    model = model_fn()
    optimizer = grouped_optimizer(opt, model)
    x, y = make_data(steps * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // engine.topology.dp_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = engine.train_step(batch, loss_fn)
        losses.append(engine.reduce(loss, "mean").item())  # each replica's mean, averaged over the replicas
    return {
        "losses": losses,
        "state": engine.get_state_dict(model),
        "desc": engine.strategy.describe(),
        "local": sorted(n for n, _ in model.named_parameters()),
        "peak_in_flight": engine.strategy.peak_in_flight,
        "calls": dict(engine.strategy.stats.calls),
        # Elements of optimizer state this rank holds (AdamW: exp_avg and exp_avg_sq), and its stage's parameters.
        "opt_elems": sum(t.numel() for st in optimizer.optimizer.state.values() for t in st.values() if t.dim() > 0),
        "stage_elems": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _schedules_and_microbatches(pp_size: int, partition: str) -> dict:
    return {
        (sched, m): _train(pp_size=pp_size, pp_schedule=sched, pp_microbatches=m, pp_partition=partition)
        for sched in ("gpipe", "1f1b")
        for m in (2, 4, 8)
    }


# Explicit cuts put tuple boundaries between stages: stage 1 of pp=2 starts at Carry, and pp=3 cuts after Fork
# and after Join. pp=2 x dp=2 uses the default parameter-balanced partition.
@pytest.mark.parametrize(
    "world_size,pp_size,partition,stage_blocks",
    [
        (2, 2, "3", [["0", "1", "2"], ["3", "4", "5", "6", "7"]]),
        (3, 3, "3,5", [["0", "1", "2"], ["3", "4"], ["5", "6", "7"]]),
        (4, 2, "parameters", None),
    ],
    ids=["pp2", "pp3", "pp2xdp2"],
)
def test_pipeline_matches_single_process(run_ranks, world_size, pp_size, partition, stage_blocks):
    ref_losses, ref_state = pipe_reference_run(STEPS, GLOBAL_BATCH, "adamw")
    results = run_ranks(_schedules_and_microbatches, world_size, pp_size, partition)
    dp_size = world_size // pp_size
    for rank, per_rank in enumerate(results):
        for (sched, m), res in per_rank.items():
            where = f"{sched}, m={m}, rank {rank} of pp={pp_size} x dp={dp_size}"
            torch.testing.assert_close(
                torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"losses, {where}"
            )
            assert set(res["state"]) == set(ref_state)
            for k in ref_state:
                torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, {where}")
            stages = res["desc"]["stage_blocks"]
            if stage_blocks is not None:
                assert stages == stage_blocks
            # Point to point: per micro-batch one message per boundary tensor each way, plus the shapes once.
            stage, (fwd, bwd) = rank // dp_size, _boundary_sizes(stages)
            sends = STEPS * m * (fwd[stage] + (bwd[stage - 1] if stage else 0))
            recvs = STEPS * m * ((fwd[stage - 1] if stage else 0) + bwd[stage])
            sends_meta = 2 if stage < pp_size - 1 else 0  # a length, then the description, to the next stage
            recvs_meta = 2 if stage > 0 else 0
            assert res["calls"].get("send", 0) == sends + sends_meta, (where, res["calls"])
            assert res["calls"].get("recv", 0) == recvs + recvs_meta, (where, res["calls"])
            # This rank holds exactly its own stage's parameters, under the whole model's names.
            mine = stages[rank // dp_size]
            assert res["local"] == sorted(k for k in ref_state if k.split(".")[0] in mine), where
    if partition == "parameters":
        # Balanced parameter counts: no other contiguous split has a smaller largest stage.
        costs = [sum(p.numel() for p in b.parameters()) for b in pipe_model()]
        cut = len(results[0][("1f1b", 2)]["desc"]["stage_blocks"][0])
        largest = max(sum(costs[:cut]), sum(costs[cut:]))
        assert largest == min(max(sum(costs[:i]), sum(costs[i:])) for i in range(1, len(costs)))


def _boundary_sizes(stages: list[list[str]]) -> tuple[list[int], list[int]]:
    """Tensors crossing the boundary after each stage of pipe_model, forward and backward. After Fork and Carry
    it is a tuple of 3, whose bool mask gets no gradient; elsewhere one tensor."""
    tuples = [s[-1] in ("2", "3") for s in stages[:-1]]
    return [3 if t else 1 for t in tuples] + [0], [2 if t else 1 for t in tuples] + [0]


def _sum_loss_with_clip() -> dict:
    return {
        sched: _train(pp_size=2, pp_schedule=sched, pp_microbatches=4, loss_fn=pipe_loss_sum, max_grad_norm=0.3)
        for sched in ("gpipe", "1f1b")
    }


def test_pipeline_summed_loss_and_clipping(run_ranks):
    """(loss_sum, items) with item counts that differ per micro-batch and replica; the global norm clipped to 0.3."""
    _, ref_state = pipe_reference_run(STEPS, GLOBAL_BATCH, "adamw", sum_loss=True, clip=0.3)
    for rank, per_rank in enumerate(run_ranks(_sum_loss_with_clip, 4)):
        for sched, res in per_rank.items():
            # The returned loss is each replica's sum / its items (replicas differ in items): parameters compare.
            for k in ref_state:
                torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, {sched}, rank {rank}")


# ------------------------------------------------------------------------------ zero1 across the replicas
def _zero1_runs() -> dict:
    runs = {
        sched: _train(pp_size=2, pp_schedule=sched, pp_microbatches=4, pp_zero_stage=1) for sched in ("gpipe", "1f1b")
    }
    # The time partition splits at the first step, after the optimizer was prepared: it is sharded then.
    runs["time"] = _train(pp_size=2, pp_microbatches=4, pp_zero_stage=1, pp_partition="time")
    runs["clip"] = _train(pp_size=2, pp_microbatches=4, pp_zero_stage=1, loss_fn=pipe_loss_sum, max_grad_norm=0.3)
    return runs


def test_pipeline_zero1_matches_single_process(run_ranks):
    """pp=2 x dp=2 with pp_zero_stage=1: each stage's optimizer state is split between its two replicas, and
    losses and parameters still match one process (rtol = atol = 1e-5), clipped summed losses included."""
    ref_losses, ref_state = pipe_reference_run(STEPS, GLOBAL_BATCH, "adamw")
    _, clip_state = pipe_reference_run(STEPS, GLOBAL_BATCH, "adamw", sum_loss=True, clip=0.3)
    results = run_ranks(_zero1_runs, 4)
    for rank, per_rank in enumerate(results):
        for run, res in per_rank.items():
            where = f"{run}, rank {rank} of pp=2 x dp=2, pp_zero_stage=1"
            assert res["desc"]["pp_zero_stage"] == 1
            if run != "clip":
                torch.testing.assert_close(
                    torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"losses, {where}"
                )
            expected = clip_state if run == "clip" else ref_state
            for k in expected:
                torch.testing.assert_close(res["state"][k], expected[k], **TOL, msg=f"{k}, {where}")
    for run in ("gpipe", "1f1b", "time"):
        for stage in (0, 1):
            a, b = results[2 * stage][run], results[2 * stage + 1][run]  # the two replicas of the stage
            assert a["stage_elems"] == b["stage_elems"]
            # Together the replicas hold the stage's AdamW moments once; each holds half, up to the padding.
            assert a["opt_elems"] + b["opt_elems"] == 2 * a["stage_elems"], (run, stage, a["opt_elems"], b["opt_elems"])
            assert max(a["opt_elems"], b["opt_elems"]) <= a["stage_elems"] + 64, (run, stage)


def _frozen_stage_zero1(entries) -> dict:
    engine = phalanx.Engine(
        strategy="pipeline", pp_size=2, pp_zero_stage=1, pp_partition="3", pp_microbatches=4, seed=0
    )
    torch.manual_seed(100 if entries is None else 999)  # a load must bring back every tensor, the frozen stage's too
    model = pipe_model()
    for block in list(model)[:3]:
        block.requires_grad_(False)  # stage 0 (blocks 0-2) has nothing to train: zero1 does not take it
    optimizer = grouped_optimizer("adamw", model)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = make_data(2 * GLOBAL_BATCH)
    first, second = (x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]), (x[GLOBAL_BATCH:], y[GLOBAL_BATCH:])
    saved = []
    if entries is None:  # step 1, save, step 2
        engine.train_step(first, pipe_loss)
        saved = [e._replace(data=e.data.clone()) for e in engine.strategy.sharded_state(model, optimizer.optimizer)]
    else:  # load what was saved after step 1, step 2
        engine.strategy.load_sharded_state(model, optimizer.optimizer, _Reader(entries))
    last = engine.train_step(second, pipe_loss).item()
    return {"entries": saved, "last": last, "state": engine.get_state_dict(model)}


def _whole(entries) -> list:
    """Slices of the same tensor from several ranks, merged; each element must come exactly once."""
    from phalanx.checkpoint.shards import ShardEntry

    parts: dict = {}
    for e in entries:
        parts.setdefault(e.key, []).append(e)
    out = []
    for key, es in parts.items():
        es.sort(key=lambda e: e.start)
        assert [e.start for e in es] == [0] + [e.stop for e in es[:-1]] and es[-1].stop == es[0].data.new_empty(
            es[0].shape
        ).numel(), key
        out.append(ShardEntry(key, es[0].shape, 0, es[-1].stop, torch.cat([e.data.reshape(-1) for e in es])))
    return out


def test_pipeline_zero1_with_a_frozen_stage(run_ranks):
    """A stage with nothing to train stays whole on its replicas; its tensors still save and load. The first
    run's two steps also match plain single-process torch with the same blocks frozen (rtol = atol = 1e-5)."""
    first = run_ranks(_frozen_stage_zero1, 4, None)
    ref_losses, ref_state = _in_order_reference(2, frozen_blocks=3)
    for rank, res in enumerate(first):
        assert abs(res["last"] - ref_losses[-1]) < 1e-5, (rank, res["last"], ref_losses[-1])
        assert set(res["state"]) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(res["state"][k], v, **TOL, msg=f"{k}, rank {rank} against torch")
    entries = _whole([e for res in first for e in res["entries"]])
    assert {e.key[len("model/") :] for e in entries if e.key.startswith("model/")} == set(first[0]["state"])
    assert not any(e.key.startswith("optim/0.") for e in entries)  # the frozen stage has no optimizer state
    # Loaded after step 1 into other initial weights, step 2 continues as the first run's step 2.
    for res in run_ranks(_frozen_stage_zero1, 4, entries):
        assert abs(res["last"] - first[0]["last"]) < 1e-5, (res["last"], first[0]["last"])
        for k, v in first[0]["state"].items():
            torch.testing.assert_close(res["state"][k], v, **TOL, msg=k)


# ---------------------------------------------------------------------------------- against the torch peer
def _peer_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(13, 24), nn.Tanh(), nn.Linear(24, 16), Residual(16), Residual(16), nn.Linear(16, 3))


def _against_torch_pipelining(schedule: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m = 4
    ours = _train(pp_size=2, pp_schedule=schedule, pp_microbatches=m, pp_partition="3", model_fn=_peer_model)
    rank = dist.get_rank()
    torch.manual_seed(100)
    full = _peer_model()
    optimizer = grouped_optimizer("adamw", full)
    mine = nn.Sequential(*list(full)[:3]) if rank == 0 else nn.Sequential(*list(full)[3:])
    stage = PipelineStage(mine, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=F.mse_loss)
    from _common import global_order

    x_all, y_all = make_data(STEPS * GLOBAL_BATCH)
    order = global_order(len(x_all), 0, 0)
    losses = []
    for step in range(STEPS):
        idx = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        if rank == 0:
            sched.step(x_all[idx])
        else:
            mb_losses: list[torch.Tensor] = []
            sched.step(target=y_all[idx], losses=mb_losses)
            losses.append(torch.stack(mb_losses).mean().item())
        optimizer.step()
        optimizer.zero_grad()
    return {
        "ours": ours,
        "theirs": {"losses": losses, "state": {k: v.detach().clone() for k, v in mine.state_dict().items()}},
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_torch_pipelining(run_ranks, schedule):
    results = run_ranks(_against_torch_pipelining, 2, schedule)
    # torch's stage modules are nn.Sequential slices renumbered from 0; ours keep the whole model's names.
    offset = {0: 0, 1: 3}
    for rank, res in enumerate(results):
        ours, theirs = res["ours"], res["theirs"]
        if rank == 1:
            torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), **TOL)
        for k, v in theirs["state"].items():
            i, rest = k.split(".", 1)
            torch.testing.assert_close(ours["state"][f"{int(i) + offset[rank]}.{rest}"], v, **TOL, msg=k)


# ------------------------------------------------------------------------------- 1F1B holds fewer activations
class _SavedCounter:
    """Counts the bytes autograd holds for backward (saved tensors), live and at the peak, through pack hooks."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0

    def pack(self, t: torch.Tensor) -> object:
        counter = self

        class _Held:
            def __init__(self) -> None:
                self.t, self.n = t, t.numel() * t.element_size()
                counter.live += self.n
                counter.total += self.n
                counter.peak = max(counter.peak, counter.live)

            def __del__(self) -> None:
                counter.live -= self.n

        return _Held()

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.t  # type: ignore[attr-defined]


def _live_activations(m: int) -> dict:
    out = {}
    for sched in ("gpipe", "1f1b"):
        engine = phalanx.Engine(strategy="pipeline", pp_schedule=sched, pp_microbatches=m, pp_partition="3,5", seed=0)
        torch.manual_seed(100)
        model = pipe_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = engine.prepare(model, optimizer)
        x, y = make_data(GLOBAL_BATCH)
        counter = _SavedCounter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            engine.train_step((x, y), pipe_loss)
        # Every micro-batch saves the same bytes, so peak / (total / m) is the number of micro-batches held at once.
        out[sched] = {"held": counter.peak * m / counter.total, "counted": engine.strategy.peak_in_flight}
    return out


def test_1f1b_holds_at_most_pp_micro_batches(run_ranks):
    m, pp = 8, 3
    for stage, res in enumerate(run_ranks(_live_activations, pp, m)):
        assert res["gpipe"]["held"] == m, (stage, res)
        assert res["1f1b"]["held"] == min(pp - stage, m), (stage, res)  # 3, 2, 1 on stages 0, 1, 2
        assert res["gpipe"]["counted"] == m and res["1f1b"]["counted"] == min(pp - stage, m)


# ----------------------------------------------------------------------------------- other things that work
def _forward_outside_train_step() -> dict:
    engine = phalanx.Engine(strategy="pipeline", pp_partition="3", seed=0)
    torch.manual_seed(100)
    model = pipe_model()
    model = engine.prepare(model)
    x, _ = make_data(6)
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    out_grad = model(x)
    try:
        out_grad.sum().backward()
        message = None
    except RuntimeError as e:
        message = str(e)
    return {"out": out, "message": message}


def test_forward_outside_train_step_returns_output_on_every_stage(run_ranks):
    torch.manual_seed(100)
    reference = pipe_model()
    x, _ = make_data(6)
    with torch.no_grad():
        expected = reference(x)
    for res in run_ranks(_forward_outside_train_step, 2):
        torch.testing.assert_close(res["out"], expected, **TOL)
        assert "train_step" in res["message"]


def _meta_built(pp_size: int) -> dict:
    engine = phalanx.Engine(
        strategy="pipeline", pp_size=pp_size, pp_partition="3" if pp_size == 2 else "parameters", seed=7
    )
    with torch.device("meta"):
        model = pipe_model()
    whole = model
    model = engine.prepare(model)
    return {
        "state": engine.get_state_dict(model),
        "meta_elsewhere": all(
            p.is_meta for n, p in whole.named_parameters() if n not in dict(model.named_parameters())
        ),
        "local_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta),
    }


def test_meta_built_model_is_materialised_stage_by_stage(run_ranks):
    """Built under torch.device('meta'), each rank allocates only its stage; the weights do not depend on the split."""
    single = run_ranks(_meta_built, 1, 1)[0]
    costs = [sum(p.numel() * 4 for p in b.parameters()) for b in pipe_model()]
    for rank, res in enumerate(run_ranks(_meta_built, 2, 2)):
        assert res["meta_elsewhere"]
        assert res["local_bytes"] == (sum(costs[:3]) if rank == 0 else sum(costs[3:]))
        for k, v in single["state"].items():
            assert torch.equal(res["state"][k], v), k


class _Heavy(nn.Module):
    """Does ~50x the work of the other blocks of _time_blocks() together."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(300):
            x = torch.tanh(self.fc(x))
        return x


def _time_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(13, 24), nn.Tanh(), _Heavy(), nn.Linear(24, 24), nn.Linear(24, 3)]


def _time_partition() -> dict:
    # Block 2 (_Heavy) dominates: timing must give it a stage of its own.
    blocks = _time_blocks()
    engine = phalanx.Engine(strategy="pipeline", pp_partition="time", pp_microbatches=2, seed=0)
    model, optimizer = engine.prepare(blocks, torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1))
    x, y = make_data(8)
    losses = [engine.train_step((x, y), pipe_loss).item() for _ in range(3)]
    return {
        "desc": engine.strategy.describe(),
        "losses": losses,
        "in_optimizer": {id(p) for g in optimizer.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
        "held": len(list(model.parameters())),
    }


def test_partition_by_measured_time(run_ranks):
    results = run_ranks(_time_partition, 2)
    assert results[0]["desc"]["stage_blocks"] == results[1]["desc"]["stage_blocks"]
    assert results[0]["desc"]["stage_blocks"] in ([["0", "1", "2"], ["3", "4"]], [["0", "1"], ["2", "3", "4"]])
    costs = results[0]["desc"]["stage_costs"]
    assert max(costs) > 5 * min(costs)  # the heavy block dominates its stage
    assert results[0]["losses"] == results[1]["losses"]
    # The same 3 steps in plain torch, one process, the 8 rows as one batch (rtol = atol = 1e-5).
    blocks = _time_blocks()
    model = nn.Sequential(*blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(8)
    ref = []
    for _ in range(3):
        loss = pipe_loss(model, (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref), **TOL)
    # After the split each rank holds, and its optimizer steps, only its own stage's parameters (8 in all).
    assert all(res["in_optimizer"] for res in results)
    assert results[0]["held"] + results[1]["held"] == 8 and min(results[0]["held"], results[1]["held"]) > 0


def test_partition_helpers():
    assert partition_blocks([1, 1, 1, 1], 2) == [0, 2]
    assert partition_blocks([10, 0, 0, 1, 1, 8], 2) == [0, 3]  # (10 | 10), parameter-free blocks spread out
    assert partition_blocks([5, 1, 1, 1, 1, 1], 3)[:2] == [0, 1]  # the 5 alone; the rest split in any way
    assert partition_blocks([1, 2, 3], 3) == [0, 1, 2]
    assert parse_partition("3,6") == [3, 6]
    assert parse_partition("time") == "time"
    for bad in ("6,3", "0,2", "a,b", "3,3"):
        with pytest.raises(ValueError, match="pp_partition"):
            parse_partition(bad)


def _precision_runs() -> dict:
    out = {}
    for precision in ("bf16-mixed", "fp16-mixed"):
        engine = phalanx.Engine(strategy="pipeline", precision=precision, pp_partition="3", pp_microbatches=4, seed=0)
        torch.manual_seed(100)
        model = pipe_model()
        optimizer = grouped_optimizer("adamw", model)
        model, optimizer = engine.prepare(model, optimizer)
        x, y = make_data(6 * GLOBAL_BATCH)
        losses = [
            engine.train_step(
                (x[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]), pipe_loss
            ).item()
            for i in range(6)
        ]
        out[precision] = {"losses": losses, "scale": engine.precision.loss_scale, "report": engine.precision_report()}
    return out


def test_pipeline_mixed_precision(run_ranks):
    ref, _ = _in_order_reference(6)
    results = run_ranks(_precision_runs, 2)
    for precision in ("bf16-mixed", "fp16-mixed"):
        # Every stage reports the same loss, and the fp16 loss scale moved identically on both stages.
        assert results[0][precision]["losses"] == results[1][precision]["losses"]
        assert results[0][precision]["scale"] == results[1][precision]["scale"]
        torch.testing.assert_close(
            torch.tensor(results[0][precision]["losses"]), torch.tensor(ref), rtol=2e-2, atol=2e-2
        )
    assert results[0]["fp16-mixed"]["report"]["loss_scaling"] == "dynamic"


# ------------------------------------------------------------------------------------ resharding via hooks
def _save_after(steps: int) -> dict:
    engine = phalanx.Engine(strategy="pipeline", pp_partition="3", pp_microbatches=4, seed=0)
    torch.manual_seed(100)
    model = pipe_model()
    optimizer = grouped_optimizer("adamw", model)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = make_data((steps + 1) * GLOBAL_BATCH)
    batches = [
        (x[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH])
        for i in range(steps + 1)
    ]
    for b in batches[:steps]:
        engine.train_step(b, pipe_loss)
    entries = [e._replace(data=e.data.clone()) for e in engine.strategy.sharded_state(model, optimizer.optimizer)]
    last = engine.train_step(batches[steps], pipe_loss).item()
    return {"entries": entries, "last": last, "state": engine.get_state_dict(model)}


class _Reader:
    def __init__(self, entries) -> None:
        self.entries = {e.key: e for e in entries}

    def keys(self):
        return self.entries.keys()

    def shape(self, key):
        return self.entries[key].shape

    def read(self, key, start, stop):
        e = self.entries[key]
        return e.data[start - e.start : stop - e.start]


def _load_and_continue(entries, steps: int, strategy: str, options: dict) -> dict:
    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(999)  # other initial weights: everything must come from the saved state
    model = pipe_model()
    optimizer = grouped_optimizer("adamw", model)
    model, optimizer = engine.prepare(model, optimizer)
    engine.strategy.load_sharded_state(model, optimizer.optimizer, _Reader(entries))
    x, y = make_data((steps + 1) * GLOBAL_BATCH)
    batch = (x[steps * GLOBAL_BATCH :], y[steps * GLOBAL_BATCH :])
    last = engine.train_step(batch, pipe_loss).item()
    return {"last": last, "state": engine.get_state_dict(model)}


def test_pipeline_state_hooks_reshard(run_ranks):
    """Shards saved by pp=2 continue training under pp=3 with other cut points, and under ddp on one rank.
    The saving run itself (3 steps, save, 1 more) is held to plain single-process torch (rtol = atol = 1e-5)."""
    saved = run_ranks(_save_after, 2, 3)
    ref_losses, ref_state = _in_order_reference(4)
    for rank, res in enumerate(saved):
        assert abs(res["last"] - ref_losses[-1]) < 1e-5, (rank, res["last"], ref_losses[-1])
        for k, v in ref_state.items():
            torch.testing.assert_close(res["state"][k], v, **TOL, msg=f"{k}, saving run rank {rank} against torch")
    entries = [e for res in saved for e in res["entries"]]
    keys = [e.key for e in entries]
    assert len(keys) == len(set(keys))  # every tensor given once, by the stage that holds it
    assert {k[len("model/") :] for k in keys if k.startswith("model/")} == set(saved[0]["state"])
    for strategy, world, options in (("pipeline", 3, {"pp_partition": "2,6", "pp_microbatches": 2}), ("ddp", 1, {})):
        for res in run_ranks(_load_and_continue, world, entries, 3, strategy, options):
            assert abs(res["last"] - saved[0]["last"]) < 1e-5, (strategy, res["last"], saved[0]["last"])
            for k, v in saved[0]["state"].items():
                torch.testing.assert_close(res["state"][k], v, **TOL, msg=lambda m: f"{k} under {strategy}: {m}")  # noqa: B023 - called in this iteration


# --------------------------------------------------------------------------------------------- bad input
def _bad_inputs() -> dict:
    import torch.distributed as dist

    errors = {}

    def catch(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            errors[name] = f"{type(e).__name__}: {e}"

    engine = phalanx.Engine(strategy="pipeline", pp_microbatches=4, seed=0)
    catch("more_stages_than_blocks", lambda: engine.prepare(nn.Sequential(nn.Linear(3, 3))))
    catch("not_sequential", lambda: engine.prepare(nn.Linear(3, 3)))
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    catch("shared_parameter", lambda: engine.prepare(tied))
    catch("cuts", lambda: phalanx.Engine(strategy="pipeline", pp_partition="1,2").prepare(pipe_model()))

    model, _ = engine.prepare(pipe_model(), torch.optim.SGD(pipe_model().parameters(), lr=0.1))
    x, y = make_data(6)
    catch("indivisible_batch", lambda: engine.train_step((x, y), pipe_loss))
    catch("backward", lambda: engine.backward(model(x).sum()))
    catch("accumulate", lambda: engine.accumulate().__enter__())
    dist.barrier()
    return errors


def _no_model_call() -> str:
    engine = phalanx.Engine(strategy="pipeline", pp_microbatches=2, seed=0)
    engine.prepare(pipe_model(), torch.optim.SGD(pipe_model().parameters(), lr=0.1))
    try:
        engine.train_step(make_data(8), lambda m, b: b[0].sum())
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_pipeline_bad_input(run_ranks):
    errors = run_ranks(_bad_inputs, 2)[0]
    assert "cannot split 1 blocks into pp_size=2 stages" in errors["more_stages_than_blocks"]
    assert "nn.Sequential" in errors["not_sequential"] and "Linear" in errors["not_sequential"]
    assert "cannot share a parameter" in errors["shared_parameter"] and "0.weight" in errors["shared_parameter"]
    assert "pp_size=2 needs 1 cut points" in errors["cuts"]
    assert "a batch of 6 samples does not split into pp_microbatches=4" in errors["indivisible_batch"]
    for key in ("backward", "accumulate"):
        assert "engine.train_step(batch, loss_fn)" in errors[key], errors[key]
    assert "did not call model" in run_ranks(_no_model_call, 1)[0]


def _pp2_engine() -> None:
    phalanx.Engine(strategy="pipeline", pp_size=2)


def test_pipeline_world_size_must_be_pp_times_dp(run_ranks):
    with pytest.raises(
        SpawnError,
        match=r"pp x dp_replicate x dp_shard x cp x tp = 2 does not divide the world; pp_size=2 .*world size 3",
    ):
        run_ranks(_pp2_engine, 3)


def _failing_stage() -> None:
    engine = phalanx.Engine(strategy="pipeline", pp_microbatches=2, seed=0)
    model, optimizer = engine.prepare(pipe_model(), torch.optim.SGD(pipe_model().parameters(), lr=0.1))
    x, y = make_data(4)
    for step in range(3):

        def loss_fn(m, b):
            if step == 2 and engine.strategy.is_last:  # noqa: B023 - called in this iteration
                raise ValueError("a bug in the last stage's loss")
            return pipe_loss(m, b)

        engine.train_step((x, y), loss_fn)


def test_one_failing_stage_tears_down_with_its_rank(run_ranks):
    """Stage 0 waits for gradients that never come; the launcher must end it and name rank 1, not hang."""
    with pytest.raises(SpawnError, match=r"rank 1") as info:
        run_ranks(_failing_stage, 2, timeout=60)
    assert "a bug in the last stage's loss" in str(info.value)


def test_pipeline_config_errors():
    with pytest.raises(ConfigError, match="grad_accum_steps=4 does not apply to strategy='pipeline'"):
        EngineConfig(strategy="pipeline", grad_accum_steps=4)
    with pytest.raises(ConfigError, match="pp_size=2 .* needs strategy='pipeline'"):
        EngineConfig(strategy="ddp", pp_size=2)
    with pytest.raises(ConfigError, match="pp_schedule='gpipe' applies to strategy='pipeline' only"):
        EngineConfig(strategy="zero2", pp_schedule="gpipe")
    with pytest.raises(ConfigError, match="pp_schedule"):
        EngineConfig(strategy="pipeline", pp_schedule="interleaved")
    with pytest.raises(ConfigError, match="cut points"):
        EngineConfig(strategy="pipeline", pp_partition="4,2")
    with pytest.raises(ConfigError, match="pp_zero_stage=2 is not supported: use 0 .* or 1"):
        EngineConfig(strategy="pipeline", pp_zero_stage=2)
    with pytest.raises(ConfigError, match="pp_zero_stage=1 applies to strategy='pipeline' only; got strategy='zero1'"):
        EngineConfig(strategy="zero1", pp_zero_stage=1)
    EngineConfig(strategy="pipeline", pp_zero_stage=1, zero_allow_untested_optimizer=True, zero_collectives="native")
    with pytest.raises(ConfigError, match="under strategy='pipeline' with pp_zero_stage=1, zero_collectives and"):
        EngineConfig(strategy="pipeline", zero_allow_untested_optimizer=True)

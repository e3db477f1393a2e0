"""Checkpoints under tensor parallelism: whole tensors in the format, any saved layout loads on any other.

The unit tests simulate the ranks of a (dp, tp) mesh in one process: each rank's pieces are real ``TPParam``
parameters (split along dim 0, along dim 1, a packed ``[q; k; v]``, kv heads replicated under tp4, a replicated
norm) with Adam-like state, saved through :class:`TPCheckpointView` around ddp's own checkpoint methods, then loaded
on every other layout and read back whole. Everything is compared bitwise.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import Checkpoint, CheckpointError
from phalanx.checkpoint.format import MANIFEST, write_json_durably, write_shard
from phalanx.checkpoint.shards import ChunkSpec, chunk_segments, read_chunk_into
from phalanx.checkpoint.state import TrainingParts, _manifest, load_checkpoint, save_checkpoint
from phalanx.config.mesh import Mesh
from phalanx.runtime.topology import Topology
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.tensor_parallel import TPParam, TPRngTracker, tp_slice_of
from phalanx.strategies.tensor_parallel.checkpoint import TPCheckpointView

# name: (whole shape, split dim, packed blocks, kv heads: the parts when fewer than tp)
LAYOUTS: dict[str, tuple[tuple[int, ...], int | None, int, int | None]] = {
    "col.weight": ((8, 6), 0, 1, None),
    "row.weight": ((6, 8), 1, 1, None),
    "qkv.weight": ((12, 6), 0, 3, None),
    "kv.weight": ((4, 6), 0, 1, 2),
    "norm.weight": ((6,), None, 1, None),
}
FULL = {n: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (n, (shape, *_)) in
        enumerate(LAYOUTS.items())}  # fmt: skip
EXP_AVG = {n: t * 3 - 1 for n, t in FULL.items()}
MASK = torch.arange(5.0)


def info_of(name: str, tp: int, tp_rank: int) -> TPParam:
    shape, dim, packed, kv = LAYOUTS[name]
    if dim is None:
        return TPParam(shape, None, 0, 1, tp, False)
    parts = tp if kv is None else min(kv, tp)
    return TPParam(shape, dim, tp_rank // (tp // parts), parts, tp // parts, False, packed)


class FakeDDP:
    """ddp's own checkpoint methods on one rank of a (dp, tp) mesh, without its reducers."""

    name = "ddp"
    sharded_state = DDPStrategy.sharded_state
    load_sharded_state = DDPStrategy.load_sharded_state
    state_shapes = DDPStrategy.state_shapes
    full_state_dict = DDPStrategy.full_state_dict
    state_dict_keys = DDPStrategy.state_dict_keys

    def __init__(self, topology: Topology) -> None:
        self.topology, self.device = topology, torch.device("cpu")

    def finish_gradient_sync(self) -> None:
        pass

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model


def rank_state(tp: int, tp_rank: int, empty: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One tp rank's model pieces and optimizer state (zeros and no state when ``empty``)."""
    root = nn.Module()
    for name in LAYOUTS:
        module_name, attr = name.split(".")
        sub = nn.Module()
        setattr(root, module_name, sub)
        info = info_of(name, tp, tp_rank)
        p = nn.Parameter(torch.zeros(info.local_shape) if empty else tp_slice_of(FULL[name], info).clone())
        p._phalanx_tp = info  # type: ignore[attr-defined]
        sub.register_parameter(attr, p)
    root.register_buffer("mask", torch.zeros(5) if empty else MASK.clone())
    opt = torch.optim.Adam(root.parameters())
    if not empty:
        for name, p in root.named_parameters():
            info = p._phalanx_tp  # type: ignore[attr-defined]
            opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": tp_slice_of(EXP_AVG[name], info).clone()}
    return root, opt


def save_layout(path: Path, tp: int, dp: int = 1) -> Checkpoint:
    """Every rank of a dp x tp mesh (tp innermost) writes its shard; the manifest as rank 0 writes it."""
    path.mkdir(parents=True)
    world, reports = tp * dp, []
    for rank in range(world):
        topo = Topology(Mesh(world, dp_shard=world // tp, tp=tp), rank)
        model, opt = rank_state(tp, topo.tp_rank)
        entries = TPCheckpointView(FakeDDP(topo), topo).sharded_state(model, [opt])
        written = write_shard(path, rank, world, entries) if entries else None
        reports.append({"error": None, "file": written, "rng": None})
    keys = {k: k for k in [*LAYOUTS, "mask"]}
    state = {"counters": {}, "seed": 0, "models": [{"class": "M", "state_dict_keys": keys}], "optimizers": [],
             "schedulers": [], "loaders": [], "objects": [], "precision": None}  # fmt: skip
    write_json_durably(
        path / MANIFEST,
        _manifest(state, reports, FakeDDP(topo), Topology(Mesh(world, dp_shard=world // tp, tp=tp), 0)),
    )
    return Checkpoint(path)


def check_loads(reader_of: Any, tp: int, dp: int = 1) -> None:
    """Every rank of a dp x tp mesh loads its pieces and optimizer state, bitwise."""
    for rank in range(tp * dp):
        topo = Topology(Mesh(tp * dp, dp_shard=dp, tp=tp), rank)
        model, opt = rank_state(tp, topo.tp_rank, empty=True)
        TPCheckpointView(FakeDDP(topo), topo).load_sharded_state(model, [opt], reader_of())
        assert torch.equal(model.mask, MASK)
        for name, p in model.named_parameters():
            info = info_of(name, tp, topo.tp_rank)
            assert torch.equal(p.detach(), tp_slice_of(FULL[name], info)), (name, tp, rank)
            assert torch.equal(opt.state[p]["exp_avg"], tp_slice_of(EXP_AVG[name], info)), (name, tp, rank)
            assert float(opt.state[p]["step"]) == 3.0


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("tp", [2, 4])
def test_chunk_segments_place_every_element_as_tp_slice_of(name, tp):
    full = torch.arange(math.prod(LAYOUTS[name][0])).reshape(LAYOUTS[name][0])
    rng = random.Random(0)
    for tp_rank in range(tp):
        info = info_of(name, tp, tp_rank)
        local = tp_slice_of(full, info).reshape(-1)
        chunk = (
            None if info.dim is None or info.parts == 1 else ChunkSpec(info.dim, info.parts, info.packed, info.index)
        )
        for a, b in [(0, local.numel())] + [sorted(rng.sample(range(local.numel() + 1), 2)) for _ in range(20)]:
            got = torch.full((b - a,), -1, dtype=full.dtype)
            for whole, offset, n in chunk_segments(tuple(full.shape), chunk, a, b):
                got[offset : offset + n] = full.reshape(-1)[whole : whole + n]
            assert torch.equal(got, local[a:b]), (name, tp_rank, a, b)


@pytest.mark.parametrize("tp,dp", [(2, 2), (4, 1), (1, 2)])
def test_saved_whole_loads_on_every_layout(tmp_path, tp, dp):
    ck = save_layout(tmp_path / "ck", tp, dp)
    # The format holds whole tensors by their own names and shapes; a split piece is one run per saving rank.
    assert ck.manifest["version"] == (2 if tp > 1 else 1) and ck.manifest["tp_size"] == tp
    assert ck.model_shapes() == {**{n: s for n, (s, *_) in LAYOUTS.items()}, "mask": (5,)}
    for key, info in ck.tensors.items():
        assert len(info["slices"]) <= tp * dp, key
    if tp > 1:
        assert {tuple(run["chunk"][:3]) for run in ck.tensors["model/row.weight"]["slices"]} == {(1, tp, 1)}
        assert len(ck.tensors["optim/row.weight/step"]["slices"]) == 1  # scalars once
        assert "in 2 chunks along dim 0" in ck.describe(tensors=True)  # kv: 2 heads, replicated under tp4
    assert ck.verify() == []
    whole = ck.state_dict()
    for name, t in FULL.items():
        assert torch.equal(whole[name], t), name
        assert torch.equal(ck.read_whole(f"optim/{name}/exp_avg"), EXP_AVG[name]), name
    assert torch.equal(whole["mask"], MASK)
    for tp2, dp2 in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        check_loads(lambda: ck.reader(0), tp2, dp2)
    # Any chunk's elements in any range, from runs that hold parts of other chunks.
    rng = random.Random(1)
    for name in LAYOUTS:
        for tp2 in (2, 4):
            info = info_of(name, tp2, tp2 - 1)
            if info.dim is None or info.parts == 1:
                continue
            chunk = ChunkSpec(info.dim, info.parts, info.packed, info.index)
            local = tp_slice_of(FULL[name], info).reshape(-1)
            for _ in range(10):
                a, b = sorted(rng.sample(range(local.numel() + 1), 2))
                assert torch.equal(ck.read(f"model/{name}", a, b, chunk), local[a:b]), (name, tp2, a, b)
    ck.close()


class MemoryReader:
    """Whole tensors held in memory, with only the StateReader basics (keys, shape, read)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def keys(self) -> Any:
        return self.tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[key].reshape(-1)[start:stop]


def test_whole_tensors_from_any_reader_load_as_pieces():
    tensors = {f"model/{n}": t for n, t in FULL.items()} | {"model/mask": MASK}
    tensors |= {f"optim/{n}/exp_avg": t for n, t in EXP_AVG.items()}
    tensors |= {f"optim/{n}/step": torch.tensor(3.0) for n in FULL}
    reader = MemoryReader(tensors)
    for tp in (1, 2, 4):
        check_loads(lambda: reader, tp)
    out = torch.empty(24)
    read_chunk_into(reader, "model/row.weight", ChunkSpec(1, 2, 1, 1), 0, 24, out)
    assert torch.equal(out, FULL["row.weight"][:, 4:].reshape(-1))


def test_view_gives_whole_shapes_and_delegates_the_rest():
    topo = Topology(Mesh(4, tp=4), 3)
    model, _ = rank_state(4, 3)
    view = TPCheckpointView(FakeDDP(topo), topo)
    assert view.state_shapes(model) == {**{n: s for n, (s, *_) in LAYOUTS.items()}, "mask": (5,)}
    assert view.name == "ddp" and view.unwrap_model(model) is model
    assert view.state_dict_keys(model)["row.weight"] == "row.weight"


def test_damaged_chunk_and_unknown_version_are_refused(tmp_path):
    save_layout(tmp_path / "ck", 2).close()
    path = tmp_path / "ck" / MANIFEST
    m = json.loads(path.read_text())
    m["tensors"]["model/row.weight"]["slices"][0]["chunk"] = [1, 3, 1, 0]  # 8 columns do not cut in 3
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="no chunk of shape"):
        Checkpoint(tmp_path / "ck")
    m["version"] = 3
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="reads versions 1, 2"):
        Checkpoint(tmp_path / "ck")


def test_factored_optimizer_state_is_refused():
    topo = Topology(Mesh(2, tp=2), 0)
    model, opt = rank_state(2, 0)
    opt.state[model.row.weight]["exp_avg_sq_row"] = torch.zeros(6)
    with pytest.raises(ValueError, match="factored state"):
        TPCheckpointView(FakeDDP(topo), topo).sharded_state(model, [opt])


def test_rng_tracker_travels_with_each_rank(tmp_path):
    topo = Topology(Mesh(1), 0)
    model, opt = rank_state(1, 0)
    view = TPCheckpointView(FakeDDP(topo), topo)
    tracker = TPRngTracker(seed=5, tp_rank=0)
    with tracker.fork():
        torch.rand(3)
    parts = TrainingParts([model], [opt], rng_trackers=[tracker])
    save_checkpoint(tmp_path / "ck", parts, view, topo, torch.device("cpu"))
    with tracker.fork():
        expected = torch.rand(3)
    fresh = TPRngTracker(seed=5, tp_rank=0)
    load_checkpoint(
        tmp_path / "ck", TrainingParts([model], [opt], rng_trackers=[fresh]), view, topo, torch.device("cpu")
    )
    with fresh.fork():
        assert torch.equal(torch.rand(3), expected)
    # Saved on another mesh: a fresh stream, a function of the seed and the step.
    m = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    m["tp_size"] = 2
    (tmp_path / "ck" / MANIFEST).write_text(json.dumps(m))
    other = TPRngTracker(seed=5, tp_rank=0)
    load_checkpoint(
        tmp_path / "ck", TrainingParts([model], [opt], rng_trackers=[other]), view, topo, torch.device("cpu")
    )
    assert other.state_dict()["states"] == {} and other.seed != 5


def _full_state_dict(tp: int) -> dict[str, Any]:
    from _tp_common import init_gloo

    rank, world = init_gloo()
    topo = Topology(Mesh(world, dp_shard=world // tp, tp=tp), rank)
    topo.build_groups("cpu")
    model, _ = rank_state(tp, topo.tp_rank)
    state = TPCheckpointView(FakeDDP(topo), topo).full_state_dict(model)
    return {k: torch.equal(v, FULL[k] if k in FULL else MASK) for k, v in state.items()}


def test_full_state_dict_gathers_over_the_tp_group(run_ranks):
    for res in run_ranks(_full_state_dict, 4, 4):
        assert res == {k: True for k in [*LAYOUTS, "mask"]}


# ------------------------------------------------------------------------------- end to end, through the Engine
GPT_PLAN = {
    "0.tok": "embedding_rowwise",
    "*.qkv": "packed_colwise(packed=3, heads=4)",
    "*.proj": "rowwise(heads=4)",
    "*.mlp.0": "colwise",
    "*.mlp.2": "rowwise",
    "3.head": "colwise_gather_output",
}


def _phase(strategy: str, options: dict[str, Any], load_from: str | None, save_to: str, steps: int) -> Any:
    """One layout of the chain: load the previous layout's checkpoint (or train), save, and give the whole weights."""
    import torch.nn.functional as F

    from phalanx.demo import GPTConfig, TinyGPT

    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    model = TinyGPT(cfg).pipeline_blocks()  # one model, names and all, under every layout (pipeline included)
    model, opt = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    topo = engine.topology
    if load_from is not None:
        engine.load_state(load_from)
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(100 * step + topo.dp_rank))
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
    engine.save_state(save_to)
    whole = engine.get_state_dict(model)
    return whole if topo.rank == 0 else None


def test_a_checkpoint_goes_through_every_layout_bitwise(run_ranks, tmp_path):
    chain = [
        ("zero2", {"tp_size": 2, "tp_plan": GPT_PLAN}, 4, 2),  # tp2 x dp2, trained two steps
        ("ddp", {}, 4, 0),  # dp4
        ("pipeline", {"pp_size": 2, "tp_size": 2, "tp_plan": GPT_PLAN}, 4, 0),  # pp2 x tp2
        ("ddp", {}, 1, 0),  # one process
    ]
    saved: list[str] = []
    wholes = []
    for i, (strategy, options, n, steps) in enumerate(chain):
        path = str(tmp_path / f"layout{i}")
        res = run_ranks(_phase, n, strategy, options, saved[-1] if saved else None, path, steps)
        saved.append(path)
        wholes.append(res[0])
    for whole in wholes[1:]:
        assert whole.keys() == wholes[0].keys()
        for key, t in wholes[0].items():
            assert torch.equal(whole[key], t), key
    first = Checkpoint(saved[0])
    assert first.manifest["tp_size"] == 2 and first.manifest["version"] == 2
    keys = sorted(k for k in first.tensors if k.startswith(("model/", "optim/")))
    for path in saved[1:]:
        with Checkpoint(path) as ck:
            assert sorted(k for k in ck.tensors if k.startswith(("model/", "optim/"))) == keys
            for key in keys:
                assert torch.equal(ck.read_whole(key), first.read_whole(key)), (path, key)
    # The whole weights are the checkpoint's (the state dict of the untied pipeline model).
    for key, t in wholes[0].items():
        assert torch.equal(first.state_dict()[key], t), key
    first.close()

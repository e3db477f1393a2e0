"""Which GPU a process takes (issue 36, B3), with CUDA faked: ``torch.cuda.is_available``, ``device_count`` and
``set_device`` are patched, so these run on any machine and check the rule, not a driver.

The rule: a process that sees one GPU uses it whatever its local rank (``srun --gpus-per-task=1``, Kubernetes); with
N visible and at most N processes per node, local rank r takes GPU r; more processes per node than visible GPUs (more
than one) is an error naming the fix; without a local rank from the launcher, it is derived from LOCAL_WORLD_SIZE, and
the global rank is trusted as a GPU index only when it cannot be wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from phalanx.runtime.world import WorldInfo, detect_world, pick_device

FakeCuda = Callable[[int], list[int]]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """``fake_cuda(n)``: CUDA with n visible devices; returns the list that records each ``set_device`` call."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(visible: int) -> list[int]:
        calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device("cuda", d).index))
        return calls

    return install


def _torchrun(rank: int, world: int, local_rank: int | None = None, local_world: int | None = None) -> WorldInfo:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    if local_world is not None:
        env["LOCAL_WORLD_SIZE"] = str(local_world)
    return detect_world(env)


def _srun(procid: int, ntasks: int, localid: int | None, **extra: str) -> WorldInfo:
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        **({"SLURM_LOCALID": str(localid)} if localid is not None else {}),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_JOB_ID": "7",
        **extra,
    }
    return detect_world(env)


@pytest.mark.parametrize(
    "world",
    [
        pytest.param(_torchrun(11, 16, local_rank=3, local_world=8), id="torchrun-local-rank-3"),
        pytest.param(_torchrun(15, 16, local_rank=7, local_world=8), id="torchrun-local-rank-7"),
        # srun --gpus-per-task=1 --ntasks-per-node=8: SLURM narrows CUDA_VISIBLE_DEVICES to one GPU per task
        pytest.param(_srun(13, 16, 5, SLURM_NTASKS_PER_NODE="8"), id="srun-localid-5"),
        pytest.param(_torchrun(6, 8), id="no-local-rank"),
    ],
)
def test_one_visible_gpu_is_used_whatever_the_local_rank(fake_cuda: FakeCuda, world: WorldInfo) -> None:
    calls = fake_cuda(1)
    assert pick_device("auto", world) == torch.device("cuda", 0)
    assert pick_device("cuda", world) == torch.device("cuda", 0)
    assert calls == [0, 0]


def test_local_rank_r_takes_gpu_r_of_eight(fake_cuda: FakeCuda) -> None:
    calls = fake_cuda(8)
    world = _torchrun(11, 16, local_rank=3, local_world=8)
    assert pick_device("auto", world) == torch.device("cuda", 3)
    assert calls == [3]
    # srun -N2 -n16 without --ntasks-per-node: the tasks per node come from SLURM_STEP_TASKS_PER_NODE
    srun = _srun(11, 16, 3, SLURM_STEP_TASKS_PER_NODE="8(x2)")
    assert srun.local_world_size == 8
    assert pick_device("auto", srun) == torch.device("cuda", 3)
    assert calls == [3, 3]


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_more_processes_per_node_than_gpus_names_the_fix(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, local_rank: int
) -> None:
    # Every rank refuses, not only 2 and 3: ranks 0 and 1 would otherwise wait for them in the rendezvous.
    calls = fake_cuda(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    world = _torchrun(4 + local_rank, 8, local_rank=local_rank, local_world=4)
    with pytest.raises(RuntimeError) as info:
        pick_device("auto", world)
    message = str(info.value)
    assert "4 processes per node" in message and "2 GPUs (CUDA_VISIBLE_DEVICES=4,5)" in message
    assert f"local rank {local_rank}" in message
    assert "launch at most 2 processes per node" in message
    assert "CUDA_VISIBLE_DEVICES" in message and "srun --gpus-per-task=1" in message
    assert "device='cpu'" in message
    assert calls == []


def test_too_many_processes_on_slurm_without_a_per_node_count(fake_cuda: FakeCuda) -> None:
    # Only the local id is known: local id 2 of a node with 2 visible GPUs still has none of its own.
    fake_cuda(2)
    with pytest.raises(RuntimeError, match=r"local rank 2 .* 2 GPUs.*srun --gpus-per-task=1"):
        pick_device("auto", _srun(2, 16, 2, SLURM_STEP_TASKS_PER_NODE="4,3"))


def test_without_local_rank_it_comes_from_local_world_size(fake_cuda: FakeCuda) -> None:
    world = _torchrun(5, 8, local_world=4)  # node 1 holds ranks 4-7: rank 5 is its local rank 1
    assert (world.local_rank, world.local_world_size) == (1, 4)
    calls = fake_cuda(4)
    assert pick_device("auto", world) == torch.device("cuda", 1)
    assert calls == [1]


def test_without_any_local_figure_the_global_rank_is_no_gpu_index(fake_cuda: FakeCuda) -> None:
    world = _torchrun(5, 8)  # a launcher that sets RANK and WORLD_SIZE only, two nodes of 4
    calls = fake_cuda(4)
    with pytest.raises(RuntimeError) as info:
        pick_device("auto", world)
    message = str(info.value)
    assert "4 visible GPUs" in message and "global rank 5" in message and "8 processes" in message
    assert "LOCAL_RANK" in message and "LOCAL_WORLD_SIZE" in message and "device='cpu'" in message
    assert calls == []
    # Where the world fits in the visible GPUs, each process's global rank is a GPU of its own on any node.
    calls = fake_cuda(8)
    assert pick_device("auto", world) == torch.device("cuda", 5)
    assert calls == [5]


def test_the_cpu_needs_no_local_rank(fake_cuda: FakeCuda) -> None:
    world = _torchrun(5, 8)
    fake_cuda(0)
    assert pick_device("auto", world) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pick_device("cuda", world)
    calls = fake_cuda(2)
    assert pick_device("cpu", _torchrun(3, 4, local_rank=3, local_world=4)) == torch.device("cpu")
    assert calls == []


def test_local_figures_each_launcher_gives() -> None:
    # mpirun --map-by node deals ranks round-robin: rank % local size would be a guess, so none is made.
    mpi = detect_world({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                        "MASTER_ADDR": "10.0.0.1"})  # fmt: skip
    assert (mpi.local_rank_known, mpi.local_world_size, mpi.local_world_known) == (False, 4, True)
    # srun over nodes of 4, 4 and 2 tasks: this node's count is its entry, found by SLURM_NODEID
    uneven = _srun(9, 10, 1, SLURM_STEP_TASKS_PER_NODE="4(x2),2", SLURM_NODEID="2")
    assert (uneven.local_rank, uneven.local_world_size, uneven.local_world_known) == (1, 2, True)
    unknown = _srun(9, 10, 1, SLURM_STEP_TASKS_PER_NODE="4(x2),2")
    assert (unknown.local_world_size, unknown.local_world_known) == (10, False)
    no_localid = _srun(9, 10, None)  # no guess from the global rank, which was the old stand-in of 0
    assert (no_localid.local_rank_known, no_localid.local_world_known) == (False, False)
    assert detect_world({}).local_rank_known and detect_world({}).local_world_known

"""Horovod's PyTorch API on phalanx: run a script written for ``import horovod.torch as hvd`` unchanged but for
its import line.

    import phalanx.horovod as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Run it with ``phalanx launch -n 2 train.py`` (or torchrun, ``srun``, ``mpirun``, or ``python train.py`` for one
process). Gradients are reduced by phalanx's own bucketed all-reduce (the ddp strategy's), over c10d.

As Horovod's coordinator does, every operation is queued and matched across ranks by name (unnamed ones by a
counter), and it starts only once every rank has asked for it with the same dtype, shape, op, scale factors and
root rank; when they disagree, every rank raises the same ``HorovodMismatchError`` (a ``RuntimeError``) naming each
rank's call, before any bytes move, and ranks that wait for operations the others never issue raise instead of
hanging (coordinator.py). Process sets are torch process groups (process_sets.py); ``join()`` stands in for a
finished rank with zeros in the others' all-reduces and optimizer steps; ``hvd.elastic`` runs on phalanx's restarts
(elastic.py). int16 travels widened over gloo, which has no int16.

Where phalanx differs from Horovod, on purpose:
- ``broadcast_optimizer_state`` never steps the optimizer, so a fresh optimizer's parameters stay as they are
  (Horovod takes a zero-gradient step that applies weight decay).
- ``step()`` after ``synchronize()`` outside ``skip_synchronize()`` warns and does not reduce a second time.
- There is no background thread: an asynchronous operation starts at the next coordinator round, which
  ``poll``, ``synchronize`` or any synchronous call runs (``poll`` may wait there for the other ranks' round).
- ``op=hvd.Adasum`` (allreduce and DistributedOptimizer) gathers every rank's tensor and combines them as one tree
  in rank order (Horovod: recursive halving, less traffic, the same tree).
- A lost rank restarts every process (torchrun's agent) instead of shrinking the running ones; ``hvd.elastic``
  resumes them from the last commit, written to disk when the launch can restart.
- Not implemented, each with an error that says what to use: MPI communicators, and the timeline (a warning).
"""

from __future__ import annotations

from phalanx.compat.horovod import elastic
from phalanx.compat.horovod.coordinator import HorovodInternalError, HorovodMismatchError, JoinedRanksError
from phalanx.compat.horovod.more_ops import (
    HostsUpdatedInterrupt,
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from phalanx.compat.horovod.ops import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    allgather,
    allreduce,
    allreduce_,
    broadcast,
    broadcast_,
    poll,
    synchronize,
)
from phalanx.compat.horovod.optimizer import DistributedOptimizer
from phalanx.compat.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from phalanx.compat.horovod.state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
)
from phalanx.compat.horovod.sync_batch_norm import SyncBatchNorm
from phalanx.compat.horovod.world import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "cuda_built", "rocm_built",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "join", "HorovodMismatchError",
    "barrier", "alltoall", "reducescatter", "grouped_allreduce", "grouped_allreduce_", "grouped_allgather",
    "grouped_reducescatter", "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async",
    "broadcast_async_", "poll", "synchronize", "HorovodInternalError", "HostsUpdatedInterrupt", "ccl_built",
    "ddl_built", "start_timeline", "stop_timeline", "JoinedRanksError",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "reducescatter_async",
    "alltoall_async", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allgather_async",
    "grouped_reducescatter_async", "sparse_allreduce_async", "SyncBatchNorm", "elastic",
]  # fmt: skip


def ccl_built() -> bool:
    """phalanx.horovod runs on c10d (gloo or NCCL), not on oneCCL."""
    return False


def ddl_built() -> bool:
    """phalanx.horovod runs on c10d (gloo or NCCL), not on IBM DDL."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline is not written; phalanx's collective log and watchdog name each collective instead."""
    from phalanx.logging import warn_once

    warn_once(f"hvd.start_timeline({file_path!r}): phalanx.horovod writes no Horovod timeline; nothing is recorded")


def stop_timeline() -> None:
    """See :func:`start_timeline`."""

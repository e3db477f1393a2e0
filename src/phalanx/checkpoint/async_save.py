"""Asynchronous saves: the call takes the state, returns, and a thread copies it to host memory and writes it.

    saving = engine.save_state(f"ckpt/step-{step}", keep_last=3, async_save=True)   # returns at once
    ...                                                # training goes on while the files are written
    engine.wait_for_checkpoint()                       # optional: every rank, raises the same error on each

What the call does before it returns, on every rank: it waits for this process's previous asynchronous save (one at
a time), agrees with the other ranks that the previous one succeeded and that the new one can start (the first
collective of any save), takes the JSON state and the RNG, and copies into host buffers (kept from one save to the
next, pinned when the state lives on a GPU) the tensors that something other than an optimizer step may change:
module buffers (BatchNorm's statistics change in the forward), frozen parameters, tensors inside the JSON state.

The parameters and the optimizer state change only in ``optimizer.step()``: the thread copies them while training
goes on, and a step pre-hook on each optimizer (:class:`Hold`; on the optimizer object whose ``step`` changes them,
which for the zero strategies is the user's optimizer stepping the flat shards) holds the next step until that copy
is done. On a GPU the call records an event on the training stream; the thread's copies run on their own stream
after it, ``non_blocking`` into pinned buffers, and the held step makes the training stream wait for their event
(``wait_event``): no host synchronisation of the training stream. The rest happens on the thread too: the wait for
the copies, the non-finite check, the shard file (written, checksummed, fsynced), and on rank 0 the manifest, the
rename into place and ``keep_last``'s rotation. Changing parameters outside a step before the next step (or
``wait_for_checkpoint()``) is not allowed: whether the checkpoint holds the change depends on timing.

**No collective runs on the thread.** The training loop's collectives and the thread's would interleave in an order
that differs between ranks, and a ``destroy_process_group`` at the end of the script would pull the group from under
the thread. DCP asks for a separate gloo group for its background step; here the ranks meet in files of the staging
directory instead, which the checkpoint already needs on a file system all ranks share: each rank writes its shard
file and then ``.rank-RRRRR.json`` (what it wrote, with checksums and its RNG, or its error), fsynced and renamed
into place; rank 0 waits for every rank's report, writes the manifest and renames the directory into place, or,
when a rank failed, removes the staging directory. A rank other than 0 knows the outcome when the staging directory
is gone: the checkpoint at the target carries the save's id in its manifest, or the save failed.

**Errors are never lost.** A failure is logged at once on the rank that sees it, as an error (printed on every rank
that has one, with its rank), and raised, naming the ranks, by the next ``save_state`` (sync or async) and by
``engine.wait_for_checkpoint()`` on every rank; ``handle.result()`` raises it on the rank that calls it. The thread
is not a daemon, so a script that ends while a save is being written waits for it, and a failure that was never
raised ends the process with exit code 1 after saying so.

**Every guarantee of a synchronous save holds:** the directory appears only when complete, a rank killed at any
moment leaves the previous checkpoint as the latest (``soak/kill_during_save.py --async``), and the files are the
same files, so a load is bitwise the same.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.format import MANIFEST, write_json_durably
from phalanx.checkpoint.shards import ShardEntry
from phalanx.logging import get_logger

__all__ = ["AsyncSave", "Copies", "Hold", "WRITER", "holds_steps", "new_save_id", "report_name"]

_POLL_S = (0.005, 0.2)  # the first and the longest pause between two looks at the staging directory


def new_save_id() -> str:
    return uuid.uuid4().hex


def report_name(rank: int) -> str:
    return f".rank-{rank:05d}.json"


class AsyncSave(Future[Path]):
    """The handle ``engine.save_state(..., async_save=True)`` returns: a ``concurrent.futures.Future`` of the
    checkpoint's path, as DCP's ``async_save`` returns one.

    ``result()`` waits for this rank's part and the checkpoint's outcome, and returns the path or raises the
    :class:`CheckpointError`; ``done()`` asks without waiting. A failure raised (or fetched with ``exception()``)
    here is not raised again by the next save. ``engine.wait_for_checkpoint()`` is the collective form: every rank
    calls it, and every rank raises the same error."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__()
        self.path = path
        self.rank = rank
        self.reported = False

    def result(self, timeout: float | None = None) -> Path:
        self.reported = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.reported = True
        return super().exception(timeout)

    def when_saved(self, fn: Callable[[Path], None]) -> None:
        """Run ``fn(path)`` once the checkpoint is in place (on the writer thread; at once if it already is), and
        never if the save failed. An error in ``fn`` is logged as an error, naming the rank and the checkpoint."""

        def run(_: Future[Path]) -> None:
            if self.failure() is not None:
                return
            try:
                fn(self.path)
            except Exception as e:  # noqa: BLE001 - a Future would swallow it; say it loudly instead
                get_logger().error(f"rank {self.rank}: after saving {self.path}: {type(e).__name__}: {e}")

        self.add_done_callback(run)

    def failure(self) -> BaseException | None:
        """The exception of a finished save (None while running or after success), without marking it raised."""
        return super().exception(0) if self.done() else None


class Copies:
    """The copies of one save into its host buffers: some made in the call, the rest (``pending``) by the thread.

    On a GPU every copy is a ``non_blocking`` device-to-host copy into a pinned buffer. The call's copies go on the
    training stream, and ``ready`` is recorded after them; the thread's go on a stream of its own, which first waits
    for ``ready`` (so they read the state as it was at the call), and ``copied`` is recorded after them. Neither the
    call nor the hook synchronises the host with the training stream."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, live state)
        self.on_cuda = False
        self.ready: Any = None  # torch.cuda.Event after the call's copies, on the training stream
        self.copied: Any = None  # torch.cuda.Event after the thread's copies, on the copy stream
        self.queued = threading.Event()  # the thread's copies are done (CPU), or queued with ``copied`` (GPU)

    def run(self) -> None:
        """The thread: make the pending copies. ``queued`` is set even when one fails (the save then fails), so a
        step held for them never waits forever."""
        try:
            if not self.pending:
                return
            if not self.on_cuda:
                for buf, data in self.pending:
                    buf.copy_(data)
                return
            device = next(d.device for _, d in self.pending if d.device.type == "cuda")
            stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(stream):
                stream.wait_event(self.ready)
                for buf, data in self.pending:
                    buf.copy_(data, non_blocking=buf.is_pinned())
                    data.record_stream(stream)  # memory freed meanwhile is not reused before the copy has read it
                self.copied = torch.cuda.Event()
                self.copied.record(stream)
        finally:
            self.pending = []
            self.queued.set()

    def wait_on_host(self) -> None:
        """The thread, before reading the buffers: every copy has landed in host memory."""
        self.queued.wait()
        for event in (self.ready, self.copied):
            if event is not None:
                event.synchronize()


class Hold:
    """Holds the next ``step()`` of each optimizer until the state it changes is copied: a step pre-hook
    (``Optimizer.register_step_pre_hook``) on each. On a CPU the hook waits for the thread's copies; on a GPU for
    them to be queued, and then makes the training stream wait for their event (``wait_event``, no host sync).

    Once the copies are done the hook does nothing; the hooks are removed by :meth:`release`, on the main thread
    outside a step (the next save, ``wait_for_checkpoint``, a load), since torch does not allow removing a hook
    while the hooks run."""

    def __init__(self, copies: Copies, optimizers: list[torch.optim.Optimizer]) -> None:
        self.copies = copies
        self.waited = False
        self.handles = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]

    def _before_step(self, *_: Any) -> None:
        if not self.waited:
            self.wait()

    def wait(self) -> None:
        self.copies.queued.wait()
        if self.copies.copied is not None:
            torch.cuda.current_stream().wait_event(self.copies.copied)
        self.waited = True

    def release(self) -> None:
        self.wait()
        for h in self.handles:
            h.remove()
        self.handles = []


def holds_steps(optimizer: Any) -> bool:
    """Whether a step pre-hook on ``optimizer`` runs before its ``step()`` changes anything: a torch optimizer whose
    class ``step`` torch wrapped with its hooks (every ``torch.optim.Optimizer`` built by its ``__init__``)."""
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and hasattr(optimizer, "_optimizer_step_pre_hooks")
        and bool(getattr(type(optimizer).step, "hooked", False))
    )


class _Writer:
    """This process's one background writer: the thread of the save in flight and the host buffers it reuses."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.last: AsyncSave | None = None
        self._buffers: list[torch.Tensor] = []
        self.hold: Hold | None = None
        self._exit_hook = False

    # ------------------------------------------------------------------ main thread
    def settle(self) -> str | None:
        """Wait for the save in flight (if any). Returns its failure if it was not raised yet (and marks it raised)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.release_hold()
        last = self.last
        if last is None or last.reported or last.failure() is None:
            return None
        last.reported = True
        return str(last.failure())

    def stage(self, entries: list[ShardEntry], later: list[bool]) -> tuple[list[ShardEntry], Copies]:
        """Host buffers for ``entries`` (reused from the last save where sizes and dtypes match), pinned for state
        on a GPU. The entries not marked ``later`` are copied now; those marked are copied by the thread
        (:meth:`Copies.run`), before the next optimizer step, which :class:`Hold` keeps waiting until then."""
        assert self.thread is None, "stage() while a save is being written: settle() first"
        staged: list[ShardEntry] = []
        copies = Copies()
        for i, e in enumerate(entries):
            data = e.data.detach().reshape(-1)
            pin = data.device.type == "cuda"
            buf = self._buffers[i] if i < len(self._buffers) else None
            if buf is None or buf.numel() != data.numel() or buf.dtype != data.dtype or buf.is_pinned() != pin:
                buf = torch.empty(data.numel(), dtype=data.dtype, pin_memory=pin)
                if i < len(self._buffers):
                    self._buffers[i] = buf
                else:
                    self._buffers.append(buf)
            if later[i]:
                copies.pending.append((buf, data))
            else:
                # On a GPU: queued on the training stream, so what the training does next comes after the copy.
                buf.copy_(data, non_blocking=pin)
            copies.on_cuda |= pin
            staged.append(e._replace(data=buf))
        del self._buffers[len(entries) :]
        if copies.on_cuda:
            copies.ready = torch.cuda.Event()
            copies.ready.record()  # after the copies above and after the step that made the state
        return staged, copies

    def release_hold(self) -> None:
        """Wait until the save in flight has copied the state it takes later, and remove its step hooks. Main
        thread, outside an optimizer step: before anything but a step changes the state (a load, the next save)."""
        if self.hold is not None:
            self.hold.release()
            self.hold = None

    def start(self, handle: AsyncSave, job: Callable[[], None]) -> None:
        """Run ``job`` on a new (non-daemon) thread; it completes ``handle``."""
        if not self._exit_hook:
            atexit.register(self._at_exit)  # after world.teardown's registration, so it runs before it
            self._exit_hook = True

        def run() -> None:
            try:
                job()
                handle.set_result(handle.path)
            except BaseException as e:  # noqa: BLE001 - every failure is the save's, and is raised where it is waited for
                from phalanx.checkpoint.format import CheckpointError

                error = e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}")
                get_logger().error(
                    f"rank {handle.rank}: the asynchronous save of {handle.path} failed: {error} (the previous "
                    "checkpoint stays the latest; the next save_state or engine.wait_for_checkpoint() raises this)"
                )
                handle.set_exception(error)

        self.last = handle
        self.thread = threading.Thread(target=run, name=f"phalanx-save-{handle.path.name}", daemon=False)
        self.thread.start()

    def _at_exit(self) -> None:
        """At the end of the process: the thread has been joined (it is not a daemon); a failure never raised ends
        the process with exit code 1."""
        failure = self.settle()
        if failure is None:
            return
        assert self.last is not None
        get_logger().error(
            f"rank {self.last.rank}: the process ends, and its last asynchronous save, of {self.last.path}, failed: "
            f"{failure}. Nothing was replaced: the previous checkpoint is the latest. Exiting with code 1"
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


WRITER = _Writer()


# ------------------------------------------------------------------------------ the thread: meeting in files
def write_report(staging: Path, rank: int, report: dict[str, Any]) -> None:
    """A rank's report for rank 0, written whole or not at all (a temporary name, fsync, rename)."""
    write_json_durably(staging / report_name(rank), report)


def _pause(waited: int) -> None:
    time.sleep(min(_POLL_S[1], _POLL_S[0] * 2 ** min(waited, 10)))


def collect_reports(staging: Path, world: int, save_id: str, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Rank 0: every other rank's report for save ``save_id``, waiting up to ``timeout_s`` for all of them."""
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    looks = 0
    while True:
        for rank in range(1, world):
            if rank in got:
                continue
            try:
                report = json.loads((staging / report_name(rank)).read_text())
            except (OSError, ValueError):
                continue  # not there yet
            if report.get("save_id") == save_id:
                got[rank] = report
        if len(got) == world - 1:
            return got
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world) if r not in got]
            raise TimeoutError(
                f"rank(s) {missing} did not report their part within {timeout_s:g} s (timeout_s): a rank was killed, "
                f"its disk stalled, or {staging} is not on a file system that every rank shares"
            )
        _pause(looks)
        looks += 1


def await_outcome(staging: Path, target: Path, save_id: str, timeout_s: float) -> None:
    """A rank other than 0, its report written: wait until rank 0 has renamed or removed the staging directory, then
    raise unless the checkpoint at ``target`` is this save's."""
    deadline = time.monotonic() + timeout_s
    looks = 0
    while staging.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 did not finish {target} within {timeout_s:g} s (timeout_s) of this rank's report: rank 0 was "
                "killed or its disk stalled"
            )
        _pause(looks)
        looks += 1
    try:
        saved = json.loads((target / MANIFEST).read_text()).get("save_id")
    except (OSError, ValueError):
        saved = None
    if saved != save_id:
        raise RuntimeError(
            f"rank 0 gave this save up (another rank failed, or rank 0 itself): {target} was not written. Rank 0's "
            "log, engine.wait_for_checkpoint() and the next save_state name the rank and the reason"
        )

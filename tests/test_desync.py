"""A desync named by default: when one rank makes a collective the others do not, the launcher's report names each
rank's call and its line, read from the ranks' ring files, without ``debug_collectives``. And the ring itself: what a
rank killed by SIGKILL leaves, what a reader trusts, and the report's wording."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from phalanx.runtime.collective_log import (
    DONE,
    FAILED,
    OPEN,
    Entry,
    Ring,
    disagreement,
    read_ring,
    read_rings,
    ring_report,
)

# Line numbers matter: the test looks for both ranks' lines in the report.
SCRIPT = textwrap.dedent(
    """\
    import sys
    import torch
    import phalanx

    engine = phalanx.Engine()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = engine.prepare(model, opt)
    for step in range(4):
        if step == 2 and engine.rank == 1:
            engine.reduce(torch.ones(5))  # line 12: the extra collective
        engine.train_step(torch.randn(4, 8), lambda m, b: m(b).pow(2).mean())  # line 13
    sys.stdout.write(f"finished {engine.rank}\\n"); sys.stdout.flush()
    """
)


def test_an_extra_collective_is_named_with_both_lines_by_the_launcher(tmp_path):
    # No debug_collectives: rank 1's 5-element all-reduce meets rank 0's ddp bucket, gloo aborts rank 1 in native code
    # (SIGABRT: nothing runs in the dying process) and rank 0's collective fails. The rings still hold both calls.
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PHALANX_DEVICE": "cpu", "PHALANX_STRATEGY": "ddp"}
    env.pop("PHALANX_DEBUG_COLLECTIVES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "-n", "2", "job.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "finished" not in proc.stdout
    assert "CollectiveMismatchError" not in err  # the check was off: the ring named it
    line = re.search(r"phalanx launch: the ranks disagree at collective #(\d+) of ranks 0, 1: (.*)", err)
    assert line, err[-3000:]
    said = line.group(2)
    assert re.search(r"rank 1 called all_reduce \(5 x float32 = 20 B\) at job\.py:12", said), said
    assert re.search(r"rank 0 called all_reduce \(ddp bucket 0, \d+ x float32 = .*\) at job\.py:13", said), said
    # Each rank's last entries: sequence number, op, size, label, line and what became of it.
    seq = line.group(1)
    assert re.search(rf"rank 1 \(pid \d+\): all_reduce #{seq} of ranks 0, 1 \(5 x float32 = 20 B\) at job\.py:12", err)
    assert re.search(rf"rank 0 \(pid \d+\): all_reduce #{seq} of ranks 0, 1 \(ddp bucket 0, .*job\.py:13", err), err
    # The launcher's own line still names the cause, after the report.
    assert re.search(r"phalanx launch: rank \d \(pid \d+\) was killed by SIGABRT|rank \d failed", err), err[-2000:]
    assert err.index("the ranks disagree") < err.rindex("phalanx launch: rank")


def _extra_collective() -> None:
    import phalanx

    engine = phalanx.Engine(strategy="ddp", device="cpu")
    model = torch.nn.Linear(8, 8)
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        if step == 1 and engine.rank == 1:
            engine.reduce(torch.ones(5))  # MARK: extra
        engine.train_step(torch.randn(4, 8), lambda m, b: m(b).pow(2).mean())  # MARK: step


def _line(mark: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if f"# MARK: {mark}" in text)


def test_spawn_names_an_extra_collective_too():
    from phalanx.launch import SpawnError, spawn

    with pytest.raises(SpawnError) as info:
        spawn(_extra_collective, nprocs=2, timeout=180, start_method="forkserver")
    text = str(info.value)
    found = re.search(r"the ranks disagree at collective #\d+ of ranks 0, 1: (.*)", text)
    assert found, text
    assert re.search(rf"rank 1 called all_reduce \(5 x float32 = 20 B\) at \S*test_desync\.py:{_line('extra')}", text)
    assert re.search(rf"rank 0 called all_reduce \(ddp bucket 0, .*test_desync\.py:{_line('step')}", text), text


def _entry(seq: int, op: str = "all_reduce", numel: int = 4, label: str | None = None, line: int = 10) -> Entry:
    return Entry((0, 1), seq, op, numel, torch.float32, label, ("/work/train.py", line), None)


GROUP = (12345, 2, b"ranks 0, 1")


def test_the_ring_keeps_the_last_entries_and_their_ends(tmp_path):
    ring = Ring(str(tmp_path / "rank-0.ring"), 0, capacity=8)
    slots = [ring.put(_entry(seq, label=f"bucket {seq}"), GROUP) for seq in range(1, 12)]
    ring.end(slots[-2], failed=False)
    ring.end(slots[-1], failed=True)
    ring.end(slots[0], failed=False)  # overwritten long ago: must not touch the slot's new record
    ring.stepped()
    got = read_ring(ring.path)
    assert got is not None and got["rank"] == 0 and got["pid"] == os.getpid() and got["steps"] == 1
    records = got["records"]
    # 11 written into 8 slots; the oldest slot is left out (a writer killed mid-copy may have half overwritten it).
    assert [r["seq"] for r in records] == list(range(5, 12))
    assert [r["state"] for r in records[-3:]] == [OPEN, DONE, FAILED]
    assert records[-1]["label"] == "bucket 11" and records[-1]["dtype"] == "torch.float32"
    assert records[-1]["site"].endswith("train.py:10") and records[-1]["group"] == "ranks 0, 1"
    assert read_ring(ring.path, after=records[-2]["n"])["records"] == records[-1:]  # type: ignore[index]
    ring.clear()
    assert read_ring(ring.path)["records"] == []  # type: ignore[index]
    (tmp_path / "rank-1.ring").write_bytes(b"not a ring")
    assert read_ring(str(tmp_path / "rank-1.ring")) is None
    assert list(read_rings(str(tmp_path))) == [0]


def test_a_rank_killed_by_sigkill_leaves_its_open_collective(tmp_path):
    # Nothing runs in a process killed by SIGKILL: the record must already be in the file's pages when it dies.
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from phalanx.runtime.collective_log import Entry, Ring
        ring = Ring({str(tmp_path / "rank-3.ring")!r}, 3)
        e = Entry((0, 3), 7, "broadcast", 6, torch.bfloat16, "weights", ("/x/train.py", 40), None)
        e.slot = ring.put(e, (1, 2, b"ranks 0, 3"))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    got = read_ring(str(tmp_path / "rank-3.ring"))
    assert got is not None and got["rank"] == 3
    (r,) = got["records"]
    assert (r["seq"], r["op"], r["numel"], r["dtype"], r["label"], r["state"]) == (
        7, "broadcast", 6, "torch.bfloat16", "weights", OPEN,
    )  # fmt: skip
    assert r["site"].endswith("train.py:40")


def _rings(tmp_path: Path, calls: dict[int, list[Entry]]) -> dict[int, dict]:
    for rank, entries in calls.items():
        ring = Ring(str(tmp_path / f"rank-{rank}.ring"), rank)
        for e in entries:
            e.slot = ring.put(e, GROUP)
            if e is not entries[-1]:
                ring.end(e.slot, failed=False)
    return read_rings(str(tmp_path))


def test_the_report_names_where_the_ranks_disagree(tmp_path):
    same = [_entry(1, label="ddp bucket 0", line=13), _entry(2, op="all_gather", line=13)]
    rings = _rings(
        tmp_path,
        {
            0: [*same, _entry(3, op="broadcast", line=40), _entry(4, line=41)],
            1: [*same, _entry(3, line=42)],
        },
    )
    found = disagreement(rings, 2)
    assert found is not None and found.startswith("the ranks disagree at collective #3 of ranks 0, 1: ")
    assert "rank 0 called broadcast (4 x float32 = 16 B) at " in found and "train.py:40" in found
    assert "rank 1 called all_reduce (4 x float32 = 16 B) at " in found and "train.py:42" in found
    text = ring_report(rings, 2)
    assert text.splitlines()[1].startswith("  rank 0 (pid ")
    assert "all_reduce #4 of ranks 0, 1 (4 x float32 = 16 B) at" in text and "in it when the rank ended" in text
    assert "the ranks disagree at collective #3" in text.splitlines()[-1]


def test_ranks_that_agree_are_not_said_to_disagree(tmp_path):
    same = [_entry(1, label="ddp bucket 0", line=13), _entry(2, op="all_gather", line=13)]
    rings = _rings(tmp_path, {0: [*same, _entry(3)], 1: list(same)})  # rank 1 has not reached #3 yet
    assert disagreement(rings, 2) is None
    assert "disagree" not in ring_report(rings, 2)


def test_the_ring_file_keeps_its_size_however_many_entries(tmp_path):
    # Written in place through the mapping: the file never grows, and its newest record is the last one written.
    path = tmp_path / "rank-0.ring"
    ring = Ring(str(path), 0, capacity=4)
    before = os.stat(path)
    for seq in range(1, 1000):
        ring.end(ring.put(_entry(seq), GROUP), failed=False)
    after = os.stat(path)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert [r["seq"] for r in read_ring(str(path))["records"]] == [997, 998, 999]  # type: ignore[index]


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_ring_without_room_is_refused(tmp_path, capacity):
    with pytest.raises(ValueError, match=r"capacity must be >= 2 records.*got"):
        Ring(str(tmp_path / "rank-0.ring"), 0, capacity=capacity)

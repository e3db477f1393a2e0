"""The hang watchdog and the desync check, as a user meets them: `phalanx launch` of a script in which one rank
goes wrong. Each run must end with one message that names the rank and its line: the hang watchdog's, well before
c10d's own timeout (the subprocess's timeout is a third of it).

The scripts run with the default hang timeout until every rank has prepared and met at a barrier, then lower it to
HANG_TIMEOUT_S: on a loaded machine ranks start seconds apart, and a 3 s timeout from the start would name that skew
as a hang (the known flakiness of these tests under load)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.config.options import ConfigError
from phalanx.config.settings import EngineConfig
from phalanx.runtime.collective_log import LOG, describe, ranks_text
from phalanx.runtime.watchdog import HANG_EXIT_CODE, compose_hang_report, default_hang_timeout

# A 3 s hang timeout and a bound on each run's time: these runs must not share the cores with other tests.
pytestmark = pytest.mark.serial

PHALANX = [sys.executable, "-m", "phalanx"]
HANG_TIMEOUT_S = 3

# Line numbers matter: the tests look for the line of each mode's misdeed in the report.
SCRIPT = textwrap.dedent(
    """\
    import os, sys, time
    import torch
    import phalanx, phalanx.runtime.watchdog

    mode, bad_rank = sys.argv[1], int(sys.argv[2])
    engine = phalanx.Engine()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = engine.prepare(model, opt)
    engine.wait_for_everyone()  # the ranks start together: a loaded machine's start-up skew is not a hang
    if phalanx.runtime.watchdog._ACTIVE is not None and phalanx.runtime.watchdog._ACTIVE.hang_timeout_s > 0:
        phalanx.runtime.watchdog._ACTIVE.hang_timeout_s = float(os.environ["JOB_HANG_TIMEOUT_S"])
    loss_fn = lambda m, b: m(b).pow(2).mean()  # line 14
    for step in range(6):
        if step == 3 and engine.rank == bad_rank:
            if mode == "sleep":
                time.sleep(600)  # line 18
            elif mode == "kill":
                os.kill(os.getpid(), 9)
            elif mode == "skipstep":
                continue
            elif mode == "other":
                engine.gather(torch.ones(3))  # line 24
            elif mode == "extra":
                engine.reduce(torch.ones(5))  # line 26
        engine.train_step(torch.randn(4, 8), loss_fn)  # line 27
    if mode != "skip" or engine.rank != bad_rank:
        engine.reduce(torch.ones(1))  # line 29
    sys.stdout.write(f"finished {engine.rank}\\n"); sys.stdout.flush()  # one write: ranks share the pipe
    """
)


def _launch(
    tmp_path: Path, nprocs: int, mode: str, bad_rank: int = 1, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    # The default timeout until every rank has started (the script lowers it to HANG_TIMEOUT_S then): under load,
    # ranks reach their first collective seconds apart, and a 3 s timeout would call that a hang.
    full_env = {**os.environ, "PHALANX_DEVICE": "cpu", "PHALANX_HANG_TIMEOUT_S": "300", **env}
    full_env["JOB_HANG_TIMEOUT_S"] = str(HANG_TIMEOUT_S)
    start = time.monotonic()
    proc = subprocess.run(
        [*PHALANX, "launch", "-n", str(nprocs), str(path), mode, str(bad_rank)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,  # the bound on a hang: every run must end with its report, not a timeout
        env=full_env,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize(("strategy", "nprocs"), [("ddp", 2), ("zero3", 3), ("pipeline", 2)])
def test_a_sleeping_rank_is_named_with_its_line(tmp_path, strategy, nprocs):
    proc, _ = _launch(tmp_path, nprocs, "sleep", PHALANX_STRATEGY=strategy)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("phalanx watchdog:") :]
    head = report.splitlines()[0]
    # Where the waiting ranks are: the train_step line, or the loss_fn's line for a zero3 gather in the forward.
    assert re.search(r"called from job.py:(27|14)\.", head), report
    assert "job.py:18 in <module>" in report, report  # where the sleeping rank is
    if strategy == "pipeline":  # rank 0, the first stage, waits for the gradient from rank 1
        assert re.search(r"rank 0 has waited \d+ s in recv from rank 1", head), head
    elif strategy == "zero3":  # zero3 on gloo gathers with point-to-point sends: the waiting rank names its peer
        assert re.search(r"rank 1 has not posted the matching (receive|send); it is at job.py:18", report), report
    else:
        assert "rank 1 has not reached it" in report, report
    assert "phalanx launch: the hang watchdog stopped the job" in proc.stderr
    assert report.count("phalanx watchdog:") == 1  # one report, not one per rank


def test_ranks_in_different_collectives_are_named_with_both_calls(tmp_path):
    proc, _ = _launch(tmp_path, 3, "other", bad_rank=1)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("phalanx watchdog:") :]
    # Ranks 0 and 2 wait in the ddp bucket's all-reduce; rank 1 in the all-gather of engine.gather, at the same place
    # of the world's sequence. Whichever rank reports, both calls and both lines are in the message.
    assert "all_gather" in report and "all_reduce" in report and "ddp bucket" in report, report
    assert "job.py:24" in report and "job.py:27" in report, report
    assert "disagree on the order of collectives" in report, report


def test_a_rank_that_skips_a_collective_is_named_when_it_leaves_early(tmp_path):
    proc, _ = _launch(tmp_path, 2, "skip", bad_rank=1)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("phalanx watchdog:") :]
    assert "rank 0 has waited" in report and "called from job.py:29" in report, report  # the last reduce
    assert re.search(
        r"rank 1 has left: it finished the script after collective #\d+ of this group, \d+ fewer", report
    ), report


def test_a_rank_killed_by_sigkill_is_named_by_the_launcher(tmp_path):
    proc, _ = _launch(tmp_path, 4, "kill", bad_rank=2, PHALANX_STRATEGY="zero2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"phalanx launch: rank 2 \(pid \d+\) was killed by SIGKILL", proc.stderr), proc.stderr[-3000:]
    assert "out-of-memory killer" in proc.stderr


def test_debug_collectives_stops_a_mismatch_before_any_bytes_move(tmp_path):
    # Rank 1 reduces an extra tensor of 5 elements where rank 0 reduces the ddp bucket: without the check the two
    # all-reduces would meet; with it, both ranks stop at once, naming both calls.
    proc, _ = _launch(tmp_path, 2, "extra", bad_rank=1, PHALANX_DEBUG_COLLECTIVES="1", PHALANX_HANG_TIMEOUT_S="0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "CollectiveMismatchError" in proc.stderr
    assert "called different collectives at the same point" in proc.stderr
    assert re.search(r"rank 0: all_reduce #\d+ of ranks 0, 1 \(ddp bucket 0, .*called from job.py:27", proc.stderr), (
        proc.stderr
    )
    assert re.search(r"rank 1: all_reduce #\d+ of ranks 0, 1 \(5 x float32.*called from job.py:26", proc.stderr), (
        proc.stderr
    )
    assert "finished" not in proc.stdout


def test_a_healthy_job_with_the_watchdog_and_the_check_on_runs_to_the_end(tmp_path):
    proc, _ = _launch(tmp_path, 2, "none", PHALANX_DEBUG_COLLECTIVES="1", PHALANX_STRATEGY="zero3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(re.findall(r"finished (\d)", proc.stdout)) == ["0", "1"], proc.stdout


def test_hang_timeout_must_be_below_the_collective_timeout():
    with pytest.raises(ConfigError, match=r"hang_timeout_s=1800 is not below timeout_s=1800.*Lower hang_timeout_s"):
        EngineConfig(hang_timeout_s=1800)
    with pytest.raises(ConfigError, match=r"invalid hang_timeout_s: got -1"):
        EngineConfig(hang_timeout_s=-1)
    assert EngineConfig(hang_timeout_s=0).hang_timeout_s == 0
    assert default_hang_timeout("cpu") < default_hang_timeout("cuda") < EngineConfig().timeout_s


def test_one_process_logs_nothing():
    import phalanx

    phalanx.Engine()
    assert LOG.on is False


def test_report_wording_for_a_rank_that_did_not_answer():
    waited = {"group": [0, 1, 2], "seq": 7, "op": "all_reduce", "numel": 4, "dtype": "torch.float32", "label": "x",
              "site": "train.py:9", "age": 61.0, "open": True, "peer": None}  # fmt: skip
    states = {0: {"open": [waited], "recent": [waited], "seq": {"0,1,2": 7}, "stack": []},
              2: {"open": [waited], "recent": [waited], "seq": {"0,1,2": 7}, "stack": []}}  # fmt: skip
    text = compose_hang_report(waited, 0, states, 3, 30)
    assert text.splitlines()[0] == (
        "phalanx watchdog: ranks 0, 2 have waited 61 s in all_reduce #7 of all 3 ranks (x, 4 x float32 = 16 B), "
        "called from train.py:9."
    )
    assert "rank 1 did not answer within 10 s: its process has gone" in text
    assert describe({**waited, "op": "recv", "peer": 3, "label": None}, 4) == "recv from rank 3 (4 x float32 = 16 B)"
    assert ranks_text([0, 1, 2, 3], 8) == "ranks 0-3"

"""scripts/gpu_check.sh, the device check of issue 36, on a machine without a GPU: its dry run passes here and can
fail (a missing module, a missing name, a shell script that does not parse), its time box skips what does not fit,
and the parts of its sections that need no GPU (sync-site naming, a training run, the failure wrapper, the ledger's
contract) do what the GPU run relies on."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SHELL = ROOT / "scripts" / "gpu_check.sh"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_T0", "OUT")}
    env["PYTHON"] = sys.executable  # the dry run's interpreter where there is no .venv
    return env


def _run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_passes_here_and_says_what_it_checked():
    proc = _run(["bash", str(SHELL), "--dry-run"])
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert "dry-run: syntax ok: scripts/gpu_check.sh (bash -n)" in lines
    assert "dry-run: syntax ok: scripts/gpu_check.py" in lines
    imports = next(line for line in lines if line.startswith("dry-run: imports ok:"))
    for name in ("phalanx.Engine", "phalanx.runtime.collective_log.watched", "phalanx.config.settings.resolve_config"):
        assert name in imports, imports
    assert "dry-run: configs ok: 21 matrix runs, 7 nccl1 runs, 2 ledger cases" in lines
    # The ledger module is either there, with its contract, or named as missing (the GPU run then fails on it).
    assert any(
        line.startswith("ledger: importable; contract ok") or line.startswith("ledger: not available") for line in lines
    )
    assert lines[-1] == "dry-run: PASS"


def test_the_dry_run_fails_on_an_import_that_does_not_resolve():
    proc = _run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--also-import",
            "phalanx.runtime.no_such_module:LEDGER",
            "--also-import",
            "phalanx:NoSuchName",
        ]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAIL dry-run:")]
    assert len(failures) == 2, proc.stdout
    assert "No module named 'phalanx.runtime.no_such_module'" in failures[0]
    assert "phalanx has no 'NoSuchName'" in failures[1]
    assert proc.stdout.splitlines()[-1] == "dry-run: FAIL (2 problems)"


def test_the_dry_run_fails_on_a_shell_script_that_does_not_parse(tmp_path):
    broken = tmp_path / "scripts" / "gpu_check.sh"
    broken.parent.mkdir()
    shutil.copy(SHELL, broken)
    with broken.open("a") as f:
        f.write('\nif [ "$dry" = 1 ]; then\n  echo never\n')  # no fi: bash -n sees it, plain bash not before the end
    proc = _run(["bash", str(broken), "--dry-run"], timeout=30)
    assert proc.returncode == 1
    assert f"FAIL dry-run: {broken} does not parse (bash -n, above)" in proc.stdout
    assert "syntax ok" not in proc.stdout


def test_sections_that_do_not_fit_the_budget_are_skipped_and_the_exit_says_so(tmp_path):
    proc = _run([sys.executable, str(SCRIPT), "--device", "cpu", "--budget", "0", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the check is incomplete" in proc.stdout
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(results) == ["ledger", "nccl1", "matrix", "test_cuda"]
    for name, r in results.items():
        assert r["status"] == "SKIP" and r["note"].startswith("over budget"), (name, r)
        assert f"--sections {name}" in r["note"]


def test_an_unknown_section_is_refused(tmp_path):
    proc = _run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "ledgr", "--out", str(tmp_path)])
    assert proc.returncode == 1
    assert "unknown section(s) ['ledgr']" in proc.stdout


def test_host_syncs_are_counted_at_the_phalanx_line_that_made_them(gpu_check):
    import phalanx

    package = Path(phalanx.__file__).resolve().parent
    fake = str(package / "engine" / "made_up.py")
    code = compile(
        "import warnings\n"
        "warnings.warn('called a synchronizing CUDA operation')\n"
        "for _ in range(2): warnings.warn('called a synchronizing CUDA operation')\n"
        "warnings.warn('an unrelated warning')\n",
        fake,
        "exec",
    )
    filters_before = list(warnings.filters)
    capture = gpu_check.SyncCapture(cuda=False)
    with capture.watching():
        exec(code, {})
        line = sys._getframe().f_lineno + 1
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # this file: outside phalanx
    assert warnings.filters == filters_before
    shown = str(Path(fake).relative_to(ROOT)) if fake.startswith(str(ROOT)) else "phalanx/engine/made_up.py"
    assert capture.count == 4
    assert capture.sites == {f"{shown}:2": 1, f"{shown}:3": 2, f"test_gpu_check.py:{line} (outside phalanx)": 1}
    assert capture.other_warnings == 1


def test_a_matrix_run_trains_on_the_cpu(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "WIDTH", 64)  # the GPU's 4 M parameters take seconds a step on a shared CPU
    ctx = gpu_check.Ctx("cpu", time.time() + 120, steps=1, warmup=1)
    for spec in (gpu_check.MATRIX[0], next(s for s in gpu_check.MATRIX if s.pipeline)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = gpu_check.train(spec, "bf16-mixed", ctx, steps=1, warmup=1)
        assert r["finite"] and len(r["losses"]) == 2, (spec.label, r)
        assert r["world"] == "single" and r["syncs_per_step"] is None and r["peak_mib"] is None
        assert r["steps"] == 1 and r["ms_per_step"] is not None  # the warm-up step is not measured


def test_a_failing_section_is_reported_and_the_run_goes_on(gpu_check, tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise KeyError("no such layer")

    def refused(ctx):
        raise gpu_check.CheckFailed("ledger: not available (phalanx.runtime.placement)")

    ctx = gpu_check.Ctx("cpu", time.time() + 60, steps=1, warmup=1)
    monkeypatch.setitem(gpu_check.SECTIONS, "ledger", (broken, 0, 1))
    monkeypatch.setitem(gpu_check.SECTIONS, "nccl1", (refused, 0, 1))
    assert gpu_check.run_section("ledger", ctx, tmp_path / "a.json") == 0
    assert gpu_check.run_section("nccl1", ctx, tmp_path / "b.json") == 0
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["status"] == "FAIL" and a["note"] == "KeyError: 'no such layer'"
    assert b["status"] == "FAIL" and b["note"] == "ledger: not available (phalanx.runtime.placement)"
    out = capsys.readouterr().out
    assert "FAIL ledger: KeyError: 'no such layer'" in out and "raise KeyError" in out  # the traceback's last lines
    assert "FAIL nccl1: ledger: not available" in out


def test_the_ledger_contract_is_checked(gpu_check):
    class Partial:
        live_bytes = 0
        peak_bytes = 1.5
        moves = [("weight", 4, "extra")]

    problems = gpu_check.ledger_contract_problems(Partial())
    assert problems == [
        "LEDGER.reset() is missing or not callable",
        "LEDGER.peak_bytes must be an int of bytes; got float",
        "LEDGER.moves must hold (what, nbytes) pairs; got [('weight', 4, 'extra')]",
    ]
    from phalanx.runtime.placement import LEDGER

    assert gpu_check.ledger_contract_problems(LEDGER) == []

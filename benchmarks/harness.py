"""What every benchmark shares, in one place.

Driver side (the benchmark's own process):
- the world: every 2-rank configuration runs in fresh processes from ``phalanx.spawn`` with ``RANK_THREADS`` thread
  each (``spawn_ranks``); ``free_port`` for a peer that wants an env:// rendezvous;
- the round loop: every configuration once per round, in an order rotated each round, each run after waiting for a
  quiet CPU, and run again once when other processes loaded the machine (``interleaved_rounds``);
- what a step costs across ranks (``slowest_rank``: a step is as slow as its slowest rank; ``mean_over_ranks``);
- the environment, the phalanx sources (commit and digest) and the result files, and the flags for all of these.

Worker side (inside the ranks ``phalanx.spawn`` starts):
- the world: ``world()`` (rank and size from spawn's environment) and ``init_gloo()`` (the gloo process group of the
  torch peers at spawn's rendezvous);
- the training loop: ``train_loop`` runs the untimed warm-up and the timed steps and collects per-step times and
  losses, CPU time, page faults, memory (``memory_now``) and a parameter checksum, the same way for every benchmark;
- the optimizer every configuration uses (``make_adamw``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

# ================================================================================================ driver side: world

RANK_THREADS = 1
"""Threads per rank of every multi-rank configuration: phalanx.spawn sets ``torch.set_num_threads`` and
``OMP_NUM_THREADS`` in each rank to it."""


def spawn_ranks(
    fn: Callable[..., Any], nprocs: int, args: Sequence[Any], timeout: float, threads: int = RANK_THREADS
) -> list[Any]:
    """``fn(*args)`` on ranks 0..nprocs-1, fresh processes from phalanx.spawn; their results in rank order."""
    import phalanx

    return phalanx.spawn(fn, nprocs=nprocs, args=tuple(args), threads_per_proc=threads, timeout=timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ================================================================================================ driver side: load


def _cpu_times() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies of all cores since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    vals += [0] * (8 - len(vals))
    total = sum(vals)  # guest time is already inside user, so the guest columns are left out
    steal = vals[7]
    return total - vals[3] - vals[4] - steal, total, steal


def cpu_busy(interval: float = 0.5) -> float | None:
    """Fraction of all cores busy over ``interval`` (this benchmark is idle meanwhile); None off Linux."""
    try:
        b0, t0, _ = _cpu_times()
        time.sleep(interval)
        b1, t1, _ = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(1, t1 - t0)


class ForeignLoad:
    """CPU time that processes other than this benchmark used during a run, as an average number of busy cores.

    Also the hypervisor's steal time over the run (cores' worth of time the VM wanted but did not get).
    """

    def __init__(self) -> None:
        self.busy0: int | None
        try:
            self.busy0, _, self.steal0 = _cpu_times()
        except (OSError, ValueError, IndexError):
            self.busy0 = None
        self.ours0 = self._ours()
        self.t0 = time.monotonic()
        self.steal_cores: float | None = None

    @staticmethod
    def _ours() -> float:
        c, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return c.ru_utime + c.ru_stime + me.ru_utime + me.ru_stime

    def stop(self) -> float | None:
        if self.busy0 is None:
            return None
        busy1, _, steal1 = _cpu_times()
        wall = max(time.monotonic() - self.t0, 1e-9)
        hz = os.sysconf("SC_CLK_TCK")
        self.steal_cores = (steal1 - self.steal0) / hz / wall
        return max(0.0, ((busy1 - self.busy0) / hz - (self._ours() - self.ours0)) / wall)


def wait_quiet(max_wait: float, threshold: float) -> float | None:
    """Wait (up to ``max_wait`` s) until other processes leave the CPU mostly idle; returns the last busy fraction."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy(1.0)
    return busy


# ================================================================================================ driver side: sources


def git_state(root: Path | None = None) -> str:
    """The commit of the checkout phalanx is imported from (or of ``root``), with '+dirty' when its src/ has
    uncommitted changes."""
    if root is None:
        import phalanx

        root = Path(phalanx.__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def src_digest(package: Path | None = None) -> str:
    """sha256 (12 hex) of every .py under the imported phalanx package (or under ``package``): '+dirty' in
    git_state() does not say whether uncommitted sources changed during a run, this does."""
    if package is None:
        import phalanx

        package = Path(phalanx.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def source_state() -> tuple[str, str]:
    """(git checkout, source digest): taken before and after a run."""
    return git_state(), src_digest()


def source_record(start: tuple[str, str], end: tuple[str, str]) -> dict[str, str]:
    """What the result file says of the sources; a warning is printed when they changed during the run."""
    if start != end:
        print(
            f"WARNING: the phalanx sources changed during the run ({start[0]} {start[1]} -> {end[0]} {end[1]}); "
            "run it again."
        )
    return {
        "phalanx_commit": start[0] if start[0] == end[0] else f"{start[0]} -> {end[0]} (changed)",
        "phalanx_src_sha256": start[1] if start[1] == end[1] else f"{start[1]} -> {end[1]} (changed)",
    }


# ================================================================================================ driver side: results


def environment(with_phalanx: bool = True, **extra: Any) -> dict[str, Any]:
    """Versions and machine (and ``extra``, e.g. a peer's version), printed at the start of a benchmark and stored
    with its results. ``with_phalanx=False`` leaves out the imported phalanx (compare_revisions imports none)."""
    if with_phalanx:
        import phalanx
    env = {
        "torch": torch.__version__,
        **({"phalanx": phalanx.__version__} if with_phalanx else {}),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        **extra,
        **({"phalanx_checkout": git_state()} if with_phalanx else {}),
        "driver_ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
    }
    print("environment:", ", ".join(f"{k}={v}" for k, v in env.items()))
    return env


def add_output_flags(p: argparse.ArgumentParser, out: Path, stem: str) -> None:
    p.add_argument("--out", default=str(out), help=f"directory for {stem}.json")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON results")
    p.add_argument("--tag", default="", help=f"write {stem}-<tag>.json instead of {stem}.json")


def write_result(
    result: dict[str, Any], args: argparse.Namespace, stem: str, env: dict[str, Any], argv: list[str] | None
) -> None:
    """Add the environment, arguments and finish time, and write ``<out>/<stem>[-<tag>].json`` unless --no-json."""
    result.update(
        environment=env, argv=sys.argv[1:] if argv is None else argv, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z")
    )
    if args.no_json:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"{stem}-{args.tag}.json" if args.tag else f"{stem}.json")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


# ================================================================================================ driver side: rounds


def add_round_flags(p: argparse.ArgumentParser, rounds: int, timeout: float = 900.0) -> None:
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (every configuration once per round)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="before each run, wait up to this many seconds for the machine to be quiet (0: never wait)",
    )
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.15,
        help="'quiet' means at most this fraction of all cores busy (from /proc/stat)",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="a run during which other processes used more than this many cores is run again (see --retries)",
    )
    p.add_argument("--retries", type=int, default=1, help="how often a run disturbed by other processes is run again")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds one spawned run may take")


def interleaved_rounds(
    configs: list[dict[str, Any]],
    args: argparse.Namespace,
    run: Callable[[dict[str, Any]], Any],
    summarize: Callable[[Any], dict[str, Any]],
    headline: Callable[[dict[str, Any]], str],
    keep_going: bool = True,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], float]:
    """``run(cfg)`` once per configuration and round; ``summarize`` its result; print ``headline(summary)``.

    Returns the summaries by configuration name (each with the CPU load around its run), the failures (a failing
    configuration is dropped from later rounds; with ``keep_going=False`` its exception ends the benchmark instead)
    and the wall time.
    """
    rounds: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in configs}
    failures: dict[str, str] = {}
    width = max((len(c["name"]) for c in configs), default=10) + 2
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        live = [c for c in configs if c["name"] not in failures]
        shift = rnd % max(1, len(live))
        for cfg in live[shift:] + live[:shift]:
            res, busy, foreign, probe, attempt = None, None, None, None, 0
            for attempt in range(args.retries + 1):
                busy = wait_quiet(args.quiet_wait, args.quiet_threshold) if args.quiet_wait > 0 else None
                probe = ForeignLoad()
                t0 = time.perf_counter()
                try:
                    res = run(cfg)
                except Exception as e:  # noqa: BLE001 - a crashing configuration is reported, the others go on
                    if not keep_going:
                        raise
                    failures[cfg["name"]] = f"{type(e).__name__}: {e}"
                    print(
                        f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} FAILED: {type(e).__name__}: "
                        f"{str(e)[-3000:]}",
                        flush=True,
                    )
                    res = None
                    break
                foreign = probe.stop()
                if foreign is None or foreign <= args.max_foreign or attempt == args.retries:
                    break
                print(
                    f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} discarded: other processes used "
                    f"{foreign:.2f} cores meanwhile (> --max-foreign {args.max_foreign}); running it again",
                    flush=True,
                )
            if res is None:
                continue
            s = summarize(res)
            s.update(
                cpu_busy_before=busy,
                foreign_load_cores=foreign,
                steal_cores=probe.steal_cores if probe else None,
                attempts=attempt + 1,
            )
            rounds[cfg["name"]].append(s)
            load = f", busy before {100 * busy:3.0f}%" if busy is not None else ""
            load += f", foreign load {foreign:.2f} cores" if foreign is not None else ""
            load += f", steal {probe.steal_cores:.2f}" if probe and probe.steal_cores else ""
            print(
                f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} {headline(s)}  "
                f"(wall {time.perf_counter() - t0:5.1f} s{load})",
                flush=True,
            )
    return rounds, failures, time.perf_counter() - t_start


# ================================================================================================ driver side: steps


def slowest_rank(results: Sequence[dict[str, Any]], key: str = "times") -> list[float]:
    """Per timed step, the largest of the ranks' ``key`` (a step is as slow as its slowest rank; the collectives keep
    the ranks in lock-step anyway)."""
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def mean_over_ranks(results: Sequence[dict[str, Any]], key: str = "losses") -> list[float]:
    """Per step, the mean over ``results`` of their ``key`` (the loss of a step whose ranks had equal batches)."""
    return [statistics.fmean(r[key][i] for r in results) for i in range(len(results[0][key]))]


def per_rank_median(rounds: Sequence[dict[str, Any]], key: str, nranks: int) -> list[float | None]:
    """Per rank, the median over rounds of the round summaries' ``key[rank]`` (None where no round has one)."""
    out: list[float | None] = []
    for k in range(nranks):
        vals = [r[key][k] for r in rounds if r[key][k] is not None]
        out.append(statistics.median(vals) if vals else None)
    return out


# ================================================================================================ worker side: world


def world() -> tuple[int, int]:
    """(rank, world size) of this process: what phalanx.spawn put in RANK and WORLD_SIZE ((0, 1) outside it)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_method() -> str:
    """phalanx.spawn's rendezvous (a file:// store), for the peers' own process groups."""
    return os.environ["PHALANX_INIT_METHOD"]


def init_gloo() -> tuple[int, int]:
    """The default process group of a torch peer: gloo at phalanx.spawn's rendezvous. Returns (rank, world size)."""
    import torch.distributed as dist

    rank, size = world()
    dist.init_process_group("gloo", init_method=init_method(), rank=rank, world_size=size)
    return rank, size


def env_rendezvous(port: int) -> None:
    """MASTER_ADDR/MASTER_PORT on loopback, for a peer that insists on an env:// rendezvous (Accelerate)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


# ================================================================================================ worker side: training


def make_adamw(params: Iterable[Any], spec: dict[str, Any]) -> torch.optim.Optimizer:
    """The AdamW of every configuration: lr ``spec["lr"]``, weight decay 0.01. ``spec["adamw"]``: "default" is torch's
    choice (the per-tensor loop for CPU tensors); "foreach" and "fused" are the multi-tensor and the fused kernels."""
    return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.01, **adamw_kwargs(spec))


def adamw_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    impl = spec.get("adamw", "default")
    return {"foreach": True} if impl == "foreach" else {"fused": True} if impl == "fused" else {}


def _status_kib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def memory_now() -> dict[str, float | None]:
    """MiB: ru_maxrss, VmHWM (peak RSS of this process image only) and VmRSS (now).

    ru_maxrss of a process started by exec after vfork also counts the parent's resident set at that moment (Linux
    carries the old mm's high-water mark into the new image), so it is never below the benchmark driver's own RSS;
    VmHWM is this interpreter's own peak.
    """
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return {
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # Linux: KiB
        "vm_hwm_mib": hwm / 1024.0 if hwm is not None else None,
        "vm_rss_mib": rss / 1024.0 if rss is not None else None,
    }


def param_sum(tensors: Iterable[torch.Tensor]) -> float:
    """float64 sum of every element: the parameter checksum of the setup checks."""
    return float(sum(t.detach().double().sum() for t in tensors))


def train_loop(
    spec: dict[str, Any],
    rank: int,
    batch: Callable[[int], Any],
    step: Callable[..., Any],
    checksum: Callable[[], float | None],
    profile: str | None = None,
) -> dict[str, Any]:
    """The training loop of every worker: ``spec["warmup"]`` untimed steps, then ``spec["steps"]`` timed ones.

    ``batch(s)`` makes step ``s``'s ``(x, y)`` (before the clock starts); ``step(x, y)`` is the timed step (forward,
    backward, optimizer step, zero_grad) and returns its loss, or ``(loss, {name: value})`` with figures of its own
    (a pipeline's schedule and wait times), kept per timed step under ``name``. The loss is a tensor or a float (nan
    on a rank that does not know it). ``checksum()`` runs after the memory figures are taken (it may gather a sharded
    model); when it fails, the failure is printed and the checksum is None. ``profile``: record the timed steps with
    torch.profiler into ``<profile>.rank<r>.{json,txt}``.

    Returns per timed step the time (``time.perf_counter``) and the extra figures, every step's loss, CPU time
    (``time.process_time``, every thread of the process) and minor page faults per timed step, memory after setup
    and at the end, the checksum, the thread count and the file phalanx was imported from.
    """
    warmup, total = spec["warmup"], spec["warmup"] + spec["steps"]
    times: list[float] = []
    losses: list[float] = []
    extra: dict[str, list[Any]] = {}
    mem_setup = memory_now()
    prof = None
    cpu0, faults0 = 0.0, 0
    for s in range(total):
        if s == warmup:
            cpu0 = time.process_time()  # CPU time of every thread of this process (gloo's included)
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = batch(s)
        if profile and s == warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            prof.__enter__()
        t0 = time.perf_counter()
        out = step(x, y)
        times.append(time.perf_counter() - t0)
        loss, figures = out if isinstance(out, tuple) else (out, {})
        for k, v in figures.items():
            extra.setdefault(k, []).append(v)
        losses.append(float(loss))
    cpu_total = time.process_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    if prof is not None:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(f"{profile}.rank{rank}.json")
        with open(f"{profile}.rank{rank}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    mem_end = memory_now()  # before the checksum, which may gather a sharded model
    try:
        param_checksum = checksum()
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the checksum is informative only
        param_checksum = None
        print(f"[rank {rank}] parameter checksum failed: {type(e).__name__}: {e}", flush=True)
    return {
        "rank": rank,
        "times": times[warmup:],
        **{k: v[warmup:] for k, v in extra.items()},
        "losses": losses,
        "peak_rss_mib": mem_end["ru_maxrss_mib"],
        "peak_hwm_mib": mem_end["vm_hwm_mib"],
        "rss_end_mib": mem_end["vm_rss_mib"],
        "setup_peak_hwm_mib": mem_setup["vm_hwm_mib"],
        "setup_rss_mib": mem_setup["vm_rss_mib"],
        # CPU seconds per timed step (batch creation included, a few %); below the wall time = waiting.
        "cpu_per_step": cpu_total / max(1, spec["steps"]),
        # Minor page faults per timed step: fresh memory from the kernel (allocator churn), each costing CPU time.
        "minor_faults_per_step": faults / max(1, spec["steps"]),
        "param_checksum": param_checksum,
        "threads": torch.get_num_threads(),
        "phalanx_file": getattr(sys.modules.get("phalanx"), "__file__", None),
    }


def watchdog_rows() -> list[tuple[str, dict[str, Any]]]:
    """Extra rows beside a strategy's default one (where the watchdog is on): the watchdog off, and the desync
    check on. Their ratios to the default row are the costs."""
    return [("watchdog off", {"hang_timeout_s": 0}), ("debug_collectives", {"debug_collectives": True})]

"""Big-model inference beside Accelerate: the same model, the same weights file and the same host budget, the rest on
disk; time per forward and peak resident memory, as ratios.

    PYTHONPATH=src /tmp/tf-venv/bin/python benchmarks/bench_dispatch.py --rounds 5   # a venv with accelerate

The model is 24 blocks of two Linear(1024) (201 MB in fp32), saved once as model.safetensors. Each run is a fresh
process that builds the model on the meta device, places it with a 60 MB host budget and runs ``--forwards`` forwards
of a batch of 4 under ``torch.inference_mode()``, after one untimed forward:

- phalanx: ``phalanx.load_and_dispatch(model, file, max_memory={"cpu": "60MB"}, no_split_module_classes=["Block"])``;
- Accelerate: ``load_checkpoint_and_dispatch(model, file, device_map=infer_auto_device_map(model, max_memory={"cpu":
  "60MB"}, no_split_module_classes=["Block"]), offload_folder=...)``.

Peak RSS is the process's VmHWM over its own baseline (measured after imports and the meta model, before loading).
Both outputs are checked against the plain model's. Runs are interleaved, in rotated order, round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = textwrap.dedent(
    """\
    import json, sys, time, torch
    from torch import nn

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    class Block(nn.Module):
        def __init__(self, d=1024):
            super().__init__()
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    def build():
        return nn.Sequential(*[Block() for _ in range(24)])

    who, where, forwards = sys.argv[1], sys.argv[2], int(sys.argv[3])
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0))
    if who == "write":
        from safetensors.torch import save_file
        torch.manual_seed(0)
        model = build()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, where + "/model.safetensors")
        with torch.inference_mode():
            torch.save(model(x), where + "/out.pt")
        sys.exit(0)
    want = torch.load(where + "/out.pt", weights_only=True)
    if who == "phalanx":
        import phalanx
        with phalanx.init_empty_weights():
            model = build()
    else:
        import accelerate
        with accelerate.init_empty_weights():
            model = build()
    with torch.inference_mode():
        torch.relu(torch.nn.functional.linear(x, torch.zeros(8, 1024), torch.zeros(8))) + x[:, :8]
    base = hwm()
    t0 = time.perf_counter()
    if who == "phalanx":
        model = phalanx.load_and_dispatch(model, where + "/model.safetensors", max_memory={"cpu": "60MB"},
                                          no_split_module_classes=["Block"])
    else:
        from accelerate import infer_auto_device_map, load_checkpoint_and_dispatch
        device_map = infer_auto_device_map(model, max_memory={"cpu": "60MB"}, no_split_module_classes=["Block"])
        model = load_checkpoint_and_dispatch(model, where + "/model.safetensors", device_map=device_map,
                                             offload_folder=where + "/acc-offload-" + str(time.time_ns()))
    load_s = time.perf_counter() - t0
    with torch.inference_mode():
        out = model(x)
        times = []
        for _ in range(forwards):
            t0 = time.perf_counter()
            out = model(x)
            times.append(time.perf_counter() - t0)
    placed = list(model.hf_device_map.values())
    print(json.dumps({"forward_ms": 1e3 * sorted(times)[len(times) // 2], "load_s": load_s,
                      "grew_mib": (hwm() - base) / 2**20, "equal": torch.equal(out, want),
                      "disk": placed.count("disk"), "cpu": placed.count("cpu")}))
    """
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--forwards", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    results: dict[str, list[dict]] = {"phalanx": [], "accelerate": []}
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        subprocess.run([sys.executable, str(worker), "write", tmp, "0"], check=True)
        for r in range(args.rounds):
            order = ["phalanx", "accelerate"] if r % 2 == 0 else ["accelerate", "phalanx"]
            for who in order:
                proc = subprocess.run(
                    [sys.executable, str(worker), who, tmp, str(args.forwards)], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    print(f"{who} failed:\n{proc.stderr[-2000:]}")
                    return 1
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                results[who].append(got)
                print(
                    f"round {r + 1} {who:10} forward {got['forward_ms']:7.1f} ms  peak +{got['grew_mib']:6.1f} MiB  "
                    f"load {got['load_s']:.2f} s  blocks on disk {got['disk']}  equal {got['equal']}"
                )
    ratio_t = [a["forward_ms"] / b["forward_ms"] for a, b in zip(results["phalanx"], results["accelerate"])]
    ratio_m = [a["grew_mib"] / b["grew_mib"] for a, b in zip(results["phalanx"], results["accelerate"])]
    med = {
        who: {k: statistics.median(x[k] for x in rs) for k in ("forward_ms", "grew_mib", "load_s")}
        for who, rs in results.items()
    }
    for who, m in med.items():
        print(
            f"{who:10} median forward {m['forward_ms']:.1f} ms, peak +{m['grew_mib']:.1f} MiB, load {m['load_s']:.2f} s"
        )
    print(
        f"phalanx / Accelerate: forward {statistics.median(ratio_t):.3f} "
        f"(rounds {min(ratio_t):.3f}-{max(ratio_t):.3f}), "
        f"peak RSS {statistics.median(ratio_m):.3f} (rounds {min(ratio_m):.3f}-{max(ratio_m):.3f})"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"results": results, "median": med, "ratio_forward": ratio_t, "ratio_peak": ratio_m}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

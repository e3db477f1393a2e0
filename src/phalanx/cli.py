"""The ``phalanx`` command.

    phalanx demo                          # trains a byte-level GPT on 2 processes
    phalanx launch -n 2 train.py [args]   # runs your script on 2 processes
    phalanx config --config phalanx.yaml  # prints the resolved config and where each value came from
    phalanx env                           # versions, devices and backends
    phalanx checkpoint info ckpt/step-1000                            # what a checkpoint holds
    phalanx checkpoint consolidate ckpt/step-1000 model.safetensors   # one plain state dict
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Sequence

from phalanx._version import __version__
from phalanx.config import ConfigError, resolve_config
from phalanx.flags import add_engine_flags, add_launch_flags, cli_values
from phalanx.launch import LaunchError, launch

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="Train PyTorch models on one or many devices.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="run a training script on several processes (torchrun underneath)")
    add_launch_flags(p)
    add_engine_flags(p)
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name, as in python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    p = sub.add_parser("config", help="print the resolved config with the origin of every value")
    add_launch_flags(p)
    add_engine_flags(p)

    sub.add_parser("env", help="print versions, devices and backends")

    p = sub.add_parser("checkpoint", help="inspect or consolidate a checkpoint written by engine.save_state")
    ck = p.add_subparsers(dest="checkpoint_command", required=True)
    q = ck.add_parser("info", help="what a checkpoint holds: world size, strategy, counters, models, files")
    q.add_argument("directory")
    q.add_argument("--tensors", action="store_true", help="list every tensor with its dtype, shape and runs")
    q.add_argument("--verify", action="store_true", help="also check every checksum")
    q = ck.add_parser("consolidate", help="write one plain safetensors state dict of a saved model")
    q.add_argument("directory")
    q.add_argument("output", help="the .safetensors file to write")
    q.add_argument("--model", type=int, default=0, help="which prepared model, in prepare order (default 0)")

    p = sub.add_parser("demo", help="train a small byte-level GPT on the Python standard library's source")
    add_launch_flags(p)
    add_engine_flags(p)
    p.epilog = "Demo options (e.g. --steps 50) follow the flags above, or come after --; see `phalanx demo -- --help`."
    return parser


def _env_report() -> str:
    import torch
    import torch.distributed as dist

    lines = [
        f"phalanx {__version__}",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__}",
        f"cpu cores {os.cpu_count()}",
        f"cuda available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}",
        f"backends gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()} mpi={dist.is_mpi_available()}",
    ]
    for i in range(torch.cuda.device_count()):
        lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
    return "\n".join(lines)


def _checkpoint_command(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from phalanx.checkpoint import Checkpoint, CheckpointError, save_model_file

    try:
        ck = Checkpoint(ns.directory)
        if ns.checkpoint_command == "info":
            print(ck.describe(tensors=ns.tensors))
            if ns.verify:
                problems = ck.verify()
                print("checksums: " + ("all match" if not problems else "; ".join(problems)))
                return 1 if problems else 0
            return 0
        problems = ck.verify()
        if problems:
            raise CheckpointError("; ".join(problems))
        with ck:
            state = ck.state_dict(ns.model)
        save_model_file(state, Path(ns.output), metadata={"format": "pt"})
        print(f"wrote {ns.output}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} elements "
              f"(load it with model.load_state_dict(safetensors.torch.load_file({ns.output!r})))")  # fmt: skip
        return 0
    except CheckpointError as e:
        print(f"phalanx checkpoint {ns.checkpoint_command}: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = list(sys.argv[1:] if argv is None else argv)
    after_separator: list[str] = []
    if args[:1] == ["demo"] and "--" in args:
        cut = args.index("--")
        args, after_separator = args[:cut], args[cut + 1 :]
    ns, unknown = parser.parse_known_args(args)
    if ns.command == "demo":
        # Options phalanx does not know are the demo's, in the order given.
        ns.demo_args = unknown + after_separator
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if ns.command == "env":
            print(_env_report())
            return 0
        if ns.command == "checkpoint":
            return _checkpoint_command(ns)
        cfg = resolve_config(file=ns.config, cli=cli_values(ns))
        if ns.command == "config":
            print(cfg.describe())
            return 0
        try:
            if ns.command == "launch":
                return launch(cfg, ns.script, ns.script_args, module=ns.module)
            if ns.command == "demo":
                from phalanx.demo import default_nproc, parse_args

                parse_args(ns.demo_args)  # --help and bad options end here, before any process starts
                if ns.nproc_per_node is None:
                    cfg.launch.nproc_per_node = default_nproc()
                return launch(cfg, "phalanx.demo", ns.demo_args, module=True)
        except LaunchError as e:
            print(f"phalanx {ns.command}: {e}", file=sys.stderr)
            return 2
    except ConfigError as e:
        print(f"phalanx {ns.command}: config error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

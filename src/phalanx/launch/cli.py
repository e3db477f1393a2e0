"""The ``phalanx`` command.

    phalanx demo                          # trains a byte-level GPT on 2 processes
    phalanx launch -n 2 train.py [args]   # runs your script on 2 processes
    phalanx config --config phalanx.yaml  # prints the resolved config and where each value came from
    phalanx env                           # versions, devices and backends
    phalanx checkpoint info ckpt/step-1000                            # what a checkpoint holds
    phalanx checkpoint consolidate ckpt/step-1000 model.safetensors   # one plain state dict
    phalanx plan --model config.json -n 8 --device-memory 80GB        # will it fit, and on which layout
    phalanx horovodrun -np 2 train.py     # Horovod's spelling of phalanx launch -n 2 train.py

``launch``, ``config`` and ``demo`` also take torchrun's and Accelerate's spellings of their flags
(``--nproc_per_node``, ``--num_processes``, ``--mixed_precision``; see ``phalanx launch --help``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import ipaddress
import os
import platform
import shlex
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from phalanx._version import __version__
from phalanx.config.flags import add_dialect_flags, add_engine_flags, add_launch_flags, flag_spellings, resolve_flags
from phalanx.config.settings import ConfigError, resolve_config
from phalanx.launch.launcher import LaunchError, launch

__all__ = ["main", "check_command_line"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line, not with the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _DemoHelp(argparse.Action):
    """``phalanx demo --help``: phalanx's flags, then the demo's own options."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="show this help, and the demo's own options, and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        parser.print_help()
        print("\n" + "-" * 30 + " the demo's own options " + "-" * 30)
        sys.stdout.flush()
        from phalanx.demo import parse_args

        parse_args(["--help"])  # prints them and exits
        parser.exit()


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(prog="phalanx", description="Train PyTorch models on one or many devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    subs: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        subs[name] = sub.add_parser(name, allow_abbrev=False, **kwargs)
        return subs[name]

    p = add(
        "launch",
        help="run a training script on several processes (torchrun underneath)",
        usage="phalanx launch [-n N] [flags] script [script args]",
        epilog="Flags after the script name go to the script: phalanx launch -n 2 --seed 1 train.py --lr 3e-4",
    )
    add_launch_flags(p)
    add_engine_flags(p)
    add_dialect_flags(p)
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name, as in python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    p = add("config", help="print the resolved config with the origin of every value", usage="phalanx config [flags]")
    add_launch_flags(p)
    add_engine_flags(p)
    add_dialect_flags(p)

    add("env", help="print versions, devices and backends")

    p = add("plot", help="a PNG of a Trainer run's losses, learning rate and throughput (needs matplotlib)")
    p.add_argument("output_dir", help="the Trainer's output_dir (it holds log.jsonl)")
    p.add_argument("-o", "--output", help="the PNG to write (default OUTPUT_DIR/training.png)")

    p = add("checkpoint", help="inspect or consolidate a checkpoint written by engine.save_state")
    ck = p.add_subparsers(dest="checkpoint_command", required=True)
    q = ck.add_parser("info", help="what a checkpoint holds: world size, strategy, counters, models, files")
    q.add_argument("directory")
    q.add_argument("--tensors", action="store_true", help="list every tensor with its dtype, shape and runs")
    q.add_argument("--verify", action="store_true", help="also check every checksum")
    q = ck.add_parser("consolidate", help="write one plain safetensors state dict of a saved model")
    q.add_argument("directory")
    q.add_argument("output", help="the .safetensors file to write")
    q.add_argument("--model", type=int, default=0, help="which prepared model, in prepare order (default 0)")

    p = add(
        "plan",
        help="will a model fit for training, and on which layout: memory per rank and traffic of ddp, zero1/2/3, "
        "offload, tp, pp, cp and ep",
        usage="phalanx plan --model MODEL [-n N] [--nnodes M] [--device-memory 80GB] [flags]",
    )
    from phalanx.planning.cli import add_plan_flags

    add_plan_flags(p)

    p = add("dispatch-plan", help="where phalanx.load_and_dispatch would put each part of a model, before loading it")
    p.add_argument(
        "path", help="a save_pretrained directory, a .safetensors file, a directory of shards, or a checkpoint"
    )
    p.add_argument(
        "--max-memory",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="a device's budget, e.g. cpu=2GiB or 0=20GiB (repeat for each device)",
    )
    p.add_argument("--no-split", help="module classes never split, comma-separated (default: the model's own)")
    p.add_argument("--dtype", help="plan for the weights in this dtype (bf16, fp16, fp32)")

    p = add(
        "demo",
        help="train a small byte-level GPT on the Python standard library's source",
        add_help=False,
        usage="phalanx demo [-n N] [flags] [--] [demo options]",
    )
    p.add_argument("-h", "--help", action=_DemoHelp)
    add_launch_flags(p, n_help="processes on this node (default: one per GPU, or 2 on a machine without GPUs)")
    add_engine_flags(p)
    add_dialect_flags(p)
    p.epilog = "The demo's own options (listed below, e.g. --steps 50) follow the flags above, or come after --."

    p = add("horovodrun", help="Horovod's spelling: phalanx horovodrun -np 2 train.py is phalanx launch -n 2 train.py")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, required=True, help="processes to run")
    p.add_argument("-H", "--hosts", help="HOST:SLOTS,... ; every host must be this machine (e.g. localhost:2)")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser, subs


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
    import math
    from pathlib import Path

    from phalanx.checkpoint.format import model_key
    from phalanx.checkpoint.pretrained import write_safetensors_streamed
    from phalanx.checkpoint.state import Checkpoint, CheckpointError

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
        models = ck.manifest["models"]
        if not 0 <= ns.model < len(models):
            raise CheckpointError(f"{ck.path} holds {len(models)} model(s); there is no model {ns.model}")
        keys = [(k, model_key("model", ns.model, stored)) for k, stored in models[ns.model]["state_dict_keys"].items()]
        with ck:  # tensor by tensor, in pieces: the whole model is never in memory
            write_safetensors_streamed(ck, keys, Path(ns.output))
        elements = sum(math.prod(ck.tensors[key]["shape"]) for _, key in keys)
        print(
            f"wrote {ns.output}: {len(keys)} tensors, {elements:,} elements "
            f"(load it with model.load_state_dict(safetensors.torch.load_file({ns.output!r})))"
        )
        return 0
    except CheckpointError as e:
        print(f"phalanx checkpoint {ns.checkpoint_command}: {e}", file=sys.stderr)
        return 2


def _unknown(command: str, unknown: list[str], spellings: Sequence[str]) -> str:
    """One line for the first thing on the command line that ``command`` does not take."""
    token = unknown[0]
    if not token.startswith("-"):
        return f"phalanx {command}: unexpected argument {token!r} (see phalanx {command} --help)"
    name = token.split("=", 1)[0]
    # A flag cut short (--nproc) means the first flag it begins; else the nearest spelling.
    close = [s for s in spellings if s.startswith(name)][:1] or difflib.get_close_matches(name, spellings, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"phalanx {command}: unknown flag {name}{hint} (see phalanx {command} --help)"


def _misplaced(args: list[str], script_args: list[str], spellings: dict[str, bool]) -> str | None:
    """One line when phalanx flags came after the script: they go to the script, and the line says how not to."""
    cut = script_args.index("--") if "--" in script_args else len(script_args)  # after --: the script's, clearly
    names: list[str] = []
    moved: list[str] = []
    kept: list[str] = []
    i = 0
    while i < cut:
        name = script_args[i].split("=", 1)[0]
        if name in spellings and name not in ("-h", "--help", "-m", "--module"):
            n = 2 if spellings[name] and "=" not in script_args[i] and i + 1 < cut else 1
            names.append(name)
            moved += script_args[i : i + n]
            i += n
        else:
            kept.append(script_args[i])
            i += 1
    if not names:
        return None
    script_at = len(args) - len(script_args) - 1
    fixed = [*args[:script_at], *moved, args[script_at], *kept, *script_args[cut:]]
    them = "it" if len(names) == 1 else "them"
    return (
        f"phalanx {args[0]}: {' and '.join(names)} came after the script name, so {args[script_at]} gets {them}, not "
        f"phalanx; to give {them} to phalanx, put {them} before the script: phalanx {shlex.join(fixed)}"
    )


def _is_this_machine(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _horovod_nproc(num_proc: int, hosts: str | None) -> int:
    """``horovodrun -np N [-H host:slots,...]`` on this machine: N processes, within the slots -H gives."""
    if num_proc < 1:
        raise LaunchError(f"-np must be 1 or more; got {num_proc}")
    if hosts is None:
        return num_proc
    slots = 0
    for entry in hosts.split(","):
        host, _, count = entry.strip().rpartition(":") if ":" in entry else (entry.strip(), "", "1")
        if not _is_this_machine(host):
            raise LaunchError(
                f"-H names host {host!r}, which is not this machine; phalanx horovodrun runs on this machine only. "
                "For several machines run phalanx launch on each: --nnodes N --node-rank R --master-addr <node 0's "
                "address> --master-port P -n <processes per machine>"
            )
        if not count.isdigit() or int(count) < 1:
            raise LaunchError(
                f"-H {hosts!r}: the slots of {host!r} must be a whole number >= 1; got {count!r} (e.g. -H localhost:2)"
            )
        slots += int(count)
    if num_proc > slots:
        raise LaunchError(
            f"-np {num_proc} needs {num_proc} slots and -H {hosts!r} gives {slots} (use -H localhost:{num_proc}, or "
            "leave -H out)"
        )
    return num_proc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args)
    except KeyboardInterrupt:  # before the ranks started, or after they ended: nothing to stop
        sys.stderr.write(f"phalanx {args[0] if args else ''}: interrupted (Ctrl-C)\n")
        return 130


def _parse(args: list[str]) -> tuple[argparse.Namespace, dict[str, bool], str | None]:
    """The command line as ``main`` reads it: the namespace, the command's flag spellings, and the one line that
    refuses it (None when it parses). argparse's own errors exit, as they do for ``main``."""
    parser, subs = _parser()
    after_separator: list[str] = []
    if args[:1] == ["demo"] and "--" in args:
        cut = args.index("--")
        args, after_separator = args[:cut], args[cut + 1 :]
    ns, unknown = parser.parse_known_args(args)
    spellings = flag_spellings(subs[ns.command]) if ns.command in subs else {}
    if ns.command == "demo":
        # Options phalanx does not know are the demo's, in the order given.
        ns.demo_args = unknown + after_separator
    elif unknown:
        return ns, spellings, _unknown(ns.command, unknown, list(spellings))
    return ns, spellings, None


def check_command_line(args: Sequence[str]) -> str | None:
    """Why ``phalanx <args>`` would be refused before it runs anything, or None when it parses: the command, its
    flags and their values, and the demo's own options. Files it names are not read. The docs test checks every
    ``phalanx`` command line in the docs with it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns, _, problem = _parse(list(args))
            if problem is None and ns.command == "demo":
                from phalanx.demo import parse_args

                parse_args(ns.demo_args)
    except SystemExit as e:
        return None if e.code in (0, None) else err.getvalue().strip() or f"exit status {e.code}"
    return problem


def _main(args: list[str]) -> int:
    ns, spellings, problem = _parse(args)
    command = ns.command
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        if command == "plot":
            from phalanx.trainer.plot import plot

            try:
                print(f"wrote {plot(ns.output_dir, ns.output)}")
            except (ImportError, FileNotFoundError, ValueError) as e:
                print(f"phalanx plot: {e}", file=sys.stderr)
                return 2
            return 0
        if command == "env":
            print(_env_report())
            return 0
        if command == "checkpoint":
            return _checkpoint_command(ns)
        if command == "plan":
            from phalanx.planning.cli import plan_command

            return plan_command(ns)
        if command == "dispatch-plan":
            from phalanx.inference.plan import DispatchError
            from phalanx.inference.plan_cli import dispatch_plan_text

            try:
                no_split = [c for c in ns.no_split.split(",") if c] if ns.no_split else None
                print(dispatch_plan_text(ns.path, ns.max_memory, no_split, ns.dtype))
            except DispatchError as e:
                print(f"phalanx dispatch-plan: {e}", file=sys.stderr)
                return 2
            return 0
        if command == "horovodrun":
            cfg = resolve_config(cli={"launch.nproc_per_node": _horovod_nproc(ns.num_proc, ns.hosts)})
            return launch(cfg, ns.script, ns.script_args)
        cfg = resolve_flags(ns)
        if command == "config":
            print(cfg.describe())
            from phalanx.launch.launcher import mesh_text

            print(mesh_text(cfg))
            return 0
        if command == "launch":
            warning = _misplaced(args, ns.script_args, spellings)
            if warning:
                print(warning, file=sys.stderr)
            return launch(cfg, ns.script, ns.script_args, module=ns.module)
        if command == "demo":
            from phalanx.demo import default_nproc, parse_args

            parse_args(ns.demo_args)  # --help and bad options end here, before any process starts
            if "launch.nproc_per_node" not in cfg.origins:
                cfg.launch.nproc_per_node = default_nproc()
            return launch(cfg, "phalanx.demo", ns.demo_args, module=True)
    except LaunchError as e:
        print(f"phalanx {command}: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"phalanx {command}: config error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

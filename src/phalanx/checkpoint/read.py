"""Reading a checkpoint back: check it from its manifest and the files' own headers, then read runs of tensors
straight into the caller's memory. Nothing here unpickles: a pickle or ``torch.save`` file where a shard should
be is refused by its first bytes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from phalanx._version import __version__
from phalanx.checkpoint.format import (
    DTYPES,
    FORMAT,
    MANIFEST,
    READABLE,
    SAFETENSORS_DTYPE,
    SHARD_NAME,
    CheckpointError,
    from_json,
    model_key,
    saved_at,
)
from phalanx.checkpoint.shards import ChunkSpec, chunk_segments

__all__ = ["Checkpoint", "latest_checkpoint"]

_WINDOW = 16 << 20  # bytes read at once for the pieces of one run that a chunk of another layout needs
_GAP = 64 << 10  # the most bytes between two such pieces read (and dropped) to save a system call


class Checkpoint:
    """A checkpoint directory, opened by its manifest alone: nothing is unpickled and no code runs.

    ``Checkpoint(path)`` checks the format, the version, that every file is there with its recorded size, and
    that each file's safetensors header holds every run the manifest puts there, with its dtype and length;
    ``verify()`` checks the checksums; ``read``/``read_into`` read runs of tensors (``read_into`` straight from
    the file into the destination's memory); ``state_dict()`` gives a model's whole state dict.

    Files are read by offsets from their safetensors headers (parsed as JSON here), not through the
    safetensors library, which cannot read into memory the caller already has.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise CheckpointError(_not_a_checkpoint(self.path))
        try:
            m = json.loads(manifest.read_text())
        except ValueError as e:
            raise CheckpointError(f"{manifest} is not valid JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise CheckpointError(
                f"{manifest} is not a phalanx checkpoint manifest "
                f"(format {m.get('format') if isinstance(m, dict) else None!r})"
            )
        if m.get("version") not in READABLE:
            raise CheckpointError(
                f"{manifest} has format version {m.get('version')!r}; this phalanx ({_phalanx_version()}) reads "
                f"versions {', '.join(map(str, READABLE))} (load it with the phalanx version that wrote it, "
                f"{m.get('phalanx_version')!r})"
            )
        self.manifest = m
        self._headers: list[tuple[dict[str, Any], int]] = []
        self._fds: dict[int, int] = {}
        try:
            self._check_files()
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"{manifest} is malformed ({type(e).__name__}: {e}); the checkpoint is damaged"
            ) from None

    def _check_files(self) -> None:
        m = self.manifest
        for f in m["files"]:
            if not SHARD_NAME.fullmatch(f["name"]):
                raise CheckpointError(f"{self.path / MANIFEST} lists a file named {f['name']!r}, not a shard name")
        self.files: list[Path] = [self.path / f["name"] for f in m["files"]]
        for f, p in zip(m["files"], self.files):
            if not p.is_file():
                raise CheckpointError(
                    f"{p} is missing: the checkpoint lists {len(self.files)} shard files and this one (rank "
                    f"{f['rank']}'s) is not there; copy the whole checkpoint directory"
                )
            self._headers.append(_read_header(p))  # first: a pickle in a shard's place is named as such
            size = p.stat().st_size
            if size != f["bytes"]:
                raise CheckpointError(
                    f"{p} has {size} bytes, the manifest says {f['bytes']}: the file is truncated or was replaced"
                )
        self.tensors: dict[str, dict[str, Any]] = m["tensors"]
        for key, info in self.tensors.items():
            itemsize = torch.empty((), dtype=DTYPES[info["dtype"]]).element_size()
            shape = tuple(info["shape"])
            for run in info["slices"]:
                chunk = run.get("chunk")
                if chunk is not None:
                    spec = run["chunk"] = ChunkSpec(*chunk)  # a tuple from here on: compared with the reader's
                    if not spec.fits(shape) or not 0 <= run["start"] <= run["stop"] <= math.prod(spec.shape(shape)):
                        raise CheckpointError(
                            f"{self.path / MANIFEST}: a run of {key} holds chunk {chunk} elements [{run['start']}, "
                            f"{run['stop']}), which is no chunk of shape {list(shape)}; the checkpoint is damaged"
                        )
                header, base = self._headers[run["file"]]
                entry = header.get(run["name"])
                expect = (SAFETENSORS_DTYPE[info["dtype"]], (run["stop"] - run["start"]) * itemsize)
                lo, hi = entry["data_offsets"] if entry is not None else (0, -1)
                if (
                    entry is None
                    or (entry.get("dtype"), hi - lo) != expect
                    or base + hi > m["files"][run["file"]]["bytes"]
                ):
                    raise CheckpointError(
                        f"{self.files[run['file']]} does not hold {key} elements [{run['start']}, {run['stop']}) "
                        f"as the manifest says (expected {expect[0]} x {expect[1]} bytes under {run['name']!r}, "
                        f"found {entry}); the file was replaced or the checkpoint is damaged"
                    )

    # ------------------------------------------------------------------ checks
    def verify(self, files: Iterable[int] | None = None) -> list[str]:
        """crc32 of every run in ``files`` (indices; default all). Returns the problems found (empty: intact)."""
        wanted = set(range(len(self.files)) if files is None else files)
        runs: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for key, info in self.tensors.items():
            for s in info["slices"]:
                if s["file"] in wanted:
                    runs.setdefault(s["file"], []).append((key, s))
        problems = []
        for index, items in sorted(runs.items()):
            path = self.files[index]
            header, base = self._headers[index]
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for key, s in items:
                        a, b = header[s["name"]]["data_offsets"]
                        crc = zlib.crc32(view[base + a : base + b])
                        if crc != s["crc32"]:
                            problems.append(
                                f"{path}: checksum mismatch in {key} elements [{s['start']}, {s['stop']}) "
                                f"(crc32 {crc:08x}, the manifest says {s['crc32']:08x}); the file is damaged"
                            )
                finally:
                    view.release()
        return problems

    def model_shapes(self, model_index: int = 0) -> dict[str, tuple[int, ...]]:
        prefix = model_key("model", model_index, "")
        return {k[len(prefix) :]: tuple(v["shape"]) for k, v in self.tensors.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ reading
    def reader(self, model_index: int = 0) -> _Reader:
        return _Reader(self, model_index)

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self.tensors[key]["dtype"]]

    def tensor_bytes(self, key: str) -> int:
        """The bytes of the whole tensor ``key``."""
        return math.prod(self.tensors[key]["shape"]) * self.dtype(key).itemsize

    def read(self, key: str, start: int, stop: int, chunk: ChunkSpec | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key`` (of its chunk ``chunk``), in new memory."""
        out = torch.empty(stop - start, dtype=self.dtype(key))
        self.read_chunk_into(key, chunk, start, stop, out)
        return out

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of ``key`` into the 1-D ``out``. The file's bytes go straight into ``out``'s
        memory when it is a contiguous CPU tensor of the saved dtype; otherwise through a buffer (another dtype
        is converted, a GPU tensor is copied to)."""
        self.read_chunk_into(key, None, start, stop, out)

    def read_chunk_into(self, key: str, chunk: ChunkSpec | None, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of chunk ``chunk`` of ``key`` (None: of the whole tensor) into the 1-D ``out``,
        however the checkpoint holds it: whole or in chunks (tensor parallelism), in the same chunks or others. A
        run saved in the chunk asked for is one read; otherwise each contiguous piece that the run and the range
        share is read straight into its place (a weight split along its last dim: one read per row)."""
        if out.device.type != "cpu" or out.dtype != self.dtype(key) or not out.is_contiguous():
            out.copy_(self.read(key, start, stop, chunk))
            return
        if out.numel() != stop - start:
            raise ValueError(
                f"read_into({key!r}, {start}, {stop}) needs {stop - start} elements; out has {out.numel()}"
            )
        info = self.tensors[key]
        size = out.element_size()
        dst = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")  # type: ignore[arg-type]
        wanted: list[tuple[int, int, int]] | None = None  # the range's pieces of the whole tensor, when needed
        for run in info["slices"]:
            saved = run.get("chunk")
            header, base = self._headers[run["file"]]
            data = base + header[run["name"]]["data_offsets"][0]
            if saved == chunk:  # the same layout: one overlap
                a, b = max(start, run["start"]), min(stop, run["stop"])
                if a < b:
                    dst_piece = dst[(a - start) * size : (b - start) * size]
                    _pread_exactly(self._fd(run["file"]), dst_piece, data + (a - run["start"]) * size)
                continue
            if saved is not None and chunk is not None and saved[:3] == chunk[:3]:
                continue  # another chunk of the same cut: nothing in common
            if wanted is None:
                wanted = chunk_segments(tuple(info["shape"]), chunk, start, stop)
            held = chunk_segments(tuple(info["shape"]), saved, run["start"], run["stop"])
            self._read_pieces(run["file"], data, size, _overlaps(held, wanted), dst)

    def _read_pieces(
        self, file: int, data: int, size: int, pieces: list[tuple[int, int, int, int]], dst: memoryview
    ) -> None:
        """Copy ``(_, src, dst_at, n)`` pieces (``src`` ascending, in elements of ``size`` bytes from the file offset
        ``data``) into ``dst``. Nearby pieces (a row-split weight's rows) are read together, one read per window of
        at most 16 MiB with gaps of at most 64 KiB, and copied from there: one system call per row would be slower
        than the disk."""
        fd, i = self._fd(file), 0
        while i < len(pieces):
            lo, j = pieces[i][1], i + 1
            while (
                j < len(pieces)
                and (pieces[j][1] - pieces[j - 1][1] - pieces[j - 1][3]) * size <= _GAP
                and (pieces[j][1] + pieces[j][3] - lo) * size <= _WINDOW
            ):
                j += 1
            if j == i + 1:
                _, src, at, n = pieces[i]
                _pread_exactly(fd, dst[at * size : (at + n) * size], data + src * size)
            else:
                window = memoryview(bytearray((pieces[j - 1][1] + pieces[j - 1][3] - lo) * size))
                _pread_exactly(fd, window, data + lo * size)
                for _, src, at, n in pieces[i:j]:
                    dst[at * size : (at + n) * size] = window[(src - lo) * size : (src - lo + n) * size]
            i = j

    def read_whole(self, key: str) -> torch.Tensor:
        shape = tuple(self.tensors[key]["shape"])
        return self.read(key, 0, math.prod(shape)).reshape(shape)

    def _fd(self, index: int) -> int:
        if index not in self._fds:
            self._fds[index] = os.open(self.files[index], os.O_RDONLY)
        return self._fds[index]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self, model_index: int = 0) -> dict[str, torch.Tensor]:
        """The whole ``state_dict()`` of a saved model (its tied keys as separate tensors), on CPU."""
        models = self.manifest["models"]
        if not 0 <= model_index < len(models):
            raise CheckpointError(f"{self.path} holds {len(models)} model(s); there is no model {model_index}")
        return {
            sd_key: self.read_whole(model_key("model", model_index, stored))
            for sd_key, stored in models[model_index]["state_dict_keys"].items()
        }

    def describe(self, tensors: bool = False) -> str:
        """What ``phalanx checkpoint info`` prints."""
        m = self.manifest
        total = sum(f["bytes"] for f in m["files"])
        lines = [
            f"checkpoint {self.path}",
            f"  format {m['format']} v{m['version']}, "
            f"saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['saved_at']))} "
            f"by phalanx {m['phalanx_version']} (torch {m['torch_version']})",
            f"  saved under strategy {m['strategy']} on world size {m['world_size']} "
            f"(pp {m['pp_size']} x dp {m['dp_size']} x tp {m.get('tp_size', 1)})",
            f"  counters: {', '.join(f'{k}={v}' for k, v in m['counters'].items()) or 'none'}",
            f"  files: {len(m['files'])} shard(s), {total / 2**20:.1f} MiB",
        ]
        for i, model in enumerate(m["models"]):
            shapes = self.model_shapes(i)
            params = sum(math.prod(s) for s in shapes.values())
            lines.append(
                f"  model {i}: {model['class']}, {len(model['state_dict_keys'])} state_dict keys, {params:,} elements"
            )
        for opt in m["optimizers"]:
            hyper = opt["param_groups"][0] if opt["param_groups"] else {}
            shown = ", ".join(
                f"{k}={from_json(v, None)}"
                for k, v in hyper.items()
                if k in ("lr", "weight_decay", "momentum", "betas")
            )
            lines.append(
                f"  optimizer: {opt['class']}, {len(opt['param_groups'])} param group(s); the first has {shown}"
            )
        lines += [f"  scheduler {i}: last_epoch={s.get('last_epoch')}" for i, s in enumerate(m["schedulers"])]
        lines += [
            f"  loader {i}: epoch {s['epoch']}, {s['samples_done']} samples into it" for i, s in enumerate(m["loaders"])
        ]
        lines += [f"  registered object {i}: {o['class']}" for i, o in enumerate(m["objects"])]
        if tensors:
            lines.append("  tensors:")
            for key, info in self.tensors.items():
                cut = next((run["chunk"] for run in info["slices"] if run.get("chunk")), None)
                how = f", in {cut.parts} chunks along dim {cut.dim}" if cut is not None else ""
                lines.append(f"    {key} {info['dtype']}{info['shape']} in {len(info['slices'])} run(s){how}")
        return "\n".join(lines)


class _Reader:
    """The StateReader a strategy loads from: one model's ``model/`` and ``optim/`` keys."""

    def __init__(self, ck: Checkpoint, model_index: int) -> None:
        self.ck = ck
        self.prefixes = {kind: model_key(kind, model_index, "") for kind in ("model", "optim")}
        self._keys = {}
        for key in ck.tensors:
            for kind, prefix in self.prefixes.items():
                if key.startswith(prefix):
                    self._keys[f"{kind}/{key[len(prefix) :]}"] = key

    def keys(self) -> Iterable[str]:
        return self._keys.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.ck.tensors[self._keys[key]]["shape"])

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.ck.read(self._keys[key], start, stop)

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        self.ck.read_into(self._keys[key], start, stop, out)

    def read_chunk_into(self, key: str, chunk: ChunkSpec | None, start: int, stop: int, out: torch.Tensor) -> None:
        self.ck.read_chunk_into(self._keys[key], chunk, start, stop, out)

    def dtype(self, key: str) -> torch.dtype:
        return self.ck.dtype(self._keys[key])


def _overlaps(held: list[tuple[int, int, int]], wanted: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """The elements two ascending lists of ``(whole_start, offset, length)`` pieces share: ``(whole_start, offset in
    the first, offset in the second, length)`` for each contiguous stretch, in one merge pass."""
    out = []
    i = j = 0
    while i < len(held) and j < len(wanted):
        h0, hoff, hn = held[i]
        w0, woff, wn = wanted[j]
        a, b = max(h0, w0), min(h0 + hn, w0 + wn)
        if a < b:
            out.append((a, hoff + a - h0, woff + a - w0, b - a))
        if h0 + hn <= w0 + wn:
            i += 1
        else:
            j += 1
    return out


def _pread_exactly(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(
                f"a checkpoint file ended {len(dst) - done} bytes early (read at offset {offset + done})"
            )
        done += n


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header (JSON) and where the data starts; refuses anything that is not safetensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(_not_safetensors(path, head))
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise CheckpointError(_not_safetensors(path, head)) from None
    if not isinstance(header, dict):
        raise CheckpointError(_not_safetensors(path, head))
    header.pop("__metadata__", None)
    return header, 8 + n


def _not_safetensors(path: Path, head: bytes) -> str:
    if head[:1] == b"\x80":
        kind = "a pickle"
    elif head[:4] == b"PK\x03\x04":
        kind = "a zip archive (torch.save writes these; they hold pickles)"
    else:
        kind = "not safetensors"
    return (
        f"{path} is {kind}, where the manifest expects a safetensors file. phalanx never unpickles checkpoint files "
        "(unpickling can run arbitrary code); the file was replaced or the checkpoint is damaged"
    )


def _not_a_checkpoint(path: Path) -> str:
    if not path.exists():
        old = path.parent / f".{path.name}.old"
        partial = path.parent / f".{path.name}.partial"
        if (old / MANIFEST).exists():
            return (
                f"no checkpoint at {path}; a save there was interrupted and the previous checkpoint is at {old} "
                "(rename it back)"
            )
        if partial.exists():
            return (
                f"no checkpoint at {path}: a save there did not finish ({partial} is its incomplete staging directory)"
            )
        return f"no checkpoint at {path}: the directory does not exist"
    inner = sorted(d.name for d in path.iterdir() if (d / MANIFEST).is_file()) if path.is_dir() else []
    hint = (
        f"; it holds checkpoints {', '.join(inner[:5])}: pass one of them, or "
        f"phalanx.checkpoint.latest_checkpoint({str(path)!r})"
        if inner
        else ""
    )
    return f"{path} is not a phalanx checkpoint (it has no {MANIFEST}){hint}"


def _phalanx_version() -> str:
    return __version__


def latest_checkpoint(parent: str | os.PathLike[str]) -> Path | None:
    """The most recently saved complete checkpoint directly inside ``parent`` (None if there is none)."""
    best: tuple[float, Path] | None = None
    root = Path(parent)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        # A save interrupted between its two renames leaves the previous checkpoint at .NAME.old (and no NAME): it
        # counts, and loads from there (the next save to NAME renames it back). Staging directories never count.
        if d.name.startswith(".") and not (d.name.endswith(".old") and not (root / d.name[1:-4]).exists()):
            continue
        when = saved_at(d)
        if when is not None and (best is None or when > best[0]):
            best = (when, d)
    return best[1] if best else None

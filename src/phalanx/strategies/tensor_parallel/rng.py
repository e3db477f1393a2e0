"""The tensor-parallel RNG tracker (Megatron's): one extra generator stream per tp rank, for dropout on sharded
activations.

Replicated activations (the residual stream without sequence parallelism) must drop the same elements on every tp
rank, so they draw from torch's default generator, which the caller seeds alike on every tp rank. Sharded activations
(attention on this rank's heads, a sequence shard) must not: ``with tracker.fork():`` swaps the default generator's
state for this rank's stream (seed + 2718 + tp_rank, Megatron's offset) and swaps it back after, keeping where the
stream got to. The planned modules that compute on sharded activations run their forward under ``fork()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TPRngTracker", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718


class TPRngTracker:
    """``fork()`` draws from this tp rank's own stream; ``state_dict()`` holds only tensors and ints."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = int(seed)
        self.tp_rank = int(tp_rank)
        self._states: dict[str, torch.Tensor] = {}
        self._forked = False

    @property
    def stream_seed(self) -> int:
        return self.seed + TP_SEED_OFFSET + self.tp_rank

    def _initial(self, device: str) -> torch.Tensor:
        if device == "cpu":
            return torch.Generator().manual_seed(self.stream_seed).get_state()
        index = int(device.split(":")[1])
        saved = torch.cuda.get_rng_state(index)
        with torch.cuda.device(index):
            torch.cuda.manual_seed(self.stream_seed)
        state = torch.cuda.get_rng_state(index)
        torch.cuda.set_rng_state(saved, index)
        return state

    def _devices(self) -> list[str]:
        devices = ["cpu"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.append(f"cuda:{torch.cuda.current_device()}")
        return devices

    @staticmethod
    def _get(device: str) -> torch.Tensor:
        return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(int(device.split(":")[1]))

    @staticmethod
    def _set(device: str, state: torch.Tensor) -> None:
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, int(device.split(":")[1]))

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this tp rank's stream inside the block (re-entrant: a nested fork stays on the stream)."""
        if self._forked:
            yield
            return
        devices = self._devices()
        saved = {d: self._get(d) for d in devices}
        for d in devices:
            self._set(d, self._states[d] if d in self._states else self._initial(d))
        self._forked = True
        try:
            yield
        finally:
            self._forked = False
            for d in devices:
                self._states[d] = self._get(d)
                self._set(d, saved[d])

    def state_dict(self) -> dict[str, Any]:
        """``{"seed": int, "tp_rank": int, "states": {device: uint8 tensor}}`` (streams not used yet are absent)."""
        return {"seed": self.seed, "tp_rank": self.tp_rank, "states": {d: s.clone() for d, s in self._states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["tp_rank"]) != self.tp_rank:
            raise ValueError(
                f"this RNG tracker state belongs to tp rank {state['tp_rank']}, not {self.tp_rank}: each tp rank "
                "loads its own (the streams differ by rank)"
            )
        self.seed = int(state["seed"])
        self._states = {d: torch.as_tensor(s, dtype=torch.uint8).clone() for d, s in state["states"].items()}

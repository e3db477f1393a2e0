"""The tensor-parallel RNG tracker: one more generator stream per tp rank (Megatron's), for dropout on sharded
activations.

Replicated activations (the residual stream without sequence parallelism) must drop the same elements on every tp
rank, so they draw from torch's default generator, which the caller seeds alike on every tp rank. Sharded activations
(attention on this rank's heads, a sequence shard) must not: ``with tracker.fork():`` swaps the default generators'
states (the CPU's, and the current CUDA device's when CUDA is in use) for this rank's own and swaps them back after.

Activation checkpointing re-runs a forward during backward and restores torch's default generator states first
(``torch.utils.checkpoint``, reentrant or not, and transformers' ``gradient_checkpointing_enable()`` on top of it),
but it knows nothing of another stream. So the fork's state is a function of what that restore covers: each fork
draws one 62-bit number from the default CPU generator, mixes it with ``seed + 2718 + tp_rank`` (Megatron's offset)
and seeds the swapped-in generators with the result. The recompute then draws the forward's number again, and the
same masks, bit for bit; the draw advances the default CPU generator alike on every tp rank, so that successive
forks (layers, micro-batches, steps) differ and the replicated stream stays in step across the tp ranks. Nothing of
the stream lives in the tracker: a checkpoint's saved torch RNG state resumes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TPRngTracker", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718
_MASK64 = (1 << 64) - 1


def _mix(stream_seed: int, drawn: int) -> int:
    """splitmix64's finaliser over (stream seed, drawn number): every bit of the result depends on both, and the
    low 32 bits (all that the CPU's Mersenne Twister takes of a seed) as much as the rest. Below 2**63, as torch
    takes seeds."""
    z = (stream_seed * 0x9E3779B97F4A7C15 + drawn) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class TPRngTracker:
    """``fork()`` draws from this tp rank's own stream, a function of torch's default CPU generator (see the module's
    doc); ``state_dict()`` holds only ints."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = int(seed)
        self.tp_rank = int(tp_rank)

    @property
    def stream_seed(self) -> int:
        return self.seed + TP_SEED_OFFSET + self.tp_rank

    @staticmethod
    def _cuda_index() -> int | None:
        # Only a CUDA that is in use: a fork must not be what initialises it (checkpointing refuses that too).
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return None

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this tp rank's stream inside the block.

        A nested fork forks again, from the outer fork's stream (still this rank's own, and drawn alike in a
        recompute that starts inside the outer fork)."""
        # From the default CPU generator, which checkpointing restores (preserve_rng_state=True, its default).
        drawn = int(torch.randint(0, 1 << 62, (), device="cpu").item())
        seed = _mix(self.stream_seed, drawn)
        cuda = self._cuda_index()
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state(cuda) if cuda is not None else None
        torch.default_generator.manual_seed(seed)
        if cuda is not None:
            torch.cuda.default_generators[cuda].manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(saved_cpu)
            if cuda is not None and saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda, cuda)

    def state_dict(self) -> dict[str, Any]:
        """``{"seed": int, "tp_rank": int, "states": {}}``: the stream itself is a function of torch's default CPU
        generator, which a checkpoint saves; ``states`` stays for the checkpoint format (older trackers kept one
        generator state per device there)."""
        return {"seed": self.seed, "tp_rank": self.tp_rank, "states": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The seed of a saved tracker; saved ``states`` (older checkpoints) are not needed: see ``state_dict``."""
        if int(state["tp_rank"]) != self.tp_rank:
            raise ValueError(
                f"this RNG tracker state belongs to tp rank {state['tp_rank']}, not {self.tp_rank}: each tp rank "
                "loads its own (the streams differ by rank)"
            )
        self.seed = int(state["seed"])

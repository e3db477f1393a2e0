"""Models, data and single-process reference loops shared by the tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES, N_OUT = 13, 3


class OddNet(nn.Module):
    """Odd-sized layers (13 -> 29 -> 7 -> 3) and a random registered buffer used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, 29)
        self.fc2 = nn.Linear(29, 7)
        self.out = nn.Linear(7, N_OUT)
        self.register_buffer("scale", torch.rand(29) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x)) * self.scale
        return self.out(torch.relu(self.fc2(h)))


class BNNet(nn.Module):
    """With BatchNorm: running statistics are buffers that ddp broadcasts from rank 0 each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, 17)
        self.bn = nn.BatchNorm1d(17)
        self.out = nn.Linear(17, N_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc1(x))))


def make_data(n: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, N_FEATURES, generator=g), torch.randn(n, N_OUT, generator=g)


def global_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The documented global sample order: a permutation drawn from seed + epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_run(
    model_cls: type[nn.Module], steps: int, global_batch: int, opt: str = "adamw", init_seed: int = 100, data_seed: int = 0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch: full global batches in the documented order, no phalanx involved."""
    torch.manual_seed(init_seed)
    model = model_cls()
    optimizer = make_optimizer(opt, model.parameters())
    x_all, y_all = make_data(steps * global_batch)
    order = global_order(len(x_all), data_seed, 0)
    losses = []
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch]
        loss = F.mse_loss(model(x_all[idx]), y_all[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


VOCAB, SEQ = 11, 5


class TiedNet(nn.Module):
    """For sharding: odd sizes, an embedding tied to the output head, a frozen layer, and a ModuleList.

    The tied weight is used by two modules, so zero3 must keep it in the root unit.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 7)
        self.fc1 = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Linear(13, 13), nn.Linear(13, 13)])
        self.proj = nn.Linear(13, 7)
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(self.emb(tokens).mean(1)))
        x = self.frozen(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.proj(x))


def make_tokens(n: int, seed: int = 4321) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n,), generator=g)


def grouped_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own lr and weight decay: matrices, and the rest (biases)."""
    mats = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "adamw":
        return torch.optim.AdamW(
            [{"params": mats, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}], lr=1e-2
        )
    return torch.optim.SGD([{"params": mats}, {"params": rest, "lr": 0.1, "momentum": 0.5}], lr=0.05, momentum=0.9)


def tied_reference_run(steps: int, global_batch: int, opt: str, init_seed: int = 100) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch on TiedNet: full global batches in the documented order."""
    torch.manual_seed(init_seed)
    model = TiedNet()
    optimizer = grouped_optimizer(opt, model)
    x_all, y_all = make_tokens(steps * global_batch)
    order = global_order(len(x_all), 0, 0)
    losses = []
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch]
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

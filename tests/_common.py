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
    model_cls: type[nn.Module],
    steps: int,
    global_batch: int,
    opt: str = "adamw",
    init_seed: int = 100,
    data_seed: int = 0,
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


def tied_reference_run(
    steps: int, global_batch: int, opt: str, init_seed: int = 100
) -> tuple[list[float], dict[str, torch.Tensor]]:
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


# ------------------------------------------------------------------------------------------ pipeline models
D_IN = 13


class Fork(nn.Module):
    """Returns a tuple: two float tensors and a bool mask, so a stage boundary after it carries three tensors."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return torch.relu(h), h, h > 0


class Carry(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(
        self, xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b, mask = xs
        return torch.tanh(self.fc(a)), b, mask


class Join(nn.Module):
    def __init__(self, d: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d_out)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b, mask = xs
        return self.fc(a * torch.sigmoid(b) + mask.float())


class Residual(nn.Module):
    """A skip connection inside one block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def pipe_model() -> nn.Sequential:
    """8 blocks with odd sizes: a parameter-free block, tuple boundaries (blocks 2 to 4) and residual blocks."""
    return nn.Sequential(
        nn.Linear(D_IN, 24),
        nn.Tanh(),
        Fork(24, 20),
        Carry(20),
        Join(20, 16),
        Residual(16),
        Residual(16),
        nn.Linear(16, N_OUT),
    )


def pipe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def pipe_loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A summed loss over the rows whose first target is positive, with their count: micro-batches differ in items."""
    x, y = batch
    keep = (y[:, 0] > 0).float()
    return (((model(x) - y) ** 2).sum(1) * keep).sum(), keep.sum()


def pipe_reference_run(
    steps: int, global_batch: int, opt: str, sum_loss: bool = False, clip: float | None = None, init_seed: int = 100
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch on pipe_model(): full global batches in the documented order."""
    torch.manual_seed(init_seed)
    model = pipe_model()
    optimizer = grouped_optimizer(opt, model)
    x_all, y_all = make_data(steps * global_batch)
    order = global_order(len(x_all), 0, 0)
    losses = []
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch]
        if sum_loss:
            loss_sum, items = pipe_loss_sum(model, (x_all[idx], y_all[idx]))
            loss = loss_sum / items
        else:
            loss = pipe_loss(model, (x_all[idx], y_all[idx]))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class Indices(torch.utils.data.Dataset):
    """The dataset 0, 1, ..., n-1: each sample is its own index, so gathers and orders can be read off directly."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

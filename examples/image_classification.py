"""Seeds 001/002's image classifier (a ResNet on CIFAR-10 under DistributedDataParallel) as a phalanx Engine loop.

    phalanx launch -n 2 examples/image_classification.py             # under a minute on 2 CPU cores
    phalanx launch -n 2 examples/image_classification.py --smoke     # a few seconds: the test suite's run
    python examples/image_classification.py                          # one process: the same global batches

What the seed's DDP program writes by hand, phalanx does in ``engine.prepare``: it starts the process group,
wraps the model, and shards the DataLoader, so there is no DistributedSampler and no ``set_epoch`` (the prepared
loader draws each epoch's order from the seed and the epoch by itself). Accuracy on the held-out set comes from
``engine.gather_for_metrics``, which returns every sample exactly once however the last batch split over the ranks.
No dataset can be downloaded here, so the 3x32x32 images are generated: each class is a smooth colour pattern of its
own, under noise and a random shift.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


def make_images(n: int, classes: int, seed: int) -> TensorDataset:
    """``n`` noisy, shifted copies of ``classes`` low-frequency colour templates, with their class labels."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(
        torch.randn(classes, 3, 4, 4, generator=torch.Generator().manual_seed(1234)),
        size=(32, 32),
        mode="bilinear",
        align_corners=False,
    )
    labels = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-4, 5, (n, 2), generator=g)
    images = torch.stack(
        [torch.roll(templates[c], (int(dy), int(dx)), dims=(1, 2)) for c, (dy, dx) in zip(labels.tolist(), shifts)]
    )
    images += 3.0 * torch.randn(images.shape, generator=g)
    return TensorDataset(images, labels)


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a shortcut (a 1x1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A stem and three stages of one BasicBlock each (16, 32, 64 channels), global average pooling, a linear head."""

    def __init__(self, classes: int, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(
            BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 4 * width, 2)
        )
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=3000)
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds (the test suite's)")
    a = p.parse_args()
    if a.smoke:
        a.epochs, a.train_size, a.eval_size = 2, 256, 100

    engine = phalanx.Engine(grad_accum_steps=a.accum, seed=a.seed)
    train_set = make_images(a.train_size, a.classes, a.seed)  # the same tensors on every rank
    eval_set = make_images(a.eval_size, a.classes, a.seed + 1)
    train_loader = DataLoader(train_set, batch_size=a.batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=2 * a.batch_size, shuffle=False)

    torch.manual_seed(a.seed)
    model = SmallResNet(a.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(train_loader) // engine.world_size // a.accum
    milestones = [int(steps_per_epoch * a.epochs * f) for f in (0.5, 0.75)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    model, optimizer, train_loader, scheduler, eval_loader = engine.prepare(
        model, optimizer, train_loader, scheduler, eval_loader
    )
    engine.print(
        f"SmallResNet on {a.train_size} generated images, {a.classes} classes, {engine.world_size} rank(s), "
        f"global batch {a.batch_size * engine.world_size * a.accum}"
    )

    history = []
    for epoch in range(a.epochs):
        model.train()
        loss_sum, correct, seen = torch.zeros(()), torch.zeros(()), 0
        for images, labels in train_loader:
            with engine.accumulate():
                outputs = model(images)
                loss = F.cross_entropy(outputs, labels)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            # Kept as tensors: reading them with .item() here would wait on every step.
            loss_sum += loss.detach() * len(labels)
            correct += (outputs.argmax(dim=1) == labels).sum()
            seen += len(labels)
        totals = engine.reduce(torch.stack([loss_sum, correct, torch.tensor(float(seen))]), "sum")
        train_loss, train_acc = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()

        model.eval()
        predictions, targets = [], []
        with torch.no_grad():
            for images, labels in eval_loader:
                predicted, labels = engine.gather_for_metrics((model(images).argmax(dim=1), labels))
                predictions.append(predicted)
                targets.append(labels)
        predicted, labels = torch.cat(predictions), torch.cat(targets)
        eval_acc = (predicted == labels).float().mean().item()
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": train_loss,
                "train_acc": train_acc,
                "eval_acc": eval_acc,
                "eval_samples": len(labels),
                "lr": scheduler.get_last_lr()[0],
            }
        )
        engine.print(
            f"Epoch [{epoch + 1}/{a.epochs}], Loss: {train_loss:.4f}, Train Acc: {100 * train_acc:.2f}%, "
            f"Eval Acc: {100 * eval_acc:.2f}% ({len(labels)} images)",
            flush=True,
        )

    # The parameters only: BatchNorm's running statistics are broadcast from rank 0 before each training forward
    # (as DistributedDataParallel does), so after the last one each rank holds its own update of them.
    weights = engine.get_state_dict(model)
    names = {name for name, _ in engine.unwrap_model(model).named_parameters()}
    checksum = float(sum(weights[name].double().sum() for name in names))
    print("result " + json.dumps({"rank": engine.rank, "history": history, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main()

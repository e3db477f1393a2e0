"""A Horovod training script, run by phalanx: only the import line differs from one written for Horovod.

    phalanx launch -n 2 examples/train_hvd.py          # two ranks
    python examples/train_hvd.py                       # one process: the same numbers

It follows the Horovod example of the seed post (init, DistributedOptimizer, broadcast of the parameters and the
optimizer state, per-rank batches), with a small classifier and generated data in place of BERT and its tokenizer.
``--real-horovod`` imports Horovod itself instead (``horovodrun -np 2 python examples/train_hvd.py --real-horovod``),
to compare the two.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step over all ranks")
parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
parser.add_argument("--save", help="rank 0 writes the final state_dict here")
parser.add_argument("--real-horovod", action="store_true", help="use horovod.torch instead of phalanx.horovod")
args = parser.parse_args()

if args.real_horovod:
    import horovod.torch as hvd
else:
    import phalanx.horovod as hvd

# Initialise Horovod and pick this process's device.
hvd.init()
local_rank = hvd.local_rank()
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(local_rank)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


# Every rank builds the model from its own seed: the broadcast below is what makes the replicas equal.
torch.manual_seed(1000 + hvd.rank())
model = Classifier().to(device)

# Generated data in place of the post's tokenised sentences: 96 samples, two classes.
g = torch.Generator().manual_seed(0)
features = torch.randn(96, 16, generator=g)
labels = (features[:, :4].sum(1) > 0).long()
dataset = TensorDataset(features, labels)

criterion = nn.CrossEntropyLoss()
if args.optimizer == "adamw":
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

# Horovod: average the gradients over the ranks, and start every rank from rank 0's weights and optimizer state.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
if hvd.rank() == 0:
    torch.manual_seed(1000)  # rank 0's weights are the ones a single process would start from
    model.load_state_dict(Classifier().state_dict())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Each rank reads its own share of every global batch (the post divides by local_size, which is only right on
# one node; the share is global_batch / size).
if args.global_batch % hvd.size():
    raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the number of ranks ({hvd.size()})")
sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
loader = DataLoader(dataset, sampler=sampler, batch_size=args.global_batch // hvd.size())

model.train()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    running_loss = 0.0
    for i, (inputs, targets) in enumerate(loader):
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        if i % 3 == 2:
            print(f"Rank {hvd.rank()} Epoch {epoch + 1} Step {i + 1} loss: {running_loss / 3:.4f}")
            running_loss = 0.0

# The loss of the last batch over all ranks, and a checksum of the weights, which every rank must agree on.
final_loss = hvd.allreduce(loss.detach(), name="final_loss").item()
checksum = sum(float(p.double().sum()) for p in model.state_dict().values())
print(f"final rank {hvd.rank()} of {hvd.size()} loss {final_loss:.8f} checksum {checksum:.8f}")
if args.save and hvd.rank() == 0:
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)

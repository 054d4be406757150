import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc

dist.init_process_group("gloo")  # run with: torchrun --nproc-per-node=4 examples/quickstart.py
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, x, y):  # single-device code, unchanged
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


dp = dist.get_world_size() // 2
plan = sc.Plan(params={"0.*": [Replicate(), Shard(0)], "2.weight": [Replicate(), Shard(1)]},  # Megatron MLP on "tp"
               default_input=[Shard(0), Replicate()])  # the batch split on "dp", whole on "tp"
step = sc.compile(train_step, mesh={"dp": dp, "tp": 2}, plan=plan)
x, y = torch.randn(32, 16), torch.randn(32, 1)  # the global batch
mine = step.mesh.get_local_rank("dp")
for i in range(5):
    loss = step(model, optimizer, x.chunk(dp)[mine], y.chunk(dp)[mine])  # each rank passes its rows
    if dist.get_rank() == 0:
        print(f"step {i}: loss {loss.item():.4f}")
dist.destroy_process_group()

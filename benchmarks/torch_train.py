#!/usr/bin/env python3
"""PyTorch on the same model and global batch as a tessera-train preset:
GPT-2 blocks (LayerNorm, fused qkv, GELU MLP, tied embeddings), AdamW with
weight decay on matrices, clip 1.0, over gloo on the CPU with FSDP2's
fully_shard per block and the root (or DDP when this torch lacks FSDP2).
Prints tokens/s (median step over the timed steps) and MFU with
tessera-train's formula. Optional: never a dependency of Tessera.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
      python benchmarks/torch_train.py LAYERS WIDTH HEADS SEQ BATCH STEPS PEAK_TFLOPS
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_gpt import GPT

L, C, H, T, B, steps = (int(a) for a in sys.argv[1:7])
peak_tflops = float(sys.argv[7])
V = 256
torch.set_num_threads(max(1, 2 // int(os.environ.get("WORLD_SIZE", "1"))))

try:
    from torch.distributed.fsdp import fully_shard
except Exception:
    fully_shard = None
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1)
model = GPT(V, T, L, H, C)
n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
if fully_shard is not None:
    mode = "FSDP2"
    for blk in model.h:
        fully_shard(blk)
    fully_shard(model)
else:
    mode = "DDP"
    model = nn.parallel.DistributedDataParallel(model)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.95))
local = B // world
times = []
for s in range(steps + 3):
    x = torch.randint(0, V, (local, T))
    y = torch.randint(0, V, (local, T))
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    lt = torch.tensor([loss.item()])
    dist.all_reduce(lt)  # tessera-train averages the loss over ranks every step too
    if s >= 3:
        times.append(time.perf_counter() - t0)
step = torch.tensor([statistics.median(times)])
dist.all_reduce(step, op=dist.ReduceOp.MAX)
if rank == 0:
    tok_s = B * T / step.item()
    flops = 6 * n_params + 12 * L * C * T
    print(f"torch {torch.__version__} {mode}: {tok_s:.0f} tok/s, MFU {100 * tok_s * flops / (peak_tflops * 1e12):.1f}%")
dist.destroy_process_group()

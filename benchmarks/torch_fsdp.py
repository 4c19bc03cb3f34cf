#!/usr/bin/env python3
"""PyTorch on the same GPT benchmark model and ranks as bench_fsdp (global
batch 8 x 128 split over the ranks, AdamW, clip 1.0), over gloo on the CPU.
Uses FSDP2's fully_shard when this torch has it (2.4+), else DDP. Optional:
never a dependency of Tessera.

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/torch_fsdp.py [steps] [mode]

mode: fsdp (default when available) or ddp.
"""
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_step import GPT, V, T  # noqa: E402  (the same model definition)

# Threads per rank: the 2 cores divided by the ranks (TORCH_THREADS overrides).
torch.set_num_threads(int(os.environ.get("TORCH_THREADS", max(1, 2 // int(os.environ.get("WORLD_SIZE", "1"))))))

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
fully_shard = None
try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except Exception:  # ImportError, or older torch failing to import the module
    try:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
    except Exception:
        pass
mode = sys.argv[2] if len(sys.argv) > 2 else ("fsdp" if fully_shard else "ddp")

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1)
model = GPT()
if mode == "fsdp":
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
else:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
local_batch = 8 // world
times = []
for s in range(steps + 2):
    x = torch.randint(0, V, (local_batch, T))
    y = torch.randint(0, V, (local_batch, T))
    dist.barrier()
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if s >= 2:
        times.append((time.perf_counter() - t0) * 1000)
step = torch.tensor([statistics.median(times)])
dist.all_reduce(step, op=dist.ReduceOp.MAX)
rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
dist.all_reduce(rss, op=dist.ReduceOp.MAX)
if rank == 0:
    ms = step.item()
    print(f"torch {torch.__version__} {mode} ranks {world}: step {ms:.1f} ms, tokens/s {8 * T / ms * 1000:.0f}, "
          f"peak RSS {rss.item():.0f} MiB per rank")
dist.destroy_process_group()

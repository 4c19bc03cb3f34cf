#!/usr/bin/python3
"""PyTorch eager reference for bench_step: the same GPT (4 layers, d=256,
4 heads, seq 128, batch 8, vocab 256, tied embeddings, AdamW, clip 1.0; or
another depth and width, one head per 64 channels), timed the same way.
Optional: any PyTorch (benchmarks/torch2.sh installs a 2.x on demand).
Prints one line like bench_step's summary. With bf16, the parameters (so
the activations, gradients and AdamW's state) are bf16, as bench_step's bf16.

    python benchmarks/torch_step.py [steps] [threads] [layers] [width] [f32|bf16]
"""
import resource
import sys
import time

import torch
import torch.nn.functional as F

from torch_gpt import GPT


V, T, L, H, C, B = 256, 128, 4, 4, 256, 8

def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else L
    width = int(sys.argv[4]) if len(sys.argv) > 4 else C
    dtype = sys.argv[5] if len(sys.argv) > 5 else "f32"
    if dtype not in ("f32", "bf16"):
        sys.exit(f"torch_step.py: expected f32 or bf16, got {dtype!r}")
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = GPT(V, T, layers, width // 64, width)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # high-water mark after setup
    total = 0.0
    for s in range(steps + 3):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = (time.perf_counter() - t0) * 1000
        if s >= 3:
            total += ms
    per = total / steps
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch {torch.__version__} {layers}x{width} {dtype} threads {threads}  step {per:.1f} ms  tokens/s {B * T / per * 1000:.0f}  "
          f"peak RSS {peak_mib:.1f} MiB (+{peak_mib - rss_setup:.1f} MiB over setup)")


if __name__ == "__main__":
    main()

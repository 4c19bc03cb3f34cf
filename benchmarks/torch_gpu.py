#!/usr/bin/env python3
"""PyTorch eager reference for bench_gpu: GPT-2 124M (12 layers, d 768, 12
heads, seq 1024, vocab 50304, tied embeddings), bf16 parameters, AdamW,
gradient clipping, on one GPU. Prints one line like bench_gpu's.

    python3 benchmarks/torch_gpu.py [steps] [batch]
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

from torch_gpt import GPT

V, T, L, H, C = 50304, 1024, 12, 12, 768

def main():
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        sys.exit(77)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    dev = torch.device("cuda")
    model = GPT(V, T, L, H, C)
    # GPT-2's initialisation, as Tessera's nn::GPT (PyTorch's defaults give
    # the tied N(0, 1) embedding logits in the hundreds): normal(0, 0.02),
    # the residual projections 0.02 / sqrt(2 L), zero biases.
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / (2 * L) ** 0.5 if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)
    model = model.to(dev).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, V, (batch, T), device=dev)
    y = torch.randint(0, V, (batch, T), device=dev)

    def step():
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / steps
    tokens = batch * T / sec
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    flops_per_token = 6 * n + 12 * L * T * C
    peak = float(os.environ.get("TESSERA_PEAK_TFLOPS", "989")) * 1e12
    print(f"pytorch  {torch.cuda.get_device_name()}  batch {batch} x {T}  step {sec * 1e3:.1f} ms  "
          f"tokens/s {tokens:.0f}  MFU {100 * tokens * flops_per_token / peak:.1f}% (of {peak / 1e12:.0f} TFLOP/s)  "
          f"loss {loss.item():.4f}  peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()

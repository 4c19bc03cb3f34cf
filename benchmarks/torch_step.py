#!/usr/bin/python3
"""PyTorch eager reference for bench_step: the same GPT (4 layers, d=256,
4 heads, seq 128, batch 8, vocab 256, tied embeddings, AdamW, clip 1.0),
timed the same way. Optional: needs Debian's python3-torch (run with
/usr/bin/python3). Prints one line like bench_step's summary.

    /usr/bin/python3 benchmarks/torch_step.py [steps] [threads]
"""
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


V, T, L, H, C, B = 256, 128, 4, 4, 256, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, "scaled_dot_product_attention") \
            else self.manual_attention(q, k, v, t)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    @staticmethod
    def manual_attention(q, k, v, t):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        return att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = GPT()
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
    print(f"torch {torch.__version__} threads {threads}  step {per:.1f} ms  tokens/s {B * T / per * 1000:.0f}  "
          f"peak RSS {peak_mib:.1f} MiB (+{peak_mib - rss_setup:.1f} MiB over setup)")


if __name__ == "__main__":
    main()

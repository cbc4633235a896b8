"""Attention forward + backward on a CPU: torch's SDPA (its flash kernel) against
transformers' eager attention, in bf16 and float32, at 4096 positions per micro-batch
and several widths, in one process. It prints each time and the ratio sdpa / eager;
logprobs.attention_kernel takes eager where that ratio is above 1 (bf16, widths <= 240).

    python benchmarks/attention.py [--threads 1] [--head-dim 64]
"""

import argparse
import time

import torch
import torch.nn.functional as F


def eager(q, k, v, mask):  # transformers' eager_attention_forward, less GQA and dropout
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask  # [B, H, T, T]
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def seconds(fn, q, k, v, mask, repeats=3):
    fn(q, k, v, mask).sum().backward()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn(q, k, v, mask).sum().backward()
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in (torch.bfloat16, torch.float32):
        for width in (64, 100, 200, 240, 256, 320, 512):
            batch = max(1, args.tokens // width)
            q, k, v = (
                torch.randn(batch, args.heads, width, args.head_dim, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = torch.zeros(batch, 1, width, width, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)
            t_sdpa, t_eager = seconds(sdpa, q, k, v, mask), seconds(eager, q, k, v, mask)
            print(
                f"{str(dtype):15s} width {width:4d} x {batch:3d}: sdpa {t_sdpa * 1e3:7.1f} ms, eager {t_eager * 1e3:7.1f} ms, sdpa/eager {t_sdpa / t_eager:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Micro-benchmark of the decode step's one-query attention on one GPU: compiled GQA matmuls vs the Triton kernels.

    python scripts/bench_decode_attention.py

For the CRQ's (16 heads / 8 KV heads) and the LLM's (32 / 8) layouts, 128-wide heads, bfloat16: µs per call of
`torch.compile(gqa_decode_attention)` and of `triton_decode_attention`, both replayed inside a CUDA graph
(`triton.testing.do_bench_cudagraph`, so launch overhead is out), for a static cache of which only the first `valid`
positions are visible (as in a decode step: the rest is not written yet), with the largest difference.
"""

from __future__ import annotations

import torch


# (stack, batch, heads, kv heads, cache length, visible positions)
CASES = [
    ("CRQ", 1, 16, 8, 1280, 700),
    ("CRQ", 1, 16, 8, 3200, 700),
    ("CRQ", 16, 16, 8, 3200, 700),
    ("LLM", 1, 32, 8, 640, 140),
    ("LLM", 16, 32, 8, 640, 140),
]


def main() -> None:
    import triton

    from funaudiochat_hf.attention_funaudiochat import gqa_decode_attention
    from funaudiochat_hf.triton_attention_funaudiochat import triton_decode_attention

    def matmuls(query, key, value, mask):
        return gqa_decode_attention(None, query, key, value, mask, scaling=0.088)[0]

    def kernels(query, key, value, mask):
        return triton_decode_attention(None, query, key, value, mask, scaling=0.088)[0]

    compiled_matmuls = torch.compile(matmuls, fullgraph=True, dynamic=False)
    print("| stack | batch | heads / kv heads | cache length | valid | matmuls, compiled (µs) | Triton (µs) | max diff |"
          )  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for stack, batch, heads, kv_heads, length, valid in CASES:
        options = dict(device="cuda", dtype=torch.bfloat16)
        query = torch.randn(batch, heads, 1, 128, **options)
        key = torch.randn(batch, kv_heads, length, 128, **options)
        value = torch.randn(batch, kv_heads, length, 128, **options)
        mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device="cuda")
        mask[..., :valid] = True
        diff = (compiled_matmuls(query, key, value, mask).float() - kernels(query, key, value, mask).float()).abs()
        times = [
            triton.testing.do_bench_cudagraph(lambda fn=fn: fn(query, key, value, mask), rep=200) * 1e3
            for fn in (compiled_matmuls, kernels)
        ]
        print(
            f"| {stack} | {batch} | {heads} / {kv_heads} | {length} | {valid} | {times[0]:.1f} | {times[1]:.1f} | "
            f"{diff.max().item():.1e} |"
        )


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("This micro-benchmark needs a CUDA device.")
    main()

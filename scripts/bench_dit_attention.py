"""Micro-benchmark of the DiT's self-attention (`funaudiochat::dit_attention`) on one GPU: the Triton kernel at its
tiles against the torch path (partial rotary + cuDNN / flash SDPA), and a sweep of the kernel's tiles.

    python scripts/bench_dit_attention.py [--frames 136,436,500] [--sweep]

Shapes are a CFG-batched flow call of the full-size estimator: q / k / v views of one fused `(2, frames, 3 * 1024)`
projection, 16 heads of 64, a key-padding mask (a streamed window's). Prints µs per call (one CUDA-graph replay of
20 calls / 20, so launch overheads do not count, as inside the flow's graphs) and each path's largest difference
from float32 SDPA. `--sweep` times BLOCK_M x BLOCK_N x warps x stages at each length and prints the best.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv_position import us_per_call  # noqa: E402  (same folder: CUDA-graph replay timing)

from funaudiochat_hf.attention_cosyvoice3 import (  # noqa: E402
    BLOCK_M,
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    launch_dit_attention,
    sdpa_dit_attention,
)
from funaudiochat_hf.modeling_cosyvoice3_dit import CosyVoice3RotaryEmbedding  # noqa: E402


HEADS, HEAD_DIM = 16, 64
TILES = {"block_m": (16, 32, 64, 128), "block_n": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4)}


def make_inputs(frames: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """q, k, v views of one fused projection, the rotary tables and an additive key-padding mask (the second row's
    last eighth hidden), on CUDA."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(2, frames, 3 * HEADS * HEAD_DIM, device="cuda", generator=generator).to(dtype)
    query, key, value = qkv.chunk(3, dim=-1)
    cos, sin = CosyVoice3RotaryEmbedding(HEAD_DIM).to("cuda")(frames, torch.device("cuda"))
    visible = torch.ones(2, frames, dtype=torch.bool, device="cuda")
    visible[1, frames - frames // 8 :] = False
    mask = torch.zeros(2, 1, 1, frames, device="cuda", dtype=dtype).masked_fill(~visible[:, None, None], -1e4)
    return query, key, value, cos, sin, mask


def compare(frame_counts: list[int]) -> None:
    print("| frames | torch path µs | kernel µs | kernel / torch | max diff (torch, kernel) |")
    print("|---|---|---|---|---|")
    for frames in frame_counts:
        query, key, value, cos, sin, mask = make_inputs(frames)
        with torch.no_grad():
            reference = sdpa_dit_attention(*(t.float() for t in (query, key, value)), cos, sin, HEADS, mask.float())
            torch_path = us_per_call(lambda: sdpa_dit_attention(query, key, value, cos, sin, HEADS, mask))
            kernel = us_per_call(lambda: launch_dit_attention(query, key, value, cos, sin, mask, HEADS))
            diffs = [
                (sdpa_dit_attention(query, key, value, cos, sin, HEADS, mask).float() - reference).abs().max().item(),
                (launch_dit_attention(query, key, value, cos, sin, mask, HEADS).float() - reference).abs().max().item(),
            ]
        print(f"| {frames} | {torch_path:.1f} | {kernel:.1f} | {kernel / torch_path:.2f} | "
              f"{diffs[0]:.1e}, {diffs[1]:.1e} |", flush=True)  # fmt: skip


def sweep(frame_counts: list[int]) -> None:
    print(f"default tiles: BLOCK_M={BLOCK_M}, BLOCK_N={BLOCK_N}, {NUM_WARPS} warps, {NUM_STAGES} stages")
    print("| frames | BLOCK_M | BLOCK_N | warps | stages | µs |")
    print("|---|---|---|---|---|---|")
    for frames in frame_counts:
        inputs = make_inputs(frames)
        results = []
        for values in itertools.product(*TILES.values()):
            options = dict(zip(TILES, values))
            try:
                with torch.no_grad():
                    us = us_per_call(lambda: launch_dit_attention(*inputs[:5], inputs[5], HEADS, **options))
            except Exception as error:  # noqa: BLE001 (out of shared memory / registers: skip the configuration)
                print(f"| {frames} | {' | '.join(map(str, values))} | failed: {type(error).__name__} |", flush=True)
                continue
            results.append((us, values))
            print(f"| {frames} | {' | '.join(map(str, values))} | {us:.2f} |", flush=True)
        best, default = min(results), dict(results).get((BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES))
        named = ", ".join(f"{name}={value}" for name, value in zip(TILES, best[1]))
        print(f"best at {frames} frames: {best[0]:.2f} µs with {named} (default tiles: {default} µs)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", default="136,436,606,806,1206")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's tiles and launch options")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    frame_counts = [int(f) for f in args.frames.split(",")]
    (sweep if args.sweep else compare)(frame_counts)


if __name__ == "__main__":
    main()

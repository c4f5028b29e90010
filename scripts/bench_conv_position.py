"""Micro-benchmark of the DiT's kernel-31, 16-group position conv (+ Mish) on one GPU: cuDNN, the unfold + matmul path
and the Triton kernel.

    python scripts/bench_conv_position.py [--frames 136,436,1500] [--sweep]

Prints µs per conv + Mish for (2, frames, 1024) inputs (a CFG-batched flow call) in float32 and bfloat16: cuDNN with
its default heuristics, cuDNN in benchmark mode, `causal_grouped_conv1d` (unfold + matmul, the torch path on CUDA up to
its size limit) and, in bfloat16, `funaudiochat::causal_conv_mish` (the Triton kernel, tap-major weights), with each
path's largest difference from cuDNN. Each figure is one CUDA-graph replay of 20 calls / 20, so launch overheads do
not count (inside the streaming decoder's graphs they do not either). `--sweep` times the kernel's tile sizes and
launch options at each length instead.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from funaudiochat_hf.position_conv_cosyvoice3 import (
    causal_grouped_conv1d,
    launch_causal_conv_mish,
    tap_major_weight,
)


def us_per_call(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time of `fn` from CUDA-graph replays (`calls` calls per graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: kernel compilation, cuDNN plans
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", default="136,436,1500")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's tile sizes and launch options")
    args = parser.parse_args()
    torch.manual_seed(0)
    frame_counts = [int(f) for f in args.frames.split(",")]
    if args.sweep:
        sweep(frame_counts)
        return
    print("| dtype | frames | cuDNN µs | cuDNN benchmark µs | unfold + matmul µs | Triton kernel µs "
          "| max diff (unfold, kernel) |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for frames in frame_counts:
            conv = torch.nn.Conv1d(1024, 1024, 31, groups=16).to("cuda", dtype)
            hidden = torch.randn(2, frames, 1024, device="cuda", dtype=dtype)
            padded = F.pad(hidden.transpose(1, 2), (30, 0))
            weight = tap_major_weight(conv.weight, conv.groups).contiguous()
            with torch.no_grad():
                expected = F.mish(conv(padded)).transpose(1, 2)
                cudnn = us_per_call(lambda: F.mish(conv(padded)))
                with torch.backends.cudnn.flags(enabled=True, benchmark=True):
                    cudnn_benchmark = us_per_call(lambda: F.mish(conv(padded)))
                unfold = us_per_call(lambda: F.mish(causal_grouped_conv1d(hidden, conv, 2**62)))
                diffs = [(F.mish(causal_grouped_conv1d(hidden, conv, 2**62)) - expected).abs().max().item()]
                kernel = "-"
                if dtype != torch.float32:
                    kernel = f"{us_per_call(lambda: launch_causal_conv_mish(hidden, weight, conv.bias, None)):.1f}"
                    got = launch_causal_conv_mish(hidden, weight, conv.bias, None)
                    diffs.append((got - expected).abs().max().item())
            print(
                f"| {str(dtype).removeprefix('torch.')} | {frames} | {cudnn:.1f} | {cudnn_benchmark:.1f} | "
                f"{unfold:.1f} | {kernel} | {', '.join(f'{d:.1e}' for d in diffs)} |",
                flush=True,
            )


def sweep(frame_counts: list[int]) -> None:
    print("| frames | BLOCK_M | warps | stages | µs |")
    print("|---|---|---|---|---|")
    for frames in frame_counts:
        conv = torch.nn.Conv1d(1024, 1024, 31, groups=16).to("cuda", torch.bfloat16)
        hidden = torch.randn(2, frames, 1024, device="cuda", dtype=torch.bfloat16)
        weight = tap_major_weight(conv.weight, conv.groups).contiguous()
        results = []
        for block_m, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            options = dict(block_m=block_m, num_warps=warps, num_stages=stages)
            try:
                with torch.no_grad():
                    us = us_per_call(lambda: launch_causal_conv_mish(hidden, weight, conv.bias, hidden, **options))
            except Exception as error:  # noqa: BLE001 (out of shared memory / registers: skip the configuration)
                print(f"| {frames} | {block_m} | {warps} | {stages} | failed: {type(error).__name__} |", flush=True)
                continue
            results.append((us, block_m, warps, stages))
            print(f"| {frames} | {block_m} | {warps} | {stages} | {us:.2f} |", flush=True)
        best = min(results)
        print(f"best at {frames} frames: {best[0]:.2f} µs with BLOCK_M={best[1]}, {best[2]} warps, {best[3]} stages")


if __name__ == "__main__":
    main()

"""Micro-benchmark of the DiT's kernel-31, 16-group position conv on one GPU: cuDNN vs the unfold + matmul path.

    python scripts/bench_conv_position.py [--frames 136,436,1500]

Prints ms per call for (2, frames, 1024) inputs (a CFG-batched flow call) in float32 and bfloat16: cuDNN with its
default heuristics, cuDNN in benchmark mode, PyTorch's native conv (cuDNN off), and `causal_grouped_conv1d` (unfold +
matmul, what the DiT runs on CUDA up to its size limit), with the largest difference from the cuDNN output.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from funaudiochat_hf.modeling_cosyvoice3 import causal_grouped_conv1d


def ms_per_call(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", default="136,436,1500")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| dtype | frames | cuDNN ms | cuDNN benchmark ms | native ms | unfold + matmul ms | max diff |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for frames in (int(f) for f in args.frames.split(",")):
            conv = torch.nn.Conv1d(1024, 1024, 31, groups=16).to("cuda", dtype)
            hidden = torch.randn(2, frames, 1024, device="cuda", dtype=dtype)
            padded = F.pad(hidden.transpose(1, 2), (30, 0))
            with torch.no_grad():
                cudnn = ms_per_call(lambda: conv(padded))
                with torch.backends.cudnn.flags(enabled=True, benchmark=True):
                    cudnn_benchmark = ms_per_call(lambda: conv(padded))
                with torch.backends.cudnn.flags(enabled=False):
                    native = ms_per_call(lambda: conv(padded))
                matmul = ms_per_call(lambda: causal_grouped_conv1d(hidden, conv, max_unfold_elements=2**62))
                diff = (causal_grouped_conv1d(hidden, conv, 2**62).transpose(1, 2) - conv(padded)).abs().max()
            print(
                f"| {str(dtype).removeprefix('torch.')} | {frames} | {cudnn:.3f} | {cudnn_benchmark:.3f} | "
                f"{native:.3f} | {matmul:.3f} | {float(diff):.1e} |"
            )


if __name__ == "__main__":
    main()

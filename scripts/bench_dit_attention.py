"""Micro-benchmark of the DiT's self-attention (`funaudiochat::dit_attention`) on one GPU: the Triton kernel at its
tiles against the torch path (partial rotary + cuDNN / flash SDPA), and a sweep of the kernel's tiles.

    python scripts/bench_dit_attention.py [--frames 136,436,500] [--streams 1] [--sweep [--tiles JSON]]

Shapes are a CFG-batched flow call of the full-size estimator: q / k / v views of one fused `(2 * streams, frames,
3 * 1024)` projection (`--streams`: the streams of a serving round decoded in one flow call), 16 heads of 64, a
key-padding mask (a streamed window's). Prints µs per call (one CUDA-graph replay of 20 calls / 20, so launch overheads
do not count, as inside the flow's graphs) and each path's largest difference from float32 SDPA. `--sweep` times
BLOCK_M x BLOCK_N x warps x stages at each length and prints the best against the kernel's own tiles (by rows and
GPU: `attention_cosyvoice3.dit_attention_tiles`); `--tiles` narrows the grid, e.g. '{"block_m": [32, 64, 128],
"num_stages": [2, 3]}' (the rest stay as in `TILES`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conv_position import us_per_call  # noqa: E402  (same folder: CUDA-graph replay timing)

from funaudiochat_hf.attention_cosyvoice3 import (  # noqa: E402
    dit_attention_tiles,
    is_hopper_gpu,
    launch_dit_attention,
    sdpa_dit_attention,
)
from funaudiochat_hf.modeling_cosyvoice3_dit import CosyVoice3RotaryEmbedding  # noqa: E402


HEADS, HEAD_DIM = 16, 64
TILES = {"block_m": (16, 32, 64, 128), "block_n": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4)}


def tile_grid(text: str | None) -> dict[str, tuple[int, ...]]:
    """`TILES` with the lists of a `--tiles` JSON object in place of its own (`argparse.ArgumentTypeError` for
    anything else)."""
    if text is None:
        return dict(TILES)
    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError("a JSON object of lists is expected, e.g. '{\"block_m\": [32, 64]}'")
    grid = dict(TILES)
    for name, values in given.items():
        if name not in TILES:
            raise argparse.ArgumentTypeError(f"no option {name!r} (one of {', '.join(TILES)})")
        if not isinstance(values, list) or not values or not all(type(v) is int and v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{name} must be a non-empty list of positive integers")
        grid[name] = tuple(values)
    return grid


def default_tiles_time(results: list[tuple[float, tuple[int, ...]]], default: tuple[int, ...]) -> float | None:
    """µs of the kernel's `default` tiles among the sweep's `(µs, (block_m, block_n, warps, stages))` results (None
    when the grid left them out)."""
    return next((us for us, values in results if tuple(values) == tuple(default)), None)


def shipped_tiles(rows: int) -> tuple[int, int, int, int]:
    """The tiles the kernel picks for a call of `rows` on this GPU."""
    return dit_attention_tiles(rows, is_hopper_gpu(torch.cuda.current_device()))


def make_inputs(frames: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, streams: int = 1):
    """q, k, v views of one fused projection (`2 * streams` rows: each stream's two CFG rows), the rotary tables and
    an additive key-padding mask (every second row's last eighth hidden), on CUDA."""
    rows = 2 * streams
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(rows, frames, 3 * HEADS * HEAD_DIM, device="cuda", generator=generator).to(dtype)
    query, key, value = qkv.chunk(3, dim=-1)
    cos, sin = CosyVoice3RotaryEmbedding(HEAD_DIM).to("cuda")(frames, torch.device("cuda"))
    visible = torch.ones(rows, frames, dtype=torch.bool, device="cuda")
    visible[1::2, frames - frames // 8 :] = False
    mask = torch.zeros(rows, 1, 1, frames, device="cuda", dtype=dtype).masked_fill(~visible[:, None, None], -1e4)
    return query, key, value, cos, sin, mask


def compare(frame_counts: list[int], streams: int = 1) -> None:
    print("| frames | torch path µs | kernel µs | kernel / torch | max diff (torch, kernel) |")
    print("|---|---|---|---|---|")
    for frames in frame_counts:
        query, key, value, cos, sin, mask = make_inputs(frames, streams=streams)
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


def sweep(frame_counts: list[int], grid: dict[str, tuple[int, ...]] = TILES, streams: int = 1) -> None:
    print(f"{2 * streams} rows; the kernel's own tiles: {shipped_tiles(2 * streams)}")
    print("| frames | BLOCK_M | BLOCK_N | warps | stages | µs |")
    print("|---|---|---|---|---|---|")
    for frames in frame_counts:
        inputs = make_inputs(frames, streams=streams)
        results = []
        for values in itertools.product(*grid.values()):
            try:
                with torch.no_grad():
                    us = us_per_call(lambda: launch_dit_attention(*inputs[:5], inputs[5], HEADS, tuple(values)))
            except Exception as error:  # noqa: BLE001 (out of shared memory / registers: skip the configuration)
                print(f"| {frames} | {' | '.join(map(str, values))} | failed: {type(error).__name__} |", flush=True)
                continue
            results.append((us, values))
            print(f"| {frames} | {' | '.join(map(str, values))} | {us:.2f} |", flush=True)
        if not results:
            print(f"no tiles ran at {frames} frames", flush=True)
            continue
        best, default = min(results), default_tiles_time(results, shipped_tiles(2 * streams))
        named = ", ".join(f"{name}={value}" for name, value in zip(grid, best[1]))
        against = "not in the grid" if default is None else f"{default:.2f} µs"
        print(f"best at {frames} frames: {best[0]:.2f} µs with {named} (its own tiles: {against})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", default="136,436,606,806,1206")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's tiles and launch options")
    parser.add_argument("--tiles", type=tile_grid, default=None, metavar="JSON",
                        help="--sweep: lists replacing the grid's, e.g. '{\"block_m\": [32, 64, 128]}'")  # fmt: skip
    parser.add_argument("--streams", type=int, default=1, help="streams per flow call: 2 CFG rows each (default 1)")
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error("--streams must be at least 1")
    if args.tiles is not None and not args.sweep:
        parser.error("--tiles narrows --sweep: pass both")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    frame_counts = [int(f) for f in args.frames.split(",")]
    if args.sweep:
        sweep(frame_counts, args.tiles or TILES, args.streams)
    else:
        compare(frame_counts, args.streams)


if __name__ == "__main__":
    main()

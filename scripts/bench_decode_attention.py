"""Micro-benchmark of the decode step's one-query attention on one GPU, as the step runs it, and its launch settings.

    python scripts/bench_decode_attention.py
    python scripts/bench_decode_attention.py --configs '{}' '{"attention_split_stages": [[16, 2]]}' --cases CRQ:16:1900

A case is a stack's layout (the full-size CRQ: 16 query heads / 8 KV heads; the LLM: 32 / 8; 128-wide heads,
bfloat16), a row count and the cache positions each row sees. Each call takes the step's path: the Triton kernels with
the q/k norms, the rotary embedding and the cache write folded in (`AttentionInputs`) and arrival counters (the last
split merges), over a static cache and a boolean mask. One call per layer, each on a cache of its own (28 for the
CRQ, 36 for the LLM, as a step's stack call: a call then reads its keys and values from memory, where calls repeated
on one cache would find them in L2), replayed as one CUDA graph (`triton.testing.do_bench_cudagraph`). Prints, per
case and `--configs` entry (`DecodeKernelConfig` fields changed from the device's; the first is the baseline), µs per
call, the bandwidth of the cache bytes a call reads, and the largest difference from the baseline's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (scripts/benchmark.py: its kernel-config parser)


HEAD_DIM = 128
STACKS = {"CRQ": (16, 8, 28), "LLM": (32, 8, 36)}  # query heads, KV heads, layers


class Case(NamedTuple):
    stack: str
    rows: int
    positions: int  # cache positions each row sees (the new one included)


# The CRQ's cache holds five positions per prompt and reply token: ~600 in the benchmark's 16-row step (a 10 s
# question), ~1,900 with the serving benchmark's prompt; the LLM's one per token.
DEFAULT_CASES = (Case("CRQ", 1, 600), Case("CRQ", 16, 600), Case("CRQ", 8, 1200), Case("CRQ", 16, 1900),
                 Case("LLM", 16, 120), Case("LLM", 16, 400))  # fmt: skip


def parse_case(text: str) -> Case:
    """`STACK:ROWS:POSITIONS`, e.g. `CRQ:16:1900`."""
    try:
        stack, rows, positions = text.split(":")
        case = Case(stack, int(rows), int(positions))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not STACK:ROWS:POSITIONS (e.g. CRQ:16:1900)") from None
    if case.stack not in STACKS or case.rows < 1 or case.positions < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the stack is one of {sorted(STACKS)}, rows and positions >= 1")
    return case


def parse_config(text: str) -> dict:
    """A `--configs` entry: a JSON object of `DecodeKernelConfig` fields, checked (`benchmark.parse_kernel_config`)."""
    try:
        return benchmark.parse_kernel_config(text) or {}
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", type=parse_config, default=[{}], metavar="JSON",
                        help="DecodeKernelConfig changes to compare, the first the baseline (default: the device's)")
    parser.add_argument("--cases", nargs="+", type=parse_case, default=list(DEFAULT_CASES), metavar="STACK:ROWS:POS")
    parser.add_argument("--rep", type=int, default=300, help="ms of replays per measurement (default: %(default)s)")
    return parser.parse_args(argv)


def kernel_configs(base, changes: list[dict]) -> list:
    """`base` with each entry's fields changed."""
    return [base.replace(**entry) for entry in changes]


def cache_gigabytes(case: Case) -> float:
    """The keys and values one call reads (GB)."""
    _, kv_heads, _ = STACKS[case.stack]
    return case.rows * kv_heads * case.positions * HEAD_DIM * 2 * 2 / 1e9


class Layers:
    """A stack's per-layer caches and projections (`layers`: the stack's count by default) and the step's shared
    inputs (norm weights, rotary tables, cache lengths, arrival counters, mask) for one case."""

    def __init__(self, case: Case, max_positions: int, device: str, layers: int | None = None,
                 dtype: torch.dtype = torch.bfloat16):  # fmt: skip
        heads, kv_heads, stack_layers = STACKS[case.stack]
        self.count = stack_layers if layers is None else layers
        self.position = case.positions - 1  # the new position's index: the call sees 0 .. position
        options = dict(device=device, dtype=dtype)
        rows = case.rows
        self.keys = [torch.randn(rows, kv_heads, max_positions, HEAD_DIM, **options) for _ in range(self.count)]
        self.values = [torch.randn(rows, kv_heads, max_positions, HEAD_DIM, **options) for _ in range(self.count)]
        self.query = [torch.randn(rows, heads * HEAD_DIM, **options) for _ in range(self.count)]
        self.key = [torch.randn(rows, kv_heads * HEAD_DIM, **options) for _ in range(self.count)]
        self.value = [torch.randn(rows, kv_heads * HEAD_DIM, **options) for _ in range(self.count)]
        self.q_norm, self.k_norm = torch.rand(HEAD_DIM, **options) + 0.5, torch.rand(HEAD_DIM, **options) + 0.5
        angles = torch.rand(rows, HEAD_DIM, device=device) * 6.28
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.lengths = torch.zeros(self.count, dtype=torch.int64, device=device)
        self.counters = torch.zeros(self.count, rows * kv_heads + 1, dtype=torch.int32, device=device)
        self.mask = torch.zeros(rows, max_positions, dtype=torch.bool, device=device)
        self.mask[:, : self.position + 1] = True

    def attend(self, launch) -> list[torch.Tensor]:
        """One call per layer at the case's position (each layer's cache length set back to it first, so that every
        replay measures the same positions); `launch`: an `AttentionLaunch`. Returns each layer's output."""
        from funaudiochat_hf.triton_attention_funaudiochat import AttentionInputs, launch_decode_attention

        self.lengths.fill_(self.position)
        outputs = []
        for layer in range(self.count):
            inputs = AttentionInputs(self.key[layer], self.value[layer], self.q_norm, self.k_norm, 1e-6, 1e-6,
                                     self.cos, self.sin, self.lengths[layer])  # fmt: skip
            outputs.append(launch_decode_attention(
                self.query[layer], self.keys[layer], self.values[layer], self.mask, HEAD_DIM**-0.5, inputs,
                self.counters[layer], launch,
            ))  # fmt: skip
        return outputs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # the configs' fields are checked here, before any GPU work
    from funaudiochat_hf.triton_config_funaudiochat import DecodeKernelConfig

    if not torch.cuda.is_available():
        raise SystemExit("This micro-benchmark needs a CUDA device.")
    configs = kernel_configs(DecodeKernelConfig.for_device("cuda"), args.configs)
    names = [json.dumps(changes) for changes in args.configs]
    print(f"{torch.cuda.get_device_name()}; configs: " + "; ".join(f"[{i}] {name}" for i, name in enumerate(names)))
    print("| stack | rows | positions | MB a call | " + " | ".join(f"[{i}] µs (TB/s, diff)" for i in range(len(names)))
          + " |")  # fmt: skip
    print("|---" * (4 + len(names)) + "|")
    for case in args.cases:
        cells = measure(case, configs, args.rep)
        print(f"| {case.stack} | {case.rows} | {case.positions} | {cache_gigabytes(case) * 1e3:.1f} | "
              + " | ".join(cells) + " |", flush=True)  # fmt: skip
        torch.cuda.empty_cache()


def measure(case: Case, configs: list, rep: int) -> list[str]:
    """Per config: "µs per call (TB/s, largest difference from the first config's outputs)"."""
    import triton

    from funaudiochat_hf.triton_attention_funaudiochat import AttentionLaunch

    layers = Layers(case, max_positions=-(-case.positions // 64) * 64 + 64, device="cuda")
    reference, cells = None, []
    for config in configs:
        launch = AttentionLaunch.of(config, case.rows)
        outputs = layers.attend(launch)
        if reference is None:
            reference = [out.float() for out in outputs]
        diff = max((out.float() - ref).abs().max().item() for out, ref in zip(outputs, reference))
        seconds = triton.testing.do_bench_cudagraph(lambda: layers.attend(launch), rep=rep) / 1e3 / layers.count
        cells.append(f"{seconds * 1e6:.2f} ({cache_gigabytes(case) / seconds / 1e3:.2f}, {diff:.0e})")
    return cells


if __name__ == "__main__":
    main()

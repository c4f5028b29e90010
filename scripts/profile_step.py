"""Profile the compiled `generate_speech` decode loop of the full-size model on one GPU (random weights).

    python scripts/profile_step.py [--steps 24] [--backend compiled] [--batch 1] [--prefill]

Prints why CUDA graphs were skipped (if they were), the number of kernel and graph launches per LLM step, and the
kernels that take the most GPU time. `--prefill` profiles a one-step call instead (the prompt's encoders, LLM and
CRQ prefill: the part of the time to first audio before the decode loop), timing `embed_prompt` against the whole
call and sorting by host time as well. Use it to see where a step's milliseconds go; `scripts/benchmark.py` gives
the numbers to report.

`--chain-table PREFIX` profiles a call of `--steps` steps and one of a quarter of them, writes both kernel timelines
(`PREFIX.long.csv`, `PREFIX.short.csv`) and prints what one decode step costs per stream and kernel: the difference of
the two calls divided by the difference of their steps, so the prefill cancels out (as in `benchmark.py`'s step
times). A kernel's "chain" time is what it adds to its stream's busy time: its end minus the later of its start and the
end of the stream's kernels before it (a programmatic dependent launch starts before that end and overlaps it). Each
stream is chained on itself, as a step's work moves between streams (the LLM's layers on one; the CRQ's sub-steps on
another while the text head runs on the first), and the time a stream waits is its idle time, not a kernel's. Then,
from the long call, the median chain time and duration of each kernel of a decoder layer (projection, attention split
and merge, three projections) per stack: the LLM's and the CRQ's.
`--summarize SHORT.csv LONG.csv SHORT_STEPS LONG_STEPS` prints the same tables from timelines written earlier, on any
machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch


sys.path.insert(0, str(Path(__file__).parent))
import benchmark  # noqa: E402  (same folder: its options)
import benchmark_chat  # noqa: E402  (its model builder and inputs)
import benchmark_common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="compiled", choices=["compiled", "cuda_graphs"])
    parser.add_argument("--compile-config", default=None, help="generate_speech(compile_config=...) as JSON")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--prefill", action="store_true", help="profile a max_new_tokens=1 call (the prefill)")
    parser.add_argument("--eager-prefill", action="store_true", help="backend 'cuda_graphs' (no compiled prefill)")
    parser.add_argument("--timeline", default=None, metavar="CSV",
                        help="also write every GPU kernel of the profiled call (name, start and duration in us) to CSV, "
                             "in start order, and print the GPU's idle share between kernels")
    parser.add_argument("--chain-table", default=None, metavar="PREFIX",
                        help="profile calls of --steps and --steps // 4 steps, write their timelines to "
                             "PREFIX.long.csv and PREFIX.short.csv and print each kernel's chain time per decode step")
    parser.add_argument("--summarize", nargs=4, default=None, metavar=("SHORT_CSV", "LONG_CSV", "SHORT", "LONG"),
                        help="print the per-step chain table of two timelines written earlier (no GPU needed)")
    args = parser.parse_args()
    if args.summarize:
        short_csv, long_csv, short_steps, long_steps = args.summarize
        short, long = read_timeline(short_csv), read_timeline(long_csv)
        print(chain_table(short, long, int(short_steps), int(long_steps), args.top))
        print(layer_table(long))
        return
    torch._logging.set_logs(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True)

    bench_args = benchmark.parse_args(
        ["--chat-backend", args.backend]
        + (["--compile-config", args.compile_config] if args.compile_config else [])
    )
    model, info = benchmark_chat.build_chat_model(bench_args)
    print(f"built {info['parameters'] / 1e9:.2f} G parameters in {info['build_s']} s", flush=True)
    inputs = benchmark_chat.make_chat_inputs(model, args.batch, 10.0, "cuda")
    prompt_len = inputs["input_ids"].shape[1]
    steps = 1 if args.prefill else args.steps
    kwargs = benchmark_chat.generation_kwargs(model, "compiled", bench_args, steps,
                                         cache_max_length=benchmark_chat.cache_length(prompt_len, bench_args),
                                         eager_prefill=args.eager_prefill)
    for attempt in range(3):  # compile, capture, warm
        start = time.perf_counter()
        with torch.no_grad():
            model.generate_speech(**inputs, **kwargs)
        torch.cuda.synchronize()
        print(f"warm-up {attempt}: {time.perf_counter() - start:.3f} s", flush=True)

    if args.prefill:  # wall-clock split: the prompt's embeddings (audio encoders) vs the whole one-step call
        def wall_ms(fn, repeats=5):
            with torch.no_grad():
                return statistics.median(benchmark_common.timed(fn, "cuda")[0] for _ in range(repeats)) * 1e3

        prompt = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        embed = wall_ms(lambda: model.embed_prompt(inputs["input_ids"], **prompt))
        whole = wall_ms(lambda: model.generate_speech(**inputs, **kwargs))
        print(f"prompt of {prompt_len} tokens: embed_prompt {embed:.1f} ms, whole one-step call {whole:.1f} ms")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            model.generate_speech(**inputs, **kwargs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = {e.key: e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                            "cuLaunchKernelEx", "cudaLaunchKernelExC")}
    print(f"launch API calls for {steps} steps (prefill included): {launches}")
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))
    if args.prefill:
        print(events.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=70))
    if args.timeline:
        write_timeline(prof, args.timeline)
    if args.chain_table and not args.prefill:
        timelines = {}
        for name, call_steps in (("short", max(1, steps // 4)), ("long", steps)):
            call_kwargs = {**kwargs, "max_new_tokens": call_steps}
            if call_steps != steps:  # a new step count: warm before profiling (the warm-ups above ran `steps`)
                with torch.no_grad():
                    model.generate_speech(**inputs, **call_kwargs)
            with profile(activities=[ProfilerActivity.CUDA]) as call_prof:
                with torch.no_grad():
                    model.generate_speech(**inputs, **call_kwargs)
                torch.cuda.synchronize()
            timelines[name] = (write_timeline(call_prof, f"{args.chain_table}.{name}.csv"), call_steps)
        (short, short_steps), (long, long_steps) = timelines["short"], timelines["long"]
        print(chain_table(short, long, short_steps, long_steps, args.top))
        print(layer_table(long))


class Kernel(NamedTuple):
    """One GPU kernel of a timeline: start and duration in µs, and its stream (None where unknown)."""

    name: str
    start: float
    duration: float
    stream: int | None = None


def write_timeline(prof, path: str) -> list[Kernel]:
    """Every GPU kernel of the profile in start order to `path` (CSV: name, start_us, duration_us, the start relative
    to the first kernel, and stream), and the GPU's busy and idle time over the span they cover. Returns the kernels."""
    import csv

    from torch.autograd import DeviceType

    events = sorted(
        (event for event in prof.events() if event.device_type == DeviceType.CUDA),
        key=lambda event: event.time_range.start,
    )
    if not events:
        print("timeline: no GPU kernels recorded")
        return []
    origin = events[0].time_range.start
    kernels = [
        Kernel(event.name, event.time_range.start - origin, event.time_range.end - event.time_range.start,
               getattr(event, "device_resource_id", None))
        for event in events
    ]  # fmt: skip
    busy, end = 0.0, 0.0
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "start_us", "duration_us", "stream"])
        for kernel in kernels:
            stop = kernel.start + kernel.duration
            busy += max(0.0, stop - max(kernel.start, end))  # overlapping kernels (other streams) counted once
            end = max(end, stop)
            stream = "" if kernel.stream is None else kernel.stream
            writer.writerow([kernel.name, f"{kernel.start:.3f}", f"{kernel.duration:.3f}", stream])
    print(f"timeline: {len(kernels)} kernels over {end / 1e3:.2f} ms, GPU busy {busy / end:.1%} -> {path}")
    return kernels


def read_timeline(path: str) -> list[Kernel]:
    """The kernels of a CSV written by `write_timeline` (files without the stream column: stream None)."""
    import csv

    with open(path, newline="") as handle:
        return [
            Kernel(row["name"], float(row["start_us"]), float(row["duration_us"]),
                   int(row["stream"]) if row.get("stream") else None)
            for row in csv.DictReader(handle)
        ]  # fmt: skip


class Chained(NamedTuple):
    """A kernel of a stream's chain: what it adds to its stream's busy time (`chain`: its end minus the later of its
    start and the latest end of the stream's kernels before it, at least 0; a programmatic dependent launch that starts
    before that end adds only its end past it) and the stream's idle time just before it (`idle`)."""

    kernel: Kernel
    chain: float
    idle: float


def stream_chains(kernels: list[Kernel]) -> dict[int | None, list[Chained]]:
    """Each stream's kernels in start order with their chain and idle times (`Chained`). A decode step's critical
    path crosses streams (the CRQ sub-steps run on a stream of their own while the text head runs on the LLM's), so
    each stream is chained on itself, and the time it waits for another is its idle time, not a kernel's cost."""
    chains: dict[int | None, list[Chained]] = {}
    previous_end: dict[int | None, float] = {}
    for kernel in sorted(kernels, key=lambda kernel: kernel.start):
        end = kernel.start + kernel.duration
        before = previous_end.get(kernel.stream)
        if before is None:
            chained = Chained(kernel, kernel.duration, 0.0)
        else:
            chained = Chained(kernel, max(0.0, end - max(before, kernel.start)), max(0.0, kernel.start - before))
        chains.setdefault(kernel.stream, []).append(chained)
        previous_end[kernel.stream] = end if before is None else max(before, end)
    return chains


def kernel_costs(kernels: list[Kernel]) -> dict[tuple, list[float]]:
    """`{(stream, name): [calls, total duration, total chain time, total idle time before them]}` in µs
    (`stream_chains`)."""
    costs: dict[tuple, list[float]] = {}
    for stream, chained in stream_chains(kernels).items():
        for kernel, chain, idle in chained:
            cost = costs.setdefault((stream, kernel.name), [0, 0.0, 0.0, 0.0])
            cost[0] += 1
            cost[1] += kernel.duration
            cost[2] += chain
            cost[3] += idle
    return costs


def chain_table(short: list[Kernel], long: list[Kernel], short_steps: int, long_steps: int, top: int = 30) -> str:
    """A Markdown table of what one decode step costs per stream and kernel name: the long call's calls, durations
    and chain times minus the short call's, divided by the difference of their steps (the prefill cancels out), the
    `top` largest chain times first; above it, each stream's chain and idle time per step."""
    if long_steps <= short_steps:
        raise ValueError(f"the long call needs more steps than the short one, got {long_steps} and {short_steps}")
    steps = long_steps - short_steps
    short_costs, long_costs = kernel_costs(short), kernel_costs(long)
    rows, streams = [], {}
    for (stream, name), cost in long_costs.items():
        before = short_costs.get((stream, name), [0, 0.0, 0.0, 0.0])
        calls, duration, chain, idle = ((now - then) / steps for now, then in zip(cost, before))
        if calls > 0:
            rows.append((stream, name, calls, duration, chain))
            totals = streams.setdefault(stream, [0.0, 0.0])
            totals[0] += chain
            totals[1] += idle
    rows.sort(key=lambda row: (-row[4], -row[3]))
    summary = "; ".join(f"stream {stream}: {chain:.1f} µs of kernels' chain, {idle:.1f} µs idle"
                        for stream, (chain, idle) in sorted(streams.items(), key=lambda item: -item[1][0]))  # fmt: skip
    lines = [
        f"Per decode step ({long_steps} - {short_steps} steps), by stream: {summary}",
        "",
        "| stream | kernel | calls / step | µs each (duration) | chain µs each | chain µs / step | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for stream, name, calls, duration, chain in rows[:top]:
        stream_chain = streams[stream][0]
        share = chain / stream_chain if stream_chain > 0 else 0.0
        cells = f"{calls:.1f} | {duration / calls:.2f} | {chain / calls:.2f} | {chain:.1f} | {share:.1%}"
        lines.append(f"| {stream} | {name[:80]} | {cells} |")
    return "\n".join(lines)


PROJECTIONS = ("_decode_linear_kernel", "_decode_rows_kernel")
LAYER = ("q/k/v", "attention split", "attention merge", "o_proj", "gate/up", "down_proj")


def _layer_at(chained: list[Chained], i: int) -> list[Chained | None] | None:
    """The decoder layer starting at `chained[i]` as its `LAYER` kernels (None for a merge done by the split kernel's
    last programs), or None: a projection, the attention's split kernel, its merge kernel unless the split merged,
    three projections."""
    names = [item.kernel.name for item in chained[i : i + 6]]
    if len(names) < 5 or names[0] not in PROJECTIONS or names[1] != "_split_kernel":
        return None
    if len(names) == 6 and names[2] == "_combine_kernel" and all(name in PROJECTIONS for name in names[3:]):
        return list(chained[i : i + 6])
    if all(name in PROJECTIONS for name in names[2:5]):
        return [chained[i], chained[i + 1], None, *chained[i + 2 : i + 5]]
    return None


def layer_table(kernels: list[Kernel]) -> str:
    """A Markdown table of one decoder layer of each stack, from a timeline of the Triton decode kernels: a layer is a
    stream's run of a projection kernel, the attention's split kernel and merge kernel (absent where the split's last
    programs merge) and three more projections (`LAYER`); consecutive layers form a stack call, and stack calls of the
    same number of layers one stack (36: the LLM, 28: the CRQ at full size). For each, the median chain time and
    duration of each of the layer's kernels on its stream ("-": the split merged)."""
    calls = []
    for chained in stream_chains(kernels).values():
        current, i = [], 0
        while i < len(chained):
            layer = _layer_at(chained, i)
            if layer is not None:
                current.append(layer)
                i += sum(item is not None for item in layer)
                continue
            if current:
                calls.append(current)
                current = []
            i += 1
        if current:
            calls.append(current)
    if not calls:
        return "No decoder layers of the Triton decode kernels in this timeline."
    stacks: dict[int, list] = {}
    for call in calls:
        stacks.setdefault(len(call), []).extend(call)
    lines = ["| stack (layers per call) | calls | " + " | ".join(LAYER) + " | layer |", "|---" * (len(LAYER) + 3) + "|"]
    for layers, stack in sorted(stacks.items(), reverse=True):
        cells = []
        for k in range(len(LAYER)):
            present = [layer[k] for layer in stack if layer[k] is not None]
            if not present:
                cells.append("-")
                continue
            chain = statistics.median(item.chain for item in present)
            cells.append(f"{chain:.2f} ({statistics.median(item.kernel.duration for item in present):.2f})")
        total = statistics.median(sum(item.chain for item in layer if item is not None) for layer in stack)
        lines.append(f"| {layers} | {len(stack) // layers} | {' | '.join(cells)} | {total:.1f} |")
    return "Median µs per decoder layer kernel, chain on its stream (duration):\n\n" + "\n".join(lines)


if __name__ == "__main__":
    main()

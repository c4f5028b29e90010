"""Profile the compiled `generate_speech` decode loop of the full-size model on one GPU (random weights).

    python scripts/profile_step.py [--steps 24] [--compile-scope parts] [--batch 1] [--prefill]

Prints why CUDA graphs were skipped (if they were), the number of kernel and graph launches per LLM step, and the
kernels that take the most GPU time. `--prefill` profiles a one-step call instead (the prompt's encoders, LLM and
CRQ prefill: the part of the time to first audio before the decode loop), timing `embed_prompt` against the whole
call and sorting by host time as well. Use it to see where a step's milliseconds go; `scripts/benchmark.py` gives
the numbers to report.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).parent))
import benchmark  # noqa: E402  (same folder: reuse its model builder and inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile-scope", default="parts", choices=["step", "parts"])
    parser.add_argument("--compile-config", default=None, help="generate_speech(compile=...) as JSON")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--prefill", action="store_true", help="profile a max_new_tokens=1 call (the prefill)")
    parser.add_argument("--eager-prefill", action="store_true", help="generate_speech(compile_prefill=False)")
    parser.add_argument("--timeline", default=None, metavar="CSV",
                        help="also write every GPU kernel of the profiled call (name, start and duration in us) to CSV, "
                             "in start order, and print the GPU's idle share between kernels")
    args = parser.parse_args()
    torch._logging.set_logs(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True)

    bench_args = benchmark.parse_args(
        ["--no-write", "--compile-scope", args.compile_scope]
        + (["--compile-config", args.compile_config] if args.compile_config else [])
    )
    model, info = benchmark.build_chat_model(bench_args)
    print(f"built {info['parameters'] / 1e9:.2f} G parameters in {info['build_s']} s", flush=True)
    inputs = benchmark.make_chat_inputs(model, args.batch, 10.0, "cuda")
    prompt_len = inputs["input_ids"].shape[1]
    steps = 1 if args.prefill else args.steps
    kwargs = benchmark.generation_kwargs(model, "compiled", bench_args, steps,
                                         cache_max_length=benchmark.cache_length(prompt_len, bench_args),
                                         compile_prefill=False if args.eager_prefill else None)
    for attempt in range(3):  # compile, capture, warm
        start = time.perf_counter()
        with torch.no_grad():
            model.generate_speech(**inputs, **kwargs)
        torch.cuda.synchronize()
        print(f"warm-up {attempt}: {time.perf_counter() - start:.3f} s", flush=True)

    if args.prefill:  # wall-clock split: the prompt's embeddings (audio encoders) vs the whole one-step call
        def wall_ms(fn, repeats=5):
            with torch.no_grad():
                return statistics.median(benchmark.timed(fn, "cuda")[0] for _ in range(repeats)) * 1e3

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


def write_timeline(prof, path: str) -> None:
    """Every GPU kernel of the profile in start order to `path` (CSV: name, start_us, duration_us, the start relative
    to the first kernel), and the GPU's busy and idle time over the span they cover."""
    import csv

    from torch.autograd import DeviceType

    kernels = sorted(
        (event for event in prof.events() if event.device_type == DeviceType.CUDA),
        key=lambda event: event.time_range.start,
    )
    if not kernels:
        print("timeline: no GPU kernels recorded")
        return
    origin = kernels[0].time_range.start
    busy, end = 0.0, origin
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "start_us", "duration_us"])
        for event in kernels:
            start, stop = event.time_range.start, event.time_range.end
            busy += max(0.0, stop - max(start, end))  # overlapping kernels (other streams) counted once
            end = max(end, stop)
            writer.writerow([event.name, f"{start - origin:.3f}", f"{stop - start:.3f}"])
    span = end - origin
    print(f"timeline: {len(kernels)} kernels over {span / 1e3:.2f} ms, GPU busy {busy / span:.1%} -> {path}")


if __name__ == "__main__":
    main()

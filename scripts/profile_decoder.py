"""Profile one steady streaming chunk of the CosyVoice3 decoder (full size, random weights; `--tiny` for a smoke run),
or with `--offline SECONDS` one offline call on that many seconds of tokens.

    python scripts/profile_decoder.py [--precision bfloat16] [--compile '{}'] [--compile-vocoder]
                                      [--channels-last-vocoder] [--stream-options '{...}'] [--offline 10]
                                      [--trace chunk.json]

Prints where the time goes: the flow vs the vocoder (wall time, synchronised), how long a whole push keeps the host
busy against when its GPU work ends (host-bound or GPU-bound), the number of kernel and graph launches, and the
kernels that take the most GPU time; `--trace` also writes the profiled chunk's Chrome trace (kernel timeline).
`scripts/benchmark.py` gives the numbers to report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).parent))
import benchmark  # noqa: E402  (same folder: its options)
import benchmark_common  # noqa: E402
import benchmark_decoder  # noqa: E402  (its decoder builder and inputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="float32", choices=["float32", "tf32", "bfloat16"])
    parser.add_argument("--compile", default=None, help="JSON kwargs of compile_estimator(); omitted = eager")
    parser.add_argument("--compile-vocoder", action="store_true", help="also run decoder.compile_vocoder()")
    parser.add_argument(
        "--channels-last-vocoder",
        action="store_true",
        help="run HiFT's filter channels-last without compiling it (hift.use_channels_last_convolutions())",
    )
    parser.add_argument("--stream-options", default=None, help="JSON kwargs of streaming_decoder()")
    parser.add_argument("--hop", type=int, default=15)
    parser.add_argument("--warm-chunks", type=int, default=20, help="chunks before the profiled one (fill windows)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--offline", type=float, default=None, help="profile an offline call on SECONDS of tokens")
    parser.add_argument("--trace", default=None, help="write the profiled call's Chrome trace (JSON) to this path")
    args = parser.parse_args(argv)

    bench_args = benchmark.parse_args(
        ["--device", args.device, "--decoder-precision", args.precision]
        + (["--tiny"] if args.tiny else [])
    )
    decoder, info = benchmark_decoder.build_decoder(bench_args)
    print(f"decoder: {info}", flush=True)
    benchmark_decoder.apply_decoder_precision(decoder, args.precision)
    if args.compile is not None:
        decoder.compile_estimator(**json.loads(args.compile))
    if args.channels_last_vocoder:
        decoder.hift.use_channels_last_convolutions()
    if args.compile_vocoder:
        decoder.compile_vocoder(**({} if args.device.startswith("cuda") else {"backend": "eager"}))
    if args.offline is not None:
        profile_offline(decoder, args)
        return
    options = json.loads(args.stream_options) if args.stream_options else {}

    def new_stream():
        return decoder.streaming_decoder(
            speaker_embedding=benchmark_decoder.speaker_embedding(args.device), token_hop_len=args.hop, **options
        )

    tokens = benchmark_decoder.random_speech_tokens(60.0, seed=5).reshape(-1).to(args.device)
    with torch.no_grad():  # a first reply compiles / records the graphs; the measured reply is the second
        warm_up = new_stream()
        for start in range(0, 4 * args.hop, args.hop):
            warm_up.push(tokens[start : start + args.hop])
    stream = new_stream()
    print(f"cuda_graphs={stream.cuda_graphs}, flow window sizes={stream.flow_window_sizes}", flush=True)

    # Time the flow and vocoder calls of every chunk (synchronised wrappers around the decoder's two stages).
    seconds = {"flow": [], "vocode": []}
    for name, attribute in (("flow", "_flow"), ("vocode", "_vocode")):
        original = getattr(stream, attribute)

        def timed(*a, _original=original, _name=name, **k):
            benchmark_common.synchronize(args.device)
            start = time.perf_counter()
            result = _original(*a, **k)
            benchmark_common.synchronize(args.device)
            seconds[_name].append(time.perf_counter() - start)
            return result

        setattr(stream, attribute, timed)

    pushed, push_seconds = 0, []
    with torch.no_grad():
        for _ in range(args.warm_chunks):
            start = time.perf_counter()
            stream.push(tokens[pushed : pushed + args.hop])
            benchmark_common.synchronize(args.device)
            if seconds["flow"]:  # pushes that decoded a chunk
                push_seconds.append(time.perf_counter() - start)
            pushed += args.hop
    seconds["whole push"] = push_seconds
    print(f"first chunk of the reply (whole push): {1e3 * push_seconds[0]:.2f} ms")
    steady = slice(len(seconds["flow"]) // 2, None)
    for name, values in seconds.items():
        values = values[steady]
        if values:
            print(f"{name}: {1e3 * sum(values) / len(values):.2f} ms per chunk (mean of {len(values)} steady chunks)")

    # Whole pushes without the synchronising wrappers: when the host returns against when the GPU is done.
    for attribute in ("_flow", "_vocode"):
        delattr(stream, attribute)
    host_ms, done_ms = [], []
    with torch.no_grad():
        for _ in range(4):
            benchmark_common.synchronize(args.device)
            start = time.perf_counter()
            stream.push(tokens[pushed : pushed + args.hop])
            host_ms.append(1e3 * (time.perf_counter() - start))
            benchmark_common.synchronize(args.device)
            done_ms.append(1e3 * (time.perf_counter() - start))
            pushed += args.hop
    print(f"whole push, unsynchronised: host returns after {sum(host_ms) / 4:.2f} ms, GPU done after "
          f"{sum(done_ms) / 4:.2f} ms (mean of 4 chunks)")

    print_profile(lambda: stream.push(tokens[pushed : pushed + args.hop]), "one chunk", args)


def profile_offline(decoder, args: argparse.Namespace) -> None:
    """Wall time of `tokens_to_mel` and `mel_to_wav` on `args.offline` seconds of tokens, then a profile of one call."""
    tokens = benchmark_decoder.random_speech_tokens(args.offline, seed=int(args.offline)).to(args.device)
    speaker = benchmark_decoder.speaker_embedding(args.device)
    seconds = {"flow (tokens_to_mel)": [], "vocode (mel_to_wav)": []}
    with torch.no_grad():
        for _ in range(4):  # the first call compiles / autotunes: not counted
            start = time.perf_counter()
            mel = decoder.tokens_to_mel(tokens, speaker)
            benchmark_common.synchronize(args.device)
            middle = time.perf_counter()
            decoder.mel_to_wav(mel)
            benchmark_common.synchronize(args.device)
            seconds["flow (tokens_to_mel)"].append(middle - start)
            seconds["vocode (mel_to_wav)"].append(time.perf_counter() - middle)
    for name, values in seconds.items():
        print(f"{name}: {1e3 * sum(values[1:]) / len(values[1:]):.2f} ms (mean of {len(values) - 1} warm calls)")
    print_profile(lambda: decoder(tokens, speaker_embedding=speaker), f"one offline call ({args.offline:g} s)", args)


def print_profile(fn, label: str, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        with torch.no_grad():
            fn()
        benchmark_common.synchronize(args.device)
    events = prof.key_averages()
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    launches = {e.key: e.count for e in events if e.key in launch_names}
    print(f"{label}: {sum(e.count for e in events if e.key.startswith('aten::'))} aten ops, launches {launches}")
    sort_by = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=args.top, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace}")


if __name__ == "__main__":
    main()

"""Time to first audio for several `generate_speech` settings, side by side in one process.

    python scripts/bench_ttfa.py --backends compiled,cuda_graphs -- --decoder-precision bfloat16 \
        --compile-vocoder --stream-options '{"first_token_hop_len": 5, "flow_left_context_tokens": 50}'

Builds the full-size chat model and decoder once (as `scripts/benchmark.py`, whose options follow `--`), then runs
`benchmark_chat.ttfa_row` (a warm-up call that compiles, then the median of `--repeats` timed calls) once per value of
`--backends` (`generate_speech(backend=...)`), in the order given, and prints one row each with the arrival time of every stream event.

The prefill (the first event) is host-bound, and its time depends on what the process compiled before: compare
settings in the same process, and compare the orders too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402  (scripts/benchmark.py: its options)
import benchmark_chat  # noqa: E402
import benchmark_common  # noqa: E402
import benchmark_decoder  # noqa: E402


def main(argv: list[str]) -> None:
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1 :]
    else:
        own, rest = argv, []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="compiled,cuda_graphs", help="backends to compare, in this order")
    options = parser.parse_args(own)
    args = benchmark.parse_args(["--parts", "chat,decoder", "--modes", "compiled", "--decoder-modes", "compiled", *rest])
    model, _ = benchmark_chat.build_chat_model(args)
    decoder, _ = benchmark_decoder.build_decoder(args)
    benchmark_decoder.apply_decoder_precision(decoder, args.decoder_precision)
    print("decoder:", benchmark_decoder.compile_decoder(decoder, args), flush=True)
    print("| order | backend | time to first audio ms | stream events ms | first call s |")
    print("|---|---|---|---|---|", flush=True)
    for order, backend in enumerate(benchmark.csv(options.backends), start=1):
        args.chat_backend = backend
        start = time.perf_counter()
        row = benchmark_chat.ttfa_row(model, decoder, "compiled", args)
        events = ", ".join(f"{ms:.1f}" for ms in row["event_ms"])
        print(
            f"| {order} | {backend} | {row['ttfa_ms']:.0f} | {events} | {row['first_call_ttfa_ms'] / 1e3:.1f} |",
            flush=True,
        )
        benchmark_common.log(f"{backend}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])

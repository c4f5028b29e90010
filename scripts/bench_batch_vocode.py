"""Vocoding N concurrent streams: one batched `decode_ready` per chunk against N sequential `push` calls.

    python scripts/bench_batch_vocode.py --streams 1,2,4,8,16 -- --decoder-precision bfloat16

Builds the full-size decoder (as `scripts/benchmark.py`, whose options follow `--`; `--tiny` for a smoke test), then
for each N: N streams of their own random voices, as the serving engine runs them (hop 15, first hop 5, the default
windows), are first fed `--warmup-tokens` tokens (the flow windows fill up and every graph shape is recorded), then
timed over `--rounds` chunks: each round adds 15 tokens to every stream and decodes the ready chunks, batched
(`streaming_batch_cosyvoice3.decode_ready`) or one stream after another (`push`), waiting for the device at the end.
Prints one JSON line per N: the median round in ms and the per-stream real-time factor (round time / 0.6 s of
audio), and how many flow / HiFT graphs the model holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402  (scripts/benchmark.py: its options)
import benchmark_common  # noqa: E402  (puts the repo's src/ on sys.path)
import benchmark_decoder  # noqa: E402  (the decoder builder)

from funaudiochat_hf.serving_engine_funaudiochat import DEFAULT_STREAM_OPTIONS  # noqa: E402
from funaudiochat_hf.streaming_batch_cosyvoice3 import decode_ready  # noqa: E402


HOP = 15
# The serving engine's first hops, without its hop growth.
STREAM_OPTIONS = {"token_hop_len": HOP, "first_token_hop_len": DEFAULT_STREAM_OPTIONS["first_token_hop_len"]}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,2,4,8,16", help="numbers of concurrent streams")
    parser.add_argument("--rounds", type=int, default=10, help="timed chunks per stream")
    parser.add_argument("--warmup-tokens", type=int, default=240, help="tokens per stream before the timing")
    own = parser.parse_args(argv[:split])
    return own, benchmark.parse_args(["--parts", "decoder", *argv[split + 1 :]])


def _streams(decoder, count: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    voices = torch.randn(count, decoder.config.spk_embed_dim, generator=generator)
    return [decoder.streaming_decoder(speaker_embedding=voice.to(decoder.device), **STREAM_OPTIONS) for voice in voices]


def _round(streams, tokens: torch.Tensor, batched: bool) -> list[torch.Tensor]:
    if batched:
        for stream, row in zip(streams, tokens):
            stream.add_tokens(row)
        return decode_ready(streams)
    return [stream.push(row) for stream, row in zip(streams, tokens)]


def measure(decoder, count: int, own: argparse.Namespace, device: str) -> dict:
    vocab = decoder.config.vocab_size
    generator = torch.Generator().manual_seed(count)
    row = {"streams": count}
    for batched in (True, False):
        streams = _streams(decoder, count, seed=count)
        for _ in range(own.warmup_tokens // HOP):
            _round(streams, torch.randint(0, vocab, (count, HOP), generator=generator), batched)
        times = []
        for _ in range(own.rounds):
            tokens = torch.randint(0, vocab, (count, HOP), generator=generator)  # on the CPU, as the engine's
            benchmark_common.synchronize(device)
            start = time.perf_counter()
            audio = _round(streams, tokens, batched)
            benchmark_common.synchronize(device)
            times.append(time.perf_counter() - start)
            if any(piece.numel() == 0 for piece in audio):
                raise RuntimeError("a round decoded no chunk for some stream: the benchmark's feeding is off")
        median = statistics.median(times)
        name = "batched" if batched else "sequential"
        row[f"{name}_round_ms"] = round(1000 * median, 2)
        row[f"{name}_rtf"] = round(median / (HOP * decoder.config.token_mel_ratio / 50), 3)  # 50 mel frames per s
    runners = getattr(decoder, "streaming_graph_runners", None) or {}
    row["graphs"] = {name: len(runner) for name, runner in runners.items()}
    return row


def main(argv: list[str]) -> None:
    own, args = parse_args(argv)
    decoder, info = benchmark_decoder.build_decoder(args)
    benchmark_decoder.apply_decoder_precision(decoder, args.decoder_precision)
    print(json.dumps({"decoder": info, "device": args.device}), flush=True)
    with torch.no_grad():
        for count in (int(value) for value in own.streams.split(",")):
            print(json.dumps(measure(decoder, count, own, args.device)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

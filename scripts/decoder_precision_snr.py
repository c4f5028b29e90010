#!/usr/bin/env python
"""Mel and waveform SNR of the CosyVoice3 decoder's DiT estimator in bfloat16 (or float16) against float32.

    python scripts/decoder_precision_snr.py                       # full-size random weights, on cuda if present
    python scripts/decoder_precision_snr.py PATH                  # a converted (config.json) or official folder
    python scripts/decoder_precision_snr.py --tiny --device cpu   # tests/fixtures/cosyvoice3_tiny, its golden tokens

Offline decoding of the same tokens twice on the same weights (`scripts/benchmark_decoder.py`'s `decoder_precision_row`:
float32, then autocast to the lower precision, which gives exactly the numbers of weights stored in it). Prints one
JSON line per precision and a short table: mel SNR, waveform SNR, F0 SNR and the waveform's SNR when vocoded with
float32's excitation (see `decoder_precision_row` for why the last two are there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402  (scripts/benchmark.py: its options)
import benchmark_common  # noqa: E402
import benchmark_decoder  # noqa: E402  (the decoder builder, precision row and SNR)


GOLDEN_FLOW = benchmark_common.REPO / "tests" / "fixtures" / "cosyvoice3_golden" / "flow_full.safetensors"


def load_decoder(path: str | None, args: argparse.Namespace):
    """(decoder in float32, its description): from `path` (a `save_pretrained` folder or an official CosyVoice3
    folder; `--tiny`: tests/fixtures/cosyvoice3_tiny), else `benchmark_decoder.build_decoder` (full-size random
    weights)."""
    if path is None and args.tiny:
        path = str(benchmark_common.COSYVOICE3_TINY)
    if path is None:
        decoder, info = benchmark_decoder.build_decoder(args)
        return decoder, info["source"]
    from funaudiochat_hf import CosyVoice3Token2Wav

    folder = Path(path)
    if not folder.is_dir():
        raise SystemExit(f"error: {path} is not a folder")
    if (folder / "config.json").exists():
        decoder = CosyVoice3Token2Wav.from_pretrained(folder, estimator_precision="float32")
    else:
        decoder = CosyVoice3Token2Wav.from_original(folder)
    return decoder.to(args.device).eval(), str(folder)


def fixture_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The golden flow test's tokens (1, 90) and speaker embedding (1, 192)."""
    from safetensors.torch import load_file

    golden = load_file(GOLDEN_FLOW)
    return golden["speech_token"], golden["embedding"]


def precision_snr(decoder, precision: str, device: str, tokens=None, speaker=None) -> dict:
    """`benchmark_decoder.decoder_precision_row` for `precision` on `decoder` (float32 weights; left so)."""
    args = argparse.Namespace(device=device, decoder_precision=precision)
    return benchmark_decoder.decoder_precision_row(decoder, args, tokens, speaker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=None, help="decoder folder (default: random full-size weights)")
    parser.add_argument("--tiny", action="store_true", help="the tiny fixture decoder and its golden tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", default="bfloat16", help="comma-separated: bfloat16, float16")
    parser.add_argument("--seconds", type=float, default=10.0, help="random tokens to decode (not with --tiny)")
    options = parser.parse_args(argv)
    precisions = benchmark.csv(options.precisions)
    for precision in precisions:
        if precision not in ("bfloat16", "float16"):
            parser.error(f"--precisions takes bfloat16 / float16, got {precision!r}")
    args = benchmark.parse_args(["--device", options.device] + (["--tiny"] if options.tiny else []))
    decoder, source = load_decoder(options.path, args)
    if options.tiny and options.path is None:
        tokens, speaker = fixture_inputs()
    else:
        tokens, speaker = benchmark_decoder.random_speech_tokens(options.seconds, seed=7), None
    rows = []
    for precision in precisions:
        row = precision_snr(decoder, precision, options.device, tokens, speaker)
        row.update(decoder=source, device=options.device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| precision | tokens | mel SNR dB | waveform SNR dB | F0 SNR dB | waveform, float32 excitation, SNR dB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['precision']} | {row['tokens']} | {row['mel_snr_db']:.1f} | {row['wav_snr_db']:.1f} | "
            f"{row['f0_snr_db']:.1f} | {row['wav_same_excitation_snr_db']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

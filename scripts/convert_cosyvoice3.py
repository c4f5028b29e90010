#!/usr/bin/env python
"""Convert an official CosyVoice3 folder (cosyvoice3.yaml, flow.pt, hift.pt[, spk2info.pt]) to a transformers folder.

    python scripts/convert_cosyvoice3.py pretrained_models/Fun-CosyVoice3-0.5B-2512 out/cosyvoice3-hf \
        --speakers Fun-Audio-Chat/utils/new_spk2info.pt

The output (config.json + model.safetensors, speaker embeddings included) loads with
`AutoModel.from_pretrained(out)` after `import funaudiochat_hf`.
"""

import argparse
import sys
from pathlib import Path

from funaudiochat_hf import CosyVoice3Token2Wav


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="official CosyVoice3 folder (cosyvoice3.yaml, flow.pt, hift.pt)")
    parser.add_argument("dst", type=Path, help="output folder for the transformers checkpoint")
    parser.add_argument(
        "--speakers",
        type=Path,
        default=None,
        help="spk2info file ({name: {'embedding': (1, 192)}}); default: spk2info.pt / new_spk2info.pt in SRC",
    )
    parser.add_argument(
        "--speaker-names", nargs="+", default=None, help="keep only these speakers, in this order (default: all)"
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty DST")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.src.is_dir():
        raise SystemExit(f"error: {args.src} is not a directory")
    if args.speakers is not None and not args.speakers.is_file():
        raise SystemExit(f"error: speakers file {args.speakers} does not exist")
    if args.dst.exists() and any(args.dst.iterdir()) and not args.overwrite:
        raise SystemExit(f"error: {args.dst} is not empty (pass --overwrite)")
    print(f"converting {args.src} (flow.pt, hift.pt, the speakers) ...", file=sys.stderr)
    try:
        model = CosyVoice3Token2Wav.from_original(args.src, args.speakers, args.speaker_names)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}")
    print(f"writing {args.dst} ...", file=sys.stderr)
    model.save_pretrained(args.dst)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.dst}: {params:,} parameters, speakers {model.config.speaker_names}, "
        f"sampling rate {model.config.sampling_rate}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

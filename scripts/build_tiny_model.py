#!/usr/bin/env python
"""Build the tiny random-weight Fun-Audio-Chat (+ CosyVoice3 decoder) folder used as the offline default.

    python scripts/build_tiny_model.py                 # into the cache (~/.cache/funaudiochat_hf/tiny-<version>)
    python scripts/build_tiny_model.py --out tiny-s2s  # anywhere else, e.g. to push it to the Hub

Its output is noise: it exists so that everything runs offline in seconds (CLI, demo, tests).
"""

import argparse
import sys

from funaudiochat_hf.tiny_model import NOISE_WARNING, build_tiny_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="target folder (default: the cache folder the CLI uses)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(args.out, seed=args.seed, force=args.force)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    print(f"note: {NOISE_WARNING}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

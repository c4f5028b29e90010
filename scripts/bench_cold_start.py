#!/usr/bin/env python
"""Cold start: from "chat model and decoder loaded" to the first audio of the first reply, in fresh processes.

    python scripts/bench_cold_start.py                           # full size, random weights, on cuda
    python scripts/bench_cold_start.py --tiny --device cpu       # smoke test (tiny random configs)

Runs two fresh Python processes one after the other. Both get the same new temporary cache root (or
`--cache-dir`) for every on-disk compile cache: Triton's kernels, Inductor's (FX graphs, autotuning), PyTorch's
and CUDA's JIT kernels. The first starts with it empty; the second finds what the first left there, as a restarted
Space or a second CLI run does. Each process:

  (a) builds the chat model and the decoder (the builders of `scripts/benchmark_chat.py` and
      `benchmark_decoder.py`: full-size random weights directly on the device, or the tiny configs with `--tiny`);
  (b) times, from there, the first audio samples of a first reply: `model.generate_speech_stream(**inputs,
      speech_decoder=decoder, speaker=..., max_new_tokens=N)` with no performance option at all, i.e. whatever the
      package does by default (compilation, kernels, CUDA graphs and the decoder's device defaults happen here);
  (c) the rest of that reply;
  (d) a second reply's time to first audio in the same process (everything warm);
and reports the peak GPU memory of the process. Besides `max_new_tokens`, the replies pass a speaker embedding (a
random-weight decoder stores none), a seed (every run samples the same tokens) and an end-of-text id the text head
cannot produce (random weights would otherwise end a reply at a random step, possibly before any audio); none of
these changes how fast a step runs.

Prints one JSON line per process and a table; `--json PATH` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


PROCESS_START = time.perf_counter()
SCRIPT = Path(__file__).resolve()
# Cache locations each process gets under the cache root (variable -> sub-folder).
CACHE_VARIABLES = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "PYTORCH_KERNEL_CACHE_PATH": "torch_kernels",
    "CUDA_CACHE_PATH": "cuda",
}


def cache_environment(cache_root: Path) -> dict[str, str]:
    """The environment of a measured process: this one's, with every compile cache under `cache_root`."""
    return {**os.environ, **{name: str(cache_root / sub) for name, sub in CACHE_VARIABLES.items()}}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random configs (tests/fixtures), for a smoke test")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="LLM steps per reply (default 50; tiny 8)")
    parser.add_argument("--input-seconds", type=float, default=None, help="spoken question (default 10 s; tiny 1 s)")
    parser.add_argument("--cache-dir", default=None, help="cache root for both processes (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--child", choices=["empty", "warm"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.tiny else 50
    if args.input_seconds is None:
        args.input_seconds = 1.0 if args.tiny else 10.0
    return args


# -- one measured process ---------------------------------------------------------------------------------------------


def measure_process(args: argparse.Namespace, caches: str) -> dict:
    """(a)-(d) in this process (see the module docstring); the row of one process."""
    sys.path.insert(0, str(SCRIPT.parent))
    import_start = time.perf_counter()
    import benchmark  # noqa: E402  (scripts/benchmark.py and its benchmark_* modules; imports torch and transformers)
    import benchmark_chat
    import benchmark_common
    import benchmark_decoder
    import torch

    import funaudiochat_hf  # noqa: F401

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import_s = time.perf_counter() - import_start
    bench_args = benchmark.parse_args(["--device", device] + (["--tiny"] if args.tiny else []))
    cuda = benchmark_common.is_cuda(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    start = time.perf_counter()
    model, _ = benchmark_chat.build_chat_model(bench_args)
    decoder, _ = benchmark_decoder.build_decoder(bench_args)
    benchmark_common.synchronize(device)
    loaded = time.perf_counter()
    load_s = loaded - start

    inputs = benchmark_chat.make_chat_inputs(model, 1, args.input_seconds, device)
    kwargs = {
        "speech_decoder": decoder,
        "speaker": benchmark_decoder.speaker_embedding(device)[0],
        "max_new_tokens": args.max_new_tokens,
        "seed": 0,
        "eos_token_id": [],  # no stop token: every reply runs max_new_tokens steps
    }
    first = timed_reply(model, inputs, kwargs, device, benchmark_common)
    second = timed_reply(model, inputs, kwargs, device, benchmark_common)
    return {
        "caches": caches,
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "tiny": args.tiny,
        "max_new_tokens": args.max_new_tokens,
        "script_start_to_loaded_s": round(loaded - PROCESS_START, 3),
        "import_s": round(import_s, 3),
        "load_s": round(load_s, 3),
        "first_audio_s": round(first["first_audio_s"], 3),
        "first_reply_rest_s": round(first["total_s"] - first["first_audio_s"], 3),
        "first_reply_audio_s": round(first["audio_s"], 3),
        "second_first_audio_s": round(second["first_audio_s"], 4),
        "second_reply_s": round(second["total_s"], 3),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        "decoder_estimator_dtype": str(decoder.flow.decoder.estimator.proj_out.weight.dtype).replace("torch.", ""),
    }


def timed_reply(model, inputs: dict, kwargs: dict, device: str, benchmark_common) -> dict:
    """One streamed reply: seconds to its first audio samples (synchronised), to its end, and its audio seconds."""
    import torch

    benchmark_common.synchronize(device)
    start = time.perf_counter()
    first_audio_s, samples, rate = None, 0, 24000
    with torch.no_grad():
        for event in model.generate_speech_stream(**inputs, **kwargs):
            if event.audio is not None and event.audio.numel():
                if first_audio_s is None:
                    benchmark_common.synchronize(device)
                    first_audio_s = time.perf_counter() - start
                samples += event.audio.numel()
                rate = event.sampling_rate
    benchmark_common.synchronize(device)
    total_s = time.perf_counter() - start
    if first_audio_s is None:
        raise RuntimeError(f"the reply ({kwargs['max_new_tokens']} steps) produced no audio")
    return {"first_audio_s": first_audio_s, "total_s": total_s, "audio_s": samples / rate}


# -- the two processes ------------------------------------------------------------------------------------------------


def child_command(args: argparse.Namespace, caches: str) -> list[str]:
    command = [sys.executable, str(SCRIPT), "--child", caches, "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--input-seconds", str(args.input_seconds)]
    if args.tiny:
        command.append("--tiny")
    if args.device:
        command += ["--device", args.device]
    return command


def run_processes(args: argparse.Namespace) -> list[dict]:
    """The two fresh processes, on one cache root (new and empty unless `--cache-dir` names one)."""
    cache_root = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="cold_start_cache_"))
    cache_root.mkdir(parents=True, exist_ok=True)
    rows = []
    for caches in ("empty", "warm"):
        command = child_command(args, caches)
        print(f"[cold start] {caches} caches ({cache_root}): {' '.join(command)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(
            command, env=cache_environment(cache_root), capture_output=True, text=True, timeout=args.timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{caches}-cache process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row.update(process_wall_s=round(time.perf_counter() - start, 3), cache_root=str(cache_root))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    header = (
        "| caches | load s | first audio s (from loaded) | rest of the reply s | 2nd reply: first audio ms "
        "| process wall s | peak GPU GB | estimator |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = "–" if row["peak_gpu_gb"] is None else f"{row['peak_gpu_gb']:.1f}"
        lines.append(
            f"| {row['caches']} | {row['load_s']:.1f} | {row['first_audio_s']:.2f} | {row['first_reply_rest_s']:.2f} "
            f"| {row['second_first_audio_s'] * 1e3:.0f} | {row['process_wall_s']:.1f} | {peak} "
            f"| {row['decoder_estimator_dtype']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(measure_process(args, args.child)), flush=True)
        return 0
    rows = run_processes(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the time to first audio goes at the defaults: `generate_speech_stream` with no performance option.

    python scripts/profile_ttfa.py                      # full size, random weights, on cuda
    python scripts/profile_ttfa.py --tiny --device cpu  # smoke test
    python scripts/profile_ttfa.py --trace ttfa.json    # also the profiled call's Chrome trace
    python scripts/profile_ttfa.py --serving-prompt --input-seconds 3 --syncs   # the serving benchmark's prompt

Builds the chat model and decoder as `scripts/benchmark.py` does, makes `--warm-calls` streamed replies (the first
ones record graphs: a prompt bucket's pass is recorded on its second call), then one more with every stage
synchronised and timed (host time, and the time until the GPU is done): embedding the prompt (audio encoders), the
prompt pass, the whole prefill; and the arrival time of every stream event up to the first audio. `--syncs`: one more
reply with every host sync counted by source line. Last, one reply under `torch.profiler`: the ops that take the most
host and device time. `--serving-prompt`: the prompt `scripts/bench_serving.py` sends (its processor's CPU tensors for
a synthetic spoken question, as the server hands them to the engine) instead of random device tensors.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark  # noqa: E402  (scripts/benchmark.py: its options)
import benchmark_chat  # noqa: E402  (builders and inputs)
import benchmark_common  # noqa: E402  (puts the repo's src/ on sys.path)
import benchmark_decoder  # noqa: E402
import torch  # noqa: E402

from funaudiochat_hf import generation_loop_funaudiochat as loop  # noqa: E402


def first_audio(model, inputs: dict, kwargs: dict, device: str) -> tuple[float, list[float]]:
    """(ms to the first non-empty audio chunk, arrival ms of every event until then) of one streamed reply."""
    benchmark_common.synchronize(device)
    start, events = time.perf_counter(), []
    with torch.no_grad():
        stream = model.generate_speech_stream(**inputs, **kwargs)
        try:
            for event in stream:
                events.append(round((time.perf_counter() - start) * 1e3, 1))
                if event.audio is not None and event.audio.numel():
                    benchmark_common.synchronize(device)
                    return (time.perf_counter() - start) * 1e3, events
        finally:
            stream.close()
    raise RuntimeError(f"no audio in {len(events)} events")


def serving_prompt_inputs(model, seconds: float) -> dict:
    """What the speech server hands its engine for a synthetic spoken question of `seconds`: the processor's CPU
    tensors of `scripts/bench_serving.py`'s request (the tiny processor, its ids those of `model`'s config)."""
    import bench_serving
    import bench_serving_models

    from funaudiochat_hf import FunAudioChatProcessor
    from funaudiochat_hf.serving_openai_funaudiochat import TranscriptMemory, parse_chat_request, wav_bytes
    from funaudiochat_hf.tiny_model import ASSETS_DIR, synthetic_question

    tiny = FunAudioChatProcessor.from_pretrained(str(ASSETS_DIR))
    processor = bench_serving_models.FullSizeProcessor(tiny, model.config)
    body = bench_serving.chat_body(wav_bytes(synthetic_question(seconds), 16000), 12, seed=0)
    return parse_chat_request(body, processor, TranscriptMemory(), [], "profile", model.dtype).speech.inputs


def host_syncs(call) -> collections.Counter:
    """{source line (the package's or transformers' last three frames): count} of the host syncs during `call()`
    (`torch.cuda.set_sync_debug_mode`)."""
    found = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "funaudiochat_hf" in f.filename or "transformers" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
        found[where or f"{Path(filename).name}:{lineno}"] += 1

    with warnings.catch_warnings():  # restores `showwarning` too
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


class StageTimes:
    """Wraps functions so that each call is synchronised before and after: {stage: [(host ms, done ms), ...]}."""

    def __init__(self, device: str):
        self.device, self.times, self._undo = device, {}, []

    def wrap(self, owner, name: str, stage: str) -> None:
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            benchmark_common.synchronize(self.device)
            start = time.perf_counter()
            result = function(*args, **kwargs)
            host = time.perf_counter()
            benchmark_common.synchronize(self.device)
            done = time.perf_counter()
            self.times.setdefault(stage, []).append((round((host - start) * 1e3, 2), round((done - start) * 1e3, 2)))
            return result

        setattr(owner, name, timed)
        self._undo.append((owner, name, function))

    def restore(self) -> None:
        for owner, name, function in reversed(self._undo):
            setattr(owner, name, function)
        self._undo.clear()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random configs (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input-seconds", type=float, default=None, help="spoken question (10 s; tiny 2 s)")
    parser.add_argument("--warm-calls", type=int, default=3, help="replies before the measured one (default 3)")
    parser.add_argument("--top", type=int, default=20, help="rows of each profiler table")
    parser.add_argument("--trace", default=None, help="write the profiled reply's Chrome trace here")
    parser.add_argument("--json", default=None, help="also write the timings to this file")
    parser.add_argument("--serving-prompt", action="store_true",
                        help="the serving benchmark's prompt (the processor's CPU tensors) instead of device tensors")
    parser.add_argument("--syncs", action="store_true", help="count one reply's host syncs by source line (CUDA)")
    args = parser.parse_args(argv)
    seconds = args.input_seconds or (2.0 if args.tiny else 10.0)
    bench_args = benchmark.parse_args(["--device", args.device] + (["--tiny"] if args.tiny else []))
    model, _ = benchmark_chat.build_chat_model(bench_args)
    decoder, _ = benchmark_decoder.build_decoder(bench_args)
    if args.serving_prompt:
        inputs = serving_prompt_inputs(model, seconds)
    else:
        inputs = benchmark_chat.make_chat_inputs(model, 1, seconds, args.device)
    kwargs = {
        "speech_decoder": decoder,
        "speaker": benchmark_decoder.speaker_embedding(args.device)[0],
        "max_new_tokens": 12,
        "seed": 0,
        "eos_token_id": [],  # random weights would otherwise stop at a random step
    }
    report = {"device": args.device, "input_seconds": seconds, "warm_calls": []}
    for _ in range(args.warm_calls):
        ms, events = first_audio(model, inputs, kwargs, args.device)
        report["warm_calls"].append({"ttfa_ms": round(ms, 1), "events_ms": events})
        print(f"warm call: first audio {ms:.1f} ms (events at {events} ms)", flush=True)

    stages = StageTimes(args.device)
    stages.wrap(model, "embed_prompt", "embed_prompt")
    stages.wrap(loop, "prefill_forward", "prompt pass (eager)")
    stages.wrap(loop, "bucketed_prefill_forward", "prompt pass (bucketed)")
    stages.wrap(loop.SpeechRun, "prefill", "prefill")
    try:
        ms, events = first_audio(model, inputs, kwargs, args.device)
    finally:
        stages.restore()
    report["timed_call"] = {"ttfa_ms": round(ms, 1), "events_ms": events, "stages": stages.times}
    print(f"timed call: first audio {ms:.1f} ms (events at {events} ms)")
    for stage, calls in stages.times.items():
        print(f"  {stage}: " + ", ".join(f"host {host} ms, done {done} ms" for host, done in calls))

    if args.syncs and benchmark_common.is_cuda(args.device):
        syncs = host_syncs(lambda: first_audio(model, inputs, kwargs, args.device))
        report["host_syncs"] = dict(syncs)
        print(f"host syncs of one reply up to its first audio: {sum(syncs.values())}")
        for where, count in syncs.most_common(args.top):
            print(f"  {count:3d}  {where}")
    elif args.syncs:
        print("host syncs: counted on CUDA only")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if benchmark_common.is_cuda(args.device) else [])
    with profile(activities=activities) as profiler:
        ms, _ = first_audio(model, inputs, kwargs, args.device)
    print(f"profiled call: first audio {ms:.1f} ms (slower: profiled)")
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if benchmark_common.is_cuda(args.device):
        print(averages.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
    if args.trace:
        profiler.export_chrome_trace(args.trace)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

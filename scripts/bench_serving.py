#!/usr/bin/env python
"""Serving benchmark: the OpenAI-compatible server over one `SpeechEngine` in this process, its load from another.

    PYTHONPATH=$PWD/src python scripts/bench_serving.py --json serving.json     # full size, random weights, cuda
    python scripts/bench_serving.py --tiny --device cpu --conversations 3 --max-tokens 8   # smoke test

Builds the full-size chat model and CosyVoice3 decoder with random weights (`bench_serving_models.py`: the builders
of `scripts/benchmark_chat.py` and `benchmark_decoder.py`; the decoder with its CUDA defaults applied as a loaded one
gets them: bf16 estimator, fused q/k/v), a processor that gives the full-size token ids (the tiny processor files, ids
remapped: `FullSizeProcessor`), starts a `SpeechEngine` and the server (`serving_server_funaudiochat.create_app`) with
uvicorn in a thread on a free loopback port, warms up, and measures:

  a. idle server: one streamed request at a time (median of 3): time to first audio (TTFA) and the step time derived
     from its chunks, side by side with `model.generate_speech_stream` called directly on the same processor inputs
     (and `generate_speech`'s step time without vocoding); where the server's TTFA goes (the engine's timeline of
     each request: admitted, prefilled, first chunk's tokens ready, vocoding, audio ready, and the rest outside the engine: HTTP, processor, event
     delivery) and after how many decode results each path has its first audio;
  b. load: `scripts/loadgen.py` in a process of its own (N streamed conversations with Poisson arrivals;
     `--concurrency C`: C at a time; in this process its clients' work would take the GIL from the engine): TTFA
     p50 / p95, per-stream RTF p50 / p95, aggregate x real time (a closed load's also over the time every user was
     in flight, the seed-0 requests' audio included), errors; from `/metrics` the rows per decode step;
     and where the TTFA went, span by span of the engine's timelines (`ttfa_spans`: queue, prefill, decode steps to
     the first chunk's tokens, wait for the vocoder, the first chunk's vocoding), p50 / p95;
  c. memory: allocated GPU memory when idle before the load, when idle again after it, and the peak;
  d. correctness under load: two requests with the idle run's seed and prompt, sent during the load, must give the
     idle run's transcript and audio.

Every reply runs exactly `--max-tokens` steps (no end-of-text id: random weights would stop at random points). The
report (`--json PATH`, and `$OUT/bench_serving.json` when OUT is set) is rewritten after every phase; `--time-budget`
skips the phases that no longer fit (`--skip-idle`: the idle phase in any case), and a watchdog writes the report and
exits if a phase hangs past the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


PROCESS_START = time.perf_counter()
SCRIPT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPT_DIR))

import benchmark_common  # noqa: E402  (puts the repo's src/ on sys.path)
import loadgen  # noqa: E402  (scripts/loadgen.py)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from funaudiochat_hf.serving_openai_funaudiochat import (  # noqa: E402
    TranscriptMemory,
    parse_chat_request,
    pcm16,
    spoken_question_body,
    wav_bytes,
)
from funaudiochat_hf.serving_server_funaudiochat import _stream_options as server_stream_options  # noqa: E402
from funaudiochat_hf.tiny_model import synthetic_question  # noqa: E402

from bench_serving_models import build_models  # noqa: E402  (scripts/bench_serving_models.py)


IDLE_REPEATS = 3
SAMPLING_RATE = 24000  # the server's audio (pcm16 chunks)
DIVERGED_FRACTION = 0.05  # of full scale: an audio difference past rounding
WARMUP_CAP_SECONDS = 240.0  # no new warm-up request after this long (a first request may compile for a while)
WATCHDOG_GRACE_SECONDS = 30.0  # past the budget: write the report and exit (a hung phase)
ISSUE_TARGETS = {  # the serving issue's acceptance numbers (full size, one GPU)
    "rtf_p95": ("<=", 0.5),
    "aggregate_x_real_time": (">=", 250.0),
    "steady_aggregate_x_real_time": (">=", 250.0),  # a closed load with all its streams in flight
    "ttfa_p50_ms": ("<=", 150.0),
    "ttfa_p95_ms": ("<=", 300.0),
    "idle_ttfa_ratio": ("<=", 1.10),
    "idle_step_ratio": ("<=", 1.10),
    "memory_delta_mb": ("<=", 8.0),
    "errors": ("<=", 0),
    "requests_lost": ("<=", 0),
    "correct_under_load": ("==", True),
}


def log(message: str) -> None:
    print(f"[bench-serving {time.perf_counter() - PROCESS_START:6.1f} s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--tiny", action="store_true", help="the package's tiny offline model (as the CLI loads it): smoke test")
    add("--device", default=None, help="default: cuda if available, else cpu")
    add("--conversations", type=int, default=32, help="conversations of the load run (default: %(default)s)")
    add("--rate", type=float, default=8.0, help="their Poisson arrival rate per second (default: %(default)s)")
    add("--concurrency", type=int, default=None, help="a closed load of this many streams, each user sending its "
        "next conversation when its reply ended (loadgen's --concurrency, less the two seed-0 requests of the "
        "correctness check while they run; default: every conversation arrives on its own)")
    add("--max-tokens", type=int, default=100, help="reply length in LLM steps of 0.2 s (default: %(default)s)")
    add("--max-batch-size", type=int, default=16, help="engine slots (default: %(default)s)")
    add("--question-seconds", type=float, default=3.0, help="the synthetic spoken question (default: %(default)s)")
    add("--stream-options", type=server_stream_options, default=None, metavar="JSON",
        help="the engine's streaming decoder settings, as funaudiochat-serve --stream-options")  # fmt: skip
    add("--feature-window-seconds", type=int, default=None, help="the feature extractor's window (`chunk_length`; "
        "features are padded to it): default the tiny processor's 30 s; the official one's is likely 300 s")
    add("--time-budget", type=float, default=420.0, help="seconds; later phases are skipped (default: %(default)s)")
    add("--skip-idle", action="store_true", help="skip the idle phase (a) whatever the budget: the load alone, e.g. "
        "to compare engine variants; its correctness check then compares the load's seed-0 requests")
    add("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.rate <= 0 or args.max_tokens < 1 or args.max_batch_size < 1:
        parser.error("--conversations, --max-tokens and --max-batch-size must be >= 1 and --rate > 0")
    if args.question_seconds <= 0 or args.time_budget <= 0:
        parser.error("--question-seconds and --time-budget must be positive")
    if args.concurrency is not None and not 1 <= args.concurrency <= args.conversations:
        parser.error("--concurrency must be between 1 and --conversations")
    if args.feature_window_seconds is not None and args.feature_window_seconds < args.question_seconds:
        parser.error("--feature-window-seconds must hold the question (--question-seconds)")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if benchmark_common.is_cuda(args.device) and not torch.cuda.is_available():
        parser.error("CUDA is not available: use --device cpu (with --tiny)")
    return args


# -- models -----------------------------------------------------------------------------------------------------------


def start_engine(model, decoder, processor, args):
    """A `SpeechEngine` as `serving_server_funaudiochat.build_engine` starts one (its CLI defaults), except that
    replies never stop before `--max-tokens`."""
    from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine
    from funaudiochat_hf.serving_server_funaudiochat import _parser as server_parser

    defaults = server_parser().parse_args([])
    return SpeechEngine(
        model,
        tokenizer=processor.tokenizer,
        speech_decoder=decoder,
        max_batch_size=args.max_batch_size,
        max_queue=max(defaults.max_queue, args.conversations + 2),
        max_prompt_tokens=defaults.max_prompt_tokens,
        max_new_tokens=args.max_tokens,
        generation_options={"eos_token_id": []},
        backend=defaults.backend,
        stream_options=args.stream_options,
    )


class BackgroundServer:
    """uvicorn serving `app` on a free loopback port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="bench-serving-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.perf_counter() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self) -> dict[str, float]:
        import httpx

        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


# -- requests ---------------------------------------------------------------------------------------------------------


def chat_body(question_wav: bytes, max_tokens: int, seed: int) -> dict:
    """A streamed chat-completions request as `loadgen` sends it (plus the usage chunk)."""
    body = spoken_question_body(question_wav, "bench", max_tokens, seed)
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream_request(client, url: str, body: dict) -> dict:
    """One streamed request: when it was sent (perf_counter), its audio chunks' arrival times (seconds after sending)
    and sample counts, transcript, 16-bit audio, finish reason and usage."""
    sent = time.perf_counter()
    times, samples, audio, transcript = [], [], [], []
    finish, usage = None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
                delta = (choice.get("delta") or {}).get("audio") or {}
                transcript.append(delta.get("transcript") or "")
                data = base64.b64decode(delta.get("data") or "")
                if data:
                    times.append(time.perf_counter() - sent)
                    samples.append(len(data) // 2)
                    audio.append(data)
    return {"sent": sent, "times": times, "samples": samples, "transcript": "".join(transcript),
            "pcm": b"".join(audio), "finish_reason": finish, "usage": usage}  # fmt: skip


def step_seconds(times: list[float], samples: list[int], samples_per_step: float) -> float | None:
    """Seconds per LLM step from a stream's audio chunks: after the first chunk every chunk but the last is one
    steady decoder hop whose samples count the steps since the previous one (the last also flushes the look-ahead)."""
    if len(times) < 3:
        return None
    steps = sum(samples[1:-1]) / samples_per_step
    return (times[-2] - times[0]) / steps if steps > 0 else None


def direct_stream(model, decoder, inputs: dict, max_tokens: int, tokenizer, device: str) -> dict:
    """The same prompt through `model.generate_speech_stream` (seed 0, no stop id), timed as the server stream."""
    benchmark_common.synchronize(device)
    start = time.perf_counter()
    times, samples, audio, text, events, event_times, first_audio_event = [], [], [], [], 0, [], None
    speech_ids = []
    with torch.no_grad():
        for event in model.generate_speech_stream(**inputs, speech_decoder=decoder, tokenizer=tokenizer,
                                                  max_new_tokens=max_tokens, eos_token_id=[], seed=0):  # fmt: skip
            benchmark_common.synchronize(device)
            now = time.perf_counter() - start
            events += 1
            event_times.append(now)
            text.append(event.text)
            speech_ids += event.speech_ids.tolist()
            if event.audio is not None and event.audio.numel():
                if first_audio_event is None:
                    first_audio_event = events
                times.append(now)
                samples.append(event.audio.numel())
                audio.append(pcm16(event.audio.numpy()))
    # Every event is one LLM step: the exact step time, for comparison with the chunk-derived one.
    exact = (event_times[-1] - event_times[0]) / (events - 1) if events > 1 else None
    return {"times": times, "samples": samples, "transcript": "".join(text), "pcm": b"".join(audio),
            "steps": events, "exact_step_s": exact, "first_audio_event": first_audio_event, "speech_ids": speech_ids,
            "prefilled_s": event_times[0] if event_times else None}  # fmt: skip


def decode_step_seconds(model, inputs: dict, max_tokens: int, device: str) -> float | None:
    """`generate_speech`'s own step time, without vocoding: the slope between replies of `max_tokens` and a quarter
    of that (prefill and per-call costs cancel), on the default generator that the direct streams use (the longer
    reply first: the shorter one then reuses its workspace and graphs)."""
    short = max_tokens // 4
    if short < 1:
        return None
    seconds = {}
    for steps in (max_tokens, short):
        benchmark_common.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate_speech(**inputs, max_new_tokens=steps, return_audio=False, eos_token_id=[], seed=0)
        benchmark_common.synchronize(device)
        seconds[steps] = time.perf_counter() - start
    return (seconds[max_tokens] - seconds[short]) / (max_tokens - short)


def compare_audio(reference: dict, other: dict) -> dict:
    """Whether `other` is `reference`'s reply: transcript, sample count, identical 16-bit audio (else its SNR)."""
    a = np.frombuffer(reference["pcm"], dtype="<i2").astype(np.float64)
    b = np.frombuffer(other["pcm"], dtype="<i2").astype(np.float64)
    same_length = len(a) == len(b)
    identical = same_length and reference["pcm"] == other["pcm"]
    snr = diverged = None
    if same_length and not identical:
        noise = float(((a - b) ** 2).sum())
        snr = float(10 * np.log10(max(float((a**2).sum()), 1e-30) / max(noise, 1e-30)))
    if not identical:
        # Rounding differences stay small everywhere; a token that went the other way changes the audio from its
        # chunk on (and a different reply from its start): the first sample of the common length off by more than
        # DIVERGED_FRACTION of full scale says which, and where (the end of the shorter one if none is).
        common = min(len(a), len(b))
        off = np.flatnonzero(np.abs(a[:common] - b[:common]) > DIVERGED_FRACTION * 32768)
        if len(off) or not same_length:
            diverged = float(off[0] if len(off) else common) / SAMPLING_RATE
    return {
        "samples": [len(a), len(b)],
        "same_transcript": reference["transcript"] == other["transcript"],
        "audio_identical": identical,
        "audio_snr_db": snr,
        "diverged_at_seconds": diverged,
        "match": same_length and reference["transcript"] == other["transcript"] and (identical or snr >= 30.0),
    }


def compare_ids(served: list[list[int]], direct: list[list[int]]) -> dict:
    """The speech ids of the idle phase's served and direct replies: their counts, and the first position where each
    reply differs from the first direct one (None: equal)."""

    def first_difference(ids: list[int], reference: list[int]) -> int | None:
        common = min(len(ids), len(reference))
        return next((i for i in range(common) if ids[i] != reference[i]), None if len(ids) == len(reference) else common)

    reference = direct[0] if direct else []
    return {
        "counts": {"server": [len(ids) for ids in served], "direct": [len(ids) for ids in direct]},
        "first_difference": {"server": [first_difference(ids, reference) for ids in served],
                             "direct": [first_difference(ids, reference) for ids in direct]},
    }  # fmt: skip


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# -- the run ----------------------------------------------------------------------------------------------------------


class Run:
    """The report being built, its budget, and where it is written."""

    def __init__(self, args):
        self.args = args
        self.started = time.perf_counter()
        self.paths = [Path(args.json)] if args.json else []
        if os.environ.get("OUT"):
            self.paths.append(Path(os.environ["OUT"]) / "bench_serving.json")
        self.report: dict = {"meta": {
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if benchmark_common.is_cuda(args.device) else None,
            "torch": torch.__version__, "tiny": args.tiny, "command": " ".join(sys.argv),
            "options": {k: v for k, v in vars(args).items()},
        }, "skipped": [], "status": "running"}  # fmt: skip
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def left(self) -> float:
        return self.args.time_budget - (time.perf_counter() - self.started)

    def fits(self, phase: str, seconds: float) -> bool:
        if self.left() >= seconds:
            return True
        log(f"skipping {phase}: {self.left():.0f} s of the time budget left, it needs about {seconds:.0f} s")
        self.report["skipped"].append(phase)
        return False

    def save(self) -> None:
        with self.lock:
            self.report["elapsed_s"] = round(time.perf_counter() - self.started, 1)
            text = json.dumps(self.report, indent=1, default=str) + "\n"
            for path in self.paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)

    def start_watchdog(self) -> None:
        def watch():
            if self.finished.wait(self.args.time_budget + WATCHDOG_GRACE_SECONDS):
                return
            if "targets" in self.report:  # measured and written: only the teardown hangs
                log("watchdog: the server's teardown hangs; exiting (the report is written)")
                os._exit(0 if self.report["status"] == "ok" else 1)
            log("watchdog: a phase hung past the time budget; writing the report and exiting")
            self.report["status"] = "watchdog: hung past the time budget"
            self.report["targets"] = targets(self.report)
            self.save()
            os._exit(3)

        threading.Thread(target=watch, name="bench-serving-watchdog", daemon=True).start()


def memory_mb(device: str) -> float | None:
    if not benchmark_common.is_cuda(device):
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / 2**20


def memory_report(device: str, after_warmup_mb: float | None, idle_mb: float | None) -> dict:
    """(c) allocated memory after the warm-up, idle before the load, idle again after it, and the load's peak."""
    if idle_mb is None:
        return {"note": "n/a (not on CUDA)"}
    after_mb = memory_mb(device)
    row = {
        "after_warmup_mb": round(after_warmup_mb, 1),
        "idle_mb": round(idle_mb, 1),
        "after_load_mb": round(after_mb, 1),
        "delta_mb": round(after_mb - idle_mb, 1),
        "peak_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
    }
    log(f"memory: idle {row['idle_mb']:.0f} MiB, after the load {row['after_load_mb']:.0f} MiB "
        f"({row['delta_mb']:+.1f}), peak during the load {row['peak_mb']:.0f} MiB")  # fmt: skip
    return row


def wait_idle(engine, seconds: float = 60.0) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        snapshot = engine.snapshot()
        if snapshot["running"] == 0 and snapshot["queued"] == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("the engine did not become idle")


def warm_up(run: Run, server, engine, model, decoder, processor, inputs, question: bytes) -> None:
    """Sequential and concurrent full-length requests, then one direct stream and `generate_speech` call of each
    length: the prefill shapes, decode graphs and the streaming decoder's graphs get compiled / recorded before
    anything is timed (no new call after `WARMUP_CAP_SECONDS`)."""
    import httpx

    args = run.args
    log("warming up (the first requests compile kernels and record CUDA graphs) ...")
    start = time.perf_counter()
    cap = min(WARMUP_CAP_SECONDS, max(0.0, run.left() - 60))
    body = chat_body(question, args.max_tokens, seed=0)
    count = 0

    async def requests():
        nonlocal count
        async with httpx.AsyncClient(timeout=max(60.0, run.left())) as client:
            await stream_request(client, server.url, body)
            count += 1
            burst = min(4, args.max_batch_size)
            if time.perf_counter() - start < cap:
                await asyncio.gather(*(stream_request(client, server.url, {**body, "seed": 100 + i})
                                       for i in range(burst)))  # fmt: skip
                count += burst

    asyncio.run(requests())
    wait_idle(engine)
    if time.perf_counter() - start < cap:
        direct_stream(model, decoder, inputs, args.max_tokens, processor.tokenizer, args.device)
        decode_step_seconds(model, inputs, args.max_tokens, args.device)
        count += 3
    seconds = time.perf_counter() - start
    run.report["warmup"] = {"calls": count, "seconds": round(seconds, 1)}
    log(f"warm-up: {count} calls in {seconds:.1f} s")


def measure_idle(run: Run, server, engine, model, decoder, processor, inputs, question: bytes,
                 samples_per_step: float):  # fmt: skip
    """(a) one request at a time through the server and directly, alternating; medians."""
    import httpx

    args = run.args
    body = chat_body(question, args.max_tokens, seed=0)
    served, direct, processing, decode, handles = [], [], [], [], []

    async def one():
        async with httpx.AsyncClient(timeout=max(60.0, run.left())) as client:
            return await stream_request(client, server.url, body)

    for _ in range(IDLE_REPEATS):
        with kept_handles(engine) as kept:  # the server's requests' handles: their engine timelines
            served.append(asyncio.run(one()))
        handles.extend(kept)
        direct.append(direct_stream(model, decoder, inputs, args.max_tokens, processor.tokenizer, args.device))
        decode.append(decode_step_seconds(model, inputs, args.max_tokens, args.device))
        started = time.perf_counter()
        parse_chat_request(body, processor, TranscriptMemory(), [], "bench", getattr(model, "dtype", None))
        processing.append(time.perf_counter() - started)

    def summary(streams):
        ttfa = [1000 * s["times"][0] if s["times"] else None for s in streams]
        step = [step_seconds(s["times"], s["samples"], samples_per_step) for s in streams]
        return {"ttfa_ms": ttfa, "ttfa_ms_median": median(ttfa), "step_ms": [None if v is None else 1000 * v
                for v in step], "step_ms_median": None if median(step) is None else 1000 * median(step)}  # fmt: skip

    row = {"repeats": IDLE_REPEATS, "server": summary(served), "direct": summary(direct)}
    exact = median([d["exact_step_s"] for d in direct])
    row["direct"]["exact_step_ms_median"] = None if exact is None else 1000 * exact
    # The decode step alone (`generate_speech`, no audio): the streams' step times above include their vocoding.
    decode_step = median(decode)
    row["generate_speech_step_ms_median"] = None if decode_step is None else 1000 * decode_step
    row["processor_ms_median"] = 1000 * median(processing)
    for name in ("ttfa", "step"):
        a, b = row["server"][f"{name}_ms_median"], row["direct"][f"{name}_ms_median"]
        row[f"{name}_ratio"] = a / b if a is not None and b else None
    if row["ttfa_ratio"] is not None:  # the server's TTFA also holds the processor (audio decoding, features)
        served_ttfa, direct_ttfa = row["server"]["ttfa_ms_median"], row["direct"]["ttfa_ms_median"]
        row["ttfa_ratio_without_processor"] = (served_ttfa - row["processor_ms_median"]) / direct_ttfa
    row["server_stages"] = server_stages(served, handles)
    row["direct_stages"] = {"prefilled": median([1000 * d["prefilled_s"] for d in direct if d["prefilled_s"]]),
                            "first_audio": row["direct"]["ttfa_ms_median"]}  # fmt: skip
    row["first_audio_after_results"] = {
        "server": [handle.first_audio_steps for handle in handles],
        "direct": [d["first_audio_event"] for d in direct],
    }
    row["server_repeats_identical"] = all(compare_audio(served[0], s)["audio_identical"] for s in served[1:])
    # Informative: the direct stream decodes at batch 1, the server in its static batch, whose kernels may round
    # differently (the load check compares server replies with each other).
    row["direct_vs_server"] = compare_audio(served[0], direct[0])
    # The raw speech ids (before the vocoder): which of the two differ when the audio does.
    row["speech_ids"] = compare_ids([handle.speech_ids for handle in handles], [d["speech_ids"] for d in direct])
    run.report["idle"] = row
    s, d = row["server"], row["direct"]
    stages = row["server_stages"]
    log("idle: the server's TTFA, stage by stage (medians, ms after submission): " + ", ".join(
        f"{stage} {fmt(ms)}" for stage, ms in stages.items()) + "; direct: " + ", ".join(
        f"{stage} {fmt(ms)}" for stage, ms in row["direct_stages"].items()) + "; first audio after "
        f"{row['first_audio_after_results']} decode results")  # fmt: skip
    log(f"idle: TTFA server {fmt(s['ttfa_ms_median'])} ms vs direct {fmt(d['ttfa_ms_median'])} ms "
        f"(x{fmt(row['ttfa_ratio'], 3)}; processor {fmt(row['processor_ms_median'])} ms of the server's, without it "
        f"x{fmt(row.get('ttfa_ratio_without_processor'), 3)}); step "
        f"{fmt(s['step_ms_median'], 2)} vs {fmt(d['step_ms_median'], 2)} ms (x{fmt(row['step_ratio'], 3)}; direct "
        f"per event {fmt(row['direct']['exact_step_ms_median'], 2)} ms; generate_speech without audio "
        f"{fmt(row['generate_speech_step_ms_median'], 2)} ms)")  # fmt: skip
    log(f"idle: speech ids {json.dumps(row['speech_ids'])}; audio samples, server: {[len(x['pcm']) // 2 for x in served]}, "
        f"direct: {[len(x['pcm']) // 2 for x in direct]}")  # fmt: skip
    return served[0]


def server_stages(served: list[dict], handles: list) -> dict:
    """Medians (ms) of where the idle server's time to first audio went: the engine's timeline of each request
    (`RequestHandle.timeline`, ms after its submission) and what lies outside the engine (the client's TTFA minus the
    engine's: HTTP, body parsing, the processor, event delivery)."""
    stages: dict[str, list] = {}
    for handle in handles:
        for stage, seconds in handle.timeline.items():
            stages.setdefault(stage, []).append(1000 * seconds)
    medians = {stage: median(values) for stage, values in stages.items()}
    outside = [1000 * (s["times"][0] - h.first_audio) for s, h in zip(served, handles)
               if s["times"] and h.first_audio is not None]  # fmt: skip
    medians["outside_engine"] = median(outside)
    return medians


# The engine's timeline of a request (`RequestHandle.timeline`) as the spans between its stages: waiting for a slot,
# its prefill, the decode steps until its first chunk's tokens are out, the wait for the vocoder, its first chunk;
# and all of them (submission to first audio: the client's time to first audio less it is spent outside the engine).
TTFA_SPANS = {"queue": (None, "admitted"), "prefill": ("admitted", "prefilled"), "decode": ("prefilled", "ready"),
              "vocoder_wait": ("ready", "vocoding"), "vocode": ("vocoding", "first_audio"),
              "in_engine": (None, "first_audio")}  # fmt: skip


def ttfa_spans(handles: list) -> dict:
    """{span: {"p50_ms", "p95_ms"}} of `TTFA_SPANS` over the requests that reached their first audio: where the time
    to first audio of a load went (which stage to shorten)."""
    spans: dict[str, list] = {name: [] for name in TTFA_SPANS}
    for handle in handles:
        timeline = handle.timeline
        if "first_audio" not in timeline:
            continue
        for name, (start, end) in TTFA_SPANS.items():
            if end in timeline and (start is None or start in timeline):
                spans[name].append(1000 * (timeline[end] - (timeline[start] if start else 0.0)))
    return {name: {"p50_ms": loadgen.percentile(values, 50), "p95_ms": loadgen.percentile(values, 95)}
            for name, values in spans.items()}  # fmt: skip


@contextlib.contextmanager
def kept_handles(engine):
    """The handles of the requests the server submits to `engine` meanwhile (their engine timelines), in a list."""
    handles, submit = [], engine.submit

    def submit_and_keep(*submit_args, **kwargs):
        handles.append(submit(*submit_args, **kwargs))
        return handles[-1]

    engine.submit = submit_and_keep
    try:
        yield handles
    finally:
        del engine.submit


async def loadgen_process(loadgen_args: list[str]) -> dict:
    """`scripts/loadgen.py` with `loadgen_args` in a process of its own (clients are not in the server's process:
    in this one their work would take the interpreter lock from the engine's threads); its JSON report."""
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "loadgen.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT_DIR / "loadgen.py"), *loadgen_args, "--json", str(report_path)
        )
        try:
            await process.wait()
        except BaseException:  # a timeout or an interrupt: no orphaned load
            process.kill()
            raise
        if not report_path.exists():
            raise RuntimeError(f"scripts/loadgen.py exited with {process.returncode} and wrote no report")
        return json.loads(report_path.read_text())


def measure_load(run: Run, server, engine, question_path: str, question: bytes, reference: dict | None):
    """(b) loadgen's run with /metrics before and after, and where its time to first audio went (`ttfa_spans`);
    (d) two seed-0 requests sent during it."""
    import httpx

    args = run.args
    shares = (0.25, 0.5)  # when the two seed-0 requests are sent, as shares of the arrival time
    # A closed load's streams include the two seed-0 requests while they run: never more than --concurrency in flight.
    users = max(1, args.concurrency - len(shares)) if args.concurrency else None
    loadgen_args = [
        "--url", server.url, "--conversations", str(args.conversations), "--rate", str(args.rate),
        "--max-tokens", str(args.max_tokens), "--audio", question_path, "--timeout", str(max(30.0, run.left())),
    ] + (["--concurrency", str(users)] if users else [])  # fmt: skip
    before = server.metrics()
    body = chat_body(question, args.max_tokens, seed=0)
    # Expected seconds over which the load's requests (closed load: its users) arrive.
    arrivals = (users or args.conversations) / args.rate

    async def probe(delay):
        await asyncio.sleep(delay)
        async with httpx.AsyncClient(timeout=max(60.0, run.left())) as client:
            return await stream_request(client, server.url, body)

    async def load():
        probes = [asyncio.create_task(probe(arrivals * share)) for share in shares]
        report = await asyncio.wait_for(loadgen_process(loadgen_args), timeout=max(10.0, run.left() - 10))
        return report, await asyncio.gather(*probes, return_exceptions=True)

    with kept_handles(engine) as handles:
        report, probes = asyncio.run(load())
    wait_idle(engine)
    after = server.metrics()

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    rows_sum, rows_count = delta("funaudiochat_decode_step_rows_sum"), delta("funaudiochat_decode_step_rows_count")
    outcomes = {k: int(delta(f'funaudiochat_requests_total{{outcome="{k}"}}'))
                for k in ("stop", "length", "cancelled", "error", "rejected")}  # fmt: skip
    sent = args.conversations + len(probes)
    report.update(
        decode_steps=int(delta("funaudiochat_decode_steps_total")),
        step_rows_mean=rows_sum / rows_count if rows_count else None,
        requests_by_outcome=outcomes,
        requests_sent=sent,
        requests_lost=sent - outcomes["stop"] - outcomes["length"],
        ttfa_spans=ttfa_spans(handles),
    )
    if report.get("steady_window"):  # the seed-0 requests' audio counts too: they are streams of the closed load
        start, end = report["steady_window"]
        streams = [[(p["sent"] + t, n / SAMPLING_RATE) for t, n in zip(p["times"], p["samples"])]
                   for p in probes if not isinstance(p, BaseException)]  # fmt: skip
        report["steady_audio_seconds"] += loadgen.audio_between(streams, start, end)
        report["steady_aggregate_x_real_time"] = report["steady_audio_seconds"] / (end - start)
    run.report["load"] = report
    closed = f" ({users} users, + {len(shares)} seed-0 requests at first)" if users else ""
    steady = "" if not report.get("steady_window") else (
        f" (steady {fmt(report['steady_aggregate_x_real_time'])}x over the "
        f"{report['steady_window'][1] - report['steady_window'][0]:.1f} s with every user in flight)"
    )
    log(f"load: {args.conversations} conversations at {args.rate}/s{closed} in {report['wall_seconds']:.1f} s: errors "
        f"{report['errors']}; TTFA p50 {fmt(report['ttfa_p50_ms'])} ms, p95 {fmt(report['ttfa_p95_ms'])} ms; RTF p50 "
        f"{fmt(report['rtf_p50'], 3)}, p95 {fmt(report['rtf_p95'], 3)}; playback stall p50 / p95 "
        f"{fmt(report['stall_p50_ms'])} / {fmt(report['stall_p95_ms'])} ms ({report['streams_stalled']} streams "
        "stalled); aggregate "
        f"{fmt(report['aggregate_x_real_time'])}x real time{steady}; {report['decode_steps']} decode steps of "
        f"{fmt(report['step_rows_mean'], 2)} rows on average; outcomes {outcomes}")  # fmt: skip
    log("load: where the time to first audio went (p50 / p95 ms): " + ", ".join(
        f"{name} {fmt(span['p50_ms'])} / {fmt(span['p95_ms'])}" for name, span in report["ttfa_spans"].items()))
    if report["error_examples"]:
        log("load errors: " + " | ".join(report["error_examples"]))

    against = "the idle reply"
    if reference is None:  # the idle phase was skipped: the two requests against each other
        reference, probes, against = probes[0], probes[1:], "the first seed-0 request of the load"
    checks = []
    for result in probes:
        if isinstance(result, BaseException) or isinstance(reference, BaseException):
            failed = result if isinstance(result, BaseException) else reference
            checks.append({"match": False, "error": f"{type(failed).__name__}: {failed}"})
        else:
            checks.append(compare_audio(reference, result))
    correct = all(c["match"] for c in checks)
    run.report["correctness"] = {"against": against, "requests": checks, "correct_under_load": correct}
    shown = [{k: c.get(k) for k in ("samples", "audio_identical", "audio_snr_db", "diverged_at_seconds", "error")}
             for c in checks]
    log(f"correctness under load: {len(checks)} seed-0 request(s) {'match' if correct else 'do NOT match'} "
        f"{against}: {json.dumps(shown)}")


def fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def targets(report: dict) -> dict:
    """The issue's numbers against its targets (None where not measured)."""
    load, idle, memory = report.get("load", {}), report.get("idle", {}), report.get("memory", {})
    values = {
        "rtf_p95": load.get("rtf_p95"),
        "aggregate_x_real_time": load.get("aggregate_x_real_time"),
        "steady_aggregate_x_real_time": load.get("steady_aggregate_x_real_time"),
        "ttfa_p50_ms": load.get("ttfa_p50_ms"),
        "ttfa_p95_ms": load.get("ttfa_p95_ms"),
        "idle_ttfa_ratio": idle.get("ttfa_ratio"),
        "idle_step_ratio": idle.get("step_ratio"),
        "memory_delta_mb": memory.get("delta_mb"),
        "errors": load.get("errors"),
        "requests_lost": load.get("requests_lost"),
        "correct_under_load": report.get("correctness", {}).get("correct_under_load"),
    }
    checks = {}
    for name, (op, limit) in ISSUE_TARGETS.items():
        value = values[name]
        ok = None
        if value is not None:
            ok = value <= limit if op == "<=" else value >= limit if op == ">=" else value == limit
        checks[name] = {"value": value, "target": f"{op} {limit}", "pass": ok}
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        from funaudiochat_hf.serving_server_funaudiochat import create_app
    except ImportError as error:
        print(f"error: the serving benchmark needs fastapi, uvicorn and httpx ({error})", file=sys.stderr)
        return 1
    run = Run(args)
    run.start_watchdog()
    engine = server = None
    question_file = tempfile.NamedTemporaryFile(suffix=".wav", delete=False)
    try:
        torch.manual_seed(0)
        log(f"building the {'tiny' if args.tiny else 'full-size random-weight'} model on {args.device} ...")
        started = time.perf_counter()
        model, decoder, processor, info = build_models(args, log)
        run.report["models"] = {**info, "build_s": round(time.perf_counter() - started, 1)}
        log(f"models ready in {run.report['models']['build_s']} s (decoder estimator "
            f"{info['decoder_estimator_dtype']}, q/k/v fused {info['decoder_qkv_fused']}); starting the engine "
            f"({args.max_batch_size} slots) ...")  # fmt: skip
        started = time.perf_counter()
        engine = start_engine(model, decoder, processor, args)
        server = BackgroundServer(create_app(engine, processor, "bench"))
        run.report["engine_start_s"] = round(time.perf_counter() - started, 1)
        log(f"engine and server up in {run.report['engine_start_s']} s at {server.url}")
        run.save()

        question = wav_bytes(synthetic_question(args.question_seconds), 16000)
        question_file.write(question)
        question_file.close()
        chat = parse_chat_request(chat_body(question, args.max_tokens, 0), processor, TranscriptMemory(), [], "bench",
                                  getattr(model, "dtype", None))  # fmt: skip
        inputs = chat.speech.inputs  # what the server hands the engine for this prompt (CPU tensors)
        run.report["prompt_tokens"] = int(inputs["input_ids"].shape[1])
        group = int(model.config.audio_config.group_size)
        samples_per_step = engine.sampling_rate * group / benchmark_common.TOKENS_PER_SECOND
        run.report["reply_seconds"] = args.max_tokens * group / benchmark_common.TOKENS_PER_SECOND

        warm_up(run, server, engine, model, decoder, processor, inputs, question)
        warm_mb = memory_mb(args.device)
        run.save()

        reference = None
        if args.skip_idle:
            run.report["skipped"].append("idle")
        elif run.fits("idle", 100):  # leaves the load its time
            reference = measure_idle(run, server, engine, model, decoder, processor, inputs, question,
                                     samples_per_step)
            run.save()
        if run.fits("load", 60):
            idle_mb = memory_mb(args.device)  # everything warm, nothing running
            if benchmark_common.is_cuda(args.device):
                torch.cuda.reset_peak_memory_stats(args.device)
            measure_load(run, server, engine, question_file.name, question, reference)
            run.report["memory"] = memory_report(args.device, warm_mb, idle_mb)
        run.report["status"] = "ok"
    except Exception as error:
        run.report["status"] = f"failed: {type(error).__name__}: {error}"
        log(run.report["status"])
        import traceback

        traceback.print_exc()
    finally:
        run.report["targets"] = targets(run.report)
        run.save()  # before the teardown (the watchdog still guards it)
        if server is not None:
            server.close()
        if engine is not None:
            engine.close()
        question_file.close()
        os.unlink(question_file.name)
        run.finished.set()
    if args.tiny:
        print("(tiny model: the targets are the issue's, for the full size on a GPU; shown for the format only)")
    for name, check in run.report["targets"].items():
        verdict = "n/a" if check["pass"] is None else "PASS" if check["pass"] else "FAIL"
        value = check["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name:24s} {shown:>12s}  target {check['target']:10s} {verdict}")
    print(json.dumps({k: run.report[k] for k in ("status", "elapsed_s")}), flush=True)
    return 0 if run.report["status"] == "ok" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # As scripts/benchmark.py: no interpreter teardown (compile workers or graphs can hang it); the report is written.
    os._exit(code)

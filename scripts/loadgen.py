"""Load generator for `funaudiochat-serve`: N streamed conversations with Poisson arrivals.

    python scripts/loadgen.py --url http://127.0.0.1:8000 --conversations 64 --rate 4 --max-tokens 100
    python scripts/loadgen.py --concurrency 16 --conversations 64 --rate 8   # 16 users, each back to back
    python scripts/loadgen.py --url http://lb:8080 --api-key $KEY --audio question.wav --json result.json

Each conversation sends one spoken question (`--audio`, default a synthetic 3-s clip) to `/v1/chat/completions` with
`stream=true` and reads the server-sent events. Arrivals are a Poisson process of `--rate` conversations per second
(exponential gaps, seeded by `--seed`): an open load, whose offered rate (rate x reply length) caps the aggregate.
With `--concurrency C`, C users arrive that way and each sends its next conversation as soon as its previous reply
ended, until `--conversations` were sent: C streams at all times, each new one arriving as another leaves (a closed
load: what the server sustains at that concurrency). Reported:

- time to first audio (TTFA): request sent -> first non-empty audio chunk, p50 / p95;
- per-stream real-time factor (RTF): the stream's wall time (sent -> last chunk) / its seconds of audio, p50 / p95
  (below 1: faster than real time);
- playback stall: how long a player that starts at the first chunk and plays in real time would wait for audio
  over the whole reply (chunks that come later than their audio is due), p50 / p95, and how many streams stalled;
- aggregate x real time: all the audio generated / the run's wall time; for a closed load also the steady
  aggregate: the audio that arrived while all C users were in flight (from the last user's first request to the
  last conversation's) / that window, without the ramp-up and the tail of the run;
- errors (HTTP errors, error events, streams without audio).

Needs `httpx` (the `dev` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class StreamResult:
    ok: bool
    error: str | None = None
    ttfa: float | None = None  # seconds
    wall: float = 0.0  # seconds, request sent -> last event
    audio_seconds: float = 0.0
    stall: float = 0.0  # seconds a real-time player would wait for audio after the first chunk
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival perf_counter, seconds of audio)


def playback_stall(chunks: list[tuple[float, float]]) -> float:
    """Seconds a player would wait for audio: it starts playing the first chunk when it arrives and plays in real time,
    pausing whenever the next chunk has not come when the audio before it ran out. `chunks`: (arrival time, seconds
    of audio) in order of arrival."""
    if not chunks:
        return 0.0
    start, played, stalled = chunks[0][0], 0.0, 0.0
    for arrival, seconds in chunks:
        due = start + played + stalled  # when the audio before this chunk has been played
        stalled += max(0.0, arrival - due)
        played += seconds
    return stalled


def audio_between(streams: list[list[tuple[float, float]]], start: float, end: float) -> float:
    """Seconds of audio that arrived in `[start, end]`: `streams` holds each stream's (arrival time, seconds of audio)
    chunks."""
    return sum(seconds for chunks in streams for arrival, seconds in chunks if start <= arrival <= end)


def _question_wav(path: str | None) -> bytes:
    if path is not None:
        return Path(path).read_bytes()
    import numpy as np

    from funaudiochat_hf.tiny_model import synthetic_question

    samples = (np.clip(synthetic_question(3.0), -1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(16000)
        writer.writeframes(samples.tobytes())
    return buffer.getvalue()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def _one(client, url: str, body: dict, headers: dict, sampling_rate: int) -> StreamResult:
    sent = time.perf_counter()
    result = StreamResult(ok=False)
    samples, chunks = 0, []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return StreamResult(ok=False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    return StreamResult(ok=False, error=str(event["error"].get("message")))
                for choice in event.get("choices", []):
                    audio = (choice.get("delta") or {}).get("audio") or {}
                    if audio.get("data"):
                        count = len(base64.b64decode(audio["data"])) // 2
                        if count:
                            chunks.append((time.perf_counter(), count / sampling_rate))
                        samples += count
    except Exception as error:  # a load test reports failures, it does not stop at the first
        return StreamResult(ok=False, error=f"{type(error).__name__}: {error}")
    result.wall = time.perf_counter() - sent
    result.audio_seconds = samples / sampling_rate
    result.ttfa = chunks[0][0] - sent if chunks else None
    result.stall = playback_stall(chunks)
    result.chunks = chunks
    result.ok = samples > 0
    if not result.ok:
        result.error = "no audio"
    return result


async def run(args) -> dict:
    import httpx

    question = base64.b64encode(_question_wav(args.audio)).decode()
    body = {
        "model": args.model,
        "modalities": ["text", "audio"],
        "audio": {"voice": args.voice, "format": "pcm16"},
        "stream": True,
        "max_completion_tokens": args.max_tokens,
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": question, "format": "wav"}}]}],
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/v1/chat/completions"
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.conversations, max_keepalive_connections=args.conversations)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        started = time.perf_counter()
        results: list[StreamResult | None] = [None] * args.conversations
        numbers = iter(range(args.conversations))  # shared by the users: each conversation is sent once
        first_sent, last_sent = [], 0.0  # each user's first request; the last conversation's

        async def user(delay: float) -> None:
            nonlocal last_sent
            await asyncio.sleep(delay)
            first_sent.append(time.perf_counter())
            for i in numbers if args.concurrency else [next(numbers)]:
                last_sent = time.perf_counter()
                results[i] = await _one(client, url, {**body, "seed": i}, headers, args.sampling_rate)

        delays = [0.0]
        for _ in range((args.concurrency or args.conversations) - 1):
            delays.append(delays[-1] + rng.expovariate(args.rate))
        await asyncio.gather(*(user(delay) for delay in delays))
        wall = time.perf_counter() - started
    good = [r for r in results if r.ok]
    # A closed load runs C streams at all times between its last user's arrival and its last conversation's start
    # (perf_counter seconds: the system's monotonic clock, comparable with other processes' on this host).
    closed = args.concurrency and args.conversations > args.concurrency  # else no user sends a second conversation
    window = (max(first_sent), last_sent) if closed and last_sent > max(first_sent) else None
    steady_audio = None if window is None else audio_between([r.chunks for r in good], *window)
    ttfa = [r.ttfa for r in good if r.ttfa is not None]
    rtf = [r.wall / r.audio_seconds for r in good if r.audio_seconds > 0]
    audio = sum(r.audio_seconds for r in good)
    stalls = [r.stall for r in good]
    return {
        "conversations": args.conversations,
        "rate_per_second": args.rate,
        "concurrency": args.concurrency,
        "wall_seconds": wall,
        "errors": len(results) - len(good),
        "error_examples": sorted({r.error for r in results if r.error})[:5],
        "ttfa_p50_ms": None if not ttfa else 1000 * percentile(ttfa, 50),
        "ttfa_p95_ms": None if not ttfa else 1000 * percentile(ttfa, 95),
        "rtf_p50": percentile(rtf, 50),
        "rtf_p95": percentile(rtf, 95),
        "stall_p50_ms": None if not stalls else 1000 * percentile(stalls, 50),
        "stall_p95_ms": None if not stalls else 1000 * percentile(stalls, 95),
        "streams_stalled": sum(stall > 0 for stall in stalls),
        "audio_seconds": audio,
        "aggregate_x_real_time": audio / wall if wall > 0 else None,
        "steady_window": window,
        "steady_audio_seconds": steady_audio,
        "steady_aggregate_x_real_time": None if window is None else steady_audio / (window[1] - window[0]),
        "streams": None if not args.per_stream else [  # chunk arrivals in seconds from the run's start
            {**asdict(r), "chunks": [(arrival - started, seconds) for arrival, seconds in r.chunks]} for r in results
        ],
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server (or load balancer) base URL")
    add("--conversations", type=int, default=16, help="how many conversations (default: %(default)s)")
    add("--rate", type=float, default=4.0, help="Poisson arrival rate, conversations per second (default: "
        "%(default)s)")  # fmt: skip
    add("--concurrency", type=int, default=None, help="a closed load: this many users, each sending its next "
        "conversation when its reply ended (default: an open load, every conversation arriving on its own)")
    add("--max-tokens", type=int, default=100, help="max_completion_tokens per reply (LLM steps of 0.2 s)")
    add("--audio", help="the spoken question (an audio file; default: a synthetic 3-s clip)")
    add("--voice", default="default")
    add("--model", default="funaudiochat")
    add("--api-key")
    add("--seed", type=int, default=0, help="seed of the arrival times (request i is sent with seed i)")
    add("--sampling-rate", type=int, default=24000, help="rate of the server's pcm16 audio")
    add("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    add("--per-stream", action="store_true", help="include every stream's figures in the JSON")
    add("--json", help="also write the report to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.conversations < 1 or args.rate <= 0:
        print("error: --conversations must be >= 1 and --rate > 0", file=sys.stderr)
        return 2
    if args.concurrency is not None and not 1 <= args.concurrency <= args.conversations:
        print("error: --concurrency must be between 1 and --conversations", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))

    def ms(value):
        return "n/a" if value is None else f"{value:.0f} ms"

    def ratio(value):
        return "n/a" if value is None else f"{value:.3f}"

    users = f", {report['concurrency']} at a time" if report["concurrency"] else ""
    steady = ""
    if report["steady_window"] is not None:
        start, end = report["steady_window"]
        steady = (f"; steady {ratio(report['steady_aggregate_x_real_time'])}x with all {report['concurrency']} in "
                  f"flight ({end - start:.1f} s)")  # fmt: skip
    print(
        f"{report['conversations']} conversations at {report['rate_per_second']}/s{users} in "
        f"{report['wall_seconds']:.1f} s: "
        f"errors {report['errors']}; TTFA p50 {ms(report['ttfa_p50_ms'])}, p95 {ms(report['ttfa_p95_ms'])}; "
        f"per-stream RTF p50 {ratio(report['rtf_p50'])}, p95 {ratio(report['rtf_p95'])}; "
        f"playback stall p50 {ms(report['stall_p50_ms'])}, p95 {ms(report['stall_p95_ms'])} "
        f"({report['streams_stalled']} streams stalled); "
        f"aggregate {ratio(report['aggregate_x_real_time'])}x real time ({report['audio_seconds']:.1f} s of audio)"
        f"{steady}"
    )
    if report["error_examples"]:
        print("errors: " + " | ".join(report["error_examples"]), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

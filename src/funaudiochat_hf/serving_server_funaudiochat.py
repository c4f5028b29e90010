"""`funaudiochat-serve`: an OpenAI-compatible speech-to-speech server over one continuous-batching `SpeechEngine`.

    funaudiochat-serve                                   # tiny offline model (noise!), no download
    funaudiochat-serve --model FunAudioLLM/Fun-Audio-Chat-8B --decoder path/to/Fun-CosyVoice3-0.5B-2512 \\
        --host 0.0.0.0 --port 8000 --max-batch-size 16 --api-key $KEY

Endpoints: `POST /v1/chat/completions` (OpenAI's audio-output format, streamed or not: see
`serving_openai_funaudiochat`), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). One process serves
one GPU; scale out with one process per GPU behind any HTTP load balancer (docs/serving.md).

FastAPI and uvicorn (the `serve` extra) are imported when the app is built, so the package itself does not need them.
(No `from __future__ import annotations` here: FastAPI reads the handlers' `Request` annotations at run time.)
"""

import argparse
import asyncio
import hmac
import json
import socket
import sys
import time

import numpy as np

from .generation_plan_funaudiochat import BACKENDS
from .serving_engine_funaudiochat import SpeechEngine, check_stream_options
from .serving_metrics_funaudiochat import prometheus_text
from .serving_openai_funaudiochat import (
    DEFAULT_VOICE,
    RequestError,
    TranscriptMemory,
    audio_delta,
    completion_response,
    error_body,
    new_ids,
    parse_chat_request,
    spoken_question_body,
    stream_chunk,
    usage,
    wav_bytes,
)
from .serving_requests_funaudiochat import EngineClosed, QueueFull


# How often a non-streamed request checks whether its client went away.
DISCONNECT_POLL_SECONDS = 0.25


def _missing_serve_extra(error: ImportError):
    return ImportError(
        f"The server needs FastAPI and uvicorn ({error.name} is missing): pip install 'funaudiochat_hf[serve]'."
    )


def create_app(engine: SpeechEngine, processor, model_name: str, api_key: str | None = None):
    """The FastAPI app serving `engine` (whose lifetime the caller owns). `api_key`: the bearer token /v1/ requires
    (None: none)."""
    _check_api_key(api_key, "`api_key`")
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    except ImportError as error:
        raise _missing_serve_extra(error) from error

    app = FastAPI(title="Fun-Audio-Chat speech-to-speech", version="1")
    transcripts = TranscriptMemory()
    model_dtype = getattr(engine.model, "dtype", None)
    created = int(time.time())

    def error(status: int, message: str, error_type: str, param=None, code=None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return error(401, "Missing or wrong API key: send `Authorization: Bearer <key>`.",
                             "invalid_request_error", code="invalid_api_key")  # fmt: skip
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "funaudiochat_hf"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.snapshot()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "The request body is not valid JSON.", "invalid_request_error")
        try:
            # The processor (audio decoding, features) runs off the event loop.
            chat = await asyncio.to_thread(
                parse_chat_request, body, processor, transcripts, engine.voices, model_name, model_dtype,
                engine.max_new_tokens,
            )
            events: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            handle = engine.submit(chat.speech, sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        except RequestError as bad:
            return JSONResponse(bad.body(), status_code=bad.status)
        except QueueFull as full:
            return error(429, str(full), "rate_limit_exceeded", code="server_busy",
                         headers={"Retry-After": str(max(1, round(full.retry_after)))})  # fmt: skip
        except EngineClosed as closed:
            return error(503, str(closed), "server_error", headers={"Retry-After": "5"})
        except ValueError as bad:  # the engine's own checks (prompt length, sampling values)
            return error(400, str(bad), "invalid_request_error")
        completion_id, audio_id = new_ids()
        if chat.stream:
            return StreamingResponse(
                _stream(chat, handle, events, completion_id, audio_id), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        try:
            pieces, finish = [], None
            while finish is None:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        return error(499, "The client closed the request.", "invalid_request_error")
                    continue
                pieces.append(event.audio)
                if event.finished:
                    finish = event
        finally:
            if not handle.finished.is_set():
                handle.cancel()
        if finish.finish_reason == "error":
            return error(500, finish.error or "generation failed", "server_error")
        transcript = processor.decode_reply(handle.text_ids)
        transcripts.remember(audio_id, transcript)
        audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        body = completion_response(
            chat, completion_id, audio_id, transcript, audio, engine.sampling_rate, _finish_reason(finish),
            usage(handle.prompt_tokens, len(handle.text_ids), len(handle.speech_ids)),
        )  # fmt: skip
        return JSONResponse(body)

    async def _stream(chat, handle, events, completion_id, audio_id):
        """Server-sent events of one request; a client that goes away cancels it (its slot frees at the next
        step)."""
        first, transcript = True, []
        try:
            while True:
                event = await events.get()
                if event.finish_reason == "error":
                    yield _sse(error_body(event.error or "generation failed", "server_error"))
                    break
                if len(event.audio) or event.text or first:
                    transcript.append(event.text)
                    delta = audio_delta(chat, audio_id, first, event.audio, event.text)
                    first = False
                    yield _sse(stream_chunk(chat, completion_id, delta))
                if event.finished:
                    yield _sse(stream_chunk(chat, completion_id, {}, _finish_reason(event)))
                    if chat.include_usage:
                        counts = usage(handle.prompt_tokens, len(handle.text_ids), len(handle.speech_ids))
                        yield _sse(stream_chunk(chat, completion_id, {}, usage_=counts, choices=False))
                    transcripts.remember(audio_id, "".join(transcript))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished.is_set():
                handle.cancel()

    return app


def _finish_reason(event) -> str:
    return "length" if event.finish_reason == "length" else "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------------------------------------------------
# The console script
# --------------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="funaudiochat-serve",
        description="OpenAI-compatible Fun-Audio-Chat speech-to-speech server with continuous batching (one GPU).",
    )
    add = parser.add_argument
    add("--model", help="chat model folder or Hub id (default: the tiny random-weight offline model: noise)")
    add("--decoder", help="CosyVoice3 speech decoder folder or Hub id (when the chat model has none)")
    add("--speakers", help="speaker embeddings file (spk2info.pt) for an official decoder folder")
    add("--served-model-name", help="the model id clients send and /v1/models lists (default: --model)")
    add("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s; 0.0.0.0: every one)")
    add("--port", type=int, default=8000, help="port (default: %(default)s)")
    add("--max-batch-size", type=int, default=16, help="conversations decoded together (default: %(default)s)")
    add("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429 (default: "
        "%(default)s)")  # fmt: skip
    add("--max-new-tokens", type=int, help="longest reply in LLM steps of 0.2 s (default: 512; tiny model: 48)")
    add("--max-prompt-tokens", type=int, default=1024, help="longest prompt in tokens (default: %(default)s)")
    add("--api-key", help="require `Authorization: Bearer <key>` on /v1/ endpoints")
    add("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="chat model dtype")
    add("--backend", default="auto", choices=list(BACKENDS), help="decode backend, as generate_speech's (default: "
        "%(default)s: eager on a CPU, the fast CUDA backend on a GPU; 'compiled': minutes of warm-up)")  # fmt: skip
    add("--stream-options", type=_stream_options, default=None, metavar="JSON",
        help="keywords of the speech decoder's streaming_decoder as JSON, over the engine's defaults (hops 5, 15, "
             "30, 60, 100, 100, ...), e.g. '{\"token_max_hop_len\": 15}' (a fixed hop: steadier chunks, several "
             "times the GPU work) or '{\"flow_left_context_tokens\": 50}': a streamed chunk's flow recomputes its "
             "left context, so a longer hop or a shorter context serves more conversations per GPU")  # fmt: skip
    add("--trust-remote-code", action="store_true", help="allow code shipped in a Hub repo")
    add("--no-warmup", dest="warmup", action="store_false", help="skip the start-up replies that warm the engine up "
        "(the first requests then pay for it)")  # fmt: skip
    add("--debug", action="store_true", help="show full tracebacks")
    return parser


def _check_api_key(api_key: str | None, option: str) -> None:
    """An empty key would let an empty bearer token in, and one with surrounding blanks could never be sent (HTTP drops
    them from a header's value): both are refused rather than served."""
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError(f"{option} is empty: pass a key, or leave the option out to serve without one")
    if api_key != api_key.strip():
        raise ValueError(f"{option} starts or ends with whitespace, which no client can send: remove it")


def check_before_loading(args) -> None:
    """What can be checked before the models load (the 8B model takes long): the sizes, the model and decoder
    sources (as the CLI checks them), and that the address is free to listen on. Raises ValueError."""
    from .cli import _check_sources, check_decoder_before_loading

    for option, value in (("--max-batch-size", args.max_batch_size), ("--max-new-tokens", args.max_new_tokens),
                          ("--max-prompt-tokens", args.max_prompt_tokens)):  # fmt: skip
        if value is not None and value < 1:
            raise ValueError(f"{option} must be at least 1, got {value}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be at least 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    _check_api_key(args.api_key, "--api-key")
    _check_sources(args)
    check_decoder_before_loading(args.model, args.decoder)
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            probe.bind((args.host, args.port))
    except OSError as error:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None


# The streaming decoder's settings the server exposes (`check_stream_options` takes a few more, for tests and tuning).
_STREAM_OPTION_NAMES = (
    "token_hop_len",
    "first_token_hop_len",
    "token_max_hop_len",
    "stream_scale_factor",
    "flow_left_context_tokens",
    "hift_left_context_frames",
)


def _stream_options(text: str) -> dict:
    """`--stream-options`: a JSON object of the streaming decoder's window and hop settings, checked by the decoder's
    rules here, before anything loads (the engine would check them only after the model loaded)."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"takes a JSON object, got {text!r}")
    for name in options:
        if name not in _STREAM_OPTION_NAMES:
            known = ", ".join(_STREAM_OPTION_NAMES)
            raise argparse.ArgumentTypeError(f"unknown option {name!r}; the options are {known}")
    try:
        check_stream_options(options)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return options


def build_engine(args) -> tuple[SpeechEngine, object, str]:
    """Load the model (as the CLI does) and start its engine; returns (engine, processor, served model name)."""
    from .cli import TINY_MODEL_MAX_NEW_TOKENS, _load_pipeline

    pipe = _load_pipeline(args)
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = TINY_MODEL_MAX_NEW_TOKENS if args.model is None else 512
    name = args.served_model_name or args.model or "funaudiochat-tiny"
    # A server whose prompts cannot hold the default system prompt and a short spoken question (the warm-up's) would
    # refuse every plain request: refused before the engine allocates its caches and records its graphs (minutes on a
    # GPU), with or without the warm-up. The count depends on the model's tokenizer, hence after loading.
    warm_up_chat = _warm_up_request(pipe.processor, [], name, pipe.model.dtype, max_new_tokens)
    warm_up_tokens = int(warm_up_chat.speech.inputs["input_ids"].shape[1])
    if warm_up_tokens > args.max_prompt_tokens:
        raise ValueError(
            f"--max-prompt-tokens {args.max_prompt_tokens} cannot hold the default system prompt and a "
            f"{WARMUP_QUESTION_SECONDS:g} s spoken question ({warm_up_tokens} tokens with this model): raise it to at "
            f"least {warm_up_tokens}"
        )
    options = {"eos_token_id": pipe._reply_stop_ids()}
    engine = SpeechEngine(
        pipe.model,
        tokenizer=pipe.processor.tokenizer,
        speech_decoder=pipe.decoder,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=max_new_tokens,
        generation_options=options,
        backend=args.backend,
        stream_options=args.stream_options,
    )
    return engine, pipe.processor, name


# A spoken question as the first requests bring one, twice: the first runs the audio encoder for the first time
# (kernel selection, a second or more on a GPU) and its prompt bucket's pass, the second records that pass (CUDA
# graphs, `generation_loop_funaudiochat.SpeechRun.prefill`); both run the speech decoder's first chunks.
WARMUP_QUESTION_SECONDS = 3.0
WARMUP_REPLIES = 2
WARMUP_STEPS = 8  # LLM steps: past a reply's first audio chunk


def warm_up(engine: SpeechEngine, processor, model_name: str) -> float:
    """Synthetic spoken requests through the server's own request path before it listens, so that the first client
    does not pay for first-use work; returns the seconds taken."""
    started = time.perf_counter()
    for _ in range(WARMUP_REPLIES):
        chat = _warm_up_request(processor, engine.voices, model_name, getattr(engine.model, "dtype", None),
                                engine.max_new_tokens)  # fmt: skip
        events = list(engine.submit(chat.speech).events())
        if events and events[-1].finish_reason == "error":
            raise RuntimeError(f"The warm-up request failed: {events[-1].error}")
    return time.perf_counter() - started


def _warm_up_request(processor, voices: list[str], model_name: str, model_dtype, max_new_tokens: int):
    """The warm-up's request (the default system prompt and a synthetic spoken question), parsed as a client's."""
    from .tiny_model import synthetic_question

    question = wav_bytes(synthetic_question(WARMUP_QUESTION_SECONDS), 16000)
    body = spoken_question_body(question, model_name, min(WARMUP_STEPS, max_new_tokens), seed=0)
    return parse_chat_request(body, processor, TranscriptMemory(), voices, model_name, model_dtype, max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError as error:
        print(f"error: {_missing_serve_extra(error)}", file=sys.stderr)
        return 1
    from .cli import one_line_error

    try:
        check_before_loading(args)
        engine, processor, name = build_engine(args)
    except Exception as error:  # one line for users; --debug for developers
        if args.debug:
            raise
        print(f"error: {one_line_error(error)}", file=sys.stderr)
        return 1
    try:
        try:
            if args.warmup:
                print("warming up (spoken requests through the engine and the speech decoder) ...", file=sys.stderr,
                      flush=True)  # fmt: skip
                print(f"warm-up done in {warm_up(engine, processor, name):.1f} s", file=sys.stderr, flush=True)
                engine.reset_metrics()  # /metrics counts traffic only
            app = create_app(engine, processor, name, api_key=args.api_key)
        except Exception as error:  # as the errors before loading (the engine is closed below)
            if args.debug:
                raise
            print(f"error: {one_line_error(error)}", file=sys.stderr)
            return 1
        print(f"serving {name} on http://{args.host}:{args.port} ({args.max_batch_size} slots); voices: "
              f"{', '.join([DEFAULT_VOICE, *engine.voices])}", file=sys.stderr, flush=True)  # fmt: skip
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gradio demo (a Hugging Face Space app): talk to Fun-Audio-Chat and hear the reply while it is generated.

Environment variables (all read and checked at start-up, before any model loads; a bad value stops the app with
an error naming the variable; an empty one counts as unset):
    FUNAUDIOCHAT_MODEL      chat model folder / Hub id (default: the tiny offline random-weight model: noise!)
    FUNAUDIOCHAT_DECODER    CosyVoice3 folder / Hub id, for the official two-repo layout (optional)
    FUNAUDIOCHAT_SPEAKERS   speaker file for an official CosyVoice3 folder (optional)
    FUNAUDIOCHAT_DEVICE     "auto", "cpu", "cuda", "cuda:1", ... (default: CUDA if available)
    FUNAUDIOCHAT_MAX_INPUT_SECONDS   longest accepted question in seconds, at most the model's audio window (default
                                     30, or the window where that is shorter)
    FUNAUDIOCHAT_BATCH_SIZE          conversations the serving engine decodes together, sharing each decode step
                                     (default 4)
    FUNAUDIOCHAT_CONCURRENCY         replies Gradio runs at the same time (default: FUNAUDIOCHAT_BATCH_SIZE)
    FUNAUDIOCHAT_MAX_PROMPT_TOKENS   longest prompt (question + kept history) in tokens; older turns are dropped
                                     to fit (default 2048)
    FUNAUDIOCHAT_WARMUP              off to skip the start-up warm-up reply (default: on, warm up before serving)
    FUNAUDIOCHAT_TRUST_REMOTE_CODE   on to load one-folder Hub repos without the package installed (default: off)
    FUNAUDIOCHAT_STREAM_AUDIO        off to send the reply audio in one piece at the end (default: stream when
                                     ffmpeg is installed, which Gradio needs to stream audio; see packages.txt)
    FUNAUDIOCHAT_FAST                on (on a GPU) to compile the chat loop and the decoder and run the decoder's
                                     DiT in bfloat16: start-up waits a few minutes for the compile (default: off)
The on/off switches take 1, true, yes (on) or 0, false, no (off), in any case.

Every reply runs on one continuous-batching `SpeechEngine` (started once per process, closed at exit): concurrent
visitors share its decode steps. Before the app says it is ready, one short synthetic reply warms the engine and the
speech decoder up (allocation, compilation), so the first visitor does not wait for it.

Run locally: `python demo/app.py` (serves on http://127.0.0.1:7860, or GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import gradio as gr
import numpy as np


MAX_TURNS = 8  # earlier turns kept as context, like the official web demo
INPUT_SAMPLING_RATE = 16000
DEFAULT_MAX_INPUT_SECONDS = 30.0
DEFAULT_BATCH_SIZE = 4
DEFAULT_MAX_PROMPT_TOKENS = 2048
_SWITCH_VALUES = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


# NamedTuples rather than dataclasses: the tests import this file by path, unregistered, which dataclasses do not allow.
class Settings(NamedTuple):
    """The demo's FUNAUDIOCHAT_* environment variables, parsed and checked by `read_settings` (see the module
    docstring); the defaults are those of unset variables."""

    model: str | None = None  # None: the tiny offline model
    decoder: str | None = None
    speakers: str | None = None
    device: str | None = None  # None: CUDA where available
    max_input_seconds: float | None = None  # None: the default, capped at the model's window once it has loaded
    batch_size: int = DEFAULT_BATCH_SIZE
    concurrency: int | None = None  # None: batch_size
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    warmup: bool = True
    trust_remote_code: bool = False
    stream_audio: bool | None = None  # None: when ffmpeg is installed
    fast: bool = False


class LoadedModel(NamedTuple):
    """What loading found out besides the pipeline itself (passed down rather than stored on the pipeline)."""

    is_tiny: bool
    fast_generate_kwargs: dict  # FUNAUDIOCHAT_FAST's generate_speech keywords ({} without it)


def _text_setting(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(name) or None  # empty: unset


def _int_setting(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = _text_setting(environ, name)
    if value is None:
        return default
    try:
        number = int(value.strip())
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _switch_setting(environ: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    value = _text_setting(environ, name)
    if value is None:
        return default
    if value.strip().lower() not in _SWITCH_VALUES:  # "true" once counted as off: only "1" was on
        raise ValueError(f"{name} must be 1, true or yes (on) or 0, false or no (off), got {value!r}")
    return _SWITCH_VALUES[value.strip().lower()]


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The FUNAUDIOCHAT_* variables of `environ` (default `os.environ`), each checked before any model loads (a bad
    one would otherwise stop the app, or every question, only after minutes of loading). Raises ValueError naming
    the variable. The model's own limit on the question's length is checked once it has loaded
    (`max_input_seconds_for`)."""
    from funaudiochat_hf.cli import _check_sources, _device
    from funaudiochat_hf.limits_funaudiochat import MAX_AUDIO_SECONDS

    environ = os.environ if environ is None else environ
    max_input_seconds = _text_setting(environ, "FUNAUDIOCHAT_MAX_INPUT_SECONDS")
    if max_input_seconds is not None:
        try:
            seconds = float(max_input_seconds.strip())
        except ValueError:
            seconds = math.nan
        if not 0 < seconds <= MAX_AUDIO_SECONDS:  # also refuses nan and inf
            raise ValueError(
                f"FUNAUDIOCHAT_MAX_INPUT_SECONDS must be a number of seconds above 0 and at most "
                f"{MAX_AUDIO_SECONDS:g} (the longest audio the model hears), got {max_input_seconds!r}"
            )
        max_input_seconds = seconds
    settings = Settings(
        model=_text_setting(environ, "FUNAUDIOCHAT_MODEL"),
        decoder=_text_setting(environ, "FUNAUDIOCHAT_DECODER"),
        speakers=_text_setting(environ, "FUNAUDIOCHAT_SPEAKERS"),
        device=_device(_text_setting(environ, "FUNAUDIOCHAT_DEVICE") or "auto", "FUNAUDIOCHAT_DEVICE"),
        max_input_seconds=max_input_seconds,
        batch_size=_int_setting(environ, "FUNAUDIOCHAT_BATCH_SIZE", DEFAULT_BATCH_SIZE),
        concurrency=_int_setting(environ, "FUNAUDIOCHAT_CONCURRENCY", None),
        max_prompt_tokens=_int_setting(environ, "FUNAUDIOCHAT_MAX_PROMPT_TOKENS", DEFAULT_MAX_PROMPT_TOKENS),
        warmup=_switch_setting(environ, "FUNAUDIOCHAT_WARMUP", True),
        trust_remote_code=_switch_setting(environ, "FUNAUDIOCHAT_TRUST_REMOTE_CODE", False),
        stream_audio=_switch_setting(environ, "FUNAUDIOCHAT_STREAM_AUDIO", None),
        fast=_switch_setting(environ, "FUNAUDIOCHAT_FAST", False),
    )
    sources = SimpleNamespace(model=settings.model, decoder=settings.decoder, speakers=settings.speakers)
    _check_sources(sources, ("FUNAUDIOCHAT_MODEL", "FUNAUDIOCHAT_DECODER", "FUNAUDIOCHAT_SPEAKERS"))
    return settings


def max_input_seconds_for(pipe, requested: float | None) -> float:
    """The longest question the app takes: `requested` (FUNAUDIOCHAT_MAX_INPUT_SECONDS; None: the default), which the
    model's processor must accept (its audio window: 30 s for the tiny model). An explicit value beyond it is refused
    naming the variable rather than lowered behind the user's back; the default is capped at it."""
    limit = getattr(pipe.processor, "max_audio_seconds", None)
    if requested is None:
        return DEFAULT_MAX_INPUT_SECONDS if limit is None else min(DEFAULT_MAX_INPUT_SECONDS, float(limit))
    if limit is not None and requested > limit:
        raise ValueError(
            f"FUNAUDIOCHAT_MAX_INPUT_SECONDS={requested:g} is more than this model takes: its processor hears at most "
            f"{limit:g} s of audio; set {limit:g} or less"
        )
    return float(requested)


def load_pipeline(settings: Settings | None = None):
    """The speech-to-speech pipeline that `settings` (default: `read_settings()`) describe, and a `LoadedModel`
    saying what else the app needs to know about it."""
    from transformers import pipeline

    from funaudiochat_hf.cli import _device

    settings = read_settings() if settings is None else settings
    model = settings.model
    device = _device(settings.device or "auto", "FUNAUDIOCHAT_DEVICE")
    try:  # the package registers the task; a one-folder Hub repo also works without it (trust_remote_code)
        import funaudiochat_hf  # noqa: F401
        from funaudiochat_hf.pipeline_speech_to_speech import register_pipeline

        register_pipeline()
        package = True
    except ImportError:
        package = False
    is_tiny = model is None
    if is_tiny:
        if not package:
            raise RuntimeError("Set FUNAUDIOCHAT_MODEL (the offline tiny model needs `pip install funaudiochat_hf`).")
        from funaudiochat_hf.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    elif package:  # before a 16 GB download: an official-layout chat model needs its decoder named
        from funaudiochat_hf.cli import check_decoder_before_loading

        check_decoder_before_loading(model, settings.decoder, "FUNAUDIOCHAT_MODEL", "FUNAUDIOCHAT_DECODER")
    # Loading takes minutes for the 8B model (longer on its first download): say what the wait is for.
    print(f"note: loading chat model {model} on {device} ...", file=sys.stderr, flush=True)
    if settings.decoder is not None:
        print(f"note: loading speech decoder {settings.decoder} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    pipe = pipeline(
        "speech-to-speech" if package else None,
        model=model,
        decoder=settings.decoder,
        speakers_file=settings.speakers,
        device=device,
        trust_remote_code=settings.trust_remote_code or None,
    )
    print(f"note: models loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    fast_generate_kwargs = {}
    if settings.fast:
        if pipe.device.type == "cuda":
            fast_generate_kwargs = enable_fast_decoding(pipe)
        else:
            print(f"note: FUNAUDIOCHAT_FAST needs a CUDA device (running on {pipe.device}): ignored.", file=sys.stderr)
    return pipe, LoadedModel(is_tiny=is_tiny, fast_generate_kwargs=fast_generate_kwargs)


def enable_fast_decoding(pipe, backend: str | None = None) -> dict:
    """The measured fast settings (docs/performance.md): the decoder's DiT in bfloat16 (mel SNR ~49 dB against float32)
    with its estimator and vocoder compiled, and the chat loop's "compiled" backend. Returns the `generate_speech`
    keyword arguments to add to every reply. `backend`: a `torch.compile` backend (tests use "eager")."""
    compile_kwargs = {} if backend is None else {"backend": backend}
    note = "note: FUNAUDIOCHAT_FAST: start-up compiles the chat loop and the decoder (a few minutes)."
    print(note, file=sys.stderr)
    decoder = pipe.decoder
    if decoder is not None:
        decoder.use_low_precision_estimator("bfloat16")
        decoder.compile_estimator(**compile_kwargs)
        decoder.compile_vocoder(**compile_kwargs)
    return {"backend": "compiled", **({"compile_config": compile_kwargs} if compile_kwargs else {})}


def example_wav() -> str:
    """A deterministic 2-s voice-like clip written to a temp file (an example input that works offline)."""
    import soundfile
    from funaudiochat_hf.tiny_model import synthetic_question

    path = Path(tempfile.gettempdir()) / "funaudiochat_demo_example.wav"
    soundfile.write(path, synthetic_question(2.0, INPUT_SAMPLING_RATE), INPUT_SAMPLING_RATE)
    return str(path)


def stream_audio_enabled(setting: bool | None = None) -> bool:
    """Whether the reply audio streams: `setting` (FUNAUDIOCHAT_STREAM_AUDIO) where given, else whether ffmpeg is
    installed (Gradio encodes streamed audio with it; without it the reply audio is sent whole when complete)."""
    if setting is not None:
        return setting
    return shutil.which("ffmpeg") is not None


def read_question(audio_path: str, max_input_seconds: float) -> np.ndarray:
    """The 16 kHz question clip, refused (`gr.Error`) when unreadable or longer than `max_input_seconds`: the length
    is checked on the file header, before the file is decoded or resampled."""
    from funaudiochat_hf.audio_io import load_audio
    from funaudiochat_hf.limits_funaudiochat import InputTooLongError

    try:
        return load_audio(audio_path, target_sampling_rate=INPUT_SAMPLING_RATE, max_seconds=max_input_seconds)
    except InputTooLongError:
        raise gr.Error(f"That recording is too long; please keep questions under {max_input_seconds:g} s.") from None
    except ValueError as error:
        raise gr.Error(f"Could not read that audio: {error}") from None


def check_system_prompt(system_prompt: str | None) -> str | None:
    """The system prompt box's text (None when empty); over `MAX_SYSTEM_PROMPT_CHARS` it is refused (`gr.Error`).
    The box caps typing at the same length, but a client can send anything."""
    from funaudiochat_hf.limits_funaudiochat import MAX_SYSTEM_PROMPT_CHARS

    if system_prompt and len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise gr.Error(
            f"The system prompt has {len(system_prompt)} characters; please keep it under {MAX_SYSTEM_PROMPT_CHARS}."
        )
    return system_prompt or None


def _to_int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


MAX_NEW_TOKENS = 1024  # the reply length slider's maximum (LLM steps): the engine's per-request limit
WARMUP_QUESTION_SECONDS = 1.0
# On a GPU the prompt pass is recorded once per 64-token prompt bucket, on its second run: the warm-up asks questions
# of these lengths twice each (three buckets; a question of another bucket runs its pass eagerly the first time and
# records it the second).
WARMUP_GPU_QUESTION_SECONDS = (1.0, 10.0, 25.0)
WARMUP_STEPS = 24  # enough for the first streamed audio chunk: the decoder runs too


def start_engine(pipe, batch_size: int = DEFAULT_BATCH_SIZE, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                 fast_generate_kwargs: dict | None = None):  # fmt: skip
    """The process's `SpeechEngine` over the pipeline's model and decoder (the caller closes it). `batch_size` rows
    share every decode step; FUNAUDIOCHAT_FAST's settings (`LoadedModel.fast_generate_kwargs`) pick its backend."""
    from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine

    fast = dict(fast_generate_kwargs or {})
    options = {"eos_token_id": pipe._reply_stop_ids()}
    if "compile_config" in fast:
        options["compile_config"] = fast["compile_config"]
    print(f"note: starting the speech engine ({batch_size} conversations per decode step) ...", file=sys.stderr)
    return SpeechEngine(
        pipe.model,
        tokenizer=pipe.processor.tokenizer,
        speech_decoder=pipe.decoder,
        max_batch_size=batch_size,
        max_queue=32,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=MAX_NEW_TOKENS,
        generation_options=options,
        backend=fast.get("backend", "auto"),
    )


def prepare_inputs(pipe, engine, history: list, turn: dict, system_prompt: str | None) -> tuple[dict, list]:
    """The processor's inputs for the conversation `history + [turn]` on the engine's device, and the chat they
    render. The oldest turns (a question and its reply at a time) are dropped until the prompt fits the engine's
    `max_prompt_tokens`; a question that does not fit alone is refused (`gr.Error`)."""
    chat = list(history[-2 * (MAX_TURNS - 1) :]) + [turn]
    while True:
        inputs = pipe.preprocess([chat], system_prompt=system_prompt, sampling_rate=INPUT_SAMPLING_RATE)
        if inputs["input_ids"].shape[1] <= engine.max_prompt_tokens:
            return pipe._ensure_tensor_on_device(inputs, device=pipe.device), chat
        if len(chat) == 1:
            raise gr.Error(
                f"That question needs {inputs['input_ids'].shape[1]} prompt tokens; this demo takes at most "
                f"{engine.max_prompt_tokens}. Please ask a shorter question."
            )
        chat = chat[2:]


def stream_reply(engine, inputs: dict, **request) -> Iterator:
    """The engine's events for one reply (`SpeechRequest` keywords in `request`); the request is cancelled when the
    caller stops early (a visitor who leaves frees the slot at the next decode step)."""
    from funaudiochat_hf.serving_requests_funaudiochat import QueueFull, SpeechRequest

    try:
        handle = engine.submit(SpeechRequest(inputs=inputs, **request))
    except QueueFull:
        raise gr.Error("The demo is busy; please try again in a moment.") from None
    except ValueError as error:
        raise gr.Error(str(error)) from None
    try:
        for event in handle.events():
            if event.finish_reason == "error":
                raise gr.Error(f"The reply failed: {event.error}")
            yield event
    finally:
        handle.cancel()  # no-op once finished


def warm_up(pipe, engine) -> float:
    """Short synthetic replies through the engine and the speech decoder (allocation, compiled code, CUDA graphs),
    so that the first visitor does not pay for them: one on a CPU; on a GPU two per prompt bucket of
    `WARMUP_GPU_QUESTION_SECONDS` (the second records the bucket's prompt pass). Returns the seconds taken."""
    from funaudiochat_hf.tiny_model import synthetic_question

    on_gpu = getattr(getattr(pipe.model, "device", None), "type", "cpu") == "cuda"
    questions = [seconds for seconds in WARMUP_GPU_QUESTION_SECONDS for _ in range(2)] if on_gpu else [
        WARMUP_QUESTION_SECONDS]  # fmt: skip
    print(f"note: warming up ({len(questions)} short synthetic replies) before serving ...", file=sys.stderr,
          flush=True)  # fmt: skip
    start = time.perf_counter()
    for question_seconds in questions:
        clip = synthetic_question(question_seconds, INPUT_SAMPLING_RATE)
        turn = {"role": "user", "content": [{"type": "audio", "audio": clip}]}
        inputs, _ = prepare_inputs(pipe, engine, [], turn, None)
        for _ in stream_reply(engine, inputs, max_new_tokens=WARMUP_STEPS, seed=0):
            pass
    seconds = time.perf_counter() - start
    print(f"note: warm-up done in {seconds:.1f} s.", file=sys.stderr, flush=True)
    return seconds


def make_responder(pipe, engine, max_input_seconds: float, stream_audio: bool):
    """The Send button's handler: stream one reply through the engine, yielding (audio chunk, transcript, chat
    messages, history) updates."""

    def respond(audio_path, history, messages, voice, temperature, top_p, max_new_tokens, system_prompt):
        if not audio_path:
            raise gr.Error("Record or upload a question first.")
        system_prompt = check_system_prompt(system_prompt)
        clip = read_question(audio_path, max_input_seconds)
        seconds = len(clip) / INPUT_SAMPLING_RATE
        turn = {"role": "user", "content": [{"type": "audio", "audio": clip}]}
        inputs, chat = prepare_inputs(pipe, engine, history, turn, system_prompt)
        messages = list(messages) + [
            {"role": "user", "content": f"🎤 ({seconds:.1f} s)"},
            {"role": "assistant", "content": ""},
        ]
        text, chunks, sampling_rate = "", [], pipe.sampling_rate
        request = dict(
            voice=voice or pipe.default_speaker,
            temperature=float(temperature),
            top_p=float(top_p),
            max_new_tokens=int(max_new_tokens),
        )
        for event in stream_reply(engine, inputs, **request):
            text += event.text
            messages[-1] = {"role": "assistant", "content": text}
            sampling_rate = event.sampling_rate
            if event.audio.size:
                chunks.append(_to_int16(event.audio))
            streamed = stream_audio and event.audio.size
            yield ((sampling_rate, chunks[-1]) if streamed else gr.skip()), text, messages, history
        history = chat + [{"role": "assistant", "content": text}]
        whole = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
        yield (gr.skip() if stream_audio else (sampling_rate, whole)), text, messages, history

    return respond


def create_app(
    pipe,
    engine,
    max_input_seconds: float | None = None,
    stream_audio: bool | None = None,
    warmup: bool = True,
    tiny_model: bool = False,
) -> gr.Blocks:
    """The Blocks app around a `SpeechToSpeechPipeline` (its processor, voices) and the `SpeechEngine` that generates
    every reply (call `.queue(...).launch()` on it). `max_input_seconds`: see `max_input_seconds_for`;
    `stream_audio`: see `stream_audio_enabled`; unless `warmup` is False, one short reply warms the engine up before
    this returns; `tiny_model` (`LoadedModel.is_tiny`) shows the offline model's warning."""
    from funaudiochat_hf.limits_funaudiochat import MAX_SYSTEM_PROMPT_CHARS

    max_input_seconds = max_input_seconds_for(pipe, max_input_seconds)
    stream_audio = stream_audio_enabled(stream_audio)
    voices = pipe.speakers
    respond = make_responder(pipe, engine, max_input_seconds, stream_audio)
    if warmup:
        warm_up(pipe, engine)

    def reset():
        return None, "", [], [], None

    with gr.Blocks(title="Fun-Audio-Chat speech-to-speech") as app:
        gr.Markdown(
            "# Fun-Audio-Chat: talk, and hear the answer\n"
            "Record or upload a spoken question; the spoken reply streams back while it is generated."
        )
        if tiny_model:
            gr.Markdown(
                "⚠️ **Offline demo model**: tiny and random-weight, so its replies are noise and gibberish. "
                "Set `FUNAUDIOCHAT_MODEL=FunAudioLLM/Fun-Audio-Chat-8B` and `FUNAUDIOCHAT_DECODER=<CosyVoice3 folder>` "
                "for real answers.",
                elem_id="tiny-model-warning",
            )
        history = gr.State([])
        with gr.Row():
            with gr.Column():
                question = gr.Audio(
                    sources=["upload", "microphone"], type="filepath", label="Your question", elem_id="question"
                )
                with gr.Row():
                    submit = gr.Button("Send", variant="primary", elem_id="submit")
                    clear = gr.Button("New conversation", elem_id="reset")
                with gr.Accordion("Voice and sampling", open=False):
                    voice = gr.Dropdown(
                        choices=voices, value=voices[0] if voices else None, label="Voice", allow_custom_value=False
                    )
                    temperature = gr.Slider(0.1, 1.5, value=0.8, step=0.05, label="Temperature")
                    top_p = gr.Slider(0.1, 1.0, value=0.9, step=0.05, label="Top-p")
                    max_new_tokens = gr.Slider(
                        8, MAX_NEW_TOKENS, value=64 if tiny_model else 512, step=8,
                        label="Max reply length (LLM steps, 0.2 s of speech each)",
                    )
                    system_prompt = gr.Textbox(
                        label="System prompt (empty: the official spoken-chat prompt)",
                        lines=2,
                        max_length=MAX_SYSTEM_PROMPT_CHARS,
                    )
                gr.Examples(examples=[[example_wav()]], inputs=[question], label="Example question")
            with gr.Column():
                reply_audio = gr.Audio(
                    label="Spoken reply",
                    streaming=stream_audio,
                    autoplay=True,
                    interactive=False,
                    elem_id="reply-audio",
                )
                transcript = gr.Textbox(label="Reply text", interactive=False, elem_id="transcript")
                chatbot = gr.Chatbot(label="Conversation", height=300, elem_id="conversation")

        submit.click(
            respond,
            inputs=[question, history, chatbot, voice, temperature, top_p, max_new_tokens, system_prompt],
            outputs=[reply_audio, transcript, chatbot, history],
        )
        clear.click(reset, outputs=[question, transcript, chatbot, history, reply_audio])
    return app


def main() -> None:
    settings = read_settings()  # every variable first: a typo must not cost minutes of loading
    pipe, loaded = load_pipeline(settings)
    max_input_seconds = max_input_seconds_for(pipe, settings.max_input_seconds)  # the model's limit: known only now
    if loaded.is_tiny:
        print("note: FUNAUDIOCHAT_MODEL is not set: serving the tiny offline model (noise).", file=sys.stderr)
    stream_audio = stream_audio_enabled(settings.stream_audio)
    if not stream_audio and settings.stream_audio is None:
        print("note: ffmpeg not found: reply audio is sent when complete (text still streams).", file=sys.stderr)
    engine = start_engine(pipe, settings.batch_size, settings.max_prompt_tokens, loaded.fast_generate_kwargs)
    try:
        app = create_app(pipe, engine, max_input_seconds, stream_audio, settings.warmup, loaded.is_tiny)
        concurrency = settings.concurrency or engine.max_batch_size  # one visitor per engine row
        app.queue(default_concurrency_limit=concurrency, max_size=32)
        app.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    finally:
        engine.close()


if __name__ == "__main__":
    main()

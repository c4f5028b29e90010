"""Gradio demo (a Hugging Face Space app): talk to Fun-Audio-Chat and hear the reply while it is generated.

Environment variables:
    FUNAUDIOCHAT_MODEL      chat model folder / Hub id (default: the tiny offline random-weight model: noise!)
    FUNAUDIOCHAT_DECODER    CosyVoice3 folder / Hub id, for the official two-repo layout (optional)
    FUNAUDIOCHAT_SPEAKERS   speaker file for an official CosyVoice3 folder (optional)
    FUNAUDIOCHAT_DEVICE     "cpu", "cuda", ... (default: CUDA if available)
    FUNAUDIOCHAT_MAX_INPUT_SECONDS   longest accepted question (default 30)
    FUNAUDIOCHAT_BATCH_SIZE          conversations the serving engine decodes together, sharing each decode step
                                     (default 4)
    FUNAUDIOCHAT_CONCURRENCY         replies Gradio runs at the same time (default: FUNAUDIOCHAT_BATCH_SIZE)
    FUNAUDIOCHAT_MAX_PROMPT_TOKENS   longest prompt (question + kept history) in tokens; older turns are dropped
                                     to fit (default 2048)
    FUNAUDIOCHAT_WARMUP              "0" to skip the start-up warm-up reply (default: warm up before serving)
    FUNAUDIOCHAT_TRUST_REMOTE_CODE   "1" to load one-folder Hub repos without the package installed
    FUNAUDIOCHAT_STREAM_AUDIO        "0" to send the reply audio in one piece at the end (default: stream when
                                     ffmpeg is installed, which Gradio needs to stream audio; see packages.txt)
    FUNAUDIOCHAT_FAST                "1" (on a GPU) to compile the chat loop and the decoder and run the decoder's
                                     DiT in bfloat16: start-up waits a few minutes for the compile

Every reply runs on one continuous-batching `SpeechEngine` (started once per process, closed at exit): concurrent
visitors share its decode steps. Before the app says it is ready, one short synthetic reply warms the engine and the
speech decoder up (allocation, compilation), so the first visitor does not wait for it.

Run locally: `python demo/app.py` (serves on http://127.0.0.1:7860, or GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import numpy as np


MAX_TURNS = 8  # earlier turns kept as context, like the official web demo
INPUT_SAMPLING_RATE = 16000


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def load_pipeline():
    """The speech-to-speech pipeline described by the environment (see the module docstring)."""
    import torch
    from transformers import pipeline

    model = os.environ.get("FUNAUDIOCHAT_MODEL")
    trust_remote_code = os.environ.get("FUNAUDIOCHAT_TRUST_REMOTE_CODE") == "1"
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

        check_decoder_before_loading(model, os.environ.get("FUNAUDIOCHAT_DECODER"), "FUNAUDIOCHAT_MODEL",
                                     "FUNAUDIOCHAT_DECODER")  # fmt: skip
    device = os.environ.get("FUNAUDIOCHAT_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = pipeline(
        "speech-to-speech" if package else None,
        model=model,
        decoder=os.environ.get("FUNAUDIOCHAT_DECODER"),
        speakers_file=os.environ.get("FUNAUDIOCHAT_SPEAKERS"),
        device=device,
        trust_remote_code=trust_remote_code or None,
    )
    pipe.is_tiny_model = is_tiny
    pipe.fast_generate_kwargs = {}
    if os.environ.get("FUNAUDIOCHAT_FAST") == "1":
        if pipe.device.type == "cuda":
            pipe.fast_generate_kwargs = enable_fast_decoding(pipe)
        else:
            print(f"note: FUNAUDIOCHAT_FAST=1 needs a CUDA device (running on {pipe.device}): ignored.", file=sys.stderr)
    return pipe


def enable_fast_decoding(pipe, backend: str | None = None) -> dict:
    """The measured fast settings (docs/performance.md): the decoder's DiT in bfloat16 (mel SNR ~49 dB against float32)
    with its estimator and vocoder compiled, and the chat loop's "compiled" backend. Returns the `generate_speech`
    keyword arguments to add to every reply. `backend`: a `torch.compile` backend (tests use "eager")."""
    compile_kwargs = {} if backend is None else {"backend": backend}
    note = "note: FUNAUDIOCHAT_FAST=1: start-up compiles the chat loop and the decoder (a few minutes)."
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


def stream_audio_enabled() -> bool:
    """Gradio encodes streamed audio with ffmpeg; without it the reply audio is sent whole when complete."""
    setting = os.environ.get("FUNAUDIOCHAT_STREAM_AUDIO")
    if setting is not None:
        return setting == "1"
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


def start_engine(pipe, batch_size: int | None = None, max_prompt_tokens: int | None = None):
    """The process's `SpeechEngine` over the pipeline's model and decoder (the caller closes it). `batch_size` rows
    share every decode step; FUNAUDIOCHAT_FAST's settings (`pipe.fast_generate_kwargs`) pick its backend."""
    from funaudiochat_hf.serving_engine_funaudiochat import SpeechEngine

    batch_size = batch_size or _env_int("FUNAUDIOCHAT_BATCH_SIZE", 4)
    max_prompt_tokens = max_prompt_tokens or _env_int("FUNAUDIOCHAT_MAX_PROMPT_TOKENS", 2048)
    fast = dict(getattr(pipe, "fast_generate_kwargs", {}))
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
    pipe, engine, max_input_seconds: float | None = None, stream_audio: bool | None = None, warmup: bool | None = None
) -> gr.Blocks:
    """The Blocks app around a `SpeechToSpeechPipeline` (its processor, voices) and the `SpeechEngine` that generates
    every reply (call `.queue(...).launch()` on it). Unless `warmup` is False (default: FUNAUDIOCHAT_WARMUP != "0"),
    one short reply warms the engine up before this returns."""
    from funaudiochat_hf.limits_funaudiochat import MAX_SYSTEM_PROMPT_CHARS

    max_input_seconds = max_input_seconds or _env_int("FUNAUDIOCHAT_MAX_INPUT_SECONDS", 30)
    # never more than the model's processor accepts (its feature window)
    max_input_seconds = min(max_input_seconds, getattr(pipe.processor, "max_audio_seconds", max_input_seconds))
    stream_audio = stream_audio_enabled() if stream_audio is None else stream_audio
    voices = pipe.speakers
    respond = make_responder(pipe, engine, max_input_seconds, stream_audio)
    if warmup is None:
        warmup = os.environ.get("FUNAUDIOCHAT_WARMUP") != "0"
    if warmup:
        warm_up(pipe, engine)

    def reset():
        return None, "", [], [], None

    with gr.Blocks(title="Fun-Audio-Chat speech-to-speech") as app:
        gr.Markdown(
            "# Fun-Audio-Chat: talk, and hear the answer\n"
            "Record or upload a spoken question; the spoken reply streams back while it is generated."
        )
        if getattr(pipe, "is_tiny_model", False):
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
                        8, MAX_NEW_TOKENS, value=64 if getattr(pipe, "is_tiny_model", False) else 512, step=8,
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
    pipe = load_pipeline()
    if getattr(pipe, "is_tiny_model", False):
        print("note: FUNAUDIOCHAT_MODEL is not set: serving the tiny offline model (noise).", file=sys.stderr)
    if not stream_audio_enabled():
        print("note: ffmpeg not found: reply audio is sent when complete (text still streams).", file=sys.stderr)
    engine = start_engine(pipe)
    try:
        app = create_app(pipe, engine)
        concurrency = _env_int("FUNAUDIOCHAT_CONCURRENCY", engine.max_batch_size)  # one visitor per engine row
        app.queue(default_concurrency_limit=concurrency, max_size=32)
        app.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    finally:
        engine.close()


if __name__ == "__main__":
    main()

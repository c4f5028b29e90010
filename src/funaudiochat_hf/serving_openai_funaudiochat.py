"""OpenAI chat-completions (audio output) requests and responses for the speech server, without a web framework.

`parse_chat_request(body, ...)` validates a `POST /v1/chat/completions` JSON body and turns it into a `SpeechRequest`
(the processor's inputs of the rendered conversation) plus the reply options; every problem raises `RequestError`
naming the parameter, which the server answers as OpenAI's error object. `completion_response` / `stream_chunk` build
the replies in OpenAI's audio-output format:

- non-streamed: `choices[0].message.audio = {"id", "data": base64 audio (wav or pcm16, 24 kHz), "expires_at",
  "transcript"}` and `usage`;
- streamed (server-sent events): `choices[0].delta.audio` chunks with base64 16-bit PCM `data` and `transcript`
  deltas, a last chunk with `finish_reason`, then `data: [DONE]`.

`max_completion_tokens` / `max_tokens` count LLM steps: one text token and 5 speech tokens (0.2 s of speech) each.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib.util
import io
import os
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .audio_io import load_audio, pcm16, wav_bytes
from .limits_funaudiochat import (
    MAX_AUDIO_SECONDS,
    MAX_SYSTEM_PROMPT_CHARS,
    MAX_TEXT_CHARS,
    InputTooLongError,
    check_text_length,
)
from .processing_funaudiochat import AUDIO_TEMPLATE, SPOKEN_S2M_PROMPT
from .serving_requests_funaudiochat import SpeechRequest


# Base64 audio larger than this is refused before decoding (OpenAI's own upload limit).
MAX_AUDIO_BYTES = 25 * 1024 * 1024
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm")
# Formats that soundfile cannot read, as (how the file starts, or where: its magic bytes). `audio_io` decodes them with
# ffmpeg (librosa's audioread fallback), from a file only. The magic is checked first: ffmpeg probes a file's content,
# not its name, and an upload that is, say, a playlist could make it open other files or URLs.
FFMPEG_INPUT_FORMATS = {"m4a": (4, b"ftyp"), "webm": (0, b"\x1a\x45\xdf\xa3")}  # MP4 `ftyp` box; EBML header
# `audio.format`s of a reply written here, and OpenAI's others, as (libsndfile format, subtype), written by
# soundfile (librosa's audio backend) where its libsndfile has them (`output_audio_formats`). A stream sends pcm16.
PCM_AUDIO_FORMATS = ("wav", "pcm16")
ENCODED_AUDIO_FORMATS = {"mp3": ("MP3", "MPEG_LAYER_III"), "flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS")}
DEFAULT_VOICE = "default"
# Transcripts of earlier replies by audio id, so that a multi-turn request may refer to an assistant turn by
# `{"audio": {"id": ...}}` as OpenAI's clients do.
MAX_REMEMBERED_TRANSCRIPTS = 4096
# `temperature: 0` or `top_p: 0` (OpenAI's "as deterministic as it gets") keeps only the most likely speech token: the
# engine samples every row (sampling is fixed per engine), and a top-p below the most likely token's probability (at
# least 1 / 6,565, the codebook's size) leaves that token alone.
GREEDY_TOP_P = 1e-6
# Parameters of OpenAI's API that would change the reply in a way this server cannot honour: a value that asks for
# something (not None, false, 0, empty, "none" or a text `response_format`, which some clients send) is refused by name
# rather than silently ignored.
UNSUPPORTED_PARAMETERS = (
    "stop", "tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs", "logit_bias",
    "frequency_penalty", "presence_penalty", "response_format", "prediction",
)  # fmt: skip


def _asks_for_something(value) -> bool:
    """Whether an `UNSUPPORTED_PARAMETERS` value asks for something (see there)."""
    if value is None or value is False or value in ("", "none", [], {}, {"type": "text"}):
        return False
    return not (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


class RequestError(ValueError):
    """A bad request: `status` (4xx), OpenAI's error `type` and `code`, and the offending `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.error_type, self.code = param, status, error_type, code

    def body(self) -> dict:
        return error_body(str(self), self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass
class ChatRequest:
    """A validated request: what the engine runs and how to answer."""

    speech: SpeechRequest
    stream: bool
    audio_format: str  # one of `output_audio_formats()` (a stream always sends pcm16)
    want_audio: bool  # "audio" in `modalities`
    include_usage: bool  # stream_options.include_usage
    model: str


class TranscriptMemory:
    """The transcripts of the last `MAX_REMEMBERED_TRANSCRIPTS` replies by audio id (thread-safe enough for one
    event loop)."""

    def __init__(self, size: int = MAX_REMEMBERED_TRANSCRIPTS):
        self.size = size
        self.items: OrderedDict[str, str] = OrderedDict()

    def remember(self, audio_id: str, transcript: str) -> None:
        self.items[audio_id] = transcript
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        return self.items.get(audio_id)


def _number(body: dict, name: str, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise RequestError(f"`{name}` must be {what} between {low} and {high}, got {value!r}.", param=name)
    return value


def _decode_input_audio(part: dict, where: str) -> np.ndarray:
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise RequestError(f"{where}: an `input_audio` part needs `input_audio.data` (base64 audio).", param=where)
    audio_format = spec.get("format")
    if audio_format not in INPUT_AUDIO_FORMATS:
        raise RequestError(
            f"{where}: `input_audio.format` must be one of {', '.join(INPUT_AUDIO_FORMATS)}, got {audio_format!r}.",
            param=f"{where}.input_audio.format",
        )
    data = spec["data"]
    if len(data) * 3 // 4 > MAX_AUDIO_BYTES:
        raise RequestError(f"{where}: the audio is larger than {MAX_AUDIO_BYTES // 2**20} MB.", param=where,
                           code="input_too_long")  # fmt: skip
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: `input_audio.data` is not valid base64.", param=where) from None
    try:
        if audio_format in FFMPEG_INPUT_FORMATS:
            return _load_with_ffmpeg(raw, audio_format, where)
        # `MAX_AUDIO_SECONDS` is checked on the file's header, before the audio is decoded.
        return load_audio(raw, max_seconds=MAX_AUDIO_SECONDS)
    except RequestError:
        raise
    except InputTooLongError as error:
        raise RequestError(f"{where}: {error}", param=where, code="input_too_long") from None
    except ValueError as error:
        raise RequestError(f"{where}: the input audio could not be read as audio ({error})", param=where) from None


@functools.cache
def ffmpeg_decodes() -> bool:
    """Whether this process can decode `FFMPEG_INPUT_FORMATS`: librosa and audioread's ffmpeg decoder are there."""
    try:
        import audioread.ffdec
    except ImportError:
        return False
    return importlib.util.find_spec("librosa") is not None and bool(audioread.ffdec.available())


def _load_with_ffmpeg(raw: bytes, audio_format: str, where: str) -> np.ndarray:
    """An upload of `FFMPEG_INPUT_FORMATS`, decoded from a temporary file (`audio_io`'s ffmpeg fallback reads paths)."""
    param = f"{where}.input_audio.format"
    if not ffmpeg_decodes():
        others = ", ".join(name for name in INPUT_AUDIO_FORMATS if name not in FFMPEG_INPUT_FORMATS)
        raise RequestError(f"{where}: this server cannot decode {audio_format} audio (it needs ffmpeg); send {others}.",
                           param=param)  # fmt: skip
    offset, magic = FFMPEG_INPUT_FORMATS[audio_format]
    if raw[offset : offset + len(magic)] != magic:
        raise RequestError(f"{where}: `input_audio.data` is not {audio_format} audio.", param=where)
    with tempfile.TemporaryDirectory(prefix="funaudiochat-upload-") as folder:
        path = os.path.join(folder, f"input.{audio_format}")
        with open(path, "wb") as file:
            file.write(raw)
        try:
            return load_audio(path, max_seconds=MAX_AUDIO_SECONDS)
        except ValueError as error:  # its message names the temporary file: the client sent data, not a file
            message = str(error).replace(f"file '{path}'", f"{audio_format} upload")
            raise type(error)(message.replace(path, f"input.{audio_format}")) from None


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "refusal"):
                raise RequestError(f"{where}[{i}]: only text parts are accepted here.", param=f"{where}[{i}]")
            text = part.get(part["type"])
            if not isinstance(text, str):  # not str()'d: a number or an object is a client's mistake
                raise RequestError(f"{where}[{i}]: a {part['type']} part needs a `{part['type']}` string.",
                                   param=f"{where}[{i}]")  # fmt: skip
            texts.append(text)
        return "".join(texts)
    raise RequestError(f"{where}: content must be a string or a list of parts.", param=where)


def render_messages(messages, transcripts: TranscriptMemory) -> tuple[list[dict], list[np.ndarray]]:
    """OpenAI `messages` -> the chat template's messages (one `AUDIO_TEMPLATE` per user clip) and the 16 kHz clips."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list.", param="messages")
    rendered, clips = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with `role` and `content`.", param=where)
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            text = _text_of(content, f"{where}.content")
            _check_length(text, f"{where}: the system prompt", MAX_SYSTEM_PROMPT_CHARS, where)
            rendered.append({"role": "system", "content": text})
        elif role == "assistant":
            audio = message.get("audio")
            if content is None and isinstance(audio, dict) and "id" in audio:
                text = transcripts.get(str(audio["id"]))
                if text is None:
                    raise RequestError(f"{where}: unknown or expired audio id {audio['id']!r}; send the transcript "
                                       "as the assistant's content instead.", param=f"{where}.audio.id")  # fmt: skip
            else:
                text = _text_of(content if content is not None else "", f"{where}.content")
            rendered.append({"role": "assistant", "content": text})
        elif role == "user":
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list) or not parts:
                raise RequestError(f"{where}.content must be a string or a non-empty list of parts.", param=where)
            pieces = []
            for j, part in enumerate(parts):
                part_where = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "input_audio":
                    clips.append(_decode_input_audio(part, part_where))
                    pieces.append(AUDIO_TEMPLATE)
                elif kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise RequestError(f"{part_where}: a text part needs a `text` string.", param=part_where)
                    pieces.append(part["text"])
                else:
                    raise RequestError(f"{part_where}: unsupported part type {kind!r} (use `input_audio` or `text`).",
                                       param=part_where)  # fmt: skip
            rendered.append({"role": "user", "content": "\n".join(pieces)})
        else:
            raise RequestError(f"{where}: unknown role {role!r} (system, user or assistant).", param=f"{where}.role")
    if rendered[-1]["role"] != "user":
        raise RequestError("The last message must be the user turn to answer.", param="messages")
    if rendered[0]["role"] != "system":
        rendered.insert(0, {"role": "system", "content": SPOKEN_S2M_PROMPT})
    _check_length("".join(m["content"] for m in rendered), "The conversation's text", MAX_TEXT_CHARS, "messages")
    return rendered, clips


def _check_length(text: str, what: str, max_chars: int, param: str) -> None:
    """`limits_funaudiochat.check_text_length` as a 400 error with OpenAI's `input_too_long` code."""
    try:
        check_text_length(text, what, max_chars)
    except InputTooLongError as error:
        raise RequestError(str(error), param=param, code="input_too_long") from None


def parse_chat_request(body, processor, transcripts: TranscriptMemory, voices: list[str], model_name: str,
                       model_dtype=None, max_reply_tokens: int = 10**9) -> ChatRequest:  # fmt: skip
    """Validate a chat-completions body and build the engine request (the processor runs here, on the caller's
    thread). `max_reply_tokens`: the engine's longest reply, checked before the processor runs. Raises
    `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):  # true == 1 in Python
        raise RequestError("Only `n` = 1 is supported.", param="n")
    for name in UNSUPPORTED_PARAMETERS:
        if _asks_for_something(body.get(name)):
            raise RequestError(f"`{name}` is not supported by this server: leave it out.", param=name,
                               code="unsupported_parameter")  # fmt: skip
    # Every value's type is checked before it is used: a JSON value of another type is the client's mistake (400),
    # not the server's (500).
    modalities = body.get("modalities") or ["text"]
    if not isinstance(modalities, list) or not all(kind in ("text", "audio") for kind in modalities):
        raise RequestError('`modalities` must be a list of "text" and "audio".', param="modalities")
    want_audio = "audio" in modalities
    audio = body.get("audio")
    formats = " | ".join(f'"{name}"' for name in output_audio_formats())
    if want_audio and not isinstance(audio, dict):
        raise RequestError(f'`modalities` asks for audio: pass `audio: {{"voice": ..., "format": {formats}}}`.',
                           param="audio")  # fmt: skip
    if audio is None:
        audio = {}
    elif not isinstance(audio, dict):
        raise RequestError(f'`audio` must be an object: {{"voice": ..., "format": {formats}}}, got {audio!r}.',
                           param="audio")  # fmt: skip
    audio_format = audio.get("format", "wav")
    if audio_format not in output_audio_formats():
        raise RequestError(f"`audio.format` must be one of {', '.join(output_audio_formats())}, got {audio_format!r}.",
                           param="audio.format")  # fmt: skip
    voice = audio.get("voice", DEFAULT_VOICE)
    if voice != DEFAULT_VOICE and voice not in voices:
        known = ", ".join([DEFAULT_VOICE, *voices])
        raise RequestError(f"Unknown voice {voice!r}; this server has: {known}.", param="audio.voice")
    stream = body.get("stream")
    if stream is None:  # OpenAI's default
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"`stream` must be true or false, got {stream!r}.", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("`stream_options` must be an object.", param="stream_options")
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError(f"`stream_options.include_usage` must be true or false, got {include_usage!r}.",
                           param="stream_options.include_usage")  # fmt: skip
    max_tokens = _number(body, "max_completion_tokens", 1, max_reply_tokens, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, max_reply_tokens, integer=True)
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    seed = _number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    if temperature == 0 or top_p == 0:  # the most likely speech token at every step, whatever the seed
        temperature, top_p = None, GREEDY_TOP_P

    messages, clips = render_messages(body.get("messages"), transcripts)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        inputs = dict(processor(text=[text], audio=clips or None, return_tensors="pt"))
    except InputTooLongError as error:  # the processor's limits (its feature extractor's window, the prompt text)
        raise RequestError(str(error), param="messages", code="input_too_long") from None
    except ValueError as error:
        raise RequestError(f"The conversation could not be prepared: {error}", param="messages") from None
    features = inputs.get("input_features")
    if features is not None and model_dtype is not None and model_dtype.is_floating_point:
        inputs["input_features"] = features.to(model_dtype)
    speech = SpeechRequest(
        inputs=inputs,
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        voice=None if voice == DEFAULT_VOICE else voice,
    )
    return ChatRequest(
        speech=speech,
        stream=stream,
        audio_format=audio_format,
        want_audio=want_audio,
        include_usage=bool(include_usage),
        model=model_name,  # the model that answers, whatever name the request used (as OpenAI's API)
    )


@functools.cache
def output_audio_formats() -> tuple[str, ...]:
    """The `audio.format`s this server writes: "wav", "pcm16" and those of `ENCODED_AUDIO_FORMATS` this process's
    libsndfile can write."""
    try:
        import soundfile
    except ImportError:
        return PCM_AUDIO_FORMATS
    writable = [name for name, (container, subtype) in ENCODED_AUDIO_FORMATS.items()
                if container in soundfile.available_formats() and subtype in soundfile.available_subtypes(container)]
    return (*PCM_AUDIO_FORMATS, *writable)


def reply_audio_bytes(audio: np.ndarray, sampling_rate: int, audio_format: str) -> bytes:
    """A non-streamed reply's audio in `audio_format` (one of `output_audio_formats()`)."""
    if audio_format == "wav":
        return wav_bytes(audio, sampling_rate)
    if audio_format == "pcm16":
        return pcm16(audio)
    import soundfile

    container, subtype = ENCODED_AUDIO_FORMATS[audio_format]
    # The 16-bit samples of the other formats (flac then holds exactly the wav's); a file of no frames cannot be read
    # back in these formats, so an empty reply is one silent sample.
    samples = np.frombuffer(pcm16(audio), "<i2") if len(audio) else np.zeros(1, dtype=np.int16)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, sampling_rate, format=container, subtype=subtype)
    return buffer.getvalue()


def spoken_question_body(question_wav: bytes, model: str, max_tokens: int, seed: int, voice: str = DEFAULT_VOICE) -> dict:
    """A chat-completions body asking one spoken question (a WAV file's bytes) for a text and 16-bit PCM audio reply:
    what the server's warm-up and the serving benchmark send (non-streamed; set `stream` for the other)."""
    return {
        "model": model, "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"},
        "max_completion_tokens": max_tokens, "seed": seed,
        "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(question_wav).decode(), "format": "wav"}}]}],
    }  # fmt: skip


def new_ids() -> tuple[str, str]:
    """A completion id and an audio id."""
    return f"chatcmpl-{uuid.uuid4().hex}", f"audio_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, steps: int, speech_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": steps,
        "total_tokens": prompt_tokens + steps,
        "completion_tokens_details": {"text_tokens": steps, "audio_tokens": speech_tokens},
    }


def completion_response(request: ChatRequest, completion_id: str, audio_id: str, transcript: str,
                        audio: np.ndarray, sampling_rate: int, finish_reason: str, usage_: dict) -> dict:  # fmt: skip
    message = {"role": "assistant", "content": None, "refusal": None}
    if request.want_audio:
        data = reply_audio_bytes(audio, sampling_rate, request.audio_format)
        message["audio"] = {
            "id": audio_id,
            "data": base64.b64encode(data).decode("ascii"),
            "expires_at": int(time.time()) + 3600,
            "transcript": transcript,
        }
    else:
        message["content"] = transcript
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_,
    }


def stream_chunk(request: ChatRequest, completion_id: str, delta: dict, finish_reason: str | None = None,
                 usage_: dict | None = None, choices: bool = True) -> dict:  # fmt: skip
    chunk = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}] if choices else [],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def audio_delta(request: ChatRequest, audio_id: str, first: bool, audio: np.ndarray, transcript: str) -> dict:
    """The `delta` of a streamed chunk: the audio as base64 16-bit PCM and the transcript's new text (or, without
    the audio modality, the text as `content`)."""
    if not request.want_audio:
        delta = {"content": transcript}
    else:
        delta = {"audio": {"data": base64.b64encode(pcm16(audio)).decode("ascii"), "transcript": transcript}}
        if first:
            delta["audio"].update(id=audio_id, expires_at=int(time.time()) + 3600)
    if first:
        delta["role"] = "assistant"
    return delta

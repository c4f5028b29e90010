"""What a client of the speech engine hands in and gets back: `SpeechRequest` (one conversation to answer), its
`SpeechEvent`s (text deltas and audio chunks), the `RequestHandle` that streams them and cancels, and the errors
`submit` raises when the engine cannot take a request (`QueueFull`, `EngineClosed`).

The engine (`serving_engine_funaudiochat.SpeechEngine`) fills a handle's events from its output thread; a client reads
them with `handle.events()` or receives them through the `sink` given to `submit`.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` waiting requests; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(RuntimeError):
    """The engine was closed (or its thread died): it takes no more requests."""


@dataclass
class SpeechRequest:
    """One conversation to answer.

    Attributes:
        inputs: the processor's outputs for ONE conversation (`input_ids` `(1, L)`, and the audio tensors).
        max_new_tokens: reply length limit in LLM steps (0.2 s of speech each); None = the engine's default.
        temperature, top_p, repetition_penalty: speech sampling values; None = the model's defaults.
        seed: the request's random seed (None: drawn from the global RNG).
        voice: a speaker name of the speech decoder, or a `(192,)` embedding; None = the decoder's default.
    """

    inputs: dict
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    voice: object = None


@dataclass
class SpeechEvent:
    """An increment of one request's reply: the decode steps since its last event (one, or several when vocoding
    ran behind).

    Attributes:
        text: new text (special tokens dropped, never half a character).
        text_ids: new text token ids (special tokens included).
        speech_ids: new raw speech ids (delay / EOS tokens included).
        audio: new float32 samples at `sampling_rate` (may be empty).
        finished: True on the request's last event.
        finish_reason: on the last event: "stop" (the model ended), "length" (`max_new_tokens`), "cancelled" or
            "error" (then `error` says why).
    """

    text: str = ""
    text_ids: list[int] = field(default_factory=list)
    speech_ids: list[int] = field(default_factory=list)
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    sampling_rate: int = 24000
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class RequestHandle:
    """A submitted request: its events (`events()`, blocking, or through the `sink` given to `submit`) and `cancel()`.

    Cancelling (or a client that goes away) frees the request's slot at the next decode step; a last event with
    `finish_reason="cancelled"` follows.
    """

    _ids = itertools.count()

    def __init__(self, request: SpeechRequest, sink: Callable[[SpeechEvent], None] | None):
        self.id = next(self._ids)
        self.request = request
        self.prompt_tokens = int(request.inputs["input_ids"].shape[1])
        self.submitted = time.perf_counter()
        self.options: dict = {}  # resolved generation options (set by the engine)
        self.first_audio: float | None = None  # seconds after submission
        # Seconds after submission at which the request reached each stage of its way to its first audio:
        # "admitted" (its prefill starts), "prefilled" (its first token is read), "ready" (the decode result that
        # completes its first chunk is handed to the output thread), "vocoding" (the output thread starts the round
        # that yields its first audio), "first_audio" (that audio is ready, before its event is delivered).
        self.timeline: dict[str, float] = {}
        self.first_audio_steps: int | None = None  # its decode results (the prefill's included) up to its first audio
        self.audio_samples = 0
        self.text_ids: list[int] = []
        self.speech_ids: list[int] = []
        self._queue: queue.Queue | None = None if sink is not None else queue.Queue()
        self._sink = sink if sink is not None else self._queue.put
        self._cancelled = threading.Event()
        self.finished = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: float | None = None) -> Iterator[SpeechEvent]:
        """The request's events, blocking, until the last (`finished`) one; `timeout` per event (queue.Empty). Another
        call goes on where the last one stopped (nothing, once the last event was taken)."""
        if self._queue is None:
            raise RuntimeError("This request's events go to the `sink` given to `submit`.")
        while True:
            if self.finished.is_set() and self._queue.empty():  # set after its last event was queued: taken already
                return
            event = self._queue.get(timeout=timeout)
            yield event
            if event.finished:
                return

    def _mark(self, stage: str, now: float | None = None) -> None:
        """Record the first time the request reaches `stage` (see `timeline`)."""
        if stage not in self.timeline:
            self.timeline[stage] = (time.perf_counter() if now is None else now) - self.submitted

    def _emit(self, event: SpeechEvent) -> None:
        self.text_ids.extend(event.text_ids)
        self.speech_ids.extend(event.speech_ids)
        self.audio_samples += len(event.audio)
        self._sink(event)
        if event.finished:
            self.finished.set()

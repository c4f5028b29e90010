"""Continuous batching for Fun-Audio-Chat speech-to-speech: many conversations share the decode steps of one GPU.

`SpeechEngine` runs the package's decode step over the rows ("slots") of one static batch in a background thread. A new
request is prefilled alone (batch 1) on a prefill thread, on a CUDA stream of its own, while the decode steps go on;
between two steps its cache rows and per-row state are placed into a free slot; a finished, cancelled or disconnected
request leaves and frees its slot at the next step. Each step is queued before the previous one's outputs are read
(`_iteration`), so the GPU does not wait for the host between steps.
Every request has its own sampling values, seed, length limit and voice, and streams text deltas and 24 kHz audio
chunks (a streaming CosyVoice3 decoder per request, on an output thread so that vocoding never delays a decode step;
the chunks ready across requests are decoded together, see `serving_vocoder_funaudiochat`).

A request computes what it would alone (`generate_speech` at batch 1, same seed; a GPU may round it differently, see
docs/serving.md): a slot is a left-padded row joined right-aligned at the batch's shared cache column `C`, with its own
noise generator and sampling values. How a slot is filled, shifted, stepped and freed is in
`serving_batch_funaudiochat` (`ServingBatch`, the engine's only view of the decode internals); the requests, events
and handles are in `serving_requests_funaudiochat`.

* Room. A request with an `L`-token prompt reserves `L + max_new_tokens` columns from its start. It joins at the
  current `C` when `L <= C` and `C + max_new_tokens <= cache_length`; otherwise every column is shifted left (or
  right) by one offset `d` such that all rows keep their reserved room (a rebase: `ServingBatch.rebase`). When no
  offset fits, the request waits (in order: nothing overtakes it) until running rows finish. With
  `cache_length >= max_prompt_tokens + 2 * max_new_tokens` (the default) every request fits at once. A request that
  joins an empty batch starts it over at `C = L` (only the column moves, nothing is copied).
"""

from __future__ import annotations

import inspect
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from .generation_loop_funaudiochat import SpeechRun
from .generation_output_funaudiochat import TextDeltas
from .generation_plan_funaudiochat import BACKENDS
from .generation_state_funaudiochat import CACHE_LENGTH_MULTIPLE
from .generation_vocoding_funaudiochat import decoder_sampling_rate, decoder_voices
from .serving_batch_funaudiochat import ServingBatch
from .serving_host_copy_funaudiochat import HostCopy
from .serving_metrics_funaudiochat import EngineMetrics
from .serving_outputs_funaudiochat import StepOutput, VocoderRound, merged_outputs, vocode_items
from .serving_requests_funaudiochat import EngineClosed, QueueFull, RequestHandle, SpeechEvent, SpeechRequest
from .serving_vocoder_funaudiochat import ServingVocoder
from .streaming_cosyvoice3 import STREAM_SIZE_MINIMA, CosyVoice3StreamingDecoder, checked_stream_size, hop_schedule


logger = logging.get_logger(__name__)

# The engine's per-request sizes (prompt tokens, reply steps): they size its prefill and batch caches. The audio and
# text limits of `limits_funaudiochat` are checked before tokenization (processor, server); these bound the tokens.
DEFAULT_MAX_PROMPT_TOKENS = 1024
DEFAULT_MAX_NEW_TOKENS = 512
# A reply's first chunks as `generate_speech_stream`'s (6 tokens, then 15: the first audio is as early), then the hop
# doubles up to 100 tokens (CosyVoice's own streaming driver's rule). A streamed chunk's flow recomputes its 200-token
# left context: at a fixed hop of 15 the decoder does 14.5 times the work of the tokens it emits, which caps what one
# GPU serves over all streams; at 100 it does 3 times.
DEFAULT_STREAM_OPTIONS = {
    "token_hop_len": 15, "pre_lookahead_len": 3, "first_token_hop_len": 6, "token_max_hop_len": 100,
}  # fmt: skip
# The interpreter's thread switch interval while an engine runs (seconds; CPython's default is 5 ms). The decode
# thread waits for each step's outputs without the GIL and needs it back as soon as they arrive; while another thread
# runs Python (the output thread's vocoder rounds, the server's event loop), CPython hands the GIL over only when that
# thread blocks or the interval has passed, so at 5 ms every wait of a loaded engine's decode thread could take up to
# 5 ms more: several times a step of ~10 ms.
THREAD_SWITCH_INTERVAL_SECONDS = 2e-4
# The longest the decode thread holds its next step while the output thread vocodes a round of start-up chunks only
# (a reply's first chunks, `ServingVocoder.in_start_up`). The chunk then has the GPU to itself, as in
# `generate_speech_stream`, instead of sharing it with the steps launched back to back (under load its vocoding took
# about half as long, the aggregate the same: docs/performance.md). The bound keeps a slow round from stalling every
# other stream's tokens for long. It also bounds the wait of a step for the vocoding of the previous one's outputs
# while no request streams yet (`_wait_for_output_thread`).
FIRST_AUDIO_HOLD_SECONDS = 0.05
# While a request is prefilled, the decode steps and the vocoder rounds wait for it unless one of their requests needs
# them now: one whose playback has caught up with its audio (counted from its first audio, played in real time), or one
# still waiting for its first audio (a step's rows: whose first chunk's speech ids are not out yet). The prefill then
# has the GPU to itself, and a new request's first audio comes sooner (beside the steps and rounds of a load a prefill
# took about twice as long). The hold ends with the prefill, at the latest after `PREFILL_HOLD_SECONDS` (a prefill alone
# takes ~50-150 ms on a GPU); a listener's buffered audio covers it.
PREFILL_HOLD_SECONDS = 0.3
# While a round of steady chunks runs on the GPU, the output thread looks for new start-up chunks (and whether the
# round is done) at least this often (seconds): they are vocoded beside the round instead of after it
# (`ServingVocoder.concurrent_start_up`).
START_UP_POLL_SECONDS = 1e-3


# `CosyVoice3StreamingDecoder`'s keywords that `stream_options` may set (the model and the voice are the engine's).
_DECODER_PARAMETERS = inspect.signature(CosyVoice3StreamingDecoder.__init__).parameters
STREAM_OPTION_NAMES = tuple(name for name in _DECODER_PARAMETERS if name not in ("self", "model", "speaker_embedding"))


def check_stream_options(stream_options: dict | None) -> dict:
    """The engine's streaming decoder keywords (`DEFAULT_STREAM_OPTIONS` updated with `stream_options`), checked by
    the streaming decoder's own rules where they need no decoder: known names, the sizes' ranges, the hop growth
    (`streaming_cosyvoice3.hop_schedule`). Raises ValueError. The engine checks them before it allocates anything; the
    decoder checks the rest (its pre-lookahead, window buckets, CUDA graphs) when the engine creates its first one."""
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ValueError(f"`stream_options` must be a dict of streaming decoder keywords, got {stream_options!r}.")
    options = {**DEFAULT_STREAM_OPTIONS, **(stream_options or {})}
    unknown = sorted(set(options) - set(STREAM_OPTION_NAMES))
    if unknown:
        known = ", ".join(STREAM_OPTION_NAMES)
        raise ValueError(f"Unknown stream option {', '.join(unknown)}; the options are {known}.")
    for name in STREAM_SIZE_MINIMA.keys() & options.keys():
        checked_stream_size(name, options[name])
    hop = options.get("token_hop_len", _DECODER_PARAMETERS["token_hop_len"].default)
    first = options.get("first_token_hop_len")
    factor = options.get("stream_scale_factor", _DECODER_PARAMETERS["stream_scale_factor"].default)
    try:
        hop_schedule(hop if first is None else first, hop, options.get("token_max_hop_len"), factor)
    except ValueError as error:  # it may be about a default the caller did not set
        defaults = ", ".join(f"{name} {value}" for name, value in DEFAULT_STREAM_OPTIONS.items())
        raise ValueError(f"{error} (unset options take the engine's defaults: {defaults})") from None
    return options


class _SwitchInterval:
    """The interpreter's thread switch interval, lowered to `THREAD_SWITCH_INTERVAL_SECONDS` while any engine runs and
    set back to what it was when the last one closes (it is process-wide: several engines share one setting)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._engines = 0
        self._previous: float | None = None

    def lower(self) -> None:
        with self._lock:
            self._engines += 1
            if self._engines == 1 and sys.getswitchinterval() > THREAD_SWITCH_INTERVAL_SECONDS:
                self._previous = sys.getswitchinterval()
                logger.info(f"Speech engine: thread switch interval {1e3 * THREAD_SWITCH_INTERVAL_SECONDS:g} ms.")
                sys.setswitchinterval(THREAD_SWITCH_INTERVAL_SECONDS)

    def restore(self) -> None:
        with self._lock:
            self._engines -= 1
            if self._engines == 0 and self._previous is not None:
                sys.setswitchinterval(self._previous)
                self._previous = None


_SWITCH_INTERVAL = _SwitchInterval()


@dataclass
class _Active:
    """Host-side bookkeeping of a request in a slot."""

    handle: RequestHandle
    run: SpeechRun
    row: int
    start: int  # first cache column of its prompt
    reserved_end: int  # start + prompt + max_new_tokens: columns it may write up to (exclusive)
    max_new_tokens: int
    tokens: int = 0  # text tokens emitted (the prefill's first one included)
    groups: int = 0  # speech groups emitted


@dataclass
class _Prefilled:
    """A request prefilled by the prefill thread, waiting for the decode thread to place it in a slot."""

    handle: RequestHandle
    run: SpeechRun
    first: dict  # its first step's outputs (`ServingBatch.prefill`)
    max_new_tokens: int


@dataclass
class _LaunchedStep:
    """A decode step queued on the GPU whose outputs the host has not taken yet: the slots it stepped (a slot freed
    or refilled since is not this step's any more) and the copy of its outputs (`ServingBatch.start_read`)."""

    slots: list[_Active]
    outputs: HostCopy


class SpeechEngine:
    """Continuous batching over one model (one GPU): see the module docstring.

    Args:
        model: a `FunAudioChatForConditionalGeneration` (eval mode).
        tokenizer: the processor's tokenizer (text deltas); None: events carry ids only.
        speech_decoder: a CosyVoice3 token2wav model (default: `model.token2wav`); None and no `token2wav`: no audio.
        max_batch_size: slots of the static batch (rows of every decode step).
        max_queue: requests that may wait while every slot is busy; one more raises `QueueFull`.
        max_prompt_tokens, max_new_tokens: per-request limits (the prefill workspace's length; the default and the
            largest reply length).
        cache_length: LLM cache columns of the batch (default: `max_prompt_tokens + 2 * max_new_tokens` rounded up:
            every request fits without waiting for room).
        generation_options: `generate_speech` keywords fixed for the engine (`eos_token_id`, `do_sample`,
            `compile_config`, ...); per-request values come with each `SpeechRequest`.
        backend: the decode backend, as `generate_speech`'s: "auto" (eager on a CPU, the fast CUDA backend on a GPU),
            "eager", "cuda_graphs" or "compiled".
        stream_options: keywords of the decoder's `streaming_decoder`, over `DEFAULT_STREAM_OPTIONS`
            (`generate_speech_stream`'s chunks, with the hop growing to 100 tokens).
    """

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        speech_decoder=None,
        max_batch_size: int = 8,
        max_queue: int = 64,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        cache_length: int | None = None,
        generation_options: dict | None = None,
        stream_options: dict | None = None,
        backend: str = "auto",
    ):
        for name, value in (("max_batch_size", max_batch_size), ("max_prompt_tokens", max_prompt_tokens),
                            ("max_new_tokens", max_new_tokens)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"`max_queue` must be a non-negative integer, got {max_queue!r}.")
        if cache_length is None:
            needed = max_prompt_tokens + 2 * max_new_tokens
            cache_length = -(-needed // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE
        if cache_length < max_prompt_tokens + max_new_tokens:
            raise ValueError(
                f"`cache_length`={cache_length} cannot hold one request of `max_prompt_tokens`={max_prompt_tokens} "
                f"and `max_new_tokens`={max_new_tokens}."
            )
        # Checked before the batch allocates its caches and records its graphs (long on a GPU).
        self.stream_options = check_stream_options(stream_options)
        self.model = model
        self.tokenizer = tokenizer
        decoder = speech_decoder if speech_decoder is not None else getattr(model, "token2wav", None)
        self.decoder = decoder
        self.sampling_rate = decoder_sampling_rate(decoder) if decoder is not None else 24000
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.metrics = EngineMetrics()
        # A warning, as the package's compile notes: long work (minutes with the compiled backend) that a default
        # logger (transformers' level: warnings) would otherwise leave silent.
        logger.warning(
            f"Speech engine: {max_batch_size} slots, {cache_length} cache columns, prompts up to {max_prompt_tokens} "
            f"tokens, replies up to {max_new_tokens} steps; allocating and warming up ..."
        )
        with torch.no_grad():
            self.batch = ServingBatch(model, max_batch_size, cache_length, generation_options or {}, backend)
        self._lock = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        # At most one: the next prefill overwrites the prefill workspace that this one's admission reads.
        self._prefilled: deque[_Prefilled] = deque()
        self._slots: list[_Active | None] = [None] * max_batch_size
        self._closed = False
        self._failure: str | None = None
        self._launched: _LaunchedStep | None = None  # decode thread only
        self._start_up_round = False  # the output thread vocodes a round of start-up chunks (the steps wait)
        self._prefilling = False  # the prefill thread runs a prefill (`_hold_for_prefill`)
        self._output: queue.Queue = queue.Queue()
        # Items put on `_output` so far, and how many of them the output thread has emitted (both under `_lock`); a
        # condition of its own on that lock, so that each round wakes only a decode thread waiting for it.
        self._handed = self._emitted = 0
        self._emission = threading.Condition(self._lock)
        # Each request's streaming decoder (output thread only); their chunks are decoded together.
        self._vocoder = None
        if decoder is not None:
            try:
                self._vocoder = self._start_vocoder(decoder, max_batch_size)
            except BaseException:  # e.g. an option only the decoder checks: a failed start keeps none of the memory
                self.batch.close()
                raise
        self._text: dict[int, TextDeltas] = {}  # request id -> its reply's text so far (output thread)
        _SWITCH_INTERVAL.lower()
        self._switch_interval_lowered = True  # until `close` sets it back
        self._decode_thread = threading.Thread(target=self._decode_loop, name="speech-engine-decode", daemon=True)
        self._prefill_thread = threading.Thread(target=self._prefill_loop, name="speech-engine-prefill", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="speech-engine-output", daemon=True)
        self._decode_thread.start()
        self._prefill_thread.start()
        self._output_thread.start()

    def _start_vocoder(self, decoder, max_batch_size: int) -> ServingVocoder:
        """The speech decoder's streams, their graphs recorded up front where they run fixed shapes."""
        vocoder = ServingVocoder(decoder, self.stream_options, self.batch.cfg.speech_bos_id)
        if vocoder.fixed_shapes:
            sizes = vocoder.warm_up_batch_sizes(max_batch_size)
            logger.warning(f"Speech engine: recording the speech decoder's graphs for rounds of {sizes} streams ...")
            vocoder.warm_up(max_batch_size)
        return vocoder

    # ------------------------------------------------------------------ public
    def submit(self, request: SpeechRequest, sink: Callable[[SpeechEvent], None] | None = None) -> RequestHandle:
        """Queue a request; its events go to `sink` (called from the engine's output thread) or to
        `handle.events()`. Raises ValueError (bad request, before it is queued), `QueueFull` or `EngineClosed`."""
        input_ids = request.inputs.get("input_ids") if isinstance(request.inputs, dict) else None
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError("`inputs` must hold the processor's `input_ids` of ONE conversation, shape (1, length).")
        if input_ids.shape[1] > self.max_prompt_tokens:
            raise ValueError(
                f"The prompt has {input_ids.shape[1]} tokens; this server takes at most {self.max_prompt_tokens} "
                "(shorten the audio or the conversation history)."
            )
        if request.max_new_tokens is not None and not 1 <= request.max_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"`max_new_tokens` must be between 1 and {self.max_new_tokens}, got {request.max_new_tokens}."
            )
        if isinstance(request.voice, str) and self.voices and request.voice not in self.voices:
            raise ValueError(f"Unknown voice {request.voice!r}; this server has: {', '.join(self.voices)}.")
        max_new = request.max_new_tokens or self.max_new_tokens
        options = self.batch.resolve(request, max_new)
        handle = RequestHandle(request, sink)
        handle.options = options
        with self._lock:
            if self._closed or self._failure is not None:
                raise EngineClosed(self._failure or "The speech engine is closed.")
            free_slots = sum(slot is None for slot in self._slots)
            waiting = len(self._waiting) + len(self._prefilled)
            if waiting >= self.max_queue + free_slots:  # a free slot takes a request at the next step
                self.metrics.requests["rejected"] += 1
                raise QueueFull(
                    f"The server is at capacity ({self.max_batch_size} running, {waiting} queued).",
                    retry_after=1.0,
                )
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    @property
    def voices(self) -> list[str]:
        """The speech decoder's voice names (empty: no named voices)."""
        return decoder_voices(self.decoder)

    def reset_metrics(self) -> None:
        """Start the metrics afresh (e.g. after a start-up warm-up, whose requests are not traffic)."""
        with self._lock:
            self.metrics = EngineMetrics()

    def snapshot(self) -> dict:
        """A consistent copy of the metrics (for `/metrics`)."""
        with self._lock:
            m = self.metrics
            return {
                "requests": dict(m.requests),
                "running": sum(slot is not None for slot in self._slots),
                "queued": len(self._waiting) + len(self._prefilled),
                "slots": self.max_batch_size,
                "steps": m.steps,
                "rebases": m.rebases,
                "step_rows": (m.step_rows.buckets, list(m.step_rows.counts), m.step_rows.sum, m.step_rows.count),
                "time_to_first_audio": (
                    m.time_to_first_audio.buckets, list(m.time_to_first_audio.counts), m.time_to_first_audio.sum,
                    m.time_to_first_audio.count,
                ),
                "audio_seconds": m.audio_seconds,
            }  # fmt: skip

    @property
    def healthy(self) -> bool:
        threads = (self._decode_thread, self._prefill_thread)
        return not self._closed and self._failure is None and all(thread.is_alive() for thread in threads)

    def close(self) -> None:
        """Stop the threads; waiting and running requests end with an error event."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            self._emission.notify_all()
        self._decode_thread.join()
        self._prefill_thread.join()
        self._fail_pending(self._failure or "The speech engine was closed.")  # waiting, prefilled and running requests
        self._output.put(None)
        self._output_thread.join()
        self.batch.close()
        if self._switch_interval_lowered:  # once, however often `close` is called
            self._switch_interval_lowered = False
            _SWITCH_INTERVAL.restore()

    def __enter__(self) -> "SpeechEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ decode thread
    def _decode_loop(self) -> None:
        self._run_thread(self._iteration, "decode loop")

    def _run_thread(self, iteration: Callable[[], bool], name: str) -> None:
        """Run `iteration` until it returns False (closing: `close` fails what is left); a failure fails every request,
        says why and stops the engine."""
        try:
            with torch.no_grad():
                while iteration():
                    pass
        except BaseException as error:  # the thread must not die silently: fail every request and say why
            logger.exception(f"The speech engine's {name} failed.")
            with self._lock:
                self._failure = f"The speech engine failed: {type(error).__name__}: {error}"
                self._closed = True  # the other threads stop too
                self._lock.notify_all()
            self._fail_pending(self._failure)

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            pending = [item.handle for item in self._prefilled] + list(self._waiting)
            pending += [slot.handle for slot in self._slots if slot is not None]
            self._waiting.clear()
            self._prefilled.clear()
            self._slots = [None] * self.max_batch_size
        for handle in pending:
            self._finish(handle, "error", reason)

    def _iteration(self) -> bool:
        """One pass of the decode thread: drop cancelled requests, place the prefilled one in a free slot, queue one
        decode step, then take the previous step's outputs. False: closing.

        The step is queued before the previous one's outputs are read: the GPU runs it while the host hands those
        outputs on (and waits for the GIL, which the other threads hold at times), instead of idling between steps;
        except while no busy row streams audio yet: then each step's outputs are read before the next step is
        queued, and vocoded first once they may complete a first chunk (`_may_complete_a_first_chunk`). A request
        that finished in the previous step is stepped once more (its outputs are dropped, its slot is then freed); a
        request joins at the first step queued after its admission."""
        with self._lock:
            while (not self._closed and not self._prefilled and self._launched is None
                   and all(slot is None for slot in self._slots)):  # fmt: skip
                self._lock.wait()
            if self._closed:
                return False
            cancelled = [handle for handle in self._waiting if handle.cancelled]
            for handle in cancelled:
                self._waiting.remove(handle)
        for handle in cancelled:
            self._finish(handle, "cancelled")
        for slot in self._slots:
            if slot is not None and slot.handle.cancelled:
                self._leave(slot, "cancelled")
        self._hold_for_prefill(slots=[slot for slot in self._slots if slot is not None])
        self._admit_prefilled()
        self._wait_for_start_up_round()
        active = [slot for slot in self._slots if slot is not None]
        launched = self._launch_step(active) if active else None
        if self._launched is not None:
            self._take_outputs(self._launched)
        self._launched = launched
        if launched is not None and self._vocoder is not None and not any(slot.handle.first_audio for slot in active):
            # No row streams audio yet (an idle server's request): no playback waits for the next step, so it waits
            # until this one's outputs are vocoded. A first chunk then has the GPU to itself, as in
            # `generate_speech_stream`; beside a queued step it took about twice as long (docs/serving.md).
            self._take_outputs(launched)
            self._launched = None
            if self._may_complete_a_first_chunk(launched):
                self._wait_for_output_thread()
        return True

    def _may_complete_a_first_chunk(self, launched: _LaunchedStep) -> bool:
        """Whether the outputs of a step just taken may give a request its first chunk: one of its requests has
        `ServingVocoder.first_chunk_tokens` speech ids or more, or has left (its last item is vocoded whole). Before
        that the output thread has no audio to vocode (it creates the request's decoder and adds the ids, host work),
        and the next step need not wait for it."""
        return any(self._slots[slot.row] is not slot or self._has_first_chunk_ids(slot) for slot in launched.slots)

    def _has_first_chunk_ids(self, slot: _Active) -> bool:
        """Whether the request of `slot` has had `ServingVocoder.first_chunk_tokens` speech ids out (its first
        chunk's, unless some are not codec tokens)."""
        return self._vocoder is not None and slot.groups * self.batch.k >= self._vocoder.first_chunk_tokens

    def _wait_for_output_thread(self) -> None:
        """Wait until the output thread has emitted everything handed to it so far, at most
        `FIRST_AUDIO_HOLD_SECONDS`."""
        with self._lock:
            target = self._handed
            self._emission.wait_for(lambda: self._emitted >= target or self._closed, FIRST_AUDIO_HOLD_SECONDS)

    def _wait_for_start_up_round(self) -> None:
        """Hold the next step while the output thread vocodes a round of start-up chunks, at most
        `FIRST_AUDIO_HOLD_SECONDS` (the step already queued keeps the GPU busy meanwhile)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._start_up_round or self._closed, FIRST_AUDIO_HOLD_SECONDS)

    def _prefill_loop(self) -> None:
        self._run_thread(self._prefill_next, "prefill thread")

    def _prefill_next(self) -> bool:
        """One pass of the prefill thread: prefill the first waiting request once a slot is free for it and the last
        prefilled one has been placed (their prefills share one workspace). False: closing."""
        with self._lock:
            while not self._closed and (self._prefilled or not self._waiting or None not in self._slots):
                self._lock.wait()
            if self._closed:
                return False
            handle = self._waiting.popleft()
        if handle.cancelled:
            self._finish(handle, "cancelled")
            return True
        try:
            handle._mark("admitted")
            self._set_prefilling(True)
            run, first = self.batch.prefill(handle.request, handle.options)
            handle._mark("prefilled")
        except Exception as error:  # the request's own problem: the batch is untouched (prefill workspace)
            logger.warning(f"Request {handle.id} failed before joining the batch: {error}")
            self._finish(handle, "error", f"{type(error).__name__}: {error}")
            return True
        finally:
            self._set_prefilling(False)
        max_new = handle.request.max_new_tokens or self.max_new_tokens
        with self._lock:
            # An engine that failed meanwhile failed its pending requests, but not this one, held by no list then.
            failure = self._failure
            if failure is None:
                self._prefilled.append(_Prefilled(handle, run, first, max_new))
                self._lock.notify_all()
        if failure is not None:
            self._finish(handle, "error", failure)
        return True

    def _set_prefilling(self, running: bool) -> None:
        with self._lock:
            self._prefilling = running
            if not running:
                self._lock.notify_all()  # steps and rounds held for the prefill go on

    def _hold_for_prefill(self, slots: Sequence[_Active] = (), handles: Sequence[RequestHandle] = ()) -> None:
        """While a request is prefilled, hold the next decode step of `slots` or vocoder round of `handles` for it, at
        most `PREFILL_HOLD_SECONDS`, unless one of their requests needs it now: its playback has caught up with its
        audio, or it waits for its first audio (a step's row only until its first chunk's speech ids are out)."""
        with self._lock:
            if not self._prefilling or not (slots or handles):
                return
            now = time.perf_counter()
            for slot in slots:
                if slot.handle.first_audio is None:
                    if not self._has_first_chunk_ids(slot):
                        return
                elif self._starved(slot.handle, now):
                    return
            for handle in handles:
                if handle.first_audio is None or self._starved(handle, now):
                    return
            self._lock.wait_for(lambda: not self._prefilling or self._closed, PREFILL_HOLD_SECONDS)

    def _starved(self, handle: RequestHandle, now: float) -> bool:
        """Whether the playback of `handle`'s audio, in real time from its first audio, has caught up with it."""
        return handle.audio_samples / self.sampling_rate < now - handle.submitted - handle.first_audio

    def _admit_prefilled(self) -> None:
        """Place the prefilled request in a free slot when it fits (else it waits, and nothing overtakes it)."""
        with self._lock:
            free = [row for row, slot in enumerate(self._slots) if slot is None]
            if not self._prefilled or not free:
                return
            item = self._prefilled[0]
        handle = item.handle
        if handle.cancelled:
            self._finish(handle, "cancelled")
        else:
            offset = self._placement(handle.prompt_tokens, item.max_new_tokens)
            if offset is None:  # no room yet: wait for running rows to finish
                return
            if offset:
                self.batch.rebase(offset, free)
                busy = [slot for slot in self._slots if slot is not None]
                for slot in busy:
                    slot.start -= offset
                    slot.reserved_end -= offset
                if busy:  # an empty batch's rebase copies nothing
                    with self._lock:
                        self.metrics.rebases += 1
            row = free[0]
            self.batch.admit(row, item.run)
            column, first = self.batch.column, item.first
            slot = _Active(handle, item.run, row, column - handle.prompt_tokens, column + item.max_new_tokens,
                           item.max_new_tokens, groups=len(first["speech"]) // self.batch.k)  # fmt: skip
            with self._lock:
                self._slots[row] = slot
            self._advance(slot, first["token"], first["done"], first["speech"])
        with self._lock:  # the prefill workspace is free again (what `admit` read is queued before the next prefill)
            self._prefilled.popleft()
            self._lock.notify_all()

    def _placement(self, length: int, max_new: int) -> int | None:
        """The column offset to shift the batch by before a request of `length` prompt tokens and `max_new` steps
        joins (0: none; negative: to the right), or None when no offset leaves every row its reserved room.

        An empty batch starts over with the prompt at columns `[0, length)` (nothing is copied): the same request
        then always gets the same columns, so an idle server repeats its computation, rounding included (a GPU's
        decode attention splits the columns by their position), and no step runs over columns no row reads."""
        cache_length, column = self.batch.cache_length, self.batch.column
        active = [slot for slot in self._slots if slot is not None]
        if not active:
            return column - length
        if length <= column and column + max_new <= cache_length:
            return 0
        low = max([slot.reserved_end - cache_length for slot in active] + [column + max_new - cache_length])
        high = min([slot.start for slot in active] + [column - length])
        return high if low <= high else None  # the largest left shift: room for the longest time

    def _launch_step(self, active: list[_Active]) -> _LaunchedStep:
        """Queue one decode step of the busy slots and the copy of its outputs."""
        self.batch.step({slot.row: slot.run.generator for slot in active})
        return _LaunchedStep(active, self.batch.start_read())

    def _take_outputs(self, launched: _LaunchedStep) -> None:
        """Hand a queued step's outputs to its requests (waiting for them); slots freed or refilled since are not
        its requests' any more."""
        tokens, done, groups, last_groups = self.batch.read_results(launched.outputs)
        with self._lock:
            self.metrics.steps += 1
            self.metrics.step_rows.observe(len(launched.slots))
        for slot in launched.slots:
            if self._slots[slot.row] is not slot:  # it left (finished, cancelled) after the step was queued
                continue
            row = slot.row
            speech = last_groups[row] if groups[row] > slot.groups else []
            slot.groups = groups[row]
            self._advance(slot, tokens[row], done[row], speech)

    def _advance(self, slot: _Active, token: int, done: bool, speech: list[int]) -> None:
        """Hand one step's outputs of a request to the output thread; free its slot when it finished."""
        slot.tokens += 1
        finish = "stop" if done else "length" if slot.tokens >= slot.max_new_tokens else None
        if finish is not None:  # the slot is free before the caller sees the last event
            self._leave(slot, None)
        self._hand(StepOutput(slot.handle, [token], speech, finish, None, time.perf_counter()))

    def _leave(self, slot: _Active, reason: str | None) -> None:
        self.batch.free(slot.row)
        with self._lock:
            self._slots[slot.row] = None
            self._lock.notify_all()  # a free slot: the prefill thread may take the next request
        if reason is not None:
            self._finish(slot.handle, reason)

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self._hand(StepOutput(handle, [], [], reason, error, time.perf_counter()))

    def _hand(self, item: StepOutput) -> None:
        """Queue an item for the output thread (counted: `_wait_for_output_thread`)."""
        with self._lock:
            self._handed += 1
            self._output.put(item)

    # ------------------------------------------------------------------ output thread
    def _output_loop(self) -> None:
        items, closing, taken = [], False, 0
        while True:
            # Everything queued so far (waiting for an item if there is none): the audio of all requests' ready
            # chunks is decoded together.
            if not closing:
                queued, closing = self._take_queued(wait=None if not items else 0)
                items += queued
                taken += len(queued)
            if items:  # a round of one (merged) item per request: its events in order
                round_items, items = self._next_round(items)
                self._hold_for_prefill(handles=[item.handle for item in round_items])
                concurrent = self._vocoder is not None and self._vocoder.concurrent_start_up
                if concurrent and not self._in_start_up(round_items):
                    running = self._start_round(round_items)
                    items, closing, more = self._start_up_meanwhile(running, items, closing)
                    taken += more
                    self._finish_round(running)
                else:
                    self._emit_round_holding_steps(round_items)
            if not items:  # everything taken so far is emitted (the queue is in the order items were handed)
                with self._lock:
                    self._emitted = taken
                    self._emission.notify_all()
            if closing and not items:
                return

    def _in_start_up(self, items: list[StepOutput]) -> bool:
        """Whether every request of a round is in its start-up (`ServingVocoder.in_start_up`)."""
        return self._vocoder is not None and all(self._vocoder.in_start_up(item.handle.id) for item in items)

    def _emit_round_holding_steps(self, items: list[StepOutput]) -> None:
        """`_emit_round`, the decode thread holding its next step meanwhile if every request of the round is in its
        start-up (`_wait_for_start_up_round`) and the round may decode audio (`ServingVocoder.may_decode`: a round
        that only adds a reply's first ids holds nothing)."""
        if not self._in_start_up(items) or not self._vocoder.may_decode(vocode_items(items)):
            self._emit_round(items)
            return
        with self._lock:
            self._start_up_round = True
        try:
            self._emit_round(items)
        finally:
            with self._lock:
                self._start_up_round = False
                self._lock.notify_all()

    def _start_up_meanwhile(
        self, running: VocoderRound, items: list[StepOutput], closing: bool
    ) -> tuple[list[StepOutput], bool, int]:
        """While `running` (a round of steady chunks) is on the GPU, take what the decode thread hands over and emit
        the start-up chunks among it at once, beside the round (`ServingVocoder.concurrent_start_up`), instead of
        after it: a steady round of many streams at their largest hop takes several times a first chunk. Returns
        `(items left, in order; whether the last item ever was taken; items taken)`."""
        taken = 0
        while running.audio is not None and not running.audio.done():
            if closing:
                time.sleep(START_UP_POLL_SECONDS)
            else:
                queued, closing = self._take_queued(wait=START_UP_POLL_SECONDS)
                items += queued
                taken += len(queued)
            if any(self._vocoder.in_start_up(item.handle.id) for item in items):
                start_up, items = self._next_round(items)  # the requests in their start-up
                self._emit_round_holding_steps(start_up)
        return items, closing, taken

    def _take_queued(self, wait: float | None) -> tuple[list[StepOutput], bool]:
        """What the decode thread has queued since the last look, and whether that ends with the last item ever (put
        after the decode thread ended). `wait`: seconds to wait for a first item (None: until one comes; 0: none).
        Taken before every round: a round may take long, and what comes meanwhile joins the next."""
        items, block = [], wait != 0
        while True:
            try:
                item = self._output.get(block, wait)
            except queue.Empty:
                return items, False
            if item is None:
                return items, True
            items.append(item)
            block = False

    def _next_round(self, items: list[StepOutput]) -> tuple[list[StepOutput], list[StepOutput]]:
        """`(round, rest)`: every queued item of each request up to its last, merged into one item per request
        (`merged_outputs`), of the requests in their start-up (`ServingVocoder.in_start_up`) if any (else of all), and
        the other items in order. A round thus catches up with all the steps handed over since the last one, however far
        vocoding fell behind (one round per step would leave it behind for good once a flow call outlasts a step). A
        reply's start-up chunks get vocoder calls of their own, also when queued while a round ran: a round's chunks
        share one flow call, whose time grows with its rows and windows (the DiT is GEMM-bound at a steady window),
        so they would otherwise wait for every steady chunk."""
        starting = set()
        if self._vocoder is not None:
            starting = {item.handle.id for item in items if self._vocoder.in_start_up(item.handle.id)}
        taken: dict[int, list[StepOutput]] = {}  # request id -> its items of this round, in order
        ended, rest = set(), []
        for item in items:
            request = item.handle.id
            take = request not in ended and (not starting or request in starting)
            (taken.setdefault(request, []) if take else rest).append(item)
            if take and item.finish is not None:  # anything after a request's last item is left (and dropped)
                ended.add(request)
        return [merged_outputs(group) for group in taken.values()], rest

    def _emit_round(self, items: list[StepOutput]) -> None:
        """Emit the events of queued items of distinct requests, in order, their audio decoded together (one vocoder
        call); a vocoder error fails its request only."""
        self._finish_round(self._start_round(items))

    def _start_round(self, items: list[StepOutput]) -> VocoderRound:
        """Queue the audio of items of distinct requests on the GPU (one vocoder call, `ServingVocoder.start`; a
        round whose requests are all in their start-up is vocoded as such)."""
        start_up = self._in_start_up(items)
        items = [item for item in items if not item.handle.finished.is_set()]  # e.g. a cancellation after the end
        parts = vocode_items(items)
        started = time.perf_counter()
        if self._vocoder is None or not items:
            return VocoderRound(items, None, None, started)
        try:
            return VocoderRound(items, self._vocoder.start(parts, start_up=start_up), None, started)
        except Exception as failure:  # not one request's problem: fail the round's requests, keep the thread
            return VocoderRound(items, None, failure, started)

    def _finish_round(self, running: VocoderRound) -> None:
        """Emit the events of a round's items (`_start_round`), in order, once its audio is on the host; a vocoder
        error fails its request only."""
        items, started = running.items, running.started
        if running.failure is not None:
            audio = [running.failure] * len(items)
        elif running.audio is None:
            audio = [np.zeros(0, np.float32)] * len(items)
        else:
            try:
                audio = running.audio.result()
            except Exception as failure:
                audio = [failure] * len(items)
        for item, samples in zip(items, audio):
            handle, text_ids, speech_ids, finish, error, _ = item
            try:
                if isinstance(samples, Exception):
                    raise samples
                finished = finish is not None
                event = SpeechEvent(
                    text=self._text_delta(handle.id, text_ids, finished), text_ids=list(text_ids),
                    speech_ids=list(speech_ids), audio=samples, sampling_rate=self.sampling_rate, finished=finished,
                    finish_reason=finish, error=error,
                )  # fmt: skip
            except Exception as failure:  # a vocoder error fails this request only
                logger.error(f"Vocoding request {handle.id} failed.", exc_info=failure)
                if self._vocoder is not None:
                    self._vocoder.drop(handle.id)
                self._text.pop(handle.id, None)
                handle.cancel()  # its slot is freed at the next step
                event = SpeechEvent(sampling_rate=self.sampling_rate, finished=True, finish_reason="error",
                                    error=f"vocoding failed: {type(failure).__name__}: {failure}")  # fmt: skip
            self._record(item, event, started)
            try:
                handle._emit(event)
            except Exception as failure:  # a sink that fails (a closed event loop) must not stop the other requests
                logger.warning(f"Request {handle.id}: its event could not be delivered ({failure}); cancelling it.")
                handle.cancel()

    def _text_delta(self, request_id: int, text_ids: list[int], final: bool) -> str:
        deltas = self._text.setdefault(request_id, TextDeltas(self.tokenizer))
        delta = deltas.push(text_ids, final)
        if final:
            self._text.pop(request_id, None)
        return delta

    def _record(self, item: StepOutput, event: SpeechEvent, vocoding_started: float) -> None:
        handle, first_audio = item.handle, False
        with self._lock:
            metrics = self.metrics
            if len(event.audio):
                metrics.audio_seconds += len(event.audio) / event.sampling_rate
                if handle.first_audio is None:
                    first_audio = True
                    handle._mark("ready", item.queued)  # the decode result that completed its first chunk
                    handle._mark("vocoding", vocoding_started)
                    handle._mark("first_audio")
                    handle.first_audio = handle.timeline["first_audio"]
                    # The decode results delivered so far, this one included (not yet in `handle.text_ids`).
                    handle.first_audio_steps = len(handle.text_ids) + len(event.text_ids)
                    metrics.time_to_first_audio.observe(handle.first_audio)
            if event.finished:
                metrics.requests[event.finish_reason] += 1
        if first_audio:
            stages = ", ".join(f"{stage} {1000 * seconds:.1f} ms" for stage, seconds in handle.timeline.items())
            steps = handle.first_audio_steps
            logger.debug(f"Request {handle.id}: first audio after {steps} decode results ({stages}).")

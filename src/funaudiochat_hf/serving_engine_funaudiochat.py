"""Continuous batching for Fun-Audio-Chat speech-to-speech: many conversations share the decode steps of one GPU.

`SpeechEngine` runs the package's decode step over the rows ("slots") of one static batch in a background thread. A new
request is prefilled alone (batch 1) between two steps and its cache rows and per-row state are placed into a free
slot; a finished, cancelled or disconnected request leaves and frees its slot at the next step. Every request has its
own sampling values, seed, length limit and voice, and streams text deltas and 24 kHz audio chunks (a streaming
CosyVoice3 decoder per request, on an output thread so that vocoding never delays a decode step; the chunks ready
across requests are decoded together, see `serving_vocoder_funaudiochat`).

A request decodes exactly as it would alone (`generate_speech` at batch 1, same seed): a slot is a left-padded row.

* Columns. The batch's static caches have `cache_length` LLM columns (K times that for the CRQ) written left to right
  by every step at one shared column `C` (the caches' `cumulative_length`). A request with an `L`-token prompt joins
  right-aligned: its prefill's cache entries go to columns `[C - L, C)`, its row of the attention masks is False before
  `C - L`, and its rotary positions (per row, carried in its state) start at 0, exactly as a left-padded row. Rotary
  positions are per row and the keys are stored rotated, so a row's columns may move without changing its attention.
* Room. A request reserves `L + max_new_tokens` columns from its start. It joins at the current `C` when `L <= C`
  and `C + max_new_tokens <= cache_length`; otherwise every column is shifted left (or right) by one offset `d` such
  that all rows keep their reserved room (a rebase: one copy of the caches and masks, no recomputation). When no offset
  fits, the request waits (in order: nothing overtakes it) until running rows finish. With
  `cache_length >= max_prompt_tokens + 2 * max_new_tokens` (the default) every request fits at once.
* Randomness. Each request draws its exponential noise from its own `torch.Generator` (seeded by the request, else
  from the global RNG), row by row before each step, in the order a single run draws it: its tokens equal its single
  run's whatever joins or leaves around it.
* Sampling values (temperature, top-p, repetition penalty) are per-row tensors read by the step. Which processors run
  at all (sampling or greedy) is fixed per engine: a top-p of 1 or a penalty of 1 in a row of a batch that runs those
  processors changes nothing, so every value rides along exactly.
* Leaving. A finished or cancelled row is marked done (the step then writes padding for it) and its mask row is
  opened (every column readable, so the idle row never attends to nothing); its slot takes the next request.

The decode internals the engine uses (workspace buffers, the step function, the prefill) are all behind
`_DecodeAdapter`, the only class here that touches them.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.utils import logging

from .generation_config_funaudiochat import SpeechRequest as ResolvedRequest
from .generation_loop_funaudiochat import SpeechRun
from .generation_output_funaudiochat import TextDeltas
from .generation_plan_funaudiochat import BACKENDS
from .generation_state_funaudiochat import CACHE_LENGTH_MULTIPLE
from .generation_vocoding_funaudiochat import decoder_sampling_rate
from .serving_vocoder_funaudiochat import ServingVocoder, VocodeItem


logger = logging.get_logger(__name__)

# The engine's per-request sizes (prompt tokens, reply steps): they size its prefill and batch caches. The audio and
# text limits of `limits_funaudiochat` are checked before tokenization (processor, server); these bound the tokens.
DEFAULT_MAX_PROMPT_TOKENS = 1024
DEFAULT_MAX_NEW_TOKENS = 512
# Values that switch every per-row sampling processor on in the batch's step (each row then reads its own values).
_BATCH_SWITCH_VALUES = {"temperature": 1.0, "top_p": 0.5, "repetition_penalty": 1.5}
# The request keywords that become per-row values.
REQUEST_SAMPLING_KEYS = ("temperature", "top_p", "repetition_penalty")
# Row counts of the batch's decode step (besides the whole batch): a step runs the smallest that holds every busy row.
_STEP_ROW_COUNTS = (1, 2, 4, 8, 16)


def step_row_counts(batch_size: int) -> tuple[int, ...]:
    """The row counts the decode step of a batch of `batch_size` slots comes in, ascending (the last: all of them).
    A request takes the lowest free slot, so the busy rows are mostly the first ones: one request alone is stepped as
    a batch of one (`generate_speech`'s step), not with the idle rows of the whole batch. Each count is one step
    graph, recorded when the engine starts."""
    return (*(rows for rows in _STEP_ROW_COUNTS if rows < batch_size), batch_size)


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
    """An increment of one request's reply.

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
        # "admitted" (its prefill starts), "prefilled" (its first token is read), "vocoding" (the output thread starts
        # the round that yields its first audio), "first_audio" (that audio is ready, before its event is delivered).
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
        """The request's events, blocking, until the last (`finished`) one; `timeout` per event (queue.Empty)."""
        if self._queue is None:
            raise RuntimeError("This request's events go to the `sink` given to `submit`.")
        while True:
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


class _DecodeAdapter:
    """The engine's only view of the decode internals.

    It owns one `SpeechGenerator` (`model.speech_generator(max_batch_size, cache_length, backend)`), held for the
    engine's lifetime: the generator owns the batch workspace (per-row sampling values), the batch-1 workspace the
    requests are prefilled in, the weight copies, compiled step functions and CUDA graphs. The batch's step is the
    generator's step function for the batch's `StepConfig`; a request's prefill is a `SpeechRun` of its own (batch 1,
    its own step configuration, exactly `generate_speech`'s). Besides that it reads and writes the workspace's per-row
    state (`_ROW_STATE`, `speech_out`, the masks, the two `StaticCache`s' tensors and `cumulative_length`) and its
    noise and sampling-value buffers.
    """

    # Per-row state a prefilled request brings into its slot (everything else of a row is scratch of one step).
    _ROW_STATE = (
        "llm_position", "crq_position", "next_embeds", "next_ids", "prev_speech_token", "speaking", "done",
        "finish_step", "groups", "last_group", "speech_seen", "text_seen",
    )  # fmt: skip

    def __init__(self, model, batch_size: int, cache_length: int, generation_options: dict, backend: str):
        self.model = model
        self.options = dict(generation_options)
        if self.options.pop("cache_implementation", "static") != "static":
            raise ValueError("The speech engine shares static caches between requests: drop `cache_implementation`.")
        for name in ("backend", "compile", "output_logits"):
            if name in self.options:
                raise ValueError(f"`{name}` is not a generation option of the engine (use `SpeechEngine(backend=...)`).")
        self.backend = backend
        self.batch_size, self.cache_length = batch_size, cache_length
        self.generator = model.speech_generator(max_batch_size=batch_size, max_length=cache_length, backend=backend)
        self.generator.acquire()  # the engine's own, for its lifetime (released by `close`)
        try:
            self._start_batch()
        except BaseException:
            self.close()
            raise
        self.steps_since_reset = 0

    def _start_batch(self) -> None:
        """The batch's run over a one-token dummy prompt per row: its step configuration and step function, and the
        prefill that allocates the batch's caches and attaches its weight copies; two warm-up steps then compile and
        record it. Every row is free afterwards."""
        dummy = torch.zeros(self.batch_size, 1, dtype=torch.long)
        # The batch's caches are static (rows join at a shared column); a request's own prefill uses the caches its
        # plan uses in `generate_speech` (e.g. dynamic ones on a CPU, where a static cache as long as the batch's
        # would make its prompt pass attend over, and build masks for, every column of it).
        batch_options = {**_BATCH_SWITCH_VALUES, "max_new_tokens": 1, "cache_implementation": "static"}
        batch_request = self._resolve(dummy, batch_options)
        self.batch_run = SpeechRun(
            self.model, self.generator, batch_request, dummy, None, {}, None, per_row_sampling=True
        )
        self.cfg, self.ws = self.batch_run.cfg, self.batch_run.ws
        self.k = self.cfg.group_size
        self.batch_run.prefill()
        # A run per row count of `step_row_counts`, over the first rows of the batch's workspace (views: the same
        # caches and state), each with its row count's plan (one row: `generate_speech`'s batch-1 step).
        self.row_runs: dict[int, SpeechRun] = {}
        for rows in step_row_counts(self.batch_size):
            run = self.batch_run
            if rows < self.batch_size:
                request = self._resolve(dummy[:rows], batch_options)
                run = SpeechRun(self.model, self.generator, request, dummy[:rows], None, {}, None,
                                per_row_sampling=True, rows_of=self.ws)  # fmt: skip
                if run.cfg.plan.step_graph:  # as a prefill checks its workspace's graphs
                    run.ws.check_graphs(self.model)
            self.row_runs[rows] = run
            # Twice: the first run compiles / warms the step up, the second records its CUDA graph
            # (`plan.step_graph`), so that no request waits for either and the graphs' memory is held from the start.
            run.step_fn(self.model, run.ws, run.cfg)
            run.step_fn(self.model, run.ws, run.cfg)
        for row in range(self.batch_size):
            self.free(row)
        self.ws.step.zero_()

    def close(self) -> None:
        """Free the generator's caches, weight copies and graphs (once)."""
        if self.generator is None:
            return
        generator, self.generator = self.generator, None
        generator.release()
        generator.close()

    # ------------------------------------------------------------------ requests
    def _resolve(self, input_ids: torch.Tensor, kwargs: dict) -> ResolvedRequest:
        return self.model.resolve_speech_request(input_ids, None, None, {**self.options, **kwargs})

    def resolve(self, request: SpeechRequest, max_new_tokens: int) -> ResolvedRequest:
        """A request's settings, checked as `generate_speech` checks them (same errors) without touching the model's
        tensors: safe to call from any thread."""
        kwargs = {"max_new_tokens": max_new_tokens}
        for name in REQUEST_SAMPLING_KEYS:
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.seed is not None:
            kwargs["seed"] = request.seed
        resolved = self._resolve(request.inputs["input_ids"], kwargs)
        for stream in ("text", "speech"):
            own = getattr(resolved, stream).switches
            batch = getattr(self.cfg, stream)
            if own.do_sample != batch.do_sample or own.uses_top_k:
                mode = "samples" if batch.do_sample else "decodes greedily"
                raise ValueError(
                    f"This engine {mode} the {stream} tokens, with temperature / top_p / repetition_penalty values per "
                    "request; a request cannot switch sampling on or off or use top_k."
                )
        return resolved

    def new_run(self, request: SpeechRequest, resolved: ResolvedRequest) -> SpeechRun:
        """The request's batch-1 run on the engine's generator (raises ValueError naming a problem of its inputs)."""
        inputs = dict(request.inputs)
        input_ids, attention_mask = inputs.pop("input_ids"), inputs.pop("attention_mask", None)
        return SpeechRun(self.model, self.generator, resolved, input_ids, attention_mask, inputs, None)

    def prefill(self, run: SpeechRun) -> dict:
        """Run a request's prompt alone in its batch-1 workspace; returns its first step's outputs (as `read`)."""
        ws = run.prefill()
        return {
            "token": int(ws.next_ids[0]),
            "done": bool(ws.done[0]),
            "speech": ws.speech_out[0, : int(ws.groups[0]) * self.k].tolist(),
        }

    # ------------------------------------------------------------------ slots
    @property
    def column(self) -> int:
        """The batch's next cache column `C` (shared by every row)."""
        return int(self.ws.llm_cache.layers[0].cumulative_length)

    def admit(self, row: int, run: SpeechRun) -> None:
        """Move the prefilled request (its batch-1 workspace) into slot `row`, right-aligned at the current column."""
        ws, pre, k = self.ws, run.ws, self.k
        # The run's own columns: its prompt after any bucket padding of its recorded prompt pass.
        skip = run.bucket_padding or 0
        length = run.input_ids.shape[1] - skip
        end = self.column
        start = end - length
        for batch_cache, own_cache, scale in ((ws.llm_cache, pre.llm_cache, 1), (ws.crq_cache, pre.crq_cache, k)):
            if batch_cache is None:
                continue
            own = slice(scale * skip, scale * (skip + length))
            for batch_layer, own_layer in zip(batch_cache.layers, own_cache.layers):
                batch_layer.keys[row, :, scale * start : scale * end] = own_layer.keys[0, :, own]
                batch_layer.values[row, :, scale * start : scale * end] = own_layer.values[0, :, own]
        ws.llm_mask[row] = True
        ws.llm_mask[row, :start] = False
        ws.crq_mask[row] = True
        ws.crq_mask[row, : k * start] = False
        for name in self._ROW_STATE:
            getattr(ws, name)[row] = getattr(pre, name)[0]
        width = min(ws.speech_out.shape[1], pre.speech_out.shape[1])
        ws.speech_out[row] = run.speech_pad_id
        ws.speech_out[row, :width] = pre.speech_out[0, :width]
        ws.text_sampling.fill_row_(row, run.request.text)
        ws.speech_sampling.fill_row_(row, run.request.speech)

    def free(self, row: int) -> None:
        """Mark slot `row` idle: the step writes padding for it; its masks read every column (never none)."""
        self.ws.done[row] = True
        self.ws.speaking[row] = False
        self.ws.llm_mask[row] = True
        self.ws.crq_mask[row] = True

    def rebase(self, offset: int, free_rows: list[int]) -> None:
        """Shift every cache column and mask column left by `offset` (right if negative); the shared column moves
        with them. Free rows' masks stay open (their content is any finite stale state)."""
        if offset == 0:
            return
        ws, k = self.ws, self.k
        end = self.column
        for cache, masks, scale in ((ws.llm_cache, ws.llm_mask, 1), (ws.crq_cache, ws.crq_mask, k)):
            if cache is None:
                continue
            shift, used = scale * offset, scale * end
            for layer in cache.layers:
                _shift_columns(layer.keys, shift, used, dim=2)
                _shift_columns(layer.values, shift, used, dim=2)
            # Columns opened on the left by a right shift precede every prompt; those vacated on the right by a left
            # shift are the next ones written, readable by every row.
            _shift_columns(masks, shift, used, dim=1, fill_left=False, fill_right=True)
            for layer in cache.layers:
                layer.cumulative_length.fill_(used - shift)
        for row in free_rows:
            ws.llm_mask[row] = True
            ws.crq_mask[row] = True

    # ------------------------------------------------------------------ steps
    def step_rows(self, busy_rows) -> int:
        """The rows a step runs while `busy_rows` are busy: the smallest row count of `step_row_counts` past the
        last busy row."""
        last = max(busy_rows)
        return next(rows for rows in self.row_runs if rows > last)

    def step(self, generators: dict[int, torch.Generator]) -> None:
        """One decode step of the first `step_rows` rows, which hold every busy one; `generators`: the busy rows' own
        generators (their noise is drawn row by row, text then speech, as a single run draws it). The other rows are
        free (done, masks open): they stay as they are until a step covers them again."""
        ws, cfg = self.ws, self.cfg
        for row, generator in generators.items():
            if cfg.text.do_sample:
                ws.text_noise[row].exponential_(generator=generator)
            if cfg.speech.do_sample and not cfg.disable_speech:
                ws.speech_noise[row].exponential_(generator=generator)
        # The step writes its text token at column `step` of `text_out`; the engine reads `next_ids` instead, so the
        # index only has to stay in range.
        if self.steps_since_reset >= ws.max_length - 1:
            ws.step.zero_()
            self.steps_since_reset = 0
        run = self.row_runs[self.step_rows(generators)]
        run.step_fn(self.model, run.ws, run.cfg)
        self.steps_since_reset += 1

    def read(self) -> tuple[list[int], list[bool], list[int], list[list[int]]]:
        """The last step's text token, done flag, speech-group count and last group of every row (one copy)."""
        ws = self.ws
        snapshot = torch.cat([ws.next_ids, ws.done.long(), ws.groups, ws.last_group.flatten()]).tolist()
        b, k = self.batch_size, self.k
        groups = snapshot[3 * b :]
        return (
            snapshot[:b],
            [bool(v) for v in snapshot[b : 2 * b]],
            snapshot[2 * b : 3 * b],
            [groups[r * k : (r + 1) * k] for r in range(b)],
        )


def _distinct_requests_prefix(items: list) -> int:
    """How many leading output items (handle first) are of distinct requests."""
    seen = set()
    for count, item in enumerate(items):
        if item[0].id in seen:
            return count
        seen.add(item[0].id)
    return len(items)


def _shift_columns(tensor: torch.Tensor, shift: int, used: int, dim: int, fill_left=None, fill_right=None) -> None:
    """Move columns `[0, used)` of `tensor` along `dim` to `[-shift, used - shift)` in place (`shift` > 0: left).
    Columns opened on the left by a right shift get `fill_left`, those vacated on the right by a left shift
    `fill_right`, when given (else they keep stale values)."""
    if shift > 0:
        tensor.narrow(dim, 0, used - shift).copy_(tensor.narrow(dim, shift, used - shift).clone())
        if fill_right is not None:
            tensor.narrow(dim, used - shift, shift).fill_(fill_right)
    elif shift < 0:
        tensor.narrow(dim, -shift, used).copy_(tensor.narrow(dim, 0, used).clone())
        if fill_left is not None:
            tensor.narrow(dim, 0, -shift).fill_(fill_left)


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


class _Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


class EngineMetrics:
    """Counters of a `SpeechEngine` (read by the server's `/metrics`); updated under the engine's lock."""

    def __init__(self):
        self.requests = {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "rejected": 0}
        self.steps = 0
        self.rebases = 0
        self.step_rows = _Histogram((1, 2, 4, 8, 16, 32, 64, 128))
        self.time_to_first_audio = _Histogram((0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0))
        self.audio_seconds = 0.0


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
        stream_options: keywords of the decoder's `streaming_decoder` (defaults as `generate_speech_stream`).
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
        self.model = model
        self.tokenizer = tokenizer
        decoder = speech_decoder if speech_decoder is not None else getattr(model, "token2wav", None)
        self.decoder = decoder
        self.sampling_rate = decoder_sampling_rate(decoder) if decoder is not None else 24000
        self.stream_options = {"token_hop_len": 15, "pre_lookahead_len": 3, "first_token_hop_len": 5}
        self.stream_options.update(stream_options or {})
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.metrics = EngineMetrics()
        logger.info(
            f"Speech engine: {max_batch_size} slots, {cache_length} cache columns, prompts up to {max_prompt_tokens} "
            f"tokens, replies up to {max_new_tokens} steps; allocating and warming up ..."
        )
        with torch.no_grad():
            self.adapter = _DecodeAdapter(model, max_batch_size, cache_length, generation_options or {}, backend)
        self._lock = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._slots: list[_Active | None] = [None] * max_batch_size
        self._closed = False
        self._failure: str | None = None
        self._output: queue.Queue = queue.Queue()
        # Each request's streaming decoder (output thread only); their chunks are decoded together.
        self._vocoder = None
        if decoder is not None:
            self._vocoder = ServingVocoder(decoder, self.stream_options, self.adapter.cfg.speech_bos_id)
            if self._vocoder.fixed_shapes:
                sizes = self._vocoder.warm_up_batch_sizes(max_batch_size)
                logger.info(f"Speech engine: recording the speech decoder's graphs for rounds of {sizes} streams ...")
                self._vocoder.warm_up(max_batch_size)
        self._text: dict[int, TextDeltas] = {}  # request id -> its reply's text so far (output thread)
        self._decode_thread = threading.Thread(target=self._decode_loop, name="speech-engine-decode", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="speech-engine-output", daemon=True)
        self._decode_thread.start()
        self._output_thread.start()

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
        options = self.adapter.resolve(request, max_new)
        handle = RequestHandle(request, sink)
        handle.options = options
        with self._lock:
            if self._closed or self._failure is not None:
                raise EngineClosed(self._failure or "The speech engine is closed.")
            free_slots = sum(slot is None for slot in self._slots)
            if len(self._waiting) >= self.max_queue + free_slots:  # a free slot takes a request at the next step
                self.metrics.requests["rejected"] += 1
                raise QueueFull(
                    f"The server is at capacity ({self.max_batch_size} running, {len(self._waiting)} queued).",
                    retry_after=1.0,
                )
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    @property
    def voices(self) -> list[str]:
        """The speech decoder's voice names (empty: no named voices)."""
        config = getattr(self.decoder, "config", None)
        return list(getattr(config, "speaker_names", None) or [])

    def snapshot(self) -> dict:
        """A consistent copy of the metrics (for `/metrics`)."""
        with self._lock:
            m = self.metrics
            return {
                "requests": dict(m.requests),
                "running": sum(slot is not None for slot in self._slots),
                "queued": len(self._waiting),
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
        return not self._closed and self._failure is None and self._decode_thread.is_alive()

    def close(self) -> None:
        """Stop the threads; waiting and running requests end with an error event."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._decode_thread.join()
        self._output.put(None)
        self._output_thread.join()
        self.adapter.close()

    def __enter__(self) -> "SpeechEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ decode thread
    def _decode_loop(self) -> None:
        try:
            with torch.no_grad():
                while self._iteration():
                    pass
        except BaseException as error:  # the thread must not die silently: fail every request and say why
            logger.exception("The speech engine's decode loop failed.")
            with self._lock:
                self._failure = f"The speech engine failed: {type(error).__name__}: {error}"
        with self._lock:
            reason = self._failure or "The speech engine was closed."
            pending = list(self._waiting) + [slot.handle for slot in self._slots if slot is not None]
            self._waiting.clear()
            self._slots = [None] * self.max_batch_size
        for handle in pending:
            self._finish(handle, "error", reason)

    def _iteration(self) -> bool:
        """One pass: drop cancelled requests, admit waiting ones, run one decode step. False: closing."""
        with self._lock:
            while not self._closed and not self._waiting and all(slot is None for slot in self._slots):
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
        self._admit_waiting()
        active = [slot for slot in self._slots if slot is not None]
        if active:
            self._decode_step(active)
        return True

    def _admit_waiting(self) -> None:
        """Prefill waiting requests into free slots, in order, while they fit."""
        while True:
            with self._lock:
                free = [row for row, slot in enumerate(self._slots) if slot is None]
                if not self._waiting or not free:
                    return
                handle = self._waiting[0]
            max_new = handle.request.max_new_tokens or self.max_new_tokens
            offset = self._placement(handle.prompt_tokens, max_new)
            if offset is None:  # no room yet: wait for running rows to finish (nothing overtakes this request)
                return
            with self._lock:
                self._waiting.popleft()
            if handle.cancelled:
                self._finish(handle, "cancelled")
                continue
            try:
                handle._mark("admitted")
                run = self.adapter.new_run(handle.request, handle.options)
                first = self.adapter.prefill(run)
                handle._mark("prefilled")
            except Exception as error:  # the request's own problem: the batch is untouched (prefill workspace)
                logger.warning(f"Request {handle.id} failed before joining the batch: {error}")
                self._finish(handle, "error", f"{type(error).__name__}: {error}")
                continue
            if offset:
                self.adapter.rebase(offset, free)
                for slot in self._slots:
                    if slot is not None:
                        slot.start -= offset
                        slot.reserved_end -= offset
                with self._lock:
                    self.metrics.rebases += 1
            row = free[0]
            self.adapter.admit(row, run)
            column = self.adapter.column
            slot = _Active(handle, run, row, column - handle.prompt_tokens, column + max_new, max_new,
                           groups=len(first["speech"]) // self.adapter.k)  # fmt: skip
            with self._lock:
                self._slots[row] = slot
            self._advance(slot, first["token"], first["done"], first["speech"])

    def _placement(self, length: int, max_new: int) -> int | None:
        """The column offset to shift the batch by before a request of `length` prompt tokens and `max_new` steps
        joins (0: none; negative: to the right), or None when no offset leaves every row its reserved room."""
        cache_length, column = self.adapter.cache_length, self.adapter.column
        if length <= column and column + max_new <= cache_length:
            return 0
        active = [slot for slot in self._slots if slot is not None]
        low = max([slot.reserved_end - cache_length for slot in active] + [column + max_new - cache_length])
        high = min([slot.start for slot in active] + [column - length])
        return high if low <= high else None  # the largest left shift: room for the longest time

    def _decode_step(self, active: list[_Active]) -> None:
        adapter = self.adapter
        adapter.step({slot.row: slot.run.generator for slot in active})
        tokens, done, groups, last_groups = adapter.read()
        with self._lock:
            self.metrics.steps += 1
            self.metrics.step_rows.observe(len(active))
        for slot in active:
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
        self._output.put((slot.handle, [token], speech, finish, None))

    def _leave(self, slot: _Active, reason: str | None) -> None:
        self.adapter.free(slot.row)
        with self._lock:
            self._slots[slot.row] = None
        if reason is not None:
            self._finish(slot.handle, reason)

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self._output.put((handle, [], [], reason, error))

    # ------------------------------------------------------------------ output thread
    def _output_loop(self) -> None:
        while True:
            # Everything queued so far: the audio of all requests' ready chunks is decoded together.
            items = [self._output.get()]
            while items[-1] is not None:
                try:
                    items.append(self._output.get_nowait())
                except queue.Empty:
                    break
            closing = items[-1] is None  # the last item ever (put after the decode thread ended)
            items = items[:-1] if closing else items
            while items:  # rounds of at most one item per request, in order: each event as if taken alone
                count = _distinct_requests_prefix(items)
                self._emit_round(items[:count])
                items = items[count:]
            if closing:
                return

    def _emit_round(self, items: list) -> None:
        """Emit the events of queued items of distinct requests, in order; a vocoder error fails its request only."""
        items = [item for item in items if not item[0].finished.is_set()]  # e.g. a cancellation after the end
        parts = [VocodeItem(handle.id, handle.request.voice, speech_ids, finish is not None,
                            finish not in ("cancelled", "error"))
                 for handle, _, speech_ids, finish, _ in items]  # fmt: skip
        started = time.perf_counter()
        try:
            audio = self._vocoder.audio(parts) if self._vocoder is not None else [np.zeros(0, np.float32)] * len(items)
        except Exception as failure:  # not one request's problem: fail the round's requests, keep the thread
            audio = [failure] * len(items)
        for (handle, text_ids, speech_ids, finish, error), samples in zip(items, audio):
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
            self._record(handle, event, started)
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

    def _record(self, handle: RequestHandle, event: SpeechEvent, vocoding_started: float) -> None:
        first_audio = False
        with self._lock:
            metrics = self.metrics
            if len(event.audio):
                metrics.audio_seconds += len(event.audio) / event.sampling_rate
                if handle.first_audio is None:
                    first_audio = True
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

"""The speech engine's audio: one CosyVoice3 streaming decoder per request, their ready chunks decoded together.

A decode step of the engine yields a few speech tokens for each of up to `max_batch_size` requests. Each request's
tokens go to its own `CosyVoice3StreamingDecoder` (its voice, its chunk boundaries, its state), but the chunks that
become ready across requests are decoded by one batched call (`streaming_batch_cosyvoice3.decode_ready`): one flow
call per padded window size instead of one per request. A request's audio equals what its decoder alone would give
(rows are independent; equal up to float rounding).

On a GPU the decoders run on CUDA streams of their own (owned here), so that their kernels overlap the engine's decode
steps on the default stream instead of queueing behind them. Those streams have a higher priority than the steps: the
engine launches decode steps back to back, and a chunk's flow call (thousands of small kernels, each waiting for the
one before) would otherwise wait for SM room behind the step's kernels at every one of its kernels, which stretches a
request's first audio far past what the same chunk costs alone (`generate_speech_stream`, which decodes and vocodes in
turn). With the priority the chunk's kernels are scheduled first and the steps fill the rest of the GPU. Nothing
crosses the vocoder's and the steps' streams: the decoders read only their own tensors and the vocoder's weights
(ordered after everything queued before the engine started, see `__init__`), and their audio reaches the host with a
`HostCopy`, which waits for the vocoder's stream without stalling the decode thread's launches.

A reply's start-up chunks (its first `START_UP_CHUNKS`) have a stream and graph runners of their own, above the
steady chunks' stream: a round of them (`start(..., start_up=True)`) runs while a round of steady chunks does, instead
of waiting for it (a steady round of many streams at their largest hop takes far longer than a first chunk). Two, not
one: the first chunk holds 0.24 s of audio, and a second chunk queued behind a steady round would leave a listener
who starts playing at the first waiting in silence. Nothing is shared between the two lanes but the weights and
read-only tables: the runners keep their own memory pools, and a request's decoder, whose tensors the start-up
chunks allocate on their stream, is handed to the steady stream (`record_stream`) before the steady rounds read it, so
that none of its memory is reused while they might.

The shapes of a batched call (batch sizes padded to `GRAPH_BATCH_SIZES`, flow windows padded to a few sizes, HiFT
windows that grow over a reply's first chunks, and with hop growth over its hops) each get a CUDA graph when they
first occur, and each graph keeps its own copies of its inputs (the flow's per-row time conditioning among them).
`warm_up` decodes synthetic streams at every batch size a round can have, from a reply's first chunk until its windows
and hop stop growing, before the engine takes requests: every graph a load replays is then recorded up front, and
memory after a load equals memory after the warm-up instead of growing the first time more requests run together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from .generation_vocoding_funaudiochat import decoder_speaker_kwargs, valid_speech_tokens
from .serving_host_copy_funaudiochat import HostCopy
from .streaming_batch_cosyvoice3 import GRAPH_BATCH_SIZES, decode_ready
from .streaming_cosyvoice3 import new_graph_runners


logger = logging.get_logger(__name__)

# Lower numbers are higher priorities; one beyond the device's range is mapped to its highest. A reply's start-up
# chunks run at the highest, the steady chunks one below (PyTorch's range is 0 to -3 on current GPUs), both above the
# engine's decode steps (0).
HIGHEST_STREAM_PRIORITY = -(2**10)
STEADY_STREAM_PRIORITY = -2
# A reply's chunks that are start-up chunks (`in_start_up`): vocoded in rounds of their own, before and beside steady
# rounds.
START_UP_CHUNKS = 2


@dataclass
class VocodeItem:
    """One decode step's output of one request: its new speech ids, whether it is the request's last, and whether
    audio is wanted (not for a cancelled or failed request)."""

    request_id: int
    voice: object
    speech_ids: list[int]
    finished: bool
    produce_audio: bool


class ServingVocoder:
    """Per-request streaming decoders of `decoder` (a CosyVoice3 token2wav model), held from a request's first speech
    token until its last item (or `drop`). Used by the engine's output thread only.

    Args:
        decoder: the token2wav model.
        stream_options: keywords of its `streaming_decoder` (hop sizes, windows).
        speech_bos_id: the chat model's first non-codec speech id (`valid_speech_tokens`).
    """

    def __init__(self, decoder, stream_options: dict, speech_bos_id: int):
        self.decoder = decoder
        self.stream_options = stream_options
        self.speech_bos_id = speech_bos_id
        self._streams: dict[int, object] = {}  # request id -> its streaming decoder
        # A decoder of these options (its chunking and graphs do not depend on the voice): the fewest speech ids a
        # request has when its first chunk can be decoded (ids that are not codec tokens are dropped, so a request
        # may need more, never fewer).
        probe = decoder.streaming_decoder(speaker_embedding=torch.zeros(decoder.config.spk_embed_dim), **stream_options)
        self.first_chunk_tokens = probe.tokens_to_next_chunk()
        self.cuda_stream = None  # every round's, or with `start_up_stream` the steady chunks'
        self.start_up_stream = None  # start-up chunks' (`concurrent_start_up`)
        self._start_up_graphs = None  # their graph runners (and the memory of their recordings)
        device = getattr(decoder, "device", torch.device("cpu"))
        if device.type == "cuda":
            creating = torch.cuda.current_stream(device)
            self.cuda_stream = torch.cuda.Stream(device, priority=STEADY_STREAM_PRIORITY)
            # The decoder's weights and tables were written on the creating thread's stream.
            self.cuda_stream.wait_stream(creating)
            if probe.cuda_graphs:
                self.start_up_stream = torch.cuda.Stream(device, priority=HIGHEST_STREAM_PRIORITY)
                self.start_up_stream.wait_stream(creating)
                self._start_up_graphs = new_graph_runners(decoder)

    def may_decode(self, items: list[VocodeItem]) -> bool:
        """Whether a round of `items` (`start`) may decode audio: a request that wants audio ends, or its new ids
        reach its next chunk (`first_chunk_tokens` for a request without a decoder yet). False: the round only adds
        ids (host work, nothing queued on the GPU). Ids that are not codec tokens are dropped, so it may say True for
        a round that decodes nothing, never False for one that decodes."""
        for item in items:
            if not item.produce_audio:
                continue
            stream = self._streams.get(item.request_id)
            needed = self.first_chunk_tokens if stream is None else stream.tokens_to_next_chunk()
            if item.finished or len(item.speech_ids) >= needed:
                return True
        return False

    def drop(self, request_id: int) -> None:
        self._streams.pop(request_id, None)

    @property
    def concurrent_start_up(self) -> bool:
        """Whether a round of start-up chunks may run while a steady round does (CUDA, graphed decoders)."""
        return self.start_up_stream is not None

    def in_start_up(self, request_id: int) -> bool:
        """Whether the request's next chunk is one of its start-up chunks (no decoder yet, or fewer than
        `START_UP_CHUNKS` decoded)."""
        stream = self._streams.get(request_id)
        return stream is None or stream.chunks_decoded < START_UP_CHUNKS

    def _new_stream(self, voice):
        return self.decoder.streaming_decoder(**decoder_speaker_kwargs(voice), **self.stream_options)

    @property
    def fixed_shapes(self) -> bool:
        """Whether the decoders run fixed shapes (CUDA graphs, or a compiled flow): then `warm_up` pays."""
        return self._new_stream(None).cuda_graphs or self.decoder.flow_is_compiled

    @staticmethod
    def warm_up_batch_sizes(max_streams: int) -> tuple[int, ...]:
        """The padded batch sizes of the rounds of at most `max_streams` ready streams (`GRAPH_BATCH_SIZES`; larger
        rounds are split into calls of the largest)."""
        largest = next((size for size in GRAPH_BATCH_SIZES if size >= max_streams), GRAPH_BATCH_SIZES[-1])
        return tuple(size for size in GRAPH_BATCH_SIZES if size <= largest)

    @torch.no_grad()
    def warm_up(self, max_streams: int, max_chunks: int = 1000) -> dict[int, int]:
        """Decode synthetic replies together, `size` at a time for every size of `warm_up_batch_sizes(max_streams)`,
        one decode step's tokens at a time (as the engine feeds them), from their first chunk until their hop has
        reached its largest and their flow and HiFT windows are full (`steady`: the chunk shapes then repeat) and one
        chunk more: every shape a round of the engine can have is decoded once (recorded, under CUDA graphs). Then
        one stream's final chunk at every flow window size (a reply's last chunk is finalized alone).
        Returns {size: chunks decoded per stream}."""
        context = torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else contextlib.nullcontext()
        tokens_per_step = 5  # a decode step's speech group; the chunk boundaries do not depend on it
        vocab_size = self.decoder.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        chunks = {}
        with context:
            for size in self.warm_up_batch_sizes(max_streams):
                streams = [self._new_stream(None) for _ in range(size)]
                decoded, steady = 0, None
                while decoded < max_chunks:
                    for stream in streams:
                        stream.add_tokens(torch.randint(0, vocab_size, (tokens_per_step,), generator=generator))
                    if not streams[0].chunk_ready():
                        continue
                    if decoded < START_UP_CHUNKS and self.start_up_stream is not None:  # their own stream, runners
                        with torch.cuda.stream(self.start_up_stream):
                            decode_ready(streams, graph_runners=self._start_up_graphs, max_rounds=1)
                        for stream in streams:
                            _hand_over(stream, self.cuda_stream)
                    else:
                        decode_ready(streams)
                    decoded += 1
                    if steady is not None:
                        break
                    if streams[0].steady:
                        steady = decoded  # one chunk more: the first one of the repeating shapes
                chunks[size] = decoded
            # A reply's last chunk is decoded alone (`finalize`) over whatever is left, so its window can be any of
            # the sizes, also one that no earlier chunk has (with hop growth: a window between two steady ones).
            for window in self._new_stream(None).flow_window_sizes or ():
                stream = self._new_stream(None)
                stream.add_tokens(torch.randint(0, vocab_size, (window,), generator=generator))
                stream.finalize()
            if self.cuda_stream is not None:
                torch.cuda.synchronize(self.cuda_stream.device)
        return chunks

    @torch.no_grad()
    def audio(self, items: list[VocodeItem]) -> list[np.ndarray | Exception]:
        """The new audio (float32 samples) of each item, or the exception that failed its request (whose decoder is
        then dropped): `start(items).result()`."""
        return self.start(items).result()

    @torch.no_grad()
    def start(self, items: list[VocodeItem], start_up: bool = False) -> "PendingAudio":
        """Queue the audio of `items` on the GPU and return without waiting for it (`PendingAudio.result`). Items must
        be of distinct requests (one step each): their tokens are added, the ready chunks of all of them decoded
        together, then the finished ones finalized.

        start_up: every item's request is in its start-up (`in_start_up`). Where `concurrent_start_up`, one chunk of
        each is decoded, on the start-up stream with its own graph runners: the round may then run while a steady
        round runs (the chunks after the start-up are the steady rounds')."""
        if len({item.request_id for item in items}) != len(items):
            raise ValueError("ServingVocoder.start takes at most one item per request")
        lane = start_up and self.start_up_stream is not None
        stream = self.start_up_stream if lane else self.cuda_stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            pending = self._start(items, self._start_up_graphs if lane else None, 1 if lane else None)
        if lane:
            for item in items:
                if item.request_id in self._streams:
                    _hand_over(self._streams[item.request_id], self.cuda_stream)
        return pending

    def _start(self, items: list[VocodeItem], graph_runners, max_rounds) -> "PendingAudio":
        results: list = [None] * len(items)
        pieces: list[list[torch.Tensor]] = [[] for _ in items]
        active = []  # (position, decoder) of the items whose tokens were added
        for position, item in enumerate(items):
            stream = self._streams.get(item.request_id)
            if not item.produce_audio or (stream is None and not item.speech_ids):
                continue  # no audio wanted, or no speech yet
            try:
                if stream is None:
                    stream = self._new_stream(item.voice)
                    self._streams[item.request_id] = stream
                valid = valid_speech_tokens(torch.tensor(item.speech_ids, dtype=torch.long), self.speech_bos_id)
                if len(valid):
                    stream.add_tokens(valid)
                active.append((position, stream))
            except Exception as error:
                results[position] = error
        ready = [(position, stream) for position, stream in active if stream.chunk_ready()]
        for position, audio in self._decode_ready(ready, graph_runners, max_rounds).items():
            if isinstance(audio, Exception):
                results[position] = audio
            else:
                pieces[position].append(audio)
        for position, stream in active:
            if results[position] is None and items[position].finished:
                try:
                    pieces[position] += self._left_chunks(stream, graph_runners)
                    pieces[position].append(stream.finalize())
                except Exception as error:
                    results[position] = error
        # Every item's audio in one copy, which waits for the stream (`HostCopy`: not stalling the decode thread).
        open_positions = [position for position, result in enumerate(results) if result is None]
        flat = [piece.reshape(-1).float() for position in open_positions for piece in pieces[position]]
        lengths = [sum(piece.numel() for piece in pieces[position]) for position in open_positions]
        copy = HostCopy(torch.cat(flat) if flat else torch.zeros(0)) if open_positions else None
        return PendingAudio(self, items, results, open_positions, lengths, copy)

    def _left_chunks(self, stream, start_up_graphs) -> list[torch.Tensor]:
        """The audio of the chunks a start-up round left ready (`max_rounds`) in a reply that ends now: each decoded as
        the chunk it is, as its decoder alone would (not merged into the final chunk), by the runners that recorded its
        shapes in the warm-up: the start-up lane's for a start-up chunk, the model's for a later one."""
        pieces = []
        while stream.chunk_ready():
            start_up = start_up_graphs is not None and stream.chunks_decoded < START_UP_CHUNKS
            pieces += decode_ready([stream], graph_runners=start_up_graphs if start_up else None, max_rounds=1)
        return pieces

    def _decode_ready(self, ready: list[tuple[int, object]], graph_runners=None,
                      max_rounds: int | None = None) -> dict[int, torch.Tensor | Exception]:  # fmt: skip
        """{position: audio or exception} of the ready decoders: one batched call (`decode_ready` with
        `graph_runners` and `max_rounds`); if it fails (it then leaves the decoders as they were), each decoder alone,
        so that only the failing request fails."""
        if not ready:
            return {}
        try:
            streams = [stream for _, stream in ready]
            audio = decode_ready(streams, graph_runners=graph_runners, max_rounds=max_rounds)
            return dict(zip((position for position, _ in ready), audio))
        except Exception as error:
            if len(ready) == 1:
                return {ready[0][0]: error}
            logger.warning(f"Vocoding {len(ready)} streams together failed ({error}); vocoding them one by one.")
        results = {}
        for position, stream in ready:
            try:
                results[position] = decode_ready([stream], graph_runners=graph_runners, max_rounds=max_rounds)[0]
            except Exception as error:
                results[position] = error
        return results


class PendingAudio:
    """A vocoder round queued on the GPU (`ServingVocoder.start`): `done()` says, without waiting, whether its audio
    has reached the host; `result()` waits for it and returns each item's audio or exception (a finished or failed
    request's decoder is then dropped)."""

    def __init__(self, vocoder: ServingVocoder, items: list[VocodeItem], results: list, open_positions: list[int],
                 lengths: list[int], copy: HostCopy | None):  # fmt: skip
        self._vocoder, self._items, self._results = vocoder, items, results
        self._open_positions, self._lengths, self._copy = open_positions, lengths, copy
        self._taken = False

    def done(self) -> bool:
        return self._copy is None or self._copy.done()

    def result(self) -> list[np.ndarray | Exception]:
        if self._taken:
            return self._results
        if self._copy is not None:
            host = self._copy.result()
            # copied out of the pinned buffer (which then goes back to its pool)
            for position, samples in zip(self._open_positions, host.split(self._lengths)):
                self._results[position] = samples.clone().numpy()
        for item, result in zip(self._items, self._results):
            if item.finished or isinstance(result, Exception) or not item.produce_audio:
                self._vocoder.drop(item.request_id)
        self._taken = True
        return self._results


def _hand_over(decoder, stream: torch.cuda.Stream) -> None:
    """Let `stream` read `decoder`'s CUDA tensors, made on another stream: none of their memory is reused before the
    work queued on `stream` by the time they are freed is done (`Tensor.record_stream`)."""
    pending = list(vars(decoder).values())
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                value.record_stream(stream)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())


__all__ = ["HIGHEST_STREAM_PRIORITY", "PendingAudio", "ServingVocoder", "VocodeItem"]

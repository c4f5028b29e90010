"""The speech engine's audio: one CosyVoice3 streaming decoder per request, their ready chunks decoded together.

A decode step of the engine yields a few speech tokens for each of up to `max_batch_size` requests. Each request's
tokens go to its own `CosyVoice3StreamingDecoder` (its voice, its chunk boundaries, its state), but the chunks that
become ready across requests are decoded by one batched call (`streaming_batch_cosyvoice3.decode_ready`): one flow
call per padded window size instead of one per request. A request's audio equals what its decoder alone would give
(rows are independent; equal up to float rounding).

On a GPU the decoders run on a CUDA stream of their own (owned here), so that their kernels overlap the engine's decode
steps on the default stream instead of queueing behind them. That stream has the device's highest priority: the
engine launches decode steps back to back, and a chunk's flow call (thousands of small kernels, each waiting for the
one before) would otherwise wait for SM room behind the step's kernels at every one of its kernels, which stretches a
request's first audio far past what the same chunk costs alone (`generate_speech_stream`, which decodes and vocodes in
turn). With the priority the chunk's kernels are scheduled first and the steps fill the rest of the GPU. Nothing
crosses the two streams: the decoders read only their own tensors and the vocoder's weights (ordered after everything
queued before the engine started, see `__init__`), and their audio reaches the host with `to_host`, which waits for
the vocoder's stream without stalling the decode thread's launches.

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
from .serving_host_copy_funaudiochat import to_host
from .streaming_batch_cosyvoice3 import GRAPH_BATCH_SIZES, decode_ready


logger = logging.get_logger(__name__)

# Lower numbers are higher priorities; one beyond the device's range is mapped to its highest.
HIGHEST_STREAM_PRIORITY = -(2**10)


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
        self.cuda_stream = None
        device = getattr(decoder, "device", torch.device("cpu"))
        if device.type == "cuda":
            self.cuda_stream = torch.cuda.Stream(device, priority=HIGHEST_STREAM_PRIORITY)
            # The decoder's weights and tables were written on the creating thread's stream.
            self.cuda_stream.wait_stream(torch.cuda.current_stream(device))

    def drop(self, request_id: int) -> None:
        self._streams.pop(request_id, None)

    def awaits_first_audio(self, request_id: int) -> bool:
        """Whether the request has had no chunk decoded yet (no decoder yet, or one before its first chunk)."""
        stream = self._streams.get(request_id)
        return stream is None or stream.chunks_decoded == 0

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
                self.cuda_stream.synchronize()
        return chunks

    @torch.no_grad()
    def audio(self, items: list[VocodeItem]) -> list[np.ndarray | Exception]:
        """The new audio (float32 samples) of each item, or the exception that failed its request (whose decoder is
        then dropped). Items must be of distinct requests (one step each): their tokens are added, the ready chunks
        of all of them decoded together, then the finished ones finalized."""
        if len({item.request_id for item in items}) != len(items):
            raise ValueError("ServingVocoder.audio takes at most one item per request")
        context = torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else contextlib.nullcontext()
        with context:
            results = self._audio(items)
        for item, result in zip(items, results):
            if item.finished or isinstance(result, Exception) or not item.produce_audio:
                self.drop(item.request_id)
        return results

    def _audio(self, items: list[VocodeItem]) -> list[np.ndarray | Exception]:
        results: list = [None] * len(items)
        pieces: list[list[torch.Tensor]] = [[] for _ in items]
        active = []  # (position, decoder) of the items whose tokens were added
        for position, item in enumerate(items):
            stream = self._streams.get(item.request_id)
            if not item.produce_audio or (stream is None and not item.speech_ids):
                continue  # no audio wanted, or no speech yet
            try:
                if stream is None:
                    stream = self.decoder.streaming_decoder(
                        **decoder_speaker_kwargs(item.voice), **self.stream_options
                    )
                    self._streams[item.request_id] = stream
                valid = valid_speech_tokens(torch.tensor(item.speech_ids, dtype=torch.long), self.speech_bos_id)
                if len(valid):
                    stream.add_tokens(valid)
                active.append((position, stream))
            except Exception as error:
                results[position] = error
        ready = [(position, stream) for position, stream in active if stream.chunk_ready()]
        for position, audio in self._decode_ready(ready).items():
            if isinstance(audio, Exception):
                results[position] = audio
            else:
                pieces[position].append(audio)
        for position, stream in active:
            if results[position] is None and items[position].finished:
                try:
                    pieces[position].append(stream.finalize())
                except Exception as error:
                    results[position] = error
        # Every item's audio in one copy, which waits for the stream (`to_host`: not stalling the decode thread).
        open_positions = [position for position, result in enumerate(results) if result is None]
        if not open_positions:
            return results
        flat = [piece.reshape(-1).float() for position in open_positions for piece in pieces[position]]
        lengths = [sum(piece.numel() for piece in pieces[position]) for position in open_positions]
        host = to_host(torch.cat(flat) if flat else torch.zeros(0))
        # copied out of the pinned buffer (which then goes back to its pool)
        for position, samples in zip(open_positions, host.split(lengths)):
            results[position] = samples.clone().numpy()
        return results

    def _decode_ready(self, ready: list[tuple[int, object]]) -> dict[int, torch.Tensor | Exception]:
        """{position: audio or exception} of the ready decoders: one batched call; if it fails (it then leaves the
        decoders as they were), each decoder alone, so that only the failing request fails."""
        if not ready:
            return {}
        try:
            return dict(zip((position for position, _ in ready), decode_ready([stream for _, stream in ready])))
        except Exception as error:
            if len(ready) == 1:
                return {ready[0][0]: error}
            logger.warning(f"Vocoding {len(ready)} streams together failed ({error}); vocoding them one by one.")
        results = {}
        for position, stream in ready:
            try:
                results[position] = stream.decode_ready()
            except Exception as error:
                results[position] = error
        return results


__all__ = ["HIGHEST_STREAM_PRIORITY", "ServingVocoder", "VocodeItem"]

"""The prompt's continuous audio encoder replayed as a CUDA graph per chunk count (`DecodePlan.prefill_graph`).

The encoder (Whisper-large-v3-sized: 32 layers) runs a question's few 2-s chunks: little GPU work, but ~15 eager
kernels a layer, so an eager call is bound by the host's launches (more so when a serving process's other threads
hold the interpreter lock). [`RecordedChunkEncoder`] pads the chunks to the full `2 * n_window` frames, so that the
shapes depend on the chunk count only, and replays `FunAudioChatAudioEncoder.encode_chunks` recorded on the decode
workspace (a [`CapturedStep`] under `("audio_chunks", num_chunks)`, in the workspace's `StepGraphs`, dropped with them
when a weight moves). Padding frames are masked keys and per-frame rows, so the valid frames are the eager call's.

Memory: the recordings of every chunk count share one pool (they replay one at a time and write into their own
buffers, the first rows of one set), so they hold the largest one's intermediates; and counts above `MAX_RECORDED_AUDIO_CHUNKS` (questions over
64 s, whose encoder is no longer launch-bound) run eagerly, so a rare long question leaves nothing behind.
"""

import dataclasses
import functools

import torch

from .step_graph_funaudiochat import CapturedStep


# The most 2-s chunks a recording covers (64 s of audio); longer questions run the encoder eagerly.
MAX_RECORDED_AUDIO_CHUNKS = 32


@dataclasses.dataclass
class AudioChunkBuffers:
    """The fixed inputs and output of the recorded encoder: the workspace keeps one set for the most chunks, and a
    chunk count's recording reads and writes its first rows (`first`)."""

    chunks: torch.Tensor  # (num_chunks, num_mel_bins, 2 * n_window) mel chunks, zero past each chunk's length
    chunk_lengths: torch.Tensor  # (num_chunks,) valid mel frames of every chunk
    hidden: torch.Tensor  # (num_chunks, n_window, d_model) the last layer's output

    @classmethod
    def for_encoder(cls, encoder, num_chunks: int) -> "AudioChunkBuffers":
        weight = encoder.conv1.weight
        frames = 2 * encoder.n_window
        return cls(
            chunks=torch.zeros(num_chunks, weight.shape[1], frames, dtype=weight.dtype, device=weight.device),
            chunk_lengths=torch.ones(num_chunks, dtype=torch.long, device=weight.device),
            hidden=torch.zeros(num_chunks, (frames + 1) // 2, weight.shape[0], dtype=weight.dtype, device=weight.device),
        )

    def first(self, num_chunks: int) -> "AudioChunkBuffers":
        """Views of the first `num_chunks` rows (fixed addresses: what one chunk count's recording reads and writes)."""
        if not 1 <= num_chunks <= self.chunks.shape[0]:
            raise ValueError(f"{num_chunks} audio chunks: the buffers hold 1 to {self.chunks.shape[0]}.")
        return AudioChunkBuffers(self.chunks[:num_chunks], self.chunk_lengths[:num_chunks], self.hidden[:num_chunks])

    def tensors(self) -> list[torch.Tensor]:
        return [self.chunks, self.chunk_lengths, self.hidden]


def _encode_buffers(model, ws, cfg, num_chunks: int) -> None:
    encoder = model.continuous_audio_tower
    buffers = ws.audio_chunk_buffers_for(num_chunks, encoder)
    hidden = encoder.encode_chunks(buffers.chunks, buffers.chunk_lengths)
    buffers.hidden.copy_(hidden)


class RecordedChunkEncoder:
    """A `chunk_encoder` for `embed_prompt` (see `FunAudioChatAudioEncoder.forward`): the chunks copied into the
    workspace's fixed buffers of their count, `encode_chunks` replayed from its recording (the first call of a count
    runs it directly, the second records it: [`CapturedStep`]). More than `MAX_RECORDED_AUDIO_CHUNKS` chunks run
    `encode_chunks` eagerly.

    The returned `(num_chunks, n_window, d_model)` tensor is the workspace's buffer: read it before the next call.
    """

    def __init__(self, model, ws, cfg):
        self.model, self.ws, self.cfg = model, ws, cfg

    def __call__(self, chunks: torch.Tensor, chunk_lengths: torch.Tensor) -> torch.Tensor:
        """`chunks` `(num_chunks, num_mel_bins, frames <= 2 * n_window)`, `chunk_lengths` `(num_chunks,)`."""
        encoder = self.model.continuous_audio_tower
        num_chunks, _, frames = chunks.shape
        if num_chunks > MAX_RECORDED_AUDIO_CHUNKS:
            return encoder.encode_chunks(chunks, chunk_lengths)
        buffers = self.ws.audio_chunk_buffers_for(num_chunks, encoder)
        if frames > buffers.chunks.shape[-1]:
            raise ValueError(f"Audio chunks of {frames} frames exceed the encoder's {buffers.chunks.shape[-1]}.")
        buffers.chunks[..., frames:].zero_()
        buffers.chunks[..., :frames].copy_(chunks)
        buffers.chunk_lengths.copy_(chunk_lengths)
        encode = functools.partial(_encode_buffers, num_chunks=num_chunks)
        CapturedStep(encode, ("audio_chunks", num_chunks), shared_pool=True)(self.model, self.ws, self.cfg)
        return buffers.hidden


__all__ = ["MAX_RECORDED_AUDIO_CHUNKS", "AudioChunkBuffers", "RecordedChunkEncoder"]

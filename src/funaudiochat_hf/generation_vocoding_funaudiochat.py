"""Vocoding of `generate_speech`'s speech tokens: offline (30-s segments, one batched decoder call) and the helpers
the streaming path shares."""

import numpy as np
import torch

from .modeling_cosyvoice3 import CosyVoice3Token2Wav


def speech_segments(tokens: torch.Tensor) -> list[torch.Tensor]:
    """A 1-D token stream cut into the independent segments Fun-Audio-Chat vocodes offline (spec funaudiochat.md §8):
    `CosyVoice3Token2Wav.segment_bounds`, the decoder's own split."""
    return [tokens[first:end] for first, end in CosyVoice3Token2Wav.segment_bounds(len(tokens))]


def decoder_speaker_kwargs(speaker) -> dict:
    """The decoder's keyword for a `speaker` argument: a stored voice's name (or a list of names), or an x-vector
    (a tensor or a numpy array) as `speaker_embedding`."""
    if speaker is None:
        return {}
    if isinstance(speaker, (torch.Tensor, np.ndarray)):
        return {"speaker_embedding": torch.as_tensor(speaker)}
    return {"speaker": speaker}


def _decoder_device(decoder) -> torch.device:
    try:
        return next(decoder.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def decoder_sampling_rate(decoder) -> int:
    rate = getattr(getattr(decoder, "config", None), "sampling_rate", None)
    return int(rate if rate is not None else getattr(decoder, "sampling_rate", 24000))


def valid_speech_tokens(speech_ids: torch.Tensor, speech_bos_id: int) -> torch.Tensor:
    """Keep only codec tokens (drops the bos delay tokens, EOS and padding)."""
    return speech_ids[(speech_ids >= 0) & (speech_ids < speech_bos_id)]


def _waveforms(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(waveform (N, samples), valid lengths (N,) or None)` of a decoder call (`CosyVoice3Token2WavOutput`, a
    `(waveform, lengths)` tuple or a plain tensor)."""
    if isinstance(output, torch.Tensor):
        return output.reshape(output.shape[0], -1), None
    if isinstance(output, dict):
        return output["waveform"], output.get("waveform_lengths")
    return output[0], output[1] if len(output) > 1 else None


@torch.no_grad()
def decode_speech_offline(decoder, speech_ids: torch.Tensor, speech_bos_id: int, speaker=None) -> list[torch.Tensor]:
    """Vocode raw speech streams `(batch, n)` into one 1-D waveform per row (on the CPU).

    Only codec ids (0 <= id < speech bos) are kept; each row is cut into independent 30-s segments (spec §8, the
    decoder's own `CosyVoice3Token2Wav.segment_bounds`). All
    segments of all rows go through the decoder in one right-padded batch call (`speech_token_lengths`) on the
    decoder's own device, which may differ from the chat model's.
    """
    rows = [speech_segments(valid_speech_tokens(row, speech_bos_id)) for row in speech_ids]
    segments = [segment for row in rows for segment in row if len(segment) > 0]
    if not segments:
        return [torch.zeros(0) for _ in rows]
    device = _decoder_device(decoder)
    lengths = torch.tensor([len(segment) for segment in segments])
    tokens = torch.nn.utils.rnn.pad_sequence(segments, batch_first=True).to(device)
    kwargs = decoder_speaker_kwargs(speaker)
    if len(segments) > 1:
        kwargs["speech_token_lengths"] = lengths.to(device)
    waveform, waveform_lengths = _waveforms(decoder(tokens, **kwargs))
    waveform = waveform.float().cpu()
    if waveform_lengths is None:
        waveform_lengths = torch.full((len(segments),), waveform.shape[1])
    pieces = iter(waveform[i, : int(n)] for i, n in enumerate(waveform_lengths.cpu()))
    return [torch.cat([next(pieces) for segment in row if len(segment) > 0] or [torch.zeros(0)]) for row in rows]


__all__ = ["decode_speech_offline", "decoder_sampling_rate", "decoder_speaker_kwargs", "speech_segments", "valid_speech_tokens"]

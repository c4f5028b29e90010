"""Vocoding of `generate_speech`'s speech tokens: offline (30-s segments, one batched decoder call) and the helpers
the streaming path shares."""

import numpy as np
import torch

# Fun-Audio-Chat vocodes offline in independent segments of 30 s = 750 tokens at 25 Hz (spec funaudiochat.md §8); the
# decoder cuts them itself (`CosyVoice3Token2Wav.forward(segment_tokens=...)`, `segment_bounds`).
OFFLINE_SEGMENT_TOKENS = 750


def decoder_speaker_kwargs(speaker) -> dict:
    """The decoder's keyword for a `speaker` argument: a stored voice's name (or a list of names), or an x-vector
    (a tensor or a numpy array) as `speaker_embedding`."""
    if speaker is None:
        return {}
    if isinstance(speaker, (torch.Tensor, np.ndarray)):
        return {"speaker_embedding": torch.as_tensor(speaker)}
    return {"speaker": speaker}


def check_decoder_speaker(decoder, speaker, batch_size: int) -> None:
    """Resolve `speaker` for a batch of `batch_size` rows as the decoder will when it vocodes (a cheap lookup through
    its `get_speaker_embedding`), so that an unknown name, a list of names of the wrong length or an x-vector of the
    wrong shape raises before the LLM decodes rather than after. A decoder without that lookup checks when it
    vocodes."""
    lookup = getattr(decoder, "get_speaker_embedding", None)
    if lookup is None:
        return
    if isinstance(speaker, (list, tuple)) and len(speaker) not in (1, batch_size):
        raise ValueError(
            f"`speaker` has {len(speaker)} names for a batch of {batch_size} rows: pass one name for every row or one "
            "per row."
        )
    try:
        lookup(**decoder_speaker_kwargs(speaker), batch_size=batch_size)
    except (TypeError, ValueError) as error:
        if "`speaker`" in str(error):
            raise
        raise type(error)(f"`speaker`: {error}") from error  # the decoder's message names its own argument


def _decoder_device(decoder) -> torch.device:
    try:
        return next(decoder.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def decoder_sampling_rate(decoder) -> int:
    rate = getattr(getattr(decoder, "config", None), "sampling_rate", None)
    return int(rate if rate is not None else getattr(decoder, "sampling_rate", 24000))


def decoder_voices(decoder) -> list[str]:
    """The names of the voices a speech decoder stores (empty: none, or no decoder)."""
    return list(getattr(getattr(decoder, "config", None), "speaker_names", None) or [])


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

    Only codec ids (0 <= id < speech bos) are kept. The rows go right-padded (`speech_token_lengths`) through one
    decoder call on the decoder's own device, which may differ from the chat model's; the decoder cuts each row into
    independent 30-s segments (`segment_tokens`, spec §8) and runs all segments of all rows as one batch, each with
    its row's voice. `speaker`: one stored name or x-vector `(192,)` for every row, or one per row (a list of names,
    or `(batch, 192)`).
    """
    rows = [valid_speech_tokens(row, speech_bos_id) for row in speech_ids]
    if not any(len(row) for row in rows):
        return [torch.zeros(0) for _ in rows]
    device = _decoder_device(decoder)
    lengths = torch.tensor([len(row) for row in rows])
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
    kwargs = decoder_speaker_kwargs(speaker)
    # The rows, not their segments, are the decoder's batch: a per-row `speaker` stays aligned with them.
    output = decoder(tokens, speech_token_lengths=lengths, segment_tokens=OFFLINE_SEGMENT_TOKENS, **kwargs)
    waveform, waveform_lengths = _waveforms(output)
    waveform = waveform.float().cpu()
    if waveform_lengths is None:
        waveform_lengths = torch.full((len(rows),), waveform.shape[1])
    return [waveform[i, : int(n)] for i, n in enumerate(waveform_lengths.cpu())]


__all__ = [
    "OFFLINE_SEGMENT_TOKENS",
    "check_decoder_speaker",
    "decode_speech_offline",
    "decoder_sampling_rate",
    "decoder_speaker_kwargs",
    "decoder_voices",
    "valid_speech_tokens",
]

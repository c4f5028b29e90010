"""The outputs of `generate_speech` and `generate_speech_stream`."""

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class FunAudioChatSpeechOutput(ModelOutput):
    """Output of [`~FunAudioChatSpeechGenerationMixin.generate_speech`].

    Args:
        sequences (`torch.LongTensor` of shape `(batch, prompt_len + new_tokens)`):
            Prompt ids followed by the generated text ids (rows that stopped early are padded with `pad_token_id`).
        speech_ids (`torch.LongTensor` of shape `(batch, group_size * groups)`):
            Raw speech-token stream per row (speech-bos delay tokens and the EOS group included), padded with the
            speech pad id after the row's stream ends.
        audio (`list[torch.FloatTensor]`, *optional*):
            One 1-D waveform per row at `sampling_rate`, when a speech decoder was available.
        sampling_rate (`int`, *optional*): Sample rate of `audio`.
        text_logits (`torch.FloatTensor` of shape `(batch, new_tokens, vocab)`, *optional*):
            Raw text logits of every step (`output_logits=True`).
        speech_logits (`torch.FloatTensor` of shape `(batch, new_tokens, group_size, codebook)`, *optional*):
            Raw CRQ logits of the K sub-steps of every step (`output_logits=True`), also for steps whose speech
            tokens were discarded.
    """

    sequences: torch.LongTensor | None = None
    speech_ids: torch.LongTensor | None = None
    audio: list[torch.Tensor] | None = None
    sampling_rate: int | None = None
    text_logits: torch.FloatTensor | None = None
    speech_logits: torch.FloatTensor | None = None


@dataclass
class SpeechStreamEvent:
    """One increment of [`~FunAudioChatSpeechGenerationMixin.generate_speech_stream`] (batch 1).

    Attributes:
        text: new text since the previous event (needs a tokenizer, else "").
        text_ids: `(n,)` new text token ids (special tokens included).
        speech_ids: `(m,)` new raw speech ids (delay/EOS tokens included).
        audio: `(samples,)` new waveform samples at `sampling_rate` (may be empty).
        sampling_rate: sample rate of `audio`.
        finished: True on the last event.
    """

    text: str
    text_ids: torch.LongTensor
    speech_ids: torch.LongTensor
    audio: torch.FloatTensor
    sampling_rate: int
    finished: bool

class TextDeltas:
    """The text of a reply's ids, handed out as it grows: `push(ids, final)` returns what the new ids add to the text
    decoded so far ("" without a tokenizer, and while the text ends in an incomplete multi-byte character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids, final: bool = False) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None or not self.ids:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""  # wait for the character's next token
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta


__all__ = ["TextDeltas", "FunAudioChatSpeechOutput", "SpeechStreamEvent"]

"""Training data collator for Fun-Audio-Chat: conversations -> the batch the model trains on.

It builds exactly the batch of the reference training stack (LLaMA-Factory template `funaudiochat` + the official
`FunAudioChatPlugin`, data made by `training/process/data_process.py`), without LLaMA-Factory.

Dataset format
--------------
One JSON object per line (JSON lines), one conversation per object:

    {"system": "You are asked to generate both text and speech tokens at the same time.",
     "messages": [
       {"role": "user", "audio": "data/question_0001.wav"},
       {"role": "assistant", "text": "Sure! The weather today is sunny and warm.",
        "speech_tokens": [16, 20, 32, 0, 12, 19, 7, 30]}]}

* `system` (optional): system prompt; defaults to the collator's `default_system_prompt` (`DEFAULT_S2M_PROMPT`).
* `messages`: alternating `user` / `assistant` turns, starting with `user` and ending with `assistant`.
* user turn: `audio` = anything `load_audio` accepts (a path, or `{"array": [...], "sampling_rate": 16000}`; in
  Python also numpy arrays / tensors / bytes), and/or `text` (an instruction; placed on a new line after the audio,
  e.g. "Please help me transcribe the audio."). An optional `transcript` is kept for reference only - the official
  recipe does not train on user transcripts.
* assistant turn: `text` (the reply text) and optional `speech_tokens` (the CosyVoice3 S3 speech-token ids of the
  spoken reply, 25 Hz ints). With `speech_tokens` the turn is a spoken reply (text + speech supervised); without it
  the turn is plain text (text-only supervision, e.g. S2T data).

The reference LLaMA-Factory format (`{"system", "messages": [{"role", "content"}], "audio": [json strings
{"path", "token", "text"}]}`, as written by the official data_process.py) is accepted as well.

What one sample becomes (reference conventions):

* user audio: `<|audio_pad|>` x `int(duration * 25)` speech tokens, log-mel features (`feature_exist_mask` True),
  empty transcript;
* assistant speech: `<|audio_bos|>` x `speech_delay_tokens` (10: the speech starts two LLM steps after the text)
  followed by the speech tokens; no waveform (`feature_exist_mask` False); its text goes to `text_ids`;
* each audio becomes `<|audio_bos|>` + `<|AUDIO|>` x `ceil(speech_tokens / 5)` + `<|audio_eos|>` in the prompt;
* `labels` = -100 over system + user turns (incl. `<|im_start|>assistant\\n`), the assistant turn ids otherwise.

Batch (B samples, A audios in sample order, right padding): `input_ids`, `attention_mask`, `labels` `(B, L)`;
`speech_ids`, `speech_attention_mask` `(A, S)`; `input_features` `(A_wav, 128, F)`, `feature_attention_mask`
`(A_wav, F)` (padded to the longest clip); `feature_exist_mask` `(A,)`; `text_ids` `(A, T)` (padded with the text pad
id); `text_attention_mask` `(A,)`.

A bad sample (audio tokens written into a text, a clip longer than the processor's `max_audio_seconds`, a text over
`MAX_TEXT_CHARS`, ...) raises `ValueError` naming the sample and message; filter such samples out of the dataset.

Use with `Trainer(..., data_collator=FunAudioChatDataCollator(processor), args=TrainingArguments(...,
remove_unused_columns=False))` so the raw conversation fields reach the collator.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature

from .audio_io import load_audio
from .limits_funaudiochat import check_text_length
from .processing_funaudiochat import AUDIO_TEMPLATE, DEFAULT_S2M_PROMPT, FunAudioChatProcessor


IGNORE_INDEX = -100


@dataclass
class _AudioItem:
    speech: str  # speech-token string fed to the speech tokenizer
    waveform: np.ndarray | None  # 16 kHz waveform for the continuous encoder, None for assistant speech
    text: str  # transcript used as `text_ids` ('' for user audio)
    expected_length: int | None = None  # number of speech tokens the string must tokenize to (validation)


@dataclass
class FunAudioChatDataCollator:
    """Collate conversations (see the module docstring) into a Fun-Audio-Chat training batch.

    Args:
        processor: the model's [`FunAudioChatProcessor`].
        default_system_prompt: system prompt for samples without `system`; None uses the chat template default
            ("You are a helpful assistant.").
        speech_delay_tokens: `<|audio_bos|>` speech tokens prepended to every assistant speech (reference: 10).
        pad_to_multiple_of: pad the text length to a multiple of this (e.g. 8 for tensor cores).
        label_pad_token_id: label of padding positions.
    """

    processor: FunAudioChatProcessor
    default_system_prompt: str | None = DEFAULT_S2M_PROMPT
    speech_delay_tokens: int = 10
    pad_to_multiple_of: int | None = None
    label_pad_token_id: int = IGNORE_INDEX

    def __post_init__(self):
        if self.speech_delay_tokens < 0:
            raise ValueError(f"`speech_delay_tokens` must be >= 0, got {self.speech_delay_tokens}.")
        self._speech_vocab = set(self.processor.speech_tokenizer.get_vocab())

    # ------------------------------------------------------------------------------------------------------------

    def __call__(self, samples: list[dict[str, Any]]) -> BatchFeature:
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        try:
            return self._collate(samples)
        except StopIteration as error:
            # A DataLoader takes a StopIteration escaping the collator as the end of the data and ends the epoch
            # silently; a defect must surface as an error instead.
            message = "The collator hit an internal StopIteration; this is a bug, please report it."
            raise RuntimeError(message) from error

    def _collate(self, samples: list[dict[str, Any]]) -> BatchFeature:
        tokenizer = self.processor.tokenizer

        parsed = [self._parse_sample(sample, index) for index, sample in enumerate(samples)]
        audio_items = [item for _, _, items in parsed for item in items]

        batch: dict[str, torch.Tensor] = {}
        num_placeholders: list[int] = []
        if audio_items:
            speech = self.processor.tokenize_speech([item.speech for item in audio_items], pad_to_multiple_of=None)
            lengths = speech["speech_attention_mask"].sum(-1).tolist()
            self._check_speech_tokens(audio_items, speech, lengths)
            num_placeholders = [self.processor.num_audio_placeholders(length) for length in lengths]
            waveforms = [item.waveform for item in audio_items if item.waveform is not None]
            if waveforms:
                batch.update(self._training_features(waveforms))
            batch["feature_exist_mask"] = torch.tensor([item.waveform is not None for item in audio_items])
            batch.update(speech)
            texts = [item.text for item in audio_items]
            batch["text_ids"] = tokenizer(
                texts, padding=True, padding_side="right", return_attention_mask=False, return_tensors="pt"
            )["input_ids"]
            batch["text_attention_mask"] = torch.tensor([text != "" for text in texts], dtype=torch.bool)

        counts = iter(num_placeholders)
        sequences, label_sequences = [], []
        for system, turns, _ in parsed:
            input_ids, labels = self._encode_conversation(system, turns, counts)
            sequences.append(input_ids)
            label_sequences.append(labels)

        batch.update(self._pad_text(sequences, label_sequences))
        ordered = {
            key: batch[key]
            for key in (
                "input_ids",
                "attention_mask",
                "labels",
                "speech_ids",
                "speech_attention_mask",
                "input_features",
                "feature_attention_mask",
                "feature_exist_mask",
                "text_ids",
                "text_attention_mask",
            )
            if key in batch
        }
        return BatchFeature(ordered)

    # ------------------------------------------------------------------------------------------------------------

    def _expanded_audio(self, count: int) -> str:
        p = self.processor
        return p.audio_bos_token + p.audio_token * count + p.audio_eos_token

    def _encode_conversation(self, system: str | None, turns: list[tuple[str, str]], counts) -> tuple[list, list]:
        """LLaMA-Factory `funaudiochat` template: the prompt (system + user turn + assistant header) is ignored in
        the labels, each assistant turn `content<|im_end|>\\n` is supervised."""
        encode = self.processor.tokenizer.encode
        input_ids: list[int] = []
        labels: list[int] = []
        for index in range(0, len(turns), 2):
            user, assistant = turns[index][1], turns[index + 1][1]
            user = self._fill_placeholders(user, counts)
            assistant = self._fill_placeholders(assistant, counts)
            source: list[int] = []
            if index == 0:
                system_text = system if system is not None else "You are a helpful assistant."
                source += encode(f"<|im_start|>system\n{system_text}<|im_end|>\n", add_special_tokens=False)
            source += encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
            target = encode(f"{assistant}<|im_end|>\n", add_special_tokens=False)
            input_ids += source + target
            labels += [IGNORE_INDEX] * len(source) + target
        return input_ids, labels

    def _fill_placeholders(self, content: str, counts) -> str:
        pieces = content.split(AUDIO_TEMPLATE)
        out = [pieces[0]]
        for piece in pieces[1:]:
            count = next(counts, None)
            if count is None:  # the parsers reject audio tokens in texts, so each template has its clip
                raise ValueError(f"More {AUDIO_TEMPLATE} placeholders than audio clips in the batch.")
            out.append(self._expanded_audio(count))
            out.append(piece)
        return "".join(out)

    def _check_text(self, text: str, where: str) -> None:
        """Texts must not carry the audio special tokens: each placeholder has to come from an audio clip."""
        p = self.processor
        found = [token for token in (p.audio_token, p.audio_bos_token, p.audio_eos_token) if token in text]
        if found:
            raise ValueError(
                f"{where}: the text contains the audio token(s) {found}; audio goes in the "
                "turn's 'audio' / 'speech_tokens' fields, never in its text. Remove such samples from the dataset "
                "(or strip the tokens from their text)."
            )
        check_text_length(text, f"{where}: the text")

    def _pad_text(self, sequences: list[list[int]], label_sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        pad_id = self.processor.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError("The text tokenizer has no pad token; set `tokenizer.pad_token` before collating.")
        length = max(len(s) for s in sequences)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        labels = torch.full((len(sequences), length), self.label_pad_token_id, dtype=torch.long)
        for row, (ids, labs) in enumerate(zip(sequences, label_sequences)):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            labels[row, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _training_features(self, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """Log-mels as the reference training plugin computes them: padded to the longest clip (no extra tail, so
        the last frame differs from the processor's `max_length` features), mask trimmed to the feature length."""
        features = self.processor.feature_extractor(
            waveforms,
            sampling_rate=self.processor.sampling_rate,
            padding="longest",
            return_attention_mask=True,
            return_tensors="pt",
        )
        input_features, mask = features["input_features"], features["attention_mask"]
        # the mask has one entry per hop (rounded up), the features drop the last STFT frame: keep the shorter
        length = min(input_features.shape[-1], mask.shape[-1])
        return {"input_features": input_features[..., :length], "feature_attention_mask": mask[..., :length]}

    def _check_speech_tokens(self, items: list[_AudioItem], speech: dict, lengths: list[int]) -> None:
        unk_id = self.processor.speech_tokenizer.unk_token_id
        for index, (item, length) in enumerate(zip(items, lengths)):
            if item.expected_length is not None and length != item.expected_length:
                raise ValueError(
                    f"Audio {index}: its speech tokens tokenized to {length} ids instead of {item.expected_length}; "
                    "some speech-token id is not in the speech tokenizer vocabulary."
                )
            if length == 0:
                raise ValueError(f"Audio {index} has no speech tokens (user audio must be at least 40 ms long).")
            if unk_id is not None and bool((speech["speech_ids"][index, :length] == unk_id).any()):
                raise ValueError(f"Audio {index}: a speech-token id is outside the speech tokenizer vocabulary.")

    # ------------------------------------------------------------------------------------------------------------
    # sample parsing
    # ------------------------------------------------------------------------------------------------------------

    def _parse_sample(self, sample: dict, index: int) -> tuple[str | None, list[tuple[str, str]], list[_AudioItem]]:
        if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list):
            raise ValueError(
                f"Sample {index} must be a dict with a 'messages' list (with `Trainer`, set "
                "`TrainingArguments(remove_unused_columns=False)` so the conversation columns are kept)."
            )
        system = sample.get("system") or self.default_system_prompt
        if system is not None:
            if not isinstance(system, str):
                raise ValueError(f"Sample {index}: 'system' must be a string.")
            self._check_text(system, f"Sample {index}, system prompt")
        messages = sample["messages"]
        if not messages or len(messages) % 2:
            raise ValueError(
                f"Sample {index} must have alternating user/assistant messages ending with an assistant turn; "
                f"got {len(messages)} message(s)."
            )
        for turn, message in enumerate(messages):
            expected = "user" if turn % 2 == 0 else "assistant"
            if not isinstance(message, dict) or message.get("role") != expected:
                raise ValueError(f"Sample {index}, message {turn}: expected role '{expected}'.")
        if "audio" in sample and any("content" in m for m in messages):
            return self._parse_reference_sample(sample, system, index)
        turns: list[tuple[str, str]] = []
        items: list[_AudioItem] = []
        for turn, message in enumerate(messages):
            if message["role"] == "user":
                turns.append(("user", self._parse_user(message, items, index, turn)))
            else:
                turns.append(("assistant", self._parse_assistant(message, items, index, turn)))
        return system, turns, items

    def _load_audio(self, audio: Any) -> np.ndarray:
        # The processor's duration limit: longer clips would lose features past the extractor's window.
        processor = self.processor
        return load_audio(audio, target_sampling_rate=processor.sampling_rate, max_seconds=processor.max_audio_seconds)

    def _parse_user(self, message: dict, items: list[_AudioItem], index: int, turn: int) -> str:
        text = message.get("text") or ""
        if not isinstance(text, str):
            raise ValueError(f"Sample {index}, message {turn}: 'text' must be a string.")
        self._check_text(text, f"Sample {index}, message {turn}")
        if message.get("audio") is None:
            if not text:
                raise ValueError(f"Sample {index}, message {turn}: a user turn needs 'audio' and/or 'text'.")
            return text
        waveform = self._load_audio(message["audio"])
        frames = self.processor.num_speech_frames(waveform)
        items.append(_AudioItem(self.processor.audio_pad_token * frames, waveform, "", frames))
        return AUDIO_TEMPLATE + ("\n" + text if text else "")

    def _parse_assistant(self, message: dict, items: list[_AudioItem], index: int, turn: int) -> str:
        text = message.get("text", "")
        if not isinstance(text, str):
            raise ValueError(f"Sample {index}, message {turn}: assistant 'text' must be a string.")
        self._check_text(text, f"Sample {index}, message {turn}")
        tokens = message.get("speech_tokens")
        if tokens is None:
            if not text:
                raise ValueError(f"Sample {index}, message {turn}: an assistant turn needs 'text' or 'speech_tokens'.")
            return text
        if isinstance(tokens, (torch.Tensor, np.ndarray)):
            tokens = tokens.tolist()
        is_id = [isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in tokens]
        if not tokens or not all(is_id):
            raise ValueError(
                f"Sample {index}, message {turn}: 'speech_tokens' must be a non-empty list of non-negative ints."
            )
        pieces = [f"[AU{int(t):04d}]" for t in tokens]
        unknown = sorted({int(t) for t, piece in zip(tokens, pieces) if piece not in self._speech_vocab})
        if unknown:
            raise ValueError(
                f"Sample {index}, message {turn}: speech token id(s) {unknown[:5]} are not in the speech tokenizer "
                f"vocabulary ({len(self._speech_vocab)} entries)."
            )
        bos = self.processor.speech_tokenizer.bos_token or self.processor.audio_bos_token
        speech = bos * self.speech_delay_tokens + "".join(pieces)
        items.append(_AudioItem(speech, None, text, self.speech_delay_tokens + len(tokens)))
        return AUDIO_TEMPLATE

    def _parse_reference_sample(self, sample: dict, system: str | None, index: int):
        """The official LLaMA-Factory sample: messages with `AUDIO_TEMPLATE` content + JSON audio items."""
        turns = [(m["role"], m["content"]) for m in sample["messages"]]
        for turn, (_, content) in enumerate(turns):
            if not isinstance(content, str):
                raise ValueError(f"Sample {index}, message {turn}: 'content' must be a string.")
            self._check_text(content.replace(AUDIO_TEMPLATE, ""), f"Sample {index}, message {turn}")
        raw_items = sample["audio"] or []
        num_placeholders = sum(content.count(AUDIO_TEMPLATE) for _, content in turns)
        if num_placeholders != len(raw_items):
            raise ValueError(
                f"Sample {index} has {num_placeholders} {AUDIO_TEMPLATE} placeholder(s) but {len(raw_items)} "
                "audio item(s)."
            )
        items = []
        for raw in raw_items:
            item = json.loads(raw) if isinstance(raw, str) else dict(raw)
            token = item["token"]
            path = item.get("path", item.get("wav_path", "")) or ""
            if token.startswith(self.processor.audio_bos_token) and "AU" in token:
                path = ""  # the reference plugin never loads a waveform for assistant speech
            waveform = self._load_audio(path) if path else None
            items.append(_AudioItem(token, waveform, item.get("text", "") or ""))
        return system, turns, items


__all__ = ["FunAudioChatDataCollator", "IGNORE_INDEX"]

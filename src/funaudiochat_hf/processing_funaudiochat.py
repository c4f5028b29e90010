"""Processor for Fun-Audio-Chat: chat prompt + user audio -> the tensors `FunAudioChatForConditionalGeneration` takes.

For every audio clip the model receives two parallel streams that both end up at the `<|AUDIO|>` placeholders of the
prompt:

* `input_features` `(clips_with_waveform, 128, frames)`: Whisper log-mels (100 frames/s) for the continuous encoder;
* `speech_ids` `(clips, speech_frames)`: discrete speech tokens at 25 Hz. For user audio these are all
  `<|audio_pad|>` (one per 40 ms, `int(duration * 25)`), padded to a multiple of `audio_group_size` (5).

The LLM runs at 5 Hz, so each `<|AUDIO|>` of the prompt is expanded to `ceil(speech_frames / 5)` copies and wrapped in
`<|audio_bos|>` ... `<|audio_eos|>` unless the text already carries them. Outputs match the reference processor
exactly (same ids, masks and features).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature, ProcessorMixin

from .audio_io import load_audio
from .limits_funaudiochat import MAX_AUDIO_SECONDS, check_audio_duration, check_text_length


# Official prompts (Fun-Audio-Chat utils/constant.py).
DEFAULT_S2T_PROMPT = "You are asked to generate text tokens."
DEFAULT_S2M_PROMPT = "You are asked to generate both text and speech tokens at the same time."
SPOKEN_S2M_PROMPT = (
    DEFAULT_S2M_PROMPT
    + " 你的名字是小云。你是一位来自杭州的温柔友善的女孩，声音甜美，举止亲切。你的回复语气自然友好，力求沟通简洁明了。"
    "你的回复简短，通常只有一到三句话，避免使用正式的称谓和重复的短语。你能用恰当的声音回复，遵循用户的指示，并能共情他们的情绪。"
    "你能用恰当的方言回复，会说四川话和粤语。"
)
AUDIO_TEMPLATE = "<|audio_bos|><|AUDIO|><|audio_eos|>"

# The processor's built-in chat template (used when the checkpoint ships none). Identical to the reference one:
# string content is copied verbatim, list content renders audio items as
# "Audio n: <|audio_bos|><|AUDIO|><|audio_eos|>\n".
DEFAULT_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Keys under which a chat-message audio item may carry its payload.
_AUDIO_ITEM_KEYS = ("audio", "path", "url", "audio_url")
# Features padded to the longest clip of a call, not to the extractor's whole window ("max_length", the reference's):
# the encoder reads only valid frames (see `FunAudioChatProcessor.extract_features`).
FEATURE_PADDING = "longest"


def _expand_local_path(path: str | os.PathLike) -> str | os.PathLike:
    """`~/dir` -> `/home/me/dir` when that is an existing local path (Hub ids are left untouched)."""
    expanded = os.path.expanduser(os.fspath(path))
    return expanded if expanded != os.fspath(path) and os.path.exists(expanded) else path


def _is_audio_item(item: Any) -> bool:
    return isinstance(item, dict) and (item.get("type") in ("audio", "input_audio") or "audio" in item)


def _is_clip_list(value: Any) -> bool:
    """A list/tuple of clips, as opposed to one waveform given as a plain list of numbers."""
    return isinstance(value, (list, tuple)) and not (len(value) and isinstance(value[0], (int, float)))


def _parse_json_item(item: Any) -> dict | None:
    """The reference JSON item `{"path": ..., "token": ..., "text": ...}` (as a dict or a JSON string), else None."""
    if isinstance(item, dict) and "token" in item:
        return item
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            parsed = json.loads(item)
        except json.JSONDecodeError as error:
            raise ValueError(f"Audio item looks like JSON but could not be parsed: {error}") from None
        if not isinstance(parsed, dict) or "token" not in parsed:
            raise ValueError("A JSON audio item must be an object with a 'token' key (and optional 'path', 'text').")
        return parsed
    return None


class FunAudioChatProcessor(ProcessorMixin):
    r"""Builds Fun-Audio-Chat model inputs from chat text and audio.

    Wraps a [`WhisperFeatureExtractor`] (log-mels), the text tokenizer (Qwen3 vocabulary + audio tokens) and the
    speech tokenizer stored in the `speech_tokenizer/` subfolder (CosyVoice3 speech-token vocabulary).

    Args:
        feature_extractor ([`WhisperFeatureExtractor`]): log-mel extractor (128 bins, 16 kHz).
        speech_tokenizer ([`PreTrainedTokenizerBase`]): speech-token tokenizer (`[AU0000]`, ..., `<|audio_pad|>`).
        tokenizer ([`PreTrainedTokenizerBase`]): text tokenizer.
        chat_template (`str`, *optional*): Jinja chat template; defaults to [`DEFAULT_CHAT_TEMPLATE`].
        audio_token, audio_bos_token, audio_eos_token, audio_pad_token (`str`): the special audio tokens.
        audio_group_size (`int`, *optional*): speech frames per LLM position (5). Defaults to the speech tokenizer's
            `audio_group_size` init kwarg, else 5.
        speech_frame_rate (`int`, defaults to 25): speech tokens per second of audio.
    """

    def __init__(
        self,
        feature_extractor=None,
        speech_tokenizer=None,
        tokenizer=None,
        chat_template: str | None = None,
        audio_token: str = "<|AUDIO|>",
        audio_bos_token: str = "<|audio_bos|>",
        audio_eos_token: str = "<|audio_eos|>",
        audio_pad_token: str = "<|audio_pad|>",
        audio_group_size: int | None = None,
        speech_frame_rate: int = 25,
    ):
        if chat_template is None:
            chat_template = DEFAULT_CHAT_TEMPLATE
        self.audio_token = getattr(tokenizer, "audio_token", None) or audio_token
        self.audio_bos_token = getattr(tokenizer, "audio_bos_token", None) or audio_bos_token
        self.audio_eos_token = getattr(tokenizer, "audio_eos_token", None) or audio_eos_token
        self.audio_pad_token = getattr(tokenizer, "audio_pad_token", None) or audio_pad_token
        if audio_group_size is None:
            init_kwargs = getattr(speech_tokenizer, "init_kwargs", None) or {}
            audio_group_size = init_kwargs.get("audio_group_size", 5)
        if int(audio_group_size) < 1:
            raise ValueError(f"`audio_group_size` must be a positive integer, got {audio_group_size}.")
        self.audio_group_size = int(audio_group_size)
        self.speech_frame_rate = int(speech_frame_rate)
        super().__init__(feature_extractor, speech_tokenizer, tokenizer, chat_template=chat_template)
        vocab = self.tokenizer.get_vocab()
        for name in ("audio_token", "audio_bos_token", "audio_eos_token"):
            if getattr(self, name) not in vocab:
                raise ValueError(f"The text tokenizer has no {name} {getattr(self, name)!r} in its vocabulary.")
        self.audio_token_id = vocab[self.audio_token]

    # ------------------------------------------------------------------------------------------------------------
    # properties
    # ------------------------------------------------------------------------------------------------------------

    @property
    def default_chat_template(self) -> str:
        """The built-in chat template (the reference processor's default)."""
        return DEFAULT_CHAT_TEMPLATE

    @property
    def sampling_rate(self) -> int:
        """Waveform rate the feature extractor expects (16 kHz)."""
        return int(self.feature_extractor.sampling_rate)

    @property
    def max_audio_seconds(self) -> float:
        """The longest clip accepted: the feature extractor's window (`n_samples`, 30 s for a `chunk_length=30`
        extractor, 300 s for the official one), capped at `MAX_AUDIO_SECONDS`. The reference processor cuts the
        features of a longer clip at the window while its prompt keeps placeholders for the whole clip (the model
        then never hears the rest); this processor refuses such clips instead."""
        window = getattr(self.feature_extractor, "n_samples", None)
        window_seconds = window / self.sampling_rate if window else MAX_AUDIO_SECONDS
        return min(float(window_seconds), MAX_AUDIO_SECONDS)

    @property
    def model_input_names(self) -> list[str]:
        return [
            "input_ids",
            "attention_mask",
            "speech_ids",
            "speech_attention_mask",
            "input_features",
            "feature_attention_mask",
            "feature_exist_mask",
        ]

    # ------------------------------------------------------------------------------------------------------------
    # loading / saving
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> FunAudioChatProcessor:
        """Load from a Hub id or a local directory (`~` is expanded; the `speech_tokenizer/` subfolder is loaded)."""
        return super().from_pretrained(_expand_local_path(pretrained_model_name_or_path), **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> list[str]:
        """Save everything `from_pretrained` needs: tokenizer, `speech_tokenizer/`, chat template, processor config.

        `preprocessor_config.json` is written as well, so tools that read the feature extractor on its own (and the
        reference code) keep working with the saved directory.
        """
        save_directory = os.path.expanduser(os.fspath(save_directory))
        files = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        if not os.path.exists(os.path.join(save_directory, "preprocessor_config.json")):
            self.feature_extractor.save_pretrained(save_directory)
        return files

    # ------------------------------------------------------------------------------------------------------------
    # building blocks (also used by the training collator)
    # ------------------------------------------------------------------------------------------------------------

    def num_speech_frames(self, waveform: np.ndarray) -> int:
        """Speech tokens (25 Hz) the reference assigns to a 16 kHz waveform: `int(len / 16000 * 25)` (floor)."""
        return int(len(waveform) / self.sampling_rate * self.speech_frame_rate)

    def num_audio_placeholders(self, num_speech_frames: int) -> int:
        """`<|AUDIO|>` positions (5 Hz) for a clip of `num_speech_frames` speech tokens: `ceil(frames / group)`."""
        return math.ceil(num_speech_frames / self.audio_group_size)

    def tokenize_speech(self, speech: list[str], pad_to_multiple_of: int | None) -> dict[str, torch.Tensor]:
        """Speech-token strings -> `speech_ids` / `speech_attention_mask` `(clips, speech_frames)`, right padded."""
        encoded = self.speech_tokenizer(
            speech,
            padding=True,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side="right",
            return_attention_mask=True,
            return_token_type_ids=False,
            return_tensors="pt",
        )
        return {"speech_ids": encoded["input_ids"], "speech_attention_mask": encoded["attention_mask"]}

    def extract_features(self, waveforms: list[np.ndarray], padding: str = FEATURE_PADDING) -> dict[str, torch.Tensor]:
        """16 kHz waveforms -> `input_features` `(clips, mel_bins, frames)` + `feature_attention_mask` `(clips, frames)`

        Args:
            padding: `"longest"` (default) pads only to the longest clip; `"max_length"` pads every clip to the
                extractor's `chunk_length`, as the reference processor does (30000 frames per clip for a 300 s
                extractor: ~0.1 s of CPU time and 15 MB per clip). Both give the same values on every valid frame (up
                to float32 rounding) and the same mask there; the encoder reads only valid frames, so the model's
                outputs do not depend on the choice.

        Raises:
            ValueError: a waveform is longer than the extractor's window (see `max_audio_seconds`).
        """
        for index, waveform in enumerate(waveforms):
            check_audio_duration(len(waveform), self.sampling_rate, self.max_audio_seconds, f"Audio clip {index}")
        if padding == "max_length":
            features = self.feature_extractor(
                waveforms,
                sampling_rate=self.sampling_rate,
                padding="max_length",
                return_attention_mask=True,
                return_tensors="pt",
            )
            return {"input_features": features["input_features"], "feature_attention_mask": features["attention_mask"]}
        if padding != "longest":
            raise ValueError(f"`padding` must be 'max_length' or 'longest', got {padding!r}.")
        extractor = self.feature_extractor
        hop, max_samples = extractor.hop_length, extractor.n_samples
        # With max_length padding the last valid STFT frames (centred, n_fft // 2 samples each side) see zeros after
        # the clip; append those zeros so the valid frames get the same values, then rebuild the mask from the true
        # lengths (the extractor would count the appended zeros as valid).
        tail = np.zeros(extractor.n_fft // 2, dtype=np.float32)
        features = extractor(
            [np.concatenate([w, tail]) for w in waveforms],
            sampling_rate=self.sampling_rate,
            padding="longest",
            return_attention_mask=False,
            return_tensors="pt",
        )["input_features"]
        lengths = torch.tensor([min(math.ceil(min(len(w), max_samples) / hop), max_samples // hop) for w in waveforms])
        num_frames = int(lengths.max())
        mask = (torch.arange(num_frames)[None, :] < lengths[:, None]).to(torch.int32)
        return {"input_features": features[..., :num_frames].contiguous(), "feature_attention_mask": mask}

    def expand_audio_placeholders(self, texts: list[str], num_speech_frames: list[int]) -> list[str]:
        """Replace the i-th `<|AUDIO|>` (across all texts, left to right) by `ceil(frames_i / group)` copies.

        A placeholder not already written as `<|audio_bos|><|AUDIO|>` or `<|AUDIO|><|audio_eos|>` is wrapped in
        `<|audio_bos|>` ... `<|audio_eos|>` (the reference rule: wrap only when neither neighbour is present).
        """
        num_placeholders = sum(text.count(self.audio_token) for text in texts)
        if num_placeholders != len(num_speech_frames):
            raise ValueError(
                f"The text contains {num_placeholders} {self.audio_token} placeholder(s) but {len(num_speech_frames)} "
                "audio clip(s) were given; pass exactly one clip per placeholder."
            )
        frames = iter(num_speech_frames)
        expanded = []
        for text in texts:
            pieces = text.split(self.audio_token)
            out = [pieces[0]]
            for index in range(1, len(pieces)):
                before, after = pieces[index - 1], pieces[index]
                tokens = self.audio_token * self.num_audio_placeholders(next(frames))
                has_bos = before.endswith(self.audio_bos_token)
                has_eos = after.startswith(self.audio_eos_token)
                if not has_bos and not has_eos:
                    tokens = self.audio_bos_token + tokens + self.audio_eos_token
                out.append(tokens)
                out.append(after)
            expanded.append("".join(out))
        return expanded

    def _prepare_audio(
        self, audio: Any, sampling_rate: int | None
    ) -> tuple[list[str], list[np.ndarray | None]]:
        """Normalise the `audio` argument into per-clip speech-token strings and 16 kHz waveforms (None: no wav)."""
        if isinstance(audio, (np.ndarray, torch.Tensor, dict, bytes, bytearray, memoryview, str)) or hasattr(
            audio, "__fspath__"
        ):
            clips = [audio]
        elif isinstance(audio, Sequence):
            clips = []
            for clip in audio:  # allow one nested level: a list of clips per prompt
                if _is_clip_list(clip):
                    clips.extend(clip)
                else:
                    clips.append(clip)
        else:
            raise ValueError(f"Unsupported `audio` of type {type(audio).__name__}.")

        speech, waveforms = [], []
        for clip in clips:
            item = _parse_json_item(clip)
            if item is not None:
                # Reference JSON path: the speech string is given; features only for items with a path.
                path = item.get("path", item.get("wav_path", "")) or ""
                if not item["token"]:
                    raise ValueError("A JSON audio item has an empty 'token' string: it needs a speech token.")
                speech.append(item["token"])
                waveforms.append(self._load_clip(path, None) if path else None)
                continue
            waveform = self._load_clip(clip, sampling_rate)
            frames = self.num_speech_frames(waveform)
            if frames == 0:
                raise ValueError(
                    f"Audio clip of {len(waveform)} samples at {self.sampling_rate} Hz is shorter than one speech "
                    f"frame ({1000 // self.speech_frame_rate} ms)."
                )
            speech.append(self.audio_pad_token * frames)
            waveforms.append(waveform)
        return speech, waveforms

    def _load_clip(self, clip: Any, sampling_rate: int | None) -> np.ndarray:
        return load_audio(clip, sampling_rate, self.sampling_rate, max_seconds=self.max_audio_seconds)

    # ------------------------------------------------------------------------------------------------------------
    # main entry points
    # ------------------------------------------------------------------------------------------------------------

    def __call__(
        self,
        text: str | list[str] | None = None,
        audio: Any = None,
        sampling_rate: int | None = None,
        return_tensors: str | None = "pt",
        padding: bool | str = True,
        padding_side: str | None = None,
        feature_padding: str = FEATURE_PADDING,
        **kwargs,
    ) -> BatchFeature:
        """Tokenize prompt(s) and prepare their audio clips.

        Args:
            text: one prompt or a batch of prompts (usually from [`apply_chat_template`]); each `<|AUDIO|>` stands
                for one clip, consumed in order across the batch.
            audio: one clip or a list of clips. A clip is anything [`load_audio`] accepts (path, bytes, array,
                tensor, `{"array", "sampling_rate"}` dict) or a reference JSON item `{"path", "token", "text"}`
                (string or dict) whose `token` string is used as its speech tokens.
            sampling_rate: rate of clips given as bare arrays/tensors (default 16 kHz); they are resampled.
                Clips longer than `max_audio_seconds` and prompts longer than `MAX_TEXT_CHARS` characters are
                refused (`ValueError`) before any decoding or tokenization.
            return_tensors: `"pt"` (default), `"np"` or None.
            padding: text padding (default pads a batch to its longest prompt).
            padding_side: `"left"` for batched generation, `"right"` otherwise (default: the tokenizer's).
            feature_padding: `"longest"` (default: features padded to the longest clip) or `"max_length"` (the
                reference processor's: padded to the extractor's chunk length); see [`extract_features`].
            **kwargs: forwarded to the text tokenizer (e.g. `add_special_tokens`, `return_token_type_ids`).

        Returns:
            [`BatchFeature`] with `input_ids`, `attention_mask` `(batch, seq)` and, when audio is given,
            `speech_ids`, `speech_attention_mask` `(clips, speech_frames)`, `input_features`
            `(clips_with_waveform, mel_bins, frames)`, `feature_attention_mask` `(clips_with_waveform, frames)`,
            `feature_exist_mask` `(clips,)` (absent when no clip has a waveform).
        """
        if text is None:
            raise ValueError("`text` is required: pass the prompt(s), e.g. from `processor.apply_chat_template`.")
        if isinstance(text, str):
            texts = [text]
        elif isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            texts = list(text)
        else:
            raise ValueError("`text` must be a string or a list of strings.")
        for index, prompt in enumerate(texts):
            if not prompt:  # would tokenize to an empty float tensor, not to ids
                raise ValueError(f"Prompt {index} is empty: pass the chat prompt, e.g. from `apply_chat_template`.")
            check_text_length(prompt, f"Prompt {index}")
        if padding_side not in (None, "left", "right"):
            raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
        if feature_padding not in ("longest", "max_length"):  # before the clips are decoded and tokenized
            raise ValueError(f"`feature_padding` must be 'longest' or 'max_length', got {feature_padding!r}.")

        audio_inputs: dict[str, Any] = {}
        if audio is not None:
            speech, waveforms = self._prepare_audio(audio, sampling_rate)
            audio_inputs.update(self.tokenize_speech(speech, pad_to_multiple_of=self.audio_group_size))
            valid_frames = audio_inputs["speech_attention_mask"].sum(-1).tolist()
            texts = self.expand_audio_placeholders(texts, valid_frames)
            present = [w for w in waveforms if w is not None]
            if present:
                audio_inputs.update(self.extract_features(present, padding=feature_padding))
                audio_inputs["feature_exist_mask"] = torch.tensor([w is not None for w in waveforms], dtype=torch.bool)
        else:
            num_placeholders = sum(t.count(self.audio_token) for t in texts)
            if num_placeholders:
                raise ValueError(
                    f"The text contains {num_placeholders} {self.audio_token} placeholder(s) but no audio was given."
                )

        kwargs.setdefault("return_token_type_ids", False)
        if padding_side is not None:
            kwargs["padding_side"] = padding_side
        text_inputs = self.tokenizer(texts, padding=padding, **kwargs)
        data = {**text_inputs, **audio_inputs}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        return_dict: bool = False,
        audio: Any = None,
        sampling_rate: int | None = None,
        return_tensors: str | None = "pt",
        feature_padding: str = FEATURE_PADDING,
        **kwargs,
    ):
        """Render conversation(s) with the chat template; optionally tokenize them together with their audio.

        User audio may be given as string content containing [`AUDIO_TEMPLATE`] (clips then come from `audio`, in
        order) or as list content with `{"type": "audio", "audio": <anything load_audio takes>}` items. Assistant
        turns of a multi-turn history are plain text. `feature_padding`: as in `__call__` (when tokenizing).

        Returns the prompt string (list of strings for a batch of conversations) when `tokenize=False`; otherwise
        the processor outputs ([`BatchFeature`] if `return_dict`, else only `input_ids`).
        """
        is_batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        conversations = [list(c) for c in conversation] if is_batched else [list(conversation)]
        supplied = [] if audio is None else self._as_clip_list(audio)
        supplied_iter = iter(supplied)
        clips: list[Any] = []
        rendered_conversations = []
        for conv in conversations:
            rendered = []
            for message in conv:
                if not isinstance(message, dict) or "role" not in message or "content" not in message:
                    raise ValueError("Every chat message must be a dict with 'role' and 'content'.")
                content = message["content"]
                if isinstance(content, str):
                    for _ in range(content.count(self.audio_token)):
                        try:
                            clips.append(next(supplied_iter))
                        except StopIteration:
                            clips.append(None)
                    rendered.append(message)
                    continue
                items = []
                for item in content:
                    if _is_audio_item(item):
                        payload = next((item[k] for k in _AUDIO_ITEM_KEYS if item.get(k) is not None), None)
                        if payload is None:
                            raise ValueError(
                                f"Audio item {sorted(item)} carries no audio: put it under 'audio' (or 'path')."
                            )
                        clips.append(payload)
                        # the template only needs to know it is audio; keep arrays out of the rendering
                        items.append({"type": "audio", "audio": "<audio>"})
                    else:
                        items.append(item)
                rendered.append({**message, "content": items})
            rendered_conversations.append(rendered)
        prompt = super().apply_chat_template(
            rendered_conversations if is_batched else rendered_conversations[0],
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        if not tokenize:
            return prompt
        leftover = sum(1 for _ in supplied_iter)
        missing = sum(1 for clip in clips if clip is None)
        if leftover or missing:
            raise ValueError(
                f"The conversation has {len(clips)} audio placeholder(s) but {len(supplied)} clip(s) were passed "
                "in `audio` for the string-content placeholders."
            )
        outputs = self(
            text=prompt,
            audio=clips or None,
            sampling_rate=sampling_rate,
            return_tensors=return_tensors,
            feature_padding=feature_padding,
        )
        return outputs if return_dict else outputs["input_ids"]

    @staticmethod
    def _as_clip_list(audio: Any) -> list:
        return list(audio) if _is_clip_list(audio) else [audio]

    # ------------------------------------------------------------------------------------------------------------
    # decoding
    # ------------------------------------------------------------------------------------------------------------

    def decode_reply(self, token_ids, **kwargs) -> str | list[str]:
        """Decode generated text ids into the reply text, cleaned like the official web demo.

        Leading `<|audio_bos|>` / `<|sil|>` and trailing `<|audio_eos|>` / `<|sil|>` / `<|im_end|>` are stripped, and
        padding tokens are dropped. Accepts one sequence (list / 1-D tensor) -> `str`, or a batch -> `list[str]`.
        """
        if isinstance(token_ids, (torch.Tensor, np.ndarray)):
            token_ids = token_ids.tolist()
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode_reply(ids, **kwargs) for ids in token_ids]
        pad_id = self.tokenizer.pad_token_id
        ids = [int(i) for i in token_ids if pad_id is None or int(i) != pad_id]
        text = self.tokenizer.decode(ids, skip_special_tokens=False, **kwargs)
        sil = re.escape("<|sil|>")
        leading = f"^({re.escape(self.audio_bos_token)}|{sil})+"
        trailing = f"({re.escape(self.audio_eos_token)}|{sil}|{re.escape('<|im_end|>')})+$"
        text = re.sub(leading, "", text)
        return re.sub(trailing, "", text)


__all__ = [
    "AUDIO_TEMPLATE",
    "DEFAULT_CHAT_TEMPLATE",
    "DEFAULT_S2M_PROMPT",
    "DEFAULT_S2T_PROMPT",
    "SPOKEN_S2M_PROMPT",
    "FunAudioChatProcessor",
]

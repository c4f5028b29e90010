"""The `speech-to-speech` pipeline: a spoken question (or a chat with spoken turns) in, a spoken reply out.

```python
import funaudiochat_hf  # registers the task
from transformers import pipeline

s2s = pipeline("speech-to-speech", model="FunAudioLLM/Fun-Audio-Chat-8B", decoder="path/to/cosyvoice3")
reply = s2s("question.wav", max_new_tokens=512)
reply["text"], reply["audio"], reply["sampling_rate"]  # str, float32 (samples,), 24000
```

The same file is shipped in one-folder Hub repos (see `scripts/build_hub_repo.py`), where
`pipeline(model=repo, trust_remote_code=True)` finds it through `config.custom_pipelines` without this package. With
the package installed, `pipeline("speech-to-speech", model=repo)` runs the installed code and none of the repo's.
It only imports its siblings relatively and uses the model's public `generate_speech` / `generate_speech_stream`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel, Pipeline
from transformers.utils import logging

from .audio_io import load_audio
from .generation_vocoding_funaudiochat import decoder_voices
from .limits_funaudiochat import MAX_AUDIO_SECONDS, check_text_length
from .processing_funaudiochat import AUDIO_TEMPLATE, SPOKEN_S2M_PROMPT, _is_audio_item


logger = logging.get_logger(__name__)

DEFAULT_SAMPLING_RATE = 24000
# Conversations per `generate_speech` call when a list is passed (override with `batch_size=`).
DEFAULT_BATCH_SIZE = 8


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and "role" in item and "content" in item


def _is_chat(item: Any) -> bool:
    if hasattr(item, "messages") and isinstance(item.messages, list):  # transformers' internal `Chat` wrapper
        return True
    return isinstance(item, (list, tuple)) and len(item) > 0 and all(_is_message(m) for m in item)


class SpeechToSpeechPipeline(Pipeline):
    """Spoken question in, spoken answer (text + 24 kHz waveform) out, with Fun-Audio-Chat.

    Inputs (one item, or a list of items for a batch):
        * audio: a file path, the bytes of an audio file, a 1-D (or channels x samples) numpy array / torch tensor at
          16 kHz (or pass `sampling_rate=`), or `{"raw" | "array": ..., "sampling_rate": sr}`;
        * a chat: a list of `{"role", "content"}` turns. User turns hold audio (any of the forms above, or a list of
          `{"type": "audio", "audio": ...}` / `{"type": "text", "text": ...}` items); earlier assistant turns are
          text (as the official demo keeps history); an optional leading system turn replaces the system prompt.

    Call keywords: `system_prompt` (defaults to the official spoken-chat prompt), `sampling_rate` (of raw arrays),
    `batch_size`, and any `generate_speech` keyword (`max_new_tokens`, `temperature`, `top_p`, `top_k`,
    `repetition_penalty`, `do_sample`, `speaker`, `seed`, `backend`, ...), which pass through unchanged.

    Returns per input: `{"text": str, "audio": np.ndarray float32 (samples,), "sampling_rate": int}`.

    Limits (docs/limits.md): a clip longer than the processor's `max_audio_seconds` or a prompt longer than
    `MAX_TEXT_CHARS` characters raises `ValueError` before any audio is decoded or resampled.

    Constructor extras: `decoder` (a CosyVoice3 token2wav model, a converted folder, an official CosyVoice3 folder or
    a Hub id) for the official two-repo layout, where the chat checkpoint carries no speech decoder;
    `speakers_file` (official `spk2info.pt`-style file used with an official CosyVoice3 folder); `speaker` (default
    voice name).
    """

    _load_processor = None  # optional in `pipeline()`: resolved in `__init__` with a clear error if missing
    _load_tokenizer = False
    _load_feature_extractor = False
    _load_image_processor = False
    _load_video_processor = False

    def __init__(self, model, processor=None, decoder=None, speakers_file=None, speaker=None, **kwargs):
        if processor is None:
            processor = self._processor_for(model)
        super().__init__(model=model, processor=processor, **kwargs)
        if decoder is not None:
            decoder = load_speech_decoder(decoder, speakers_file=speakers_file)
            decoder.to(self.device)
        self.speech_decoder = decoder
        if self.decoder is None:
            raise ValueError(
                "This chat model has no speech decoder (token2wav). Pass `decoder=` with a CosyVoice3 folder or Hub "
                "id (the official Fun-CosyVoice3-0.5B-2512 layout or one converted by scripts/convert_cosyvoice3.py), "
                "or load a one-folder repo built by scripts/build_hub_repo.py."
            )
        if speaker is not None and self.speakers and speaker not in self.speakers:
            raise ValueError(f"Unknown speaker {speaker!r}; the decoder has: {', '.join(self.speakers)}.")
        self.default_speaker = speaker
        if getattr(self.model.config, "tiny_weight_seed", None) is not None:  # written by tiny_model.py
            logger.warning(
                "This is the tiny RANDOM-WEIGHT model (funaudiochat_hf.tiny_model): its replies are noise, not speech, "
                "and gibberish text. Load FunAudioLLM/Fun-Audio-Chat-8B for real replies."
            )

    @staticmethod
    def _processor_for(model):
        from transformers import AutoProcessor

        source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
        if not source:
            raise ValueError("Pass `processor=` (a FunAudioChatProcessor): it cannot be inferred from this model.")
        # The repo's processor code only where the model itself runs the repo's code (`trust_remote_code`, a
        # `transformers_modules` class); the installed package serves its own one-folder repos without it.
        trust = type(model).__module__.startswith("transformers_modules.")
        return AutoProcessor.from_pretrained(source, trust_remote_code=trust)

    @property
    def decoder(self):
        """The CosyVoice3 decoder that voices the replies: the one passed as `decoder=`, else the model's own."""
        return self.speech_decoder if self.speech_decoder is not None else getattr(self.model, "token2wav", None)

    @property
    def speakers(self) -> list[str]:
        """Names of the voices stored in the speech decoder (pass one as `speaker=`)."""
        return decoder_voices(self.decoder)

    @property
    def sampling_rate(self) -> int:
        config = getattr(self.decoder, "config", None)
        return int(getattr(config, "sampling_rate", None) or DEFAULT_SAMPLING_RATE)

    # ---------------------------------------------------------------------------------------------------------------
    # Pipeline protocol

    def _sanitize_parameters(self, system_prompt=None, sampling_rate=None, **generate_kwargs):
        preprocess_params = {}
        if system_prompt is not None:
            preprocess_params["system_prompt"] = system_prompt
        if sampling_rate is not None:
            preprocess_params["sampling_rate"] = sampling_rate
        for name in ("batch_size", "num_workers"):
            generate_kwargs.pop(name, None)
        return preprocess_params, generate_kwargs, {}

    def __call__(self, inputs, **kwargs):
        """Run one input (returns a dict) or a list of inputs (returns a list of dicts, in order).

        A list is generated `batch_size` conversations at a time (default 8) in one batched `generate_speech` call;
        every output belongs to its own input only.
        """
        conversations, is_batch = self._split_inputs(inputs)
        batch_size = kwargs.pop("batch_size", None)
        if batch_size is None:  # 0 is refused below, not taken for "unset"
            batch_size = self._batch_size or DEFAULT_BATCH_SIZE
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        results = []
        for start in range(0, len(conversations), batch_size):
            group = conversations[start : start + batch_size]
            results.extend(self.run_single(group, preprocess_params, forward_params, postprocess_params))
        return results if is_batch else results[0]

    def preprocess(self, conversations, system_prompt=None, sampling_rate=None) -> dict[str, Any]:
        """Render each conversation with the chat template and run the processor over the whole group.

        `conversations` is a list of chats (each a list of turns); rows are left-padded for batched generation.
        """
        texts, audios = [], []
        for conversation in conversations:
            text, clips = self._render(conversation, system_prompt, sampling_rate)
            texts.append(text)
            audios.extend(clips)
        padding_kwargs = {"padding": True, "padding_side": "left"} if len(texts) > 1 else {}
        model_inputs = self.processor(text=texts, audio=audios, return_tensors="pt", **padding_kwargs)
        model_inputs = dict(model_inputs)
        features = model_inputs.get("input_features")
        if features is not None and self.model.dtype.is_floating_point:
            model_inputs["input_features"] = features.to(self.model.dtype)
        return model_inputs

    def _forward(self, model_inputs, **generate_kwargs) -> dict[str, Any]:
        prompt_length = model_inputs["input_ids"].shape[1]
        generate_kwargs = self._generate_kwargs(generate_kwargs)
        output = self.model.generate_speech(**model_inputs, **generate_kwargs)
        batch = model_inputs["input_ids"].shape[0]
        audio = output.audio if output.audio is not None else [torch.zeros(0)] * batch
        return {
            "reply_ids": output.sequences[:, prompt_length:],
            "audio": [a.detach().float().reshape(-1).cpu() for a in audio],
            "sampling_rate": getattr(output, "sampling_rate", None) or self.sampling_rate,
        }

    def postprocess(self, model_outputs) -> list[dict[str, Any]]:
        results = []
        for reply_ids, audio in zip(model_outputs["reply_ids"], model_outputs["audio"]):
            results.append(
                {
                    "text": self.processor.decode_reply(reply_ids),
                    "audio": audio.numpy().astype(np.float32, copy=False),
                    "sampling_rate": int(model_outputs["sampling_rate"]),
                }
            )
        return results

    # ---------------------------------------------------------------------------------------------------------------
    # Streaming

    def stream(self, inputs, system_prompt=None, sampling_rate=None, **generate_kwargs) -> Iterator[dict[str, Any]]:
        """Generate the reply to one input while it is produced.

        Yields `{"text": str (new text), "audio": np.ndarray float32 (new samples), "sampling_rate": int,
        "finished": bool}` events: audio arrives in chunks of `token_hop_len` speech tokens (15 = 0.6 s by default),
        long before the reply is complete. Concatenating all `audio` chunks gives the whole reply; concatenating the
        `text` deltas gives the reply text without special tokens (`__call__` cleans it like the official demo).
        """
        conversations, is_batch = self._split_inputs(inputs)
        if is_batch:
            raise ValueError("`stream` takes one input (a single audio or chat), not a list; call it per input.")
        model_inputs = self.preprocess(conversations, system_prompt=system_prompt, sampling_rate=sampling_rate)
        model_inputs = self._ensure_tensor_on_device(model_inputs, device=self.device)
        generate_kwargs = self._generate_kwargs(generate_kwargs)
        with torch.no_grad():
            # The model decodes the text incrementally (special tokens dropped, never half a character).
            for event in self.model.generate_speech_stream(
                **model_inputs, tokenizer=self.processor.tokenizer, **generate_kwargs
            ):
                audio = event.audio if event.audio is not None else torch.zeros(0)
                yield {
                    "text": event.text or "",
                    "audio": audio.detach().float().reshape(-1).cpu().numpy(),
                    "sampling_rate": int(getattr(event, "sampling_rate", None) or self.sampling_rate),
                    "finished": bool(event.finished),
                }

    # ---------------------------------------------------------------------------------------------------------------
    # Helpers

    @property
    def _max_audio_seconds(self) -> float:
        return getattr(self.processor, "max_audio_seconds", MAX_AUDIO_SECONDS)

    def _generate_kwargs(self, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
        generate_kwargs = dict(generate_kwargs)
        if generate_kwargs.get("speaker") is None and self.default_speaker is not None:
            generate_kwargs["speaker"] = self.default_speaker
        if self.speech_decoder is not None:
            generate_kwargs.setdefault("speech_decoder", self.speech_decoder)
        if generate_kwargs.get("eos_token_id") is None:
            generate_kwargs["eos_token_id"] = self._reply_stop_ids()
        return generate_kwargs

    def _reply_stop_ids(self) -> list[int]:
        """A reply ends at the chat template's `<|im_end|>` (the tokenizer's eos, what the official S2S example passes
        as `eos_token_id`), or at the generation config's eos (`<|endoftext|>` in the official checkpoint)."""
        ids = [getattr(self.processor.tokenizer, "eos_token_id", None)]
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids += configured if isinstance(configured, (list, tuple)) else [configured]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _split_inputs(self, inputs) -> tuple[list[list[dict[str, Any]]], bool]:
        """Normalize any accepted input into a list of chats and whether the caller passed a batch."""
        if _is_chat(inputs):
            return [self._as_chat(inputs)], False
        if isinstance(inputs, tuple):
            inputs = list(inputs)
        if isinstance(inputs, list):
            if len(inputs) == 0:
                raise ValueError("Got an empty list of inputs.")
            if all(isinstance(x, (int, float, np.number)) for x in inputs):
                raise ValueError(
                    "Got a list of numbers: pass a waveform as a numpy array (or a dict with 'array' and "
                    "'sampling_rate'); a list means a batch of inputs."
                )
            return [self._as_chat(item) for item in inputs], True
        return [self._as_chat(inputs)], False

    @staticmethod
    def _as_chat(item) -> list[dict[str, Any]]:
        if hasattr(item, "messages") and isinstance(item.messages, list):
            return list(item.messages)
        if _is_chat(item):
            return list(item)
        if item is None:
            raise ValueError("Got `None` as input: pass an audio file path, bytes, an array or a chat.")
        return [{"role": "user", "content": [{"type": "audio", "audio": item}]}]

    def _render(self, conversation, system_prompt, sampling_rate) -> tuple[str, list[np.ndarray]]:
        """Chat template text with one `AUDIO_TEMPLATE` per user clip (the official prompt form) + the 16 kHz clips."""
        messages, clips = [], []
        for turn in conversation:
            role, content = turn["role"], turn["content"]
            if role == "user":
                text, turn_clips = self._user_content(content, sampling_rate, self._max_audio_seconds)
                clips.extend(turn_clips)
                messages.append({"role": "user", "content": text})
            elif role in ("assistant", "system"):
                if not isinstance(content, str):
                    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                    content = "".join(texts)
                messages.append({"role": role, "content": content})
            else:
                raise ValueError(f"Unknown chat role {role!r}: expected 'system', 'user' or 'assistant'.")
        if not clips:
            raise ValueError("The conversation has no user audio: speech-to-speech needs at least one spoken turn.")
        if messages[-1]["role"] != "user":
            raise ValueError("The last turn of the conversation must be a user turn (the one to reply to).")
        check_text_length(system_prompt, "The system prompt")
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt or SPOKEN_S2M_PROMPT})
        elif system_prompt is not None:
            messages[0] = {"role": "system", "content": system_prompt}
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, clips

    @staticmethod
    def _user_content(content, sampling_rate, max_seconds) -> tuple[str, list[np.ndarray]]:
        if isinstance(content, str) and AUDIO_TEMPLATE in content:
            raise ValueError(
                "A user turn holds the audio placeholder text but no audio: put the audio itself in the turn, e.g. "
                '{"role": "user", "content": [{"type": "audio", "audio": "question.wav"}]}.'
            )
        if isinstance(content, str) and not _looks_like_path(content):
            raise ValueError(
                f"A user turn holds text only ({content[:40]!r}): Fun-Audio-Chat replies to speech; give the user "
                'turn audio, e.g. [{"type": "audio", "audio": "question.wav"}].'
            )
        items = content if isinstance(content, list) and all(isinstance(p, dict) for p in content) else None
        if items is None or (items and not any(_is_audio_item(p) or p.get("type") == "text" for p in items)):
            items = [{"type": "audio", "audio": content}]
        pieces, clips = [], []
        for part in items:
            if _is_audio_item(part):
                audio = part.get("audio", part.get("input_audio", part.get("path")))
                clips.append(_load_clip(audio, sampling_rate, max_seconds))
                pieces.append(AUDIO_TEMPLATE)
            elif part.get("type") == "text":
                pieces.append(part["text"])
            else:
                raise ValueError(f"Unsupported content item in a user turn: {part!r}.")
        # An instruction after the audio goes on its own line, as in the official prompts.
        return "\n".join(pieces), clips


def _looks_like_path(text: str) -> bool:
    return os.path.exists(os.path.expanduser(text)) or Path(text).suffix.lower() in (".wav", ".flac", ".mp3", ".ogg")


def _load_clip(audio, sampling_rate, max_seconds) -> np.ndarray:
    # `sampling_rate` describes raw waveforms only: files and dicts carry their own rate. `max_seconds` is checked
    # on the file header / array length, before decoding or resampling.
    if isinstance(audio, (np.ndarray, torch.Tensor)):
        return load_audio(audio, sampling_rate=sampling_rate, max_seconds=max_seconds)
    return load_audio(audio, max_seconds=max_seconds)


def load_speech_decoder(decoder, speakers_file=None, **kwargs):
    """A CosyVoice3 token2wav model from a model instance, a local folder or a Hub id.

    Folders with a `config.json` are converted ones (`CosyVoice3Token2Wav.from_pretrained`); folders with the
    official `cosyvoice3.yaml` (+ `flow.pt`, `hift.pt`) are read with `CosyVoice3Token2Wav.from_original`.
    """
    if not isinstance(decoder, (str, os.PathLike)):
        return decoder
    from .modeling_cosyvoice3 import CosyVoice3Token2Wav

    path = Path(os.path.expanduser(str(decoder)))
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(decoder)))
    if (path / "config.json").is_file():
        return CosyVoice3Token2Wav.from_pretrained(path, **kwargs)
    if (path / "cosyvoice3.yaml").is_file():
        return CosyVoice3Token2Wav.from_original(path, speakers_file=speakers_file)
    raise ValueError(
        f"{decoder} is not a CosyVoice3 folder: expected a converted folder (config.json + model.safetensors) or an "
        "official one (cosyvoice3.yaml, flow.pt, hift.pt)."
    )


def register_pipeline() -> None:
    """Register the `speech-to-speech` task with transformers (done by `import funaudiochat_hf`)."""
    from transformers.pipelines import PIPELINE_REGISTRY

    registered = PIPELINE_REGISTRY.supported_tasks.get("speech-to-speech", {})
    if registered.get("impl") is SpeechToSpeechPipeline:
        return  # idempotent: re-registering would log an "overwriting" warning
    PIPELINE_REGISTRY.register_pipeline(
        "speech-to-speech",
        pipeline_class=SpeechToSpeechPipeline,
        pt_model=AutoModel,
        type="multimodal",
    )

"""Fine-tuning Fun-Audio-Chat with the transformers `Trainer`: loss logging, freezing, LoRA targets, JSON-lines data.

Everything distributed (DDP, FSDP, DeepSpeed) comes from `Trainer` / `accelerate`; nothing here is specific to one
device count. The pieces:

* [`FunAudioChatTrainer`]: a `Trainer` that also logs the model's `text_loss` and `speech_loss` (averaged over the
  logging window exactly like `loss`) and evaluates them as `eval_text_loss` / `eval_speech_loss`. The optimised loss
  is the model's own `loss = text_loss + speech_loss`.
* [`freeze_audio_encoder`]: stop training the continuous (Whisper) audio encoder.
* [`lora_config`]: a peft `LoraConfig` whose regex targets the LLM and CRQ projections (peft has no defaults for this
  model type); [`merge_lora`] merges the adapters back into a plain model that saves and reloads correctly.
* [`JsonlSpeechDataset`]: reads the JSON-lines conversation format documented in `data_collator_funaudiochat`.
* [`make_synthetic_dataset`]: writes a tiny deterministic dataset (synthetic user wavs + random assistant text and
  speech tokens) for smoke tests and the CPU example of `scripts/finetune.py`.

```python
trainer = FunAudioChatTrainer(
    model=model,
    args=TrainingArguments("out", remove_unused_columns=False, gradient_checkpointing=True),
    train_dataset=JsonlSpeechDataset("train.jsonl"),
    data_collator=FunAudioChatDataCollator(processor),
)
trainer.train()
```
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer

from .audio_io import wav_bytes
from .data_collator_funaudiochat import FunAudioChatDataCollator


logger = logging.getLogger(__name__)

# Extra losses of `FunAudioChatCausalLMOutputWithPast` that the trainer logs next to `loss`.
LOGGED_LOSSES = ("text_loss", "speech_loss")

# Linear projections of a Qwen3 decoder layer (the LLM and the CRQ transformer are both Qwen3).
_QWEN3_PROJECTIONS = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
LLM_LORA_TARGETS = rf"language_model\.model\.layers\.\d+\.{_QWEN3_PROJECTIONS}"
CRQ_LORA_TARGETS = (
    rf"audio_invert_tower\.(crq_transformer\.layers\.\d+\.{_QWEN3_PROJECTIONS}"
    r"|pre_matching|input_matching|output_matching)"
)


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------


class FunAudioChatTrainer(Trainer):
    """`Trainer` for [`FunAudioChatForConditionalGeneration`] (plain or wrapped by peft).

    On top of `Trainer`:

    * `text_loss` and `speech_loss` are logged with every training `loss` log, averaged over the same steps (and
      processes) as `loss`, and evaluation reports `eval_text_loss` / `eval_speech_loss` (sample-weighted means,
      like `eval_loss`).
    * `remove_unused_columns` is turned off: the collator needs the raw conversation fields of the dataset.
    * `processor` (a [`FunAudioChatProcessor`]) is saved with every checkpoint and the final model, and gives the
      default `data_collator` ([`FunAudioChatDataCollator`]). It is deliberately not handed to `Trainer` as
      `processing_class`: `Trainer.train()` would then rewrite the model's text `eos_token_id` / `pad_token_id` to
      the tokenizer's, and the model reads those ids to build its transcript targets.

    The loss is the model's `loss` (per-batch means, as in the reference recipe); with gradient accumulation the
    trainer averages the micro-batch losses (the model sets `accepts_loss_kwargs = False`).
    """

    def __init__(self, *args, processor=None, **kwargs):
        if processor is None and hasattr(kwargs.get("processing_class"), "speech_tokenizer"):
            processor = kwargs.pop("processing_class")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and training_args.remove_unused_columns:
            logger.info("FunAudioChatTrainer: setting remove_unused_columns=False (the collator needs raw samples).")
            training_args.remove_unused_columns = False
        if kwargs.get("data_collator") is None and len(args) < 3:
            if processor is None:
                raise ValueError("FunAudioChatTrainer needs `processor=` or a `data_collator`.")
            kwargs["data_collator"] = FunAudioChatDataCollator(processor)
        super().__init__(*args, **kwargs)
        self.processor = processor
        self._logged_loss_sums: dict[str, torch.Tensor] = {}
        self._logged_loss_step = self.state.global_step
        self._eval_loss_sums: dict[str, torch.Tensor] = {}
        self._eval_samples = 0

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if state_dict:
            # A gathered full state dict (FSDP) holds the tied speech head as its own copy, which `save_pretrained`
            # cannot tell from a separate weight (it compares storages): drop it, as a single-process save does.
            tied = getattr(self.accelerator.unwrap_model(self.model), "all_tied_weights_keys", None) or {}
            state_dict = {name: value for name, value in state_dict.items() if name not in tied}
        super()._save(output_dir, state_dict=state_dict)
        # Under FSDP every process calls `_save` (for the collective gathers); only the writer saves files.
        if self.processor is not None and self.args.should_save:
            self.processor.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        self._record_losses(outputs, model.training, inputs)
        return (loss, outputs) if return_outputs else loss

    def _record_losses(self, outputs: Any, training: bool, inputs: dict[str, Any]) -> None:
        for name in LOGGED_LOSSES:
            value = outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
            if value is None:
                continue
            value = value.detach().float()
            if training:
                if not self._logged_loss_sums:  # a new logging window starts (also after resuming)
                    self._logged_loss_step = self.state.global_step
                # Same scaling as the trainer applies to `loss` before accumulating it into `tr_loss`.
                value = value / max(getattr(self, "current_gradient_accumulation_steps", 1), 1)
                sums = self._logged_loss_sums
            else:
                value = value * inputs["input_ids"].shape[0]
                sums = self._eval_loss_sums
            sums[name] = sums[name] + value if name in sums else value
        if not training and "input_ids" in inputs:
            self._eval_samples += inputs["input_ids"].shape[0]

    def _gathered_sum(self, value: torch.Tensor) -> float:
        if self.accelerator.num_processes > 1:
            value = self.accelerator.gather(value.reshape(1).to(self.accelerator.device)).sum()
        return float(value)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._logged_loss_sums:
            steps = max(self.state.global_step - self._logged_loss_step, 1)
            processes = self.accelerator.num_processes
            for name, total in self._logged_loss_sums.items():
                logs[name] = self._gathered_sum(total) / processes / steps
            self._logged_loss_sums = {}
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        self._eval_loss_sums, self._eval_samples = {}, 0
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        samples = self._gathered_sum(torch.tensor(float(self._eval_samples)))
        if samples > 0:
            for name, total in self._eval_loss_sums.items():
                output.metrics[f"{prefix}_{name}"] = self._gathered_sum(total) / samples
        self._eval_loss_sums, self._eval_samples = {}, 0
        return output


# ----------------------------------------------------------------------------------------------------------------
# Freezing and LoRA
# ----------------------------------------------------------------------------------------------------------------


def freeze_audio_encoder(model: nn.Module) -> int:
    """Freeze the continuous (Whisper) audio encoder `continuous_audio_tower` of `model` (also inside a peft model).

    The discrete encoder `audio_tower` stays trainable: its `embed_tokens` is also the CRQ speech output head.

    Returns:
        The number of frozen parameters.
    """
    encoders = [module for name, module in model.named_modules() if name.split(".")[-1] == "continuous_audio_tower"]
    if not encoders:
        raise ValueError(f"{type(model).__name__} has no `continuous_audio_tower` to freeze.")
    frozen = 0
    for encoder in encoders:
        for param in encoder.parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def lora_target_modules(llm: bool = True, crq: bool = True) -> str:
    """Regex (peft `target_modules`, full-name match) for the LoRA-adapted linear layers.

    Args:
        llm: the Qwen3 LLM's attention and MLP projections (`language_model.model.layers.*`).
        crq: the CRQ speech decoder's projections: its Qwen3 layers plus `pre_matching`, `input_matching` and
            `output_matching`. The speech `lm_head` is tied to the speech embedding and is never adapted.
    """
    patterns = [pattern for pattern, wanted in ((LLM_LORA_TARGETS, llm), (CRQ_LORA_TARGETS, crq)) if wanted]
    if not patterns:
        raise ValueError("lora_target_modules needs llm=True and/or crq=True.")
    # peft full-matches a string against each module's name; the optional prefix covers wrapped models.
    return rf"(.*\.)?({'|'.join(patterns)})"


def lora_config(
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    llm: bool = True,
    crq: bool = True,
    modules_to_save: Sequence[str] | None = None,
    **kwargs,
):
    """A `peft.LoraConfig` for Fun-Audio-Chat (see [`lora_target_modules`] for what is adapted).

    Use `peft.get_peft_model(model, lora_config())`; after training, [`merge_lora`] (`merge_and_unload()` keeping
    the speech-head tie) gives back a plain `FunAudioChatForConditionalGeneration` for `save_pretrained` /
    `generate_speech`.
    Extra `kwargs` go to `LoraConfig` (e.g. `use_rslora=True`).
    """
    from peft import LoraConfig

    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}.")
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=lora_target_modules(llm=llm, crq=crq),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        bias="none",
        **kwargs,
    )


def merge_lora(peft_model) -> nn.Module:
    """Merge LoRA adapters into the base model (`peft_model.merge_and_unload()`) and return the plain model.

    peft's merge sets `config.tie_word_embeddings = False` whenever the LLM's input and output embeddings are
    separate tensors, which they always are here. For Fun-Audio-Chat that flag ties the CRQ speech head to the
    speech embedding (LoRA never touches either), and clearing it would make `save_pretrained` + `from_pretrained`
    lose the speech head. This keeps the flag as it was.
    """
    base_model = peft_model.get_base_model()
    tie_word_embeddings = base_model.config.tie_word_embeddings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input and output embeddings are no longer tied")
        merged = peft_model.merge_and_unload()
    merged.config.tie_word_embeddings = tie_word_embeddings
    return merged


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


class JsonlSpeechDataset(Dataset):
    """Conversations from a JSON-lines file (format: see `data_collator_funaudiochat`), one sample per line.

    Relative audio paths are resolved against `audio_root` (default: the folder of the JSON-lines file), so a dataset
    folder can be moved as a whole. Audio is loaded later, by the collator.

    Args:
        path: the `.jsonl` file.
        audio_root: folder relative audio paths are relative to.
    """

    def __init__(self, path: str | os.PathLike, audio_root: str | os.PathLike | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"Dataset file not found: '{path}'.")
        self.audio_root = Path(audio_root).expanduser() if audio_root is not None else self.path.parent
        self.samples: list[dict] = []
        with self.path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    sample = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{self.path}:{line_number}: invalid JSON ({error.msg}).") from None
                if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list):
                    raise ValueError(f"{self.path}:{line_number}: expected an object with a 'messages' list.")
                self.samples.append(self._resolve_paths(sample))
        if not self.samples:
            raise ValueError(f"Dataset file '{path}' contains no samples.")

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            return str(self.audio_root / value)
        return value

    def _resolve_paths(self, sample: dict) -> dict:
        for message in sample["messages"]:
            if isinstance(message, dict) and isinstance(message.get("audio"), str):
                message["audio"] = self._resolve(message["audio"])
            elif isinstance(message, dict) and isinstance(message.get("audio"), dict) and "path" in message["audio"]:
                message["audio"]["path"] = self._resolve(message["audio"]["path"])
        return sample

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def _synthetic_voice(rng: np.random.Generator, seconds: float, sampling_rate: int) -> np.ndarray:
    """A voice-like clip: a harmonic tone with a gliding pitch, a syllable-rate envelope and a little noise."""
    t = np.arange(int(seconds * sampling_rate)) / sampling_rate
    base = rng.uniform(100.0, 250.0)
    pitch = base * (1.0 + 0.2 * np.sin(2 * np.pi * rng.uniform(0.3, 1.5) * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sampling_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * rng.uniform(2.0, 5.0) * t))
    noise = 0.01 * rng.standard_normal(t.shape)
    return (0.1 * voice * envelope + noise).astype(np.float32)


def _speech_vocab_size(processor) -> int:
    """Number of speech-token ids (`[AU0000]`, `[AU0001]`, ... in the speech tokenizer)."""
    vocab = processor.speech_tokenizer.get_vocab()
    count = sum(1 for token in vocab if re.fullmatch(r"\[AU\d+\]", token))
    if count == 0:
        raise ValueError("The speech tokenizer has no `[AU....]` speech tokens.")
    return count


def _word_pool(tokenizer) -> list[str]:
    """Plain alphabetic tokens of the text tokenizer (decoded), used as random 'words'."""
    special = set(tokenizer.all_special_ids)
    pool = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        piece = tokenizer.decode([token_id])
        if piece.strip().isascii() and piece.strip().isalpha():
            pool.append(piece.strip())
    if not pool:
        raise ValueError("The text tokenizer has no alphabetic tokens to build synthetic text from.")
    return sorted(set(pool))


def make_synthetic_dataset(
    output_dir: str | os.PathLike,
    processor,
    num_samples: int = 16,
    seed: int = 0,
    min_seconds: float = 0.6,
    max_seconds: float = 1.6,
    min_words: int = 2,
    max_words: int = 6,
    min_speech_tokens: int = 10,
    max_speech_tokens: int = 30,
    system: str | None = None,
) -> Path:
    """Write a deterministic synthetic speech-to-speech dataset and return the path of its `train.jsonl`.

    Each sample: one user turn with a synthetic voice-like wav (`audio/NNNN.wav`, 16 kHz) and one assistant turn with
    random text (words from `processor.tokenizer`) and random speech-token ids (from the speech tokenizer's range).
    The same arguments always give the same files. Only good for smoke tests: the targets are random.

    Args:
        output_dir: folder to write `train.jsonl` and `audio/` into (created).
        processor: the model's [`FunAudioChatProcessor`] (its tokenizers define the vocabularies).
        num_samples: number of conversations.
        seed: random seed.
        min_seconds, max_seconds: user clip duration range.
        min_words, max_words: assistant text length range (words).
        min_speech_tokens, max_speech_tokens: assistant speech length range (25 Hz tokens).
        system: system prompt stored in every sample (None: the collator's default).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    if not 0 < min_seconds <= max_seconds:
        raise ValueError(f"Need 0 < min_seconds <= max_seconds, got {min_seconds}, {max_seconds}.")
    if not 1 <= min_words <= max_words or not 1 <= min_speech_tokens <= max_speech_tokens:
        raise ValueError("Need 1 <= min_words <= max_words and 1 <= min_speech_tokens <= max_speech_tokens.")
    output_dir = Path(output_dir).expanduser()
    (output_dir / "audio").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sampling_rate = processor.sampling_rate
    words = _word_pool(processor.tokenizer)
    speech_vocab = _speech_vocab_size(processor)

    lines = []
    for index in range(num_samples):
        seconds = float(rng.uniform(min_seconds, max_seconds))
        audio_name = f"audio/{index:04d}.wav"
        (output_dir / audio_name).write_bytes(wav_bytes(_synthetic_voice(rng, seconds, sampling_rate), sampling_rate))
        text = " ".join(rng.choice(words, size=int(rng.integers(min_words, max_words + 1))).tolist())
        num_tokens = int(rng.integers(min_speech_tokens, max_speech_tokens + 1))
        speech_tokens = rng.integers(0, speech_vocab, size=num_tokens).tolist()
        sample = {
            "messages": [
                {"role": "user", "audio": audio_name},
                {"role": "assistant", "text": text, "speech_tokens": speech_tokens},
            ]
        }
        if system is not None:
            sample["system"] = system
        lines.append(json.dumps(sample))
    path = output_dir / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


__all__ = [
    "CRQ_LORA_TARGETS",
    "FunAudioChatTrainer",
    "JsonlSpeechDataset",
    "LLM_LORA_TARGETS",
    "LOGGED_LOSSES",
    "freeze_audio_encoder",
    "lora_config",
    "lora_target_modules",
    "make_synthetic_dataset",
    "merge_lora",
]

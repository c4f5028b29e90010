"""Configuration of Fun-Audio-Chat: a Qwen3 LLM with a Whisper-style audio encoder, a discrete speech encoder and the
CRQ speech decoder (the "Speech Refined Head").

Both classes read the official `config.json` unchanged. The defaults are the real Fun-Audio-Chat-8B values (not the
Qwen2-Audio values the official classes inherited), so `FunAudioChatConfig()` describes the released model.

The configs keep an explicit `__init__(..., **kwargs)` (instead of the dataclass fields that transformers >= 5.4 uses
for its own configs) so the same file works on every transformers 5 release we support.
"""

import os
from typing import Any

from transformers import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, AutoConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .configuration_cosyvoice3 import CosyVoice3Config


# Qwen3-0.6B dimensions: the body of the CRQ speech decoder in Fun-Audio-Chat-8B.
_DEFAULT_CRQ_TRANSFORMER_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "initializer_range": 0.02,
}

# Qwen3-8B dimensions (the LLM of Fun-Audio-Chat-8B) plus the three text-token ids the model code reads.
_DEFAULT_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "max_position_embeddings": 262144,
    "max_window_layers": 28,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

# Text-token ids read by the model code, stored on `text_config` as in the official checkpoint.
_DEFAULT_TEXT_SPECIAL_IDS: dict[str, int] = {
    "audio_bos_index": 151670,  # <|audio_bos|>: wraps audio, and switches speech generation on
    "audio_eos_index": 151671,  # <|audio_eos|>: wraps audio, and the text token forced when speech ends
    "sil_index": 151673,  # <|sil|>: text filler while speech continues after the text ended
}


def _build_sub_config(value: "dict | PreTrainedConfig | None", defaults: dict[str, Any]) -> PreTrainedConfig:
    """A transformers config from a config object, its dict form (as in config.json), or `None` (the defaults)."""
    if isinstance(value, PreTrainedConfig):
        return value
    if value is None:
        value = defaults
    elif not isinstance(value, dict):
        raise TypeError(f"Expected a dict or a PreTrainedConfig, got {type(value).__name__}.")
    value = dict(value)
    model_type = value.pop("model_type", defaults["model_type"])
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"Unknown sub-config model_type {model_type!r}.")
    return CONFIG_MAPPING[model_type](**value)


class FunAudioChatAudioEncoderConfig(PreTrainedConfig):
    r"""
    Configuration of the audio side of Fun-Audio-Chat: the continuous (Whisper-style) encoder, the discrete speech
    encoder and the CRQ speech decoder. Defaults are the Fun-Audio-Chat-8B values.

    Args:
        num_mel_bins (`int`, defaults to 128): log-mel channels of the input features.
        encoder_layers (`int`, defaults to 32): Transformer layers of the continuous encoder.
        encoder_attention_heads (`int`, defaults to 20): attention heads of the continuous encoder.
        encoder_ffn_dim (`int`, defaults to 5120): MLP width of the continuous encoder.
        d_model (`int`, defaults to 1280): width of the continuous encoder.
        dropout, attention_dropout, activation_dropout (`float`, default 0.0): dropout probabilities.
        activation_function (`str`, defaults to `"gelu"`): MLP activation of the continuous encoder.
        scale_embedding (`bool`, defaults to `False`): stored for compatibility, never applied (as in the reference).
        initializer_range (`float`, defaults to 0.02): std of the weight initialisation.
        max_source_positions (`int`, defaults to 1500): rows of the sinusoidal position table.
        n_window (`int`, defaults to 100): the encoder attends within chunks of `2 * n_window` mel frames.
        output_dim (`int`, defaults to 4096): output width of all audio modules (= the LLM hidden size).
        codebook_size (`int`, defaults to 6565): speech vocabulary (6561 speech codes + bos/eos/pad/reserved).
        bos_token_id, eos_token_id, pad_token_id (`int`, default 6561, 6562, 6563): speech-vocabulary special ids.
        group_size (`int`, defaults to 5): speech tokens (25 Hz) per LLM position (5 Hz).
        continuous_features_mode (`str`, defaults to `"replace"`): how continuous features enter the discrete
            encoder output, `"replace"` or `"add"`.
        enable_audio_invert_tower (`bool`, defaults to `True`): build the CRQ speech decoder.
        crq_transformer_config (`dict` or `Qwen3Config`, defaults to Qwen3-0.6B dims): the CRQ Transformer body.
        encoder_layerdrop (`float`, defaults to 0.0): stored for compatibility, never applied.
    """

    model_type = "funaudiochat_audio_encoder"
    attribute_map = {
        "num_hidden_layers": "encoder_layers",
        "num_attention_heads": "encoder_attention_heads",
        "intermediate_size": "encoder_ffn_dim",
        "hidden_size": "d_model",
    }
    sub_configs = {"crq_transformer_config": Qwen3Config}

    def __init__(
        self,
        num_mel_bins: int = 128,
        encoder_layers: int = 32,
        encoder_attention_heads: int = 20,
        encoder_ffn_dim: int = 5120,
        d_model: int = 1280,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        activation_function: str = "gelu",
        activation_dropout: float = 0.0,
        scale_embedding: bool = False,
        initializer_range: float = 0.02,
        max_source_positions: int = 1500,
        n_window: int = 100,
        output_dim: int = 4096,
        codebook_size: int = 6565,
        bos_token_id: int = 6561,
        eos_token_id: int = 6562,
        pad_token_id: int = 6563,
        group_size: int = 5,
        continuous_features_mode: str = "replace",
        enable_audio_invert_tower: bool = True,
        crq_transformer_config: "dict | PreTrainedConfig | None" = None,
        encoder_layerdrop: float = 0.0,
        **kwargs,
    ):
        if continuous_features_mode not in ("replace", "add"):
            raise ValueError(
                f"continuous_features_mode must be 'replace' or 'add', got {continuous_features_mode!r}."
            )
        # The official config.json repeats the layer count as `num_hidden_layers` (an alias of encoder_layers here).
        encoder_layers = kwargs.pop("num_hidden_layers", encoder_layers)
        self.num_mel_bins = num_mel_bins
        self.encoder_layers = encoder_layers
        self.encoder_attention_heads = encoder_attention_heads
        self.encoder_ffn_dim = encoder_ffn_dim
        self.d_model = d_model
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_function = activation_function
        self.activation_dropout = activation_dropout
        self.scale_embedding = scale_embedding
        self.initializer_range = initializer_range
        self.max_source_positions = max_source_positions
        self.n_window = n_window
        self.output_dim = output_dim
        self.codebook_size = codebook_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.group_size = group_size
        self.continuous_features_mode = continuous_features_mode
        self.enable_audio_invert_tower = enable_audio_invert_tower
        self.crq_transformer_config = _build_sub_config(crq_transformer_config, _DEFAULT_CRQ_TRANSFORMER_CONFIG)
        self.encoder_layerdrop = encoder_layerdrop
        super().__init__(**kwargs)


class _PipelinesOfTheRepo(dict):
    """`config.custom_pipelines` as the installed package reads it: the repo's entries, minus membership (`in`) for
    the tasks that the package registers itself.

    A one-folder repo (scripts/build_hub_repo.py) lists its `speech-to-speech` pipeline file there, so that
    `pipeline(model=repo, trust_remote_code=True)` finds it without this package. transformers' `pipeline()` infers
    the task from the entries' keys, then runs the repo's code for a task `in` them, and refuses to without
    `trust_remote_code`, even where the installed package registered that task. Read by the installed package, such a
    task is not `in` the entries, so the installed code serves the repo and none of the repo's code runs; the keys (the
    task inference) and the saved entries stay as the repo wrote them."""

    def __init__(self, entries: dict, served: frozenset):
        super().__init__(entries)
        self.served = served

    def __contains__(self, task) -> bool:
        return task not in self.served and super().__contains__(task)

    def __reduce__(self):  # copies (`to_dict` deep-copies the config) keep the class and what it serves
        return type(self), (dict(self), self.served)


def _pipelines_of_the_repo(custom_pipelines: dict) -> dict:
    """`custom_pipelines` with the tasks whose registered pipeline lives next to this file marked as served (see
    `_PipelinesOfTheRepo`). Read as the repo's own code (a `transformers_modules` copy), nothing is served here."""
    from transformers.pipelines import PIPELINE_REGISTRY

    package = __name__.rpartition(".")[0]
    served = frozenset(
        task
        for task in custom_pipelines
        if getattr(PIPELINE_REGISTRY.supported_tasks.get(task, {}).get("impl"), "__module__", "").rpartition(".")[0]
        == package
    )
    return _PipelinesOfTheRepo(custom_pipelines, served) if served else custom_pipelines


class FunAudioChatConfig(PreTrainedConfig):
    r"""
    Configuration of [`FunAudioChatForConditionalGeneration`]. Defaults are the Fun-Audio-Chat-8B values.

    Args:
        audio_config (`dict` or `FunAudioChatAudioEncoderConfig`): the audio modules (encoders + CRQ decoder).
        text_config (`dict` or `PreTrainedConfig`, defaults to Qwen3-8B dims): the LLM. Also carries
            `audio_bos_index`, `audio_eos_index` and `sil_index`, the text ids the model code reads.
        audio_token_index (`int`, defaults to 151669): id of the `<|AUDIO|>` placeholder (alias `audio_token_id`).
        ignore_index (`int`, defaults to -100): label value ignored by the losses.
        sampling_rate (`int`, defaults to 24000): sample rate of the speech the model produces (CosyVoice3 output);
            the pipelines read it to label generated audio. The *input* rate is the feature extractor's (16 kHz).
        tie_word_embeddings (`bool`, defaults to `True`): tie the CRQ speech head to the discrete speech embedding
            (`audio_invert_tower.lm_head` <- `audio_tower.embed_tokens`), as the official model always does. The text
            LM head is governed by `text_config.tie_word_embeddings` (False for Fun-Audio-Chat-8B).
        token2wav_config (`dict` or `CosyVoice3Config`, *optional*): a speech-token decoder bundled with the chat model
            (built as `model.token2wav`, weights under `token2wav.*`). Absent in the official checkpoint.
    """

    model_type = "funaudiochat"
    attribute_map = {"audio_token_id": "audio_token_index"}
    sub_configs = {
        "text_config": AutoConfig,
        "audio_config": FunAudioChatAudioEncoderConfig,
        "token2wav_config": CosyVoice3Config,
    }

    def __init__(
        self,
        audio_config: "dict | FunAudioChatAudioEncoderConfig | None" = None,
        text_config: "dict | PreTrainedConfig | None" = None,
        audio_token_index: int = 151669,
        ignore_index: int = -100,
        sampling_rate: int = 24000,
        tie_word_embeddings: bool = True,
        token2wav_config: "dict | CosyVoice3Config | None" = None,
        **kwargs,
    ):
        if isinstance(audio_config, dict):
            audio_config = {k: v for k, v in audio_config.items() if k != "model_type"}
            audio_config = FunAudioChatAudioEncoderConfig(**audio_config)
        elif audio_config is None:
            audio_config = FunAudioChatAudioEncoderConfig()
        elif not isinstance(audio_config, FunAudioChatAudioEncoderConfig):
            raise TypeError(
                f"audio_config must be a dict or FunAudioChatAudioEncoderConfig, got {type(audio_config)}."
            )
        self.audio_config = audio_config

        self.text_config = _build_sub_config(text_config, _DEFAULT_TEXT_CONFIG)
        for name, default in _DEFAULT_TEXT_SPECIAL_IDS.items():
            if getattr(self.text_config, name, None) is None:
                setattr(self.text_config, name, default)

        # `audio_token_id` (the transformers-wide spelling) is accepted as an alias.
        self.audio_token_index = kwargs.pop("audio_token_id", audio_token_index)
        self.ignore_index = ignore_index
        self.sampling_rate = sampling_rate
        self.tie_word_embeddings = tie_word_embeddings
        if isinstance(token2wav_config, dict):
            token2wav_config = CosyVoice3Config(**{k: v for k, v in token2wav_config.items() if k != "model_type"})
        elif token2wav_config is not None and not isinstance(token2wav_config, CosyVoice3Config):
            raise TypeError(f"token2wav_config must be a dict or CosyVoice3Config, got {type(token2wav_config)}.")
        self.token2wav_config = token2wav_config
        # The official config.json stores `hidden_size` (= text hidden); it is always derived from text_config.
        kwargs.pop("hidden_size", None)
        if kwargs.get("custom_pipelines"):
            kwargs["custom_pipelines"] = _pipelines_of_the_repo(kwargs["custom_pipelines"])
        super().__init__(**kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "FunAudioChatConfig":
        # `~/models/...` means the expanded local path (transformers alone would read it as an invalid Hub id).
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path.startswith("~"):
            pretrained_model_name_or_path = os.path.expanduser(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @property
    def hidden_size(self) -> int:
        """The LLM hidden size (every audio module projects to it)."""
        return self.text_config.hidden_size

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> PreTrainedConfig:
        """The LLM (Qwen3) config: what generation, caches and `resize_token_embeddings` need."""
        return self.text_config


__all__ = ["FunAudioChatAudioEncoderConfig", "FunAudioChatConfig"]

"""`FunAudioChatPreTrainedModel`: the loading settings every Fun-Audio-Chat model shares (the chat model and its
continuous audio encoder)."""

from transformers import PreTrainedModel

from .configuration_funaudiochat import FunAudioChatConfig


class FunAudioChatPreTrainedModel(PreTrainedModel):
    """Shared loading settings of the Fun-Audio-Chat models (the audio encoder initialises its own fixed tables)."""

    config_class = FunAudioChatConfig
    config: FunAudioChatConfig
    # The official checkpoint has no root prefix (keys start with `language_model.`, `audio_tower.`, ...).
    base_model_prefix = ""
    main_input_name = "input_ids"
    input_modalities = ("audio", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = [
        "Qwen3DecoderLayer",
        "Qwen2_5OmniAudioEncoderLayer",
        "FunAudioChatDiscreteEncoder",
        "FunAudioChatCRQDecoder",
    ]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False


__all__ = ["FunAudioChatPreTrainedModel"]

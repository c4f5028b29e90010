"""FunAudioChatConfig / FunAudioChatAudioEncoderConfig: official config.json, real defaults, serialization."""

import json

import pytest
from transformers import AutoConfig, Qwen3Config

import funaudiochat_hf  # noqa: F401  (registers the Auto classes)
from funaudiochat_hf.configuration_funaudiochat import FunAudioChatAudioEncoderConfig, FunAudioChatConfig

from conftest import FUNAUDIOCHAT_TINY


def test_reads_official_config_json():
    config = AutoConfig.from_pretrained(FUNAUDIOCHAT_TINY)
    raw = json.loads((FUNAUDIOCHAT_TINY / "config.json").read_text())
    assert isinstance(config, FunAudioChatConfig)
    assert config.audio_token_index == raw["audio_token_index"] == config.audio_token_id
    assert isinstance(config.text_config, Qwen3Config)
    assert config.text_config.hidden_size == raw["text_config"]["hidden_size"] == config.hidden_size
    assert config.text_config.audio_bos_index == raw["text_config"]["audio_bos_index"]
    assert config.text_config.audio_eos_index == raw["text_config"]["audio_eos_index"]
    assert config.text_config.sil_index == raw["text_config"]["sil_index"]
    assert config.get_text_config() is config.text_config

    audio = config.audio_config
    raw_audio = raw["audio_config"]
    assert isinstance(audio, FunAudioChatAudioEncoderConfig)
    for key in ("d_model", "encoder_layers", "output_dim", "codebook_size", "bos_token_id", "eos_token_id",
                "pad_token_id", "group_size", "n_window", "continuous_features_mode"):
        assert getattr(audio, key) == raw_audio[key], key
    assert audio.num_hidden_layers == raw_audio["num_hidden_layers"]
    crq = audio.crq_transformer_config
    assert isinstance(crq, Qwen3Config)
    assert (crq.hidden_size, crq.head_dim, crq.num_key_value_heads) == (32, 16, 1)
    assert crq.rope_parameters["rope_theta"] == raw_audio["crq_transformer_config"]["rope_theta"]


def test_defaults_are_full_size_fun_audio_chat_8b():
    config = FunAudioChatConfig()
    assert config.audio_token_index == 151669  # not the Qwen2-Audio leftover 151646
    assert config.sampling_rate == 24000
    assert config.ignore_index == -100
    audio = config.audio_config
    assert audio.output_dim == 4096  # not the Qwen2.5-Omni 3584
    speech_ids = (audio.codebook_size, audio.bos_token_id, audio.eos_token_id, audio.pad_token_id)
    assert speech_ids == (6565, 6561, 6562, 6563)
    assert (audio.group_size, audio.d_model, audio.encoder_layers, audio.num_mel_bins) == (5, 1280, 32, 128)
    assert audio.continuous_features_mode == "replace"
    crq = audio.crq_transformer_config
    assert (crq.hidden_size, crq.num_hidden_layers, crq.num_attention_heads, crq.head_dim) == (1024, 28, 16, 128)
    text = config.text_config
    text_dims = (text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size)
    assert text_dims == (4096, 36, 12288, 151936)
    assert (text.audio_bos_index, text.audio_eos_index, text.sil_index) == (151670, 151671, 151673)
    assert text.tie_word_embeddings is False
    assert config.hidden_size == 4096


def test_audio_token_id_alias_and_sub_config_forms():
    assert FunAudioChatConfig(audio_token_id=7).audio_token_index == 7
    crq = Qwen3Config(hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    from_object = FunAudioChatAudioEncoderConfig(crq_transformer_config=crq)
    from_dict = FunAudioChatAudioEncoderConfig(crq_transformer_config=crq.to_dict())
    assert from_object.crq_transformer_config is crq
    assert isinstance(from_dict.crq_transformer_config, Qwen3Config)
    assert from_dict.crq_transformer_config.hidden_size == 48
    # A text config given without the Fun-Audio-Chat ids gets the real ones.
    config = FunAudioChatConfig(text_config={"model_type": "qwen3", "hidden_size": 64})
    assert config.text_config.audio_bos_index == 151670


def test_bad_values_raise():
    with pytest.raises(ValueError, match="continuous_features_mode"):
        FunAudioChatAudioEncoderConfig(continuous_features_mode="concat")
    with pytest.raises(ValueError, match="model_type"):
        FunAudioChatConfig(text_config={"model_type": "not_a_model"})


def test_save_and_reload_round_trip(tmp_path):
    config = AutoConfig.from_pretrained(FUNAUDIOCHAT_TINY)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "funaudiochat"
    assert saved["sampling_rate"] == 24000
    assert saved["audio_config"]["crq_transformer_config"]["hidden_size"] == 32
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert reloaded.to_diff_dict() == config.to_diff_dict()
    crq, reloaded_crq = config.audio_config.crq_transformer_config, reloaded.audio_config.crq_transformer_config
    assert reloaded_crq.to_dict() == crq.to_dict()


def test_optional_token2wav_config(tmp_path):
    from funaudiochat_hf.configuration_cosyvoice3 import CosyVoice3Config

    assert FunAudioChatConfig().token2wav_config is None
    config = FunAudioChatConfig(token2wav_config=CosyVoice3Config(dit_depth=2).to_dict())
    assert isinstance(config.token2wav_config, CosyVoice3Config) and config.token2wav_config.dit_depth == 2
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).token2wav_config.dit_depth == 2
    with pytest.raises(TypeError, match="token2wav_config"):
        FunAudioChatConfig(token2wav_config=3)

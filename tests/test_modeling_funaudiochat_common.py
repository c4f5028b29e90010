"""transformers' own common tests (`ModelTesterMixin`, `GenerationTesterMixin`, `ConfigTester` of the installed version,
fetched by `transformers_common_tests`) on a tiny `FunAudioChatForConditionalGeneration`, as transformers' own
`tests/models/*/test_modeling_*.py` do: text-only inputs, and the same with one audio clip per row.

Deviations kept for the official checkpoint's layout are skipped below, each with its reason.
"""

import copy
import unittest

import pytest
import torch

import transformers_common_tests


try:
    COMMON = transformers_common_tests.load()
except Exception as error:  # noqa: BLE001  (any failure to fetch or import them: skip, saying why)
    pytest.skip(f"transformers' common tests are unavailable: {error}", allow_module_level=True)

from funaudiochat_hf.configuration_funaudiochat import FunAudioChatConfig  # noqa: E402
from funaudiochat_hf.modeling_funaudiochat import FunAudioChatForConditionalGeneration  # noqa: E402


GENERATION_MISSING = COMMON.missing("generation.test_utils")
EXPORT_MISSING = COMMON.missing("exporters.test_export")
CONFIG_KWARGS_MISSING = COMMON.missing("utils.test_configuration_utils")


class FunAudioChatModelTester:
    """A tiny config (2 LLM layers of width 32, a 2-layer audio encoder, a 1-layer CRQ) and its inputs.

    With `with_audio`, every row holds one clip: `speech_length` speech tokens filling `speech_length / group_size`
    `<|AUDIO|>` slots, and the clip's log-mels (`4 * speech_length` frames: the encoder's stride-2 conv and 2:1 pooling
    give 25 Hz features of the speech ids' length). One clip per row keeps every clip-level input sliceable by row
    (the batching test takes the first `n / batch_size` entries of each input).
    """

    # Special ids low in the vocabulary (tests that shrink it clamp the ids from above), but not below 5 (the
    # eager-vs-SDPA tests add rows of random ids below 5, which must not be `<|AUDIO|>` slots).
    pad_token_id, eos_token_id = 0, 1
    audio_token_id, audio_bos_id, audio_eos_id, sil_id = 5, 6, 7, 8
    first_text_id = 9

    def __init__(self, parent, with_audio=False, batch_size=3, seq_length=9, speech_length=4):
        self.parent = parent
        self.with_audio = with_audio
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.speech_length = speech_length
        self.group_size = 2
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.is_training = True
        self.num_mel_bins = 8
        self.audio_config = {
            "num_mel_bins": self.num_mel_bins,
            "num_hidden_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 24,
            "d_model": 16,
            "max_source_positions": 32,
            "n_window": 4,
            "output_dim": self.hidden_size,
            "codebook_size": 24,
            "bos_token_id": 20,
            "eos_token_id": 21,
            "pad_token_id": 22,
            "group_size": self.group_size,
            "crq_transformer_config": {
                "hidden_size": 16,
                "intermediate_size": 24,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "vocab_size": 24,
                "max_position_embeddings": 256,
            },
        }

    def get_config(self) -> FunAudioChatConfig:
        text_config = {
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": 37,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 512,
            "bos_token_id": self.eos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "audio_bos_index": self.audio_bos_id,
            "audio_eos_index": self.audio_eos_id,
            "sil_index": self.sil_id,
        }
        return FunAudioChatConfig(
            audio_config=copy.deepcopy(self.audio_config),
            text_config=text_config,
            audio_token_index=self.audio_token_id,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
        )

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = torch.randint(self.first_text_id, self.vocab_size, (self.batch_size, self.seq_length))
        attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.with_audio:
            slots = self.speech_length // self.group_size
            input_ids[:, 2 : 2 + slots] = self.audio_token_id
            input_ids[:, 1] = self.audio_bos_id
            input_ids[:, 2 + slots] = self.audio_eos_id
            frames = 4 * self.speech_length
            inputs.update(
                speech_ids=torch.randint(0, 20, (self.batch_size, self.speech_length)),
                speech_attention_mask=torch.ones(self.batch_size, self.speech_length, dtype=torch.long),
                input_features=torch.randn(self.batch_size, self.num_mel_bins, frames),
                feature_attention_mask=torch.ones(self.batch_size, frames, dtype=torch.long),
            )
        return config, inputs


AUDIO_INPUT_NAMES = ["speech_ids", "speech_attention_mask", "input_features", "feature_attention_mask"]


class _FunAudioChatCommonTests(COMMON.ModelTesterMixin, COMMON.GenerationTesterMixin):
    all_model_classes = (FunAudioChatForConditionalGeneration,)
    all_generative_model_classes = (FunAudioChatForConditionalGeneration,)
    pipeline_model_mapping = {}
    with_audio = False
    # The audio inputs, for the helpers that rebuild a model's inputs (attention-implementation equivalence,
    # padding-free and flex-attention tests).
    additional_model_inputs = AUDIO_INPUT_NAMES
    # `get_audio_features` returns the encoder output projected to the LLM width (`output_dim`; the projection is
    # inside the official `continuous_audio_tower`), which the common shape check takes for `audio_config.hidden_size`
    # (`d_model`); tests/test_modeling_funaudiochat.py checks the shape.
    skip_test_audio_features_output_shape = True

    def setUp(self):
        # With audio, 7 rows: the eager-vs-SDPA tests pad every input to 7 rows with random values, which would give
        # clips without `<|AUDIO|>` slots.
        batch_size = 7 if self.with_audio else 3
        self.model_tester = FunAudioChatModelTester(self, with_audio=self.with_audio, batch_size=batch_size)
        self.config_tester = COMMON.ConfigTester(self, config_class=FunAudioChatConfig, has_text_modality=False)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # The mixin adds labels for the classes of transformers' auto mappings only: ours is a causal LM.
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels:
            inputs_dict["labels"] = inputs_dict["input_ids"].clone()
        return inputs_dict

    def _audio_features_prepare_config_and_inputs(self):
        config, inputs = FunAudioChatModelTester(self, with_audio=True).prepare_config_and_inputs_for_common()
        return config, {k: inputs[k] for k in ("input_features", "feature_attention_mask")}

    def test_config(self):
        if CONFIG_KWARGS_MISSING:
            self.config_tester.create_and_test_config_to_json_string()
            self.config_tester.create_and_test_config_to_json_file()
            self.config_tester.create_and_test_config_from_and_save_pretrained()
            self.config_tester.create_and_test_config_from_and_save_pretrained_subfolder()
            self.config_tester.create_and_test_config_with_num_labels()
            self.config_tester.check_config_can_be_init_without_params()
            self.skipTest(f"check_config_arguments_init: {CONFIG_KWARGS_MISSING} (the other checks passed)")
        self.config_tester.run_common_tests()

    @unittest.skip(
        "No base model: the official checkpoint's keys start at the root (`language_model.`, `audio_tower.`, ...), "
        "so `base_model_prefix` is empty and `base_model` is the model itself"
    )
    def test_model_base_model_prefix(self):
        pass

    @unittest.skip(
        "The CRQ's Qwen3 body is configured by `audio_config.crq_transformer_config` (official config layout), while "
        "this test pairs every Qwen3 submodel with the top-level `text_config` of the same class"
    )
    def test_internal_model_config_and_subconfig_are_same(self):
        pass

    @unittest.skipIf(GENERATION_MISSING is None, "GenerationTesterMixin is available: its tests run")
    def test_generation_tester_mixin(self):
        self.skipTest(f"GenerationTesterMixin: {GENERATION_MISSING}")

    @unittest.skipIf(EXPORT_MISSING is None, "ExportTesterMixin is available: its tests run")
    def test_export_tester_mixin(self):
        self.skipTest(f"ExportTesterMixin: {EXPORT_MISSING}")


class FunAudioChatModelTest(_FunAudioChatCommonTests, unittest.TestCase):
    """Text-only inputs."""

    _NO_AUDIO_LAYER_RUN = (
        "The mixin checks the first GradientCheckpointingLayer in module order, an audio-encoder layer, which "
        "text-only inputs never run; FunAudioChatAudioModelTest runs this test with audio"
    )

    @unittest.skip(_NO_AUDIO_LAYER_RUN)
    def test_training_gradient_checkpointing(self):
        pass

    @unittest.skip(_NO_AUDIO_LAYER_RUN)
    def test_training_gradient_checkpointing_use_reentrant_false(self):
        pass

    @unittest.skip(_NO_AUDIO_LAYER_RUN)
    def test_training_gradient_checkpointing_use_reentrant_true(self):
        pass


class FunAudioChatAudioModelTest(_FunAudioChatCommonTests, unittest.TestCase):
    """One audio clip per row."""

    with_audio = True
